"""``ortcapture demo``: capture and replay a real model on the best available provider, verify every replay against
the uncaptured run, and print a timing table.

Arms (p50/p90 host wall time per call, µs; every call ends with the outputs on the host):
plain ``run(numpy)``; IOBinding without graph (input already on the device); captured replay of the same
IOBinding I/O (raw ORT ``run_with_iobinding`` on the captured ``gpu_graph_id``); ``CapturedGraph.run`` with
numpy in and out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="ONNX model (default: the reference YOLOv8n, fetched from PyPI)")
    p.add_argument("--provider", choices=["auto", "cuda", "webgpu"], default="auto")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per arm (default: 200 on CUDA, 10 on WebGPU, whose software adapter needs ~1 s a call)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=1x3x320x320",
                   help="example input shape (dims of dynamic inputs; batch comes from --batch otherwise)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def make_sessions(model, provider: str):
    """(uncaptured ``onnxruntime.InferenceSession``, capturing ``ortcapture.InferenceSession``) on ``provider``."""
    import onnxruntime as ort

    import ortcapture
    from ortcapture._providers import session_args

    def so():
        o = ort.SessionOptions()
        o.log_severity_level = 3
        return o

    return (ort.InferenceSession(model, **session_args(provider, False, so())),
            ortcapture.InferenceSession(model, **session_args(provider, True, so())))


def example_shapes(model_path: str, batch: int, overrides: list[str]) -> dict:
    """``{input: shape}`` to capture with: ``--shape`` overrides, else the model's dims with a dynamic first dim set
    to ``batch`` and other dynamic dims to 320 (the reference model's). Raises :class:`CaptureError` for a bad or
    unknown ``--shape``."""
    from ortcapture import _specialize as shapes
    from ortcapture.errors import CaptureError

    given = shapes.parse_shape_args(overrides)
    all_dims = shapes.input_dims(shapes.load_model(model_path))
    unknown = sorted(set(given) - set(all_dims))
    if unknown:
        raise CaptureError(f"--shape names {unknown}, but the model's inputs are {sorted(all_dims)}")
    out = {}
    for name, dims in all_dims.items():
        if name in given:
            out[name] = given[name]
            continue
        fixed = [d if isinstance(d, int) else None for d in dims]
        if fixed and fixed[0] is None:
            fixed[0] = batch
        if any(d is None for d in fixed):
            # the reference model's spatial dims; other models pass --shape
            fixed = [320 if d is None else d for d in fixed]
        out[name] = tuple(fixed)
    return out


def run(args) -> int:
    import numpy as np
    import onnxruntime as ort

    from ortcapture import transfer
    from ortcapture.cli import models as models
    from ortcapture import _specialize as shapes
    from ortcapture.cli import timing as timing
    from ortcapture._providers import pick_provider

    from ortcapture.errors import CaptureError

    if args.batch < 1 or (args.iters is not None and args.iters < 1):
        raise CaptureError("--batch and --iters must be >= 1")
    if args.model and not os.path.isfile(args.model):
        raise CaptureError(f"no such model file: {args.model}")
    model = args.model or str(models.reference_model())
    try:
        shapes.load_model(model)
    except Exception as exc:  # noqa: BLE001 - protobuf decode errors
        raise CaptureError(f"cannot read {model} as an ONNX model: {exc}") from None
    provider = pick_provider(args.provider)
    if args.iters is None:
        args.iters = 200 if provider == "cuda" else 10
    plain, sess = make_sessions(model, provider)
    info = sess.capture_info or sess.requested_capture
    shapes_ = example_shapes(model, args.batch, args.shape)
    type_of = {m.name: m.type for m in sess.get_inputs()}
    rng = np.random.default_rng(0)
    np_types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
                "tensor(int32)": np.int32}
    feeds = [{n: rng.random(s).astype(np_types[type_of[n]]) for n, s in shapes_.items()} for _ in range(4)]
    refs = [plain.run(None, f) for f in feeds]

    print(f"ortcapture demo: {model}\n  provider {info.ep.name} (device {info.device_type}:{info.device_id}), "
          f"onnxruntime {ort.__version__}, inputs {shapes_}, capture "
          f"{'on a shape-specialised session' if sess.capture_deferred else 'on the session'}")
    if sess.capture_deferred:
        print("  (ORT's error above, 'cannot use the graph capture feature ... not been partitioned', is expected: it\n"
              "   refuses capture while the input dims are dynamic; ortcapture then fixes them per example shape)")
    graph = sess.capture(feeds[0])
    target = graph.session

    # IOBinding without graph: same fixed device input, outputs bound to fixed device buffers, readback each call
    nog_in = {n: target.allocate(s, feeds[0][n].dtype) for n, s in shapes_.items()}
    nog_out = {n: target.allocate(v.shape(), transfer.np_dtype_of(v)) for n, v in graph.outputs.items()}
    nog = ort.IOBinding(plain)
    for n, v in nog_in.items():
        nog.bind_ortvalue_input(n, v)
    for n, v in nog_out.items():
        nog.bind_ortvalue_output(n, v)
    dev_feeds = []  # device copies of each feed, to update the fixed inputs device-to-device
    for f in feeds:
        dev_feeds.append({n: transfer.update_inplace(target.allocate(a.shape, a.dtype), a) for n, a in f.items()})

    worst = 0.0
    checked = 0

    def check(outs, k):
        nonlocal worst, checked
        for got, want in zip(outs, refs[k]):
            worst = max(worst, float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want))))
        checked += 1

    results = {}
    warm = 5 if provider == "cuda" else 1
    results["plain run(numpy)"] = timing.measure(lambda i: plain.run(None, feeds[i % 4]), args.iters, warm)

    def nograph(i):
        for n, v in nog_in.items():
            v.update_inplace(dev_feeds[i % 4][n])
        plain.run_with_iobinding(nog)
        return [transfer.to_numpy(v) for v in nog_out.values()]

    results["IOBinding, no graph"] = timing.measure(nograph, args.iters, warm)

    def replay(i):  # the fixed inputs updated by hand (device to device), then a bare replay
        for n, v in graph.inputs.items():
            v.update_inplace(dev_feeds[i % 4][n])
        graph.replay()
        return [transfer.to_numpy(v) for v in graph.outputs.values()]

    results["captured replay"] = timing.measure(replay, args.iters, warm)
    results["CapturedGraph.run(numpy)"] = timing.measure(lambda i: graph.run(feeds[i % 4]), args.iters, warm)
    # verification, outside the timed loops: every arm's output against the uncaptured run
    for i in range(8 if provider == "cuda" else 4):
        check(nograph(i), i % 4)
        check(replay(i), i % 4)
        check(graph.run(feeds[i % 4]), i % 4)

    stats = {k: timing.summary(v) for k, v in results.items()}
    base = stats["plain run(numpy)"]["p50_us"]
    iob = stats["IOBinding, no graph"]["p50_us"]
    print(f"\n  {'arm':<28}{'p50 µs':>10}{'p90 µs':>10}{'vs plain':>10}{'vs IOBinding':>14}")
    for k, s in stats.items():
        print(f"  {k:<28}{s['p50_us']:>10.1f}{s['p90_us']:>10.1f}{base / s['p50_us']:>9.2f}x"
              f"{iob / s['p50_us']:>13.2f}x")
    tol = 1e-3 if provider == "webgpu" else 1e-4
    ok = worst <= tol * max(1.0, max(float(np.abs(r).max()) for rr in refs for r in rr))
    print(f"\n  verified {checked} replays against the uncaptured run: max abs diff {worst:.3g} "
          f"({'OK' if ok else 'MISMATCH'}); captured graphs {list(sess.captured_graphs)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": model, "provider": provider, "ort": ort.__version__, "shapes": shapes_,
                       "stats": stats, "max_abs_diff": worst, "ok": ok}, fh, indent=2)
    graph.release()
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
