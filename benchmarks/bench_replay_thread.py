"""The cost of ``replay_thread=True`` (issue 16): a bucket session whose replays all run on one session-owned thread,
called from another thread, against the same session type called directly. Interleaved arms in one process, a warm
pass, then ``--passes`` rounds; the hand-off cost per call is the difference of the medians (µs).

    python benchmarks/bench_replay_thread.py --provider webgpu   # software adapter: source webgpu.env first
    python benchmarks/bench_replay_thread.py --provider cuda --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _model() -> bytes:
    from tests import tiny

    return tiny.bucket_model()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", choices=["webgpu", "cuda"], default="webgpu")
    ap.add_argument("--calls", type=int, default=300, help="calls per arm per pass")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)

    import onnxruntime as ort

    import ortcapture
    from ortcapture._ort.providers import session_args

    def make(replay_thread):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        return ortcapture.InferenceSession(_model(), **session_args(args.provider, True, so),
                                           buckets={"batch": [4]}, replay_thread=replay_thread)

    arms = {"direct": make(False), "replay_thread": make(True)}
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    samples = {a: [] for a in arms}

    def calls(sess, out):
        for _ in range(args.calls):
            t = time.perf_counter()
            sess.run(None, {"X": x})
            out.append(time.perf_counter() - t)

    def in_thread(sess, out):  # both arms are called from a worker thread, as a server would
        t = threading.Thread(target=calls, args=(sess, out))
        t.start()
        t.join()

    for sess in arms.values():
        in_thread(sess, [])  # warm: capture and verify
    for p in range(args.passes):
        order = list(arms) if p % 2 == 0 else list(arms)[::-1]
        for arm in order:
            in_thread(arms[arm], samples[arm])
    res = {arm: {"median_us": float(np.median(v) * 1e6), "p90_us": float(np.percentile(v, 90) * 1e6),
                 "calls": len(v)} for arm, v in samples.items()}
    res["handoff_us"] = res["replay_thread"]["median_us"] - res["direct"]["median_us"]
    res["provider"] = args.provider
    res["onnxruntime"] = ort.__version__
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
