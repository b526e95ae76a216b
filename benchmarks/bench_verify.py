"""Cost of capture-time verification (``verify=``, issue 15) per capture on the reference model (YOLOv8n 320n).

For each level (off, example, full) captures the reference model ``--repeats`` times on a fresh session each time
(so the WebGPU CPU EP reference session is built inside the first capture of each session, as a user sees it) and
reports the capture time (first capture after a warm-up one; again on the same session); the difference to ``off``
is the verification's cost, and ``verification_s`` is the verification's own time (``CapturedGraph.verification``)
for the second capture (reference session already built), the steadier number on a shared machine.

    python benchmarks/bench_verify.py --provider webgpu|cuda [--repeats 3] [--out verify.json]

Prints one JSON object (also written to ``--out``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import onnxruntime as ort

import ortcapture
from ortcapture._ort.providers import session_args
from ortcapture.cli.models import reference_model

SHAPE = (1, 3, 320, 320)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", choices=("webgpu", "cuda"), default="webgpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = reference_model()
    x = np.random.default_rng(0).random(SHAPE, np.float32)
    result = {"provider": args.provider, "onnxruntime": ort.__version__, "model": str(path), "shape": SHAPE,
              "repeats": args.repeats, "levels": {}}
    for level in ("off", "example", "full"):
        first, second, own = [], [], []
        for _ in range(args.repeats):
            so = ort.SessionOptions()
            so.log_severity_level = 3
            sess = ortcapture.InferenceSession(path, **session_args(args.provider, True, so))
            sess.capture({"images": x}, verify="off").release()  # warm: sibling session, kernels, allocator
            t0 = time.perf_counter()
            g = sess.capture({"images": x}, verify=level)
            first.append(time.perf_counter() - t0)
            g.release()
            t0 = time.perf_counter()
            g = sess.capture({"images": x}, verify=level)
            second.append(time.perf_counter() - t0)
            if g.verification is not None:
                own.append(g.verification.seconds)
            g.release()
        result["levels"][level] = {"capture_s_first": statistics.median(first),
                                   "capture_s_again": statistics.median(second),
                                   "verification_s": statistics.median(own) if own else 0.0}
    off = result["levels"]["off"]
    for level in ("example", "full"):
        lv = result["levels"][level]
        lv["verify_cost_s_first"] = lv["capture_s_first"] - off["capture_s_first"]
        lv["verify_cost_s_again"] = lv["capture_s_again"] - off["capture_s_again"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
