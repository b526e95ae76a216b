"""A real library under ``ortcapture.patched()``: nudenet 3.4.2's ``NudeDetector`` (it builds
``onnxruntime.InferenceSession(model_path)`` itself and calls plain ``run()``), timed against the same detector on
a raw ORT session of the same provider without capture, in one process, calls alternated.

    python benchmarks/dropin_library.py --provider cuda --iters 300 [--json out.json]

Reports p50 per ``detect()`` (pre/post-processing included) and per ``session.run()`` on the preprocessed input,
the ratio raw / patched, the max abs difference of the raw model outputs, and the session's replay counts.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="cuda", choices=("cuda", "webgpu"))
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()

    import nudenet
    import onnxruntime as ort
    from nudenet.nudenet import _read_image

    import ortcapture
    from ortcapture._ort.providers import session_args

    rng = np.random.default_rng(0)
    imgs = [(rng.random((480, 640, 3)) * 255).astype(np.uint8) for _ in range(4)]
    with ortcapture.patched(args.provider):
        ours = nudenet.NudeDetector()
    raw = nudenet.NudeDetector.__new__(nudenet.NudeDetector)  # the same object, its session made by raw ORT
    raw.__dict__.update(ours.__dict__)
    raw.onnx_session = ort.InferenceSession(_model_path(nudenet),
                                            **session_args(args.provider, False))
    xs = [_read_image(img, ours.input_width)[0] for img in imgs]
    name = ours.input_name

    def timed(fn, n):
        out = np.empty(n)
        for i in range(n):
            t0 = time.perf_counter()
            fn(i)
            out[i] = time.perf_counter() - t0
        return out

    res = {"provider": args.provider, "ort": ort.__version__, "iters": args.iters}
    for label, call in (("detect", lambda d: (lambda i: d.detect(imgs[i % 4]))),
                        ("run", lambda d: (lambda i: d.onnx_session.run(None, {name: xs[i % 4]})))):
        for d in (ours, raw):  # warm-up (the first call captures)
            timed(call(d), 10)
        a, b = [], []
        for _ in range(5):  # alternated blocks
            a.append(timed(call(raw), args.iters // 5))
            b.append(timed(call(ours), args.iters // 5))
        pa, pb = float(np.median(np.concatenate(a))) * 1e6, float(np.median(np.concatenate(b))) * 1e6
        res[label] = {"raw_p50_us": pa, "patched_p50_us": pb, "speedup": pa / pb}
        print(f"{label:>7}: raw ORT {pa:8.1f} µs   ortcapture.patched {pb:8.1f} µs   {pa / pb:.2f}x", flush=True)
    diff = max(float(np.abs(ours.onnx_session.run(None, {name: x})[0] - raw.onnx_session.run(None, {name: x})[0])
                     .max()) for x in xs)
    res["max_abs_diff"] = diff
    res["stats"] = dict(ours.onnx_session.stats)
    print(f"max abs diff of the raw outputs {diff:.3g}; patched session {res['stats']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


def _model_path(nudenet) -> str:
    import os

    return os.path.join(os.path.dirname(nudenet.__file__), "320n.onnx")


if __name__ == "__main__":
    raise SystemExit(main())
