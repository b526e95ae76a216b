#!/usr/bin/env python3
"""Host <-> device copy strategies for a plain numpy feed, measured with cuda-python alone (no ORT needed).

Issue 32 asks a plain numpy batch-8 YOLOv8n request (input 8x3x320x320 float32 = 9.8 MB, output 8x22x2100 float32
= 1.48 MB) in and out within 1.45x of the device-resident replay. This script times the ways the bytes can go, in
one process, so the staging code can take the fastest (medians over ``--iters`` calls, µs):

* upload: ``cudaMemcpyAsync`` from pageable memory (what ORT's ``update_inplace(numpy)`` does), from T threads on
  streams of their own; a host copy into page-locked memory then one DMA (serial); the chunked pipeline as
  ``ortcapture.transfer._fill_and_send`` did it (1 MiB chunks handed to a pool, the caller queuing every DMA);
  striped: T threads each copy their own stripe in sub-chunks and queue each sub-chunk's DMA themselves.
* page-locking the caller's own array in place: ``cudaHostRegister`` + ``cudaHostUnregister`` per call, and the
  DMA from an array registered once.
* readback: into a new pageable array; into page-locked memory; into page-locked memory then copied out (by one
  or T threads).
* the staging buffer's kind (fourth round): write-combined page-locked memory (``cudaHostAllocWriteCombined``: CPU
  stores bypass the cache, no read-for-ownership; CPU reads of it are slow) and transparent huge pages
  (``mmap`` + ``madvise(MADV_HUGEPAGE)`` + ``cudaHostRegister``), each filled by 1-4 threads and with chunk claims of
  1-4 MiB; and "8 sources in turn" (a new request array each call, not in cache), the case plain numpy serving has.

``--only REGEX`` runs the matching cases alone; run it again with ``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_
threshold=0x40000`` to see glibc's non-temporal memcpy on 1 MiB chunks.

Usage (the H200)::

    /opt/torch/.venv/bin/python benchmarks/bench_host_copy.py --out "$OUT/host_copy.json"
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--in-bytes", type=int, default=8 * 3 * 320 * 320 * 4)
    ap.add_argument("--out-bytes", type=int, default=8 * 22 * 2100 * 4)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="a regular expression: only the cases whose name matches")
    args = ap.parse_args()
    import mmap
    import os
    import platform
    import re

    import numpy as np
    from cuda.bindings import runtime as rt

    def ok(res):
        err = res[0]
        if int(err):
            raise RuntimeError(str(err))
        return res[1] if len(res) > 1 else None

    ok(rt.cudaSetDevice(0))
    ok(rt.cudaFree(0))
    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    n, m = args.in_bytes, args.out_bytes
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    sptr = src.ctypes.data
    dptr = int(ok(rt.cudaMalloc(n)))
    optr = int(ok(rt.cudaMalloc(m)))
    hptr = int(ok(rt.cudaHostAlloc(n, 1)))
    hout = int(ok(rt.cudaHostAlloc(m, 1)))

    class _Block:
        def __init__(self, ptr, size):
            self.__array_interface__ = {"data": (ptr, False), "shape": (size,), "typestr": "|u1", "version": 3}

    pinned = np.asarray(_Block(hptr, n))
    pinned_out = np.asarray(_Block(hout, m))
    wptr = int(ok(rt.cudaHostAlloc(n, 1 | 4)))  # cudaHostAllocPortable | cudaHostAllocWriteCombined
    wc = np.asarray(_Block(wptr, n))
    huge = 2 << 20
    thp_map = mmap.mmap(-1, -(-n // huge) * huge + huge)  # anonymous; 2 MiB-aligned view below
    thp_base = np.frombuffer(thp_map, np.uint8)
    off = (-thp_base.ctypes.data) % huge
    thp = thp_base[off:off + n]
    madvised = False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            thp_map.madvise(mmap.MADV_HUGEPAGE)
            madvised = True
        except OSError:
            pass
    thp[:] = 1  # touch every page
    tptr = int(thp.ctypes.data)
    ok(rt.cudaHostRegister(tptr, n, 0))
    bufs = {"pinned": (pinned, hptr), "write-combined pinned": (wc, wptr), "THP registered": (thp, tptr)}
    cold = [np.random.default_rng(10 + i).integers(0, 255, n, dtype=np.uint8) for i in range(8)]
    turn = [0]

    def next_src():
        turn[0] = (turn[0] + 1) % len(cold)
        return cold[turn[0]]
    streams = [ok(rt.cudaStreamCreateWithFlags(1)) for _ in range(8)]
    stream = streams[0]
    pools = {t: ThreadPoolExecutor(t - 1) for t in (2, 3, 4, 8)}

    def sync(s=stream):
        ok(rt.cudaStreamSynchronize(s))

    def send(d, h, k, s=stream):
        (err,) = rt.cudaMemcpyAsync(d, h, k, kind, s)
        if int(err):
            raise RuntimeError(str(err))

    cases = {}

    def case(name):
        def deco(fn):
            cases[name] = fn
            return fn
        return deco

    @case("upload: pageable cudaMemcpyAsync, 1 thread")
    def _():
        send(dptr, sptr, n)
        sync()

    def pageable_striped(t):
        step = -(-n // t)

        def part(i):
            a = i * step
            b = min(n, a + step)
            send(dptr + a, sptr + a, b - a, streams[i])
            sync(streams[i])
        fs = [pools[t].submit(part, i) for i in range(1, t)]
        part(0)
        for f in fs:
            f.result()

    for t in (2, 4):
        cases[f"upload: pageable cudaMemcpyAsync, {t} threads (stripes, own streams)"] = \
            lambda t=t: pageable_striped(t)

    @case("upload: host copy into pinned, then one DMA (serial)")
    def _():
        np.copyto(pinned, src)
        send(dptr, hptr, n)
        sync()

    @case("fill only: 1 thread")
    def _():
        np.copyto(pinned, src)

    def fill_striped(t, buf="pinned", source=None):  # one stripe per thread, the caller copying the first
        dst = bufs[buf][0]
        s_ = src if source is None else source()
        step = -(-n // t)
        fs = [pools[t].submit(np.copyto, dst[a:a + step], s_[a:a + step]) for a in range(step, n, step)] \
            if t > 1 else []
        np.copyto(dst[:step], s_[:step])
        for f in fs:
            f.result()

    for t in (2, 4, 8):
        cases[f"fill only: {t} threads (stripes)"] = lambda t=t: fill_striped(t)

    def chunked_pool(t, chunk=1 << 20):  # the 2026-12-01 _fill_and_send
        bounds = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
        a, b = bounds[0]
        fs = [pools[t].submit(np.copyto, pinned[a:b], src[a:b]) for a, b in bounds[1:]]
        np.copyto(pinned[a:b], src[a:b])
        send(dptr + a, hptr + a, b - a)
        for (a, b), f in zip(bounds[1:], fs):
            if f.cancel():
                np.copyto(pinned[a:b], src[a:b])
            else:
                f.result()
            send(dptr + a, hptr + a, b - a)
        sync()

    for t in (2, 4, 8):
        cases[f"upload: chunked 1 MiB via pool, caller sends, {t} threads"] = lambda t=t: chunked_pool(t)

    def striped_send(t, chunk):
        step = -(-n // t)

        def part(i):
            a0 = i * step
            b0 = min(n, a0 + step)
            for a in range(a0, b0, chunk):
                b = min(b0, a + chunk)
                np.copyto(pinned[a:b], src[a:b])
                send(dptr + a, hptr + a, b - a)
        fs = [pools[t].submit(part, i) for i in range(1, t)]
        part(0)
        for f in fs:
            f.result()
        sync()

    for t in (2, 4, 8):
        for chunk in (256 << 10, 1 << 20):
            cases[f"upload: striped, each thread sends its {chunk >> 10} KiB chunks, {t} threads"] = \
                lambda t=t, c=chunk: striped_send(t, c)

    def claimed_send(t, chunk=1 << 20, buf="pinned", source=None):  # ortcapture._staging._fill_and_send
        starts = iter(range(0, n, chunk))
        lock = threading.Lock()
        dst, base = bufs[buf]
        s_ = src if source is None else source()

        def work():
            while True:
                with lock:
                    a = next(starts, None)
                if a is None:
                    return
                b = min(n, a + chunk)
                np.copyto(dst[a:b], s_[a:b])
                send(dptr + a, base + a, b - a)
        fs = [pools[t].submit(work) for _ in range(t - 1)]
        work()
        for f in fs:
            f.cancel() or f.result()
        sync()

    for t in (2, 3, 4):
        cases[f"upload: shared 1 MiB chunk claims, each thread sends its own, {t} threads"] = \
            lambda t=t: claimed_send(t)
    # fourth round: the staging buffer's kind, chunk sizes, and a new (cold) source array per call
    for buf in bufs:
        for t in (1, 2, 4):
            if buf != "pinned":  # page-locked from one source: "fill only: T threads (stripes)" above
                cases[f"fill only into {buf}: {t} threads"] = lambda t=t, b=buf: fill_striped(t, b)
            cases[f"fill only into {buf}: {t} threads, 8 sources in turn"] = \
                lambda t=t, b=buf: fill_striped(t, b, next_src)
        for t in (2, 3, 4):
            for chunk in (1 << 20, 2 << 20, 4 << 20):
                if buf == "pinned" and chunk == 1 << 20:
                    continue  # above
                cases[f"upload: {buf}, {chunk >> 20} MiB chunk claims, {t} threads"] = \
                    lambda t=t, c=chunk, b=buf: claimed_send(t, c, b)
            cases[f"upload: {buf}, 1 MiB chunk claims, {t} threads, 8 sources in turn"] = \
                lambda t=t, b=buf: claimed_send(t, 1 << 20, b, next_src)
        cases[f"upload: {buf} buffer already filled (DMA only)"] = \
            lambda b=bufs[buf][1]: (send(dptr, b, n), sync())
    cases["upload: pageable cudaMemcpyAsync, 1 thread, 8 sources in turn"] = \
        lambda: (send(dptr, next_src().ctypes.data, n), sync())

    # page-locking the caller's own array in place (cudaHostRegister): what it costs, and the DMA from it after
    @case("register: cudaHostRegister + cudaHostUnregister of the input array")
    def _():
        ok(rt.cudaHostRegister(sptr, n, 0))
        ok(rt.cudaHostUnregister(sptr))

    reg = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)  # registered for the rest of the run
    rptr = reg.ctypes.data
    ok(rt.cudaHostRegister(rptr, n, 0))

    @case("upload: the caller's array page-locked in place (cudaHostRegister once; DMA only)")
    def _():
        send(dptr, rptr, n)
        sync()

    IDLE_CASES = {}
    IDLE_CASES["upload: the caller's array page-locked in place (cudaHostRegister once; DMA only), after 1.4 ms idle"] \
        = cases["upload: the caller's array page-locked in place (cudaHostRegister once; DMA only)"]
    for name in ("upload: striped, each thread sends its 1024 KiB chunks, 2 threads",
                 "upload: shared 1 MiB chunk claims, each thread sends its own, 2 threads",
                 "upload: pageable cudaMemcpyAsync, 1 thread"):
        IDLE_CASES[name + ", after 1.4 ms idle"] = cases[name]

    @case("upload: pinned buffer already filled (DMA only)")
    def _():
        send(dptr, hptr, n)
        sync()

    @case("readback: into a new pageable array")
    def _():
        a = np.empty(m, np.uint8)
        send(a.ctypes.data, optr, m)
        sync()

    @case("readback: into pinned (DMA only)")
    def _():
        send(hout, optr, m)
        sync()

    @case("readback: into pinned, then copied into a new array")
    def _():
        send(hout, optr, m)
        sync()
        pinned_out.copy()

    for t in (2, 4):
        def rb(t=t):
            send(hout, optr, m)
            sync()
            out = np.empty(m, np.uint8)
            step = -(-m // t)
            fs = [pools[t].submit(np.copyto, out[a:a + step], pinned_out[a:a + step]) for a in range(step, m, step)]
            np.copyto(out[:step], pinned_out[:step])
            for f in fs:
                f.result()
        cases[f"readback: into pinned, then copied out by {t} threads"] = rb

    if args.only:
        keep = re.compile(args.only)
        cases = {k: v for k, v in cases.items() if keep.search(k)}
        IDLE_CASES = {k: v for k, v in IDLE_CASES.items() if keep.search(k)}
    try:
        thp_mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp_mode = None
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), None) \
        if os.path.exists("/proc/cpuinfo") else None
    res = {"in_bytes": n, "out_bytes": m, "iters": args.iters, "cpu": cpu, "libc": platform.libc_ver(),
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES"), "thp": thp_mode, "thp_madvised": madvised,
           "cases": {}}
    clock = time.perf_counter_ns
    for rnd in range(2):  # two rounds, interleaved order: the later round reported
        for name, fn in cases.items():
            for _ in range(10):
                fn()
            xs = []
            for _ in range(args.iters):
                t0 = clock()
                fn()
                xs.append((clock() - t0) / 1e3)
            if rnd:
                res["cases"][name] = {"p50_us": statistics.median(xs), "p10_us": sorted(xs)[len(xs) // 10]}
        for name, fn in IDLE_CASES.items():  # each call after the caller spun 1.4 ms (a replay) with workers idle
            xs = []
            for _ in range(args.iters):
                end = time.perf_counter() + 0.0014
                while time.perf_counter() < end:
                    pass
                t0 = clock()
                fn()
                xs.append((clock() - t0) / 1e3)
            if rnd:
                res["cases"][name] = {"p50_us": statistics.median(xs), "p10_us": sorted(xs)[len(xs) // 10]}
    # correctness of the striped pipeline: the device bytes equal the source
    striped_send(4, 256 << 10)
    back = np.empty(n, np.uint8)
    send(back.ctypes.data, dptr, n)
    sync()
    res["striped_exact"] = bool(np.array_equal(back, src))
    for buf in ("write-combined pinned", "THP registered"):
        claimed_send(3, 2 << 20, buf, next_src)
        send(back.ctypes.data, dptr, n)
        sync()
        res[f"{buf} exact"] = bool(np.array_equal(back, cold[turn[0]]))
    send(dptr, rptr, n)
    sync()
    send(back.ctypes.data, dptr, n)
    sync()
    res["registered_exact"] = bool(np.array_equal(back, reg))
    ok(rt.cudaHostUnregister(rptr))
    ok(rt.cudaHostUnregister(tptr))
    width = max(map(len, res["cases"]))
    for name, v in res["cases"].items():
        print(f"{name:<{width}}  p50 {v['p50_us']:8.1f} µs   p10 {v['p10_us']:8.1f}")
    print("exact:", {k: v for k, v in res.items() if k.endswith("exact")}, "cpu:", cpu, "thp:", thp_mode,
          "libc:", res["libc"], "tunables:", res["glibc_tunables"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
