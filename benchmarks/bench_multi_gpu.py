#!/usr/bin/env python3
"""Two-GPU numbers for issue 7 (needs onnxruntime-gpu and >= 2 CUDA GPUs), reference model, batch 1.

Per GPU d in (0, 1):  IOBinding without graph vs ``CapturedGraph.run(OrtValue on GPU d)`` (p50, output read back to
the host in both arms), and max |captured - uncaptured| on that GPU.
Copies (1.2 MB input, ``ortcapture.update_inplace`` into a GPU-1 buffer): from GPU 1 (same device), from GPU 0
(peer), from a torch tensor on cuda:0 (peer), and the host path for scale; plus whether CUDA reports peer access.
Two threads: both GPUs replaying at once (each thread its own session) vs one GPU alone, calls per second.
Usage: python benchmarks/bench_multi_gpu.py [--iters N] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()

    import onnxruntime as ort

    import ortcapture
    from ortcapture._ort import compat
    from ortcapture.cli import models
    from ortcapture.cli import timing
    from ortcapture._ort.providers import session_args

    rt = compat.cudart()
    n = int(rt.cudaGetDeviceCount()[1]) if rt is not None else 0
    if n < 2 or "CUDAExecutionProvider" not in ort.get_available_providers():
        print(f"needs the CUDA EP and two GPUs (found {n})", file=sys.stderr)
        return 2
    model = str(models.reference_model())
    shape = (1, 3, 320, 320)
    host = np.random.default_rng(0).random(shape, dtype=np.float32)

    def so():
        o = ort.SessionOptions()
        o.log_severity_level = 3
        return o

    res = {"ort": ort.__version__, "gpus": n, "per_gpu": {}, "copies": {}}
    res["peer_access"] = {f"{a}->{b}": bool(rt.cudaDeviceCanAccessPeer(a, b)[1]) for a, b in ((0, 1), (1, 0))}
    graphs = {}
    for d in (0, 1):
        plain = ort.InferenceSession(model, **session_args("cuda", False, so(), device_id=d))
        sess = ortcapture.InferenceSession(model, **session_args("cuda", True, so(), device_id=d))
        g = graphs[d] = sess.capture({"images": host})
        src = sess.allocate(shape, np.float32)
        ortcapture.update_inplace(src, host)
        x, y = sess.allocate(shape, np.float32), sess.allocate((1, 22, 2100), np.float32)
        ortcapture.update_inplace(x, host)
        b = plain.io_binding()
        b.bind_ortvalue_input("images", x)
        b.bind_ortvalue_output("output0", y)

        def iob(i, b=b, y=y, x=x, src=src, plain=plain):
            x.update_inplace(src)
            plain.run_with_iobinding(b)
            return y.numpy()

        def cap(i, g=g, src=src):
            return g.run({"images": src})

        diff = float(np.abs(cap(0)[0] - plain.run(None, {"images": host})[0]).max())
        a, c = timing.summary(timing.measure(iob, args.iters)), timing.summary(timing.measure(cap, args.iters))
        res["per_gpu"][d] = {"iobinding_p50_us": a["p50_us"], "captured_p50_us": c["p50_us"],
                             "speedup": a["p50_us"] / c["p50_us"], "max_abs_diff_vs_uncaptured": diff}
    sess1 = graphs[1].session
    dst = sess1.allocate(shape, np.float32)
    same = sess1.allocate(shape, np.float32)
    ortcapture.update_inplace(same, host)
    peer = ort.OrtValue.ortvalue_from_numpy(host, "cuda", 0)
    sources = {"GPU 1 OrtValue (same device)": same, "GPU 0 OrtValue (peer)": peer, "host numpy": host}
    try:
        import torch

        sources["torch cuda:0 tensor (peer)"] = torch.from_numpy(host).to("cuda:0")
        torch.cuda.synchronize(0)
    except Exception as exc:  # noqa: BLE001
        print(f"(torch source skipped: {exc})", file=sys.stderr)
    for name, srcv in sources.items():
        s = timing.summary(timing.measure(lambda i, s=srcv: ortcapture.update_inplace(dst, s), args.iters))
        ok = bool(np.array_equal(ortcapture.to_numpy(dst), host))
        res["copies"][name] = {"p50_us": s["p50_us"], "GB_per_s": host.nbytes / s["p50_us"] / 1e3, "correct": ok}
    # two threads, one session per GPU, replaying at once
    def rate(ids, seconds=2.0):
        counts, stop = dict.fromkeys(ids, 0), time.perf_counter() + seconds

        def work(d):
            while time.perf_counter() < stop:
                graphs[d].run({"images": host})
                counts[d] += 1

        ts = [threading.Thread(target=work, args=(d,)) for d in ids]
        [t.start() for t in ts]
        [t.join() for t in ts]
        return {str(d): c / seconds for d, c in counts.items()}

    res["threads"] = {"one GPU alone (calls/s)": rate([1]), "two GPUs, two threads (calls/s)": rate([0, 1])}
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
