#!/usr/bin/env python3
"""ortcapture's overhead against hand-written raw ORT, in one process, arms interleaved.

Replay arms (reference model, captured, per call):
  raw replay        raw onnxruntime: x.update_inplace(src OrtValue) + run_with_iobinding on the captured id
  CapturedGraph     g.run({"images": src OrtValue}, copy_outputs=False)
  raw numpy io      x.update_inplace(numpy) + run_with_iobinding + output readback
  CapturedGraph np  g.run({"images": numpy})
Update arms (the 1.2 MB batch-1 input, device to device):
  raw update_inplace(OrtValue)    dst.update_inplace(src)            (ORT >= 1.26)
  ortcapture.update_inplace(OrtValue)
  ortcapture.update_inplace(torch)  (if torch with CUDA is importable)
On WebGPU every replay arm ends with the output readback (run_with_iobinding returns before the GPU is done).
Usage: python benchmarks/bench_overhead.py [--provider cuda|webgpu] [--iters N] [--rounds R] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--provider", choices=["auto", "cuda", "webgpu"], default="auto")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    import onnxruntime as ort

    import ortcapture
    from ortcapture.cli import models
    from ortcapture.cli import timing
    from ortcapture.cli.demo import make_sessions
    from ortcapture._ort.providers import pick_provider
    from ortcapture.session import run_options_for

    provider = pick_provider(args.provider)
    model = str(models.reference_model())
    shape = (1, 3, 320, 320)
    if provider == "webgpu":
        from ortcapture._ort import specialize as shapes

        model = shapes.fix_input_shapes(model, {"images": shape})  # raw ORT needs fixed dims to capture on WebGPU
    _, sess = make_sessions(model, provider)
    # raw ORT session capturing the same model, with its own IOBinding
    if provider == "cuda":
        raw = ort.InferenceSession(model, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"}),
                                                     "CPUExecutionProvider"])
    else:
        from ortcapture import webgpu

        raw = ort.InferenceSession(model, webgpu.session_options(True))
    dev = sess.capture_info.device_type
    x = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, dev, 0) if dev == "cuda" else \
        raw.create_ortvalue_from_shape_and_type(shape, np.float32, dev, 0)
    y = ort.OrtValue.ortvalue_from_shape_and_type((1, 22, 2100), np.float32, dev, 0) if dev == "cuda" else \
        raw.create_ortvalue_from_shape_and_type((1, 22, 2100), np.float32, dev, 0)
    rb = raw.io_binding()
    rb.bind_ortvalue_input("images", x)
    rb.bind_ortvalue_output("output0", y)
    ro = run_options_for(0)
    host = np.random.default_rng(0).random(shape, dtype=np.float32)
    src = sess.allocate(shape, np.float32)
    ortcapture.update_inplace(src, host)
    ortcapture.update_inplace(x, host)
    raw.run_with_iobinding(rb, ro)  # raw capture
    g = sess.capture({"images": host})
    sync = (lambda v: ortcapture.to_numpy(v)) if dev == "webgpu" else (lambda v: None)

    def raw_replay(i):
        x.update_inplace(src) if dev == "cuda" else ort.copy_tensors([src], [x], None)
        raw.run_with_iobinding(rb, ro)
        sync(y)

    def ours_replay(i):
        out = g.run({"images": src}, copy_outputs=False)
        sync(out[0])

    def raw_numpy(i):
        if dev == "cuda":
            x.update_inplace(host)
        else:
            ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(host)], [x], None)
        raw.run_with_iobinding(rb, ro)
        return ortcapture.to_numpy(y)

    def ours_numpy(i):
        return g.run({"images": host})

    arms = {"raw replay": raw_replay, "CapturedGraph.run(OrtValue)": ours_replay,
            "raw numpy in/out": raw_numpy, "CapturedGraph.run(numpy)": ours_numpy}
    outs = list(g.outputs.values())
    arms["part: ReplayOutput wrap"] = lambda i: [ortcapture.ReplayOutput(v, g, 0) for v in outs]
    if dev == "cuda":
        dst = sess.allocate(shape, np.float32)
        arms["raw update_inplace(OrtValue)"] = lambda i: dst.update_inplace(src)
        arms["ortcapture.update_inplace(OrtValue)"] = lambda i: ortcapture.update_inplace(dst, src)
        try:
            import torch

            t = torch.from_numpy(host).cuda()
            torch.cuda.synchronize()
            arms["ortcapture.update_inplace(torch)"] = lambda i: ortcapture.update_inplace(dst, t)
        except Exception as exc:  # noqa: BLE001
            print(f"(torch arm skipped: {exc})", file=sys.stderr)
    # correctness of both replay arms before timing
    want = ortcapture.to_numpy(y)
    got = g.run({"images": host})[0]
    diff = float(np.abs(got - want).max())
    samples = {k: [] for k in arms}
    iters = args.iters if dev == "cuda" else max(3, args.iters // 50)
    for _ in range(args.rounds):  # interleave the arms round by round
        for k, fn in arms.items():
            samples[k].append(timing.measure(fn, iters, warmup=3))
    stats = {k: timing.summary(np.concatenate(v)) for k, v in samples.items()}
    raw_p50 = stats["raw replay"]["p50_us"]
    print(f"provider {provider}, onnxruntime {ort.__version__}, max |ours - raw| = {diff:.3g}")
    print(f"{'arm':<40}{'p50 µs':>10}{'p90 µs':>10}{'min µs':>10}")
    for k, s in stats.items():
        print(f"{k:<40}{s['p50_us']:>10.1f}{s['p90_us']:>10.1f}{s['min_us']:>10.1f}")
    res = {"provider": provider, "ort": ort.__version__, "stats": stats, "max_abs_diff": diff,
           "captured_graph_minus_raw_us": stats["CapturedGraph.run(OrtValue)"]["p50_us"] - raw_p50,
           "captured_graph_over_raw": stats["CapturedGraph.run(OrtValue)"]["p50_us"] / raw_p50}
    if "raw update_inplace(OrtValue)" in stats:
        base = stats["raw update_inplace(OrtValue)"]["p50_us"]
        res["update_inplace_ortvalue_ratio"] = stats["ortcapture.update_inplace(OrtValue)"]["p50_us"] / base
        if "ortcapture.update_inplace(torch)" in stats:
            res["update_inplace_torch_ratio"] = stats["ortcapture.update_inplace(torch)"]["p50_us"] / base
    # paired (alternating-iteration) overhead: reference model, and a tiny model where the GPU time is ~0 so
    # ortcapture's host-side cost is not buried in replay-time noise
    pairs = {"reference model": (raw_replay, ours_replay)}
    if dev == "cuda":
        from tests import tiny  # noqa: E402 - the repo's tiny-model builders

        tmodel = tiny.affine_model((1, 64))
        traw = ort.InferenceSession(tmodel, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
        tx = ort.OrtValue.ortvalue_from_shape_and_type((1, 64), np.float32, "cuda", 0)
        ty = ort.OrtValue.ortvalue_from_shape_and_type((1, 64), np.float32, "cuda", 0)
        tsrc = ort.OrtValue.ortvalue_from_numpy(np.ones((1, 64), np.float32), "cuda", 0)
        tb = traw.io_binding()
        tb.bind_ortvalue_input("X", tx)
        tb.bind_ortvalue_output("Y", ty)
        traw.run_with_iobinding(tb, ro)
        tours = ortcapture.InferenceSession(tmodel, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
        tg = tours.capture({"X": np.ones((1, 64), np.float32)})

        def tiny_raw(i):
            tx.update_inplace(tsrc)
            traw.run_with_iobinding(tb, ro)

        pairs["tiny model (1x64 affine)"] = (tiny_raw, lambda i: tg.run({"X": tsrc}, copy_outputs=False))
    res["paired"] = {}
    for name, (fa, fb) in pairs.items():
        a, b = timing.paired(fa, fb, args.iters * args.rounds)
        extra = timing.paired_extra(a, b)  # both call orders weighted alike
        res["paired"][name] = {"raw_p50_us": float(np.median(a)), "ours_p50_us": float(np.median(b)),
                               "median_extra_us": extra}
        print(f"paired, {name}: raw p50 {np.median(a):.1f} µs, CapturedGraph.run p50 {np.median(b):.1f} µs, "
              f"extra {extra:+.1f} µs")
    print(json.dumps({k: v for k, v in res.items() if k != "stats"}))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
