#!/usr/bin/env python3
"""The GIL "convoy" a replica's replay thread meets (issue 44, item 4), on the CPU: per-call time of a call that
waits once outside the GIL (ORT's CPU run of a 256x256 MatMul at batch 8, then a 0.2 ms sleep standing for a GPU or
DMA wait) on a worker thread, alone and beside a thread that runs Python without pause (a replica's event loop under
load), at Python's default switch interval (5 ms) and at ``ortcapture.serving.ray_common.SWITCH_INTERVAL_S``.

The waiting thread gets the GIL back only when the running one is made to drop it, after up to the switch interval:
a call that waits k times costs up to k x 5 ms under load. ``ortcapture serve``'s replicas set 0.5 ms
(:func:`ortcapture.serving.ray_common.quick_gil_handoff`).

Usage: python benchmarks/bench_gil_handoff.py [--calls 200]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import numpy as np
import onnxruntime as ort

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bucket_arms import matmul_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--wait-ms", type=float, default=0.2, help="the wait outside the GIL per call")
    args = ap.parse_args()
    from ortcapture.serving.ray_common import SWITCH_INTERVAL_S

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(matmul_model(256), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((8, 256), dtype=np.float32)

    def call():
        y = s.run(None, {"X": x.copy()})[0]
        time.sleep(args.wait_ms / 1e3)  # a wait that releases the GIL (the GPU, a DMA, another thread)
        return y.copy()

    def busy(stop):
        n = 0
        while not stop.is_set():
            n += sum(range(200))  # pure Python: keeps the GIL until made to drop it

    old = sys.getswitchinterval()
    try:
        for interval in (old, SWITCH_INTERVAL_S):
            sys.setswitchinterval(interval)
            for load in (False, True):
                stop = threading.Event()
                t = threading.Thread(target=busy, args=(stop,), daemon=True)
                if load:
                    t.start()
                res: list[float] = []

                def worker(res=res):
                    for _ in range(args.calls):
                        t0 = time.perf_counter()
                        call()
                        res.append(time.perf_counter() - t0)
                w = threading.Thread(target=worker)
                w.start()
                w.join()
                stop.set()
                if load:
                    t.join()
                print(f"switch interval {interval * 1e3:.1f} ms, {'beside a busy thread' if load else 'alone':21}: "
                      f"p50 {statistics.median(res) * 1e6:7.0f} us per call", flush=True)
    finally:
        sys.setswitchinterval(old)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
