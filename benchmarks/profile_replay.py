#!/usr/bin/env python3
# ruff: noqa: SLF001 - a profiler of the replay path reads the graph's internals (both code trees have them)
"""Where a replay's time goes, and ortcapture against the same graph driven raw — old and new code, fresh processes.

Issue 32's measurements, in one script:

* ``steps``: ``perf_counter_ns`` per step of ``CapturedGraph.run`` — each step of the replay path timed on its own on
  the real graph (the foreign-capture probe, the session guard and the CUDA gate, the per-thread lookup, the feed copy,
  ORT's ``run_with_iobinding``, the output wrappers, the readback), and the whole call; "python" is the whole call
  less the feed copy and the ORT call.
* ``overhead``: ``g.run({name: OrtValue}, copy_outputs=False)`` against the graph's *own* IOBinding driven raw
  (``update_inplace`` of the same source + ORT's ``run_with_iobinding`` on the same session, binding and run options),
  alternated call by call (``paired``: the median extra per call, both call orders weighted alike). Same graph, so the
  ~20 µs by which two captures of one model differ is not in the number.
* ``after_wait``: the same steps each timed right after a real replay's wait for the GPU (where they run in a
  stream of replays; on the H200 hosts Python costs several times more there than back to back), and ortcapture's
  whole host path there: ``g.run`` with its one ORT call stubbed.
* ``paired``: ablations in the same alternation as ``overhead`` — ``g.run(None)`` over ORT's call alone, the
  foreign-capture probe before ORT's call, ``g.run`` without the probe, and raw against raw (the method's noise).
* ``numpy`` (a real model, batch 8): numpy in -> numpy out. Device-resident replay (no feed, outputs left on the
  device); raw ORT ``update_inplace(numpy)`` + run + ``.numpy()``; ``g.run(numpy)`` of the same array every call and of 8 arrays in turn; where the code has them,
  ``g.host_inputs`` filled + ``copy_outputs="pinned"`` (the fill timed apart), and the staging copy itself (host
  memcpy into the pinned buffer; host -> device copy).
* ``stream``: throughput of a stream of batch-8 numpy requests through ``g.run_many`` (where the code has it; else a
  loop of ``g.run``) against back-to-back device-resident replays.

Each case runs in fresh worker processes, ``--procs`` of them per code tree, the trees alternating (old, new, new,
old, ...); the report gives the median over processes of each per-process median. ``--baseline DIR`` names an older
checkout of the package (``DIR/ortcapture/__init__.py`` or ``DIR/__init__.py``); without it only the working tree's
code runs.

Usage (CUDA, the H200)::

    python benchmarks/profile_replay.py --provider cuda --baseline .baseline --procs 5 --out "$OUT/profile_replay.json"

WebGPU (software adapter here: host-side costs only; real models are slow there, so ``--cases tiny``)::

    python benchmarks/profile_replay.py --provider webgpu --baseline .baseline --procs 5 --cases tiny
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

#: case name -> (model, batch)
CASES = {"tiny": ("tiny", 1), "yolo1": ("reference", 1), "yolo8": ("reference", 8),
         "affine8": ("affine", 8),
         # issue 42: plain run() with buckets [1,2,4,8] against g.run(numpy) on a graph of the request's size, paired,
         # a mixed batch 1-8 stream and 300 reused arrays (benchmarks/bucket_arms.py): YOLOv8n 320, and a 64x64 MatMul
         "buckets": ("reference", 0), "buckets_matmul": ("matmul", 0)}  # YOLOv8n's batch-8 input (8x3x320x320) through a 2-node model: transfers only
#: the cases that also time numpy in -> numpy out and a stream of requests
HOST_IO_CASES = ("yolo8", "affine8")


# ---------------------------------------------------------------------------------------------------------------
# worker: one process, one code tree, one case
# ---------------------------------------------------------------------------------------------------------------
def _import_tree(pkg: str | None):
    """Put the code tree to measure first on sys.path (the repo root after it, for tests.tiny), import ortcapture."""
    if pkg:
        pkg = os.path.abspath(pkg)
        root = os.path.dirname(pkg) if os.path.isfile(os.path.join(pkg, "__init__.py")) else pkg
        if not os.path.isfile(os.path.join(root, "ortcapture", "__init__.py")):
            raise SystemExit(f"--pkg {pkg}: no ortcapture package there")
    else:
        root = REPO
    sys.path[:0] = [root] + ([REPO] if root != REPO else [])
    import ortcapture

    return ortcapture


def _clock_overhead_ns(clock) -> float:
    xs = []
    for _ in range(2000):
        t0 = clock()
        xs.append(clock() - t0)
    return float(statistics.median(xs))


def _time_each(fn, iters: int, warmup: int = 5, prep=None) -> list[float]:
    """``fn()`` timed call by call, µs; ``prep()`` (untimed) before each call where given."""
    clock = time.perf_counter_ns
    for _ in range(warmup):
        if prep is not None:
            prep()
        fn()
    out = []
    for _ in range(iters):
        if prep is not None:
            prep()
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1e3)
    return out


def _paired(fa, fb, iters: int, warmup: int = 5) -> tuple[list[float], list[float]]:
    """fa and fb alternated call by call, which one goes first alternating too (µs each)."""
    clock = time.perf_counter_ns
    for _ in range(warmup):
        fa()
        fb()
    a, b = [], []
    for i in range(iters):
        if i % 2:
            t0 = clock(); fb(); t1 = clock(); fa(); t2 = clock()  # noqa: E702
            b.append((t1 - t0) / 1e3); a.append((t2 - t1) / 1e3)  # noqa: E702
        else:
            t0 = clock(); fa(); t1 = clock(); fb(); t2 = clock()  # noqa: E702
            a.append((t1 - t0) / 1e3); b.append((t2 - t1) / 1e3)  # noqa: E702
    return a, b


def _paired_extra(a: list[float], b: list[float]) -> float:
    d = [y - x for x, y in zip(a, b)]
    first_a, first_b = d[0::2], d[1::2]
    return (statistics.median(first_a) + statistics.median(first_b)) / 2 if first_b else statistics.median(first_a)


def _med(xs) -> float:
    return float(statistics.median(xs))


def _cpu_list(text: str) -> set[int]:
    """``"2-5,8"`` -> {2, 3, 4, 5, 8}."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def worker(args) -> dict:
    if args.cpus:
        os.sched_setaffinity(0, _cpu_list(args.cpus))
    if args.sched != "auto":  # how CUDA waits for the GPU (cudaSetDeviceFlags before the context exists)
        from cuda.bindings import runtime as rt

        flag = {"spin": rt.cudaDeviceScheduleSpin, "yield": rt.cudaDeviceScheduleYield,
                "blocking": rt.cudaDeviceScheduleBlockingSync}[args.sched]
        (err,) = rt.cudaSetDeviceFlags(flag)
        if int(err):
            raise SystemExit(f"cudaSetDeviceFlags: {err}")
    ortcapture = _import_tree(args.pkg)
    if args.case.startswith("buckets"):
        sys.path.insert(0, HERE)
        import bucket_arms

        return bucket_arms.run_arms(ortcapture, args.provider, CASES[args.case][0], args.iters)
    import numpy as np

    from ortcapture import transfer
    from ortcapture._ort import compat
    from ortcapture._ort.providers import session_args
    from ortcapture._core.run import uncaptured_run_options

    import onnxruntime as ort

    provider = args.provider
    model_kind, batch = CASES[args.case]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if args.intra_op_threads is not None:
        so.intra_op_num_threads = args.intra_op_threads
    for kv in args.session_config:
        key, _, value = kv.partition("=")
        so.add_session_config_entry(key, value)
    if model_kind == "tiny":
        from tests import tiny

        model = tiny.affine_model((1, 64))
        name, shape = "X", (1, 64)
    elif model_kind == "affine":
        from tests import tiny

        shape = (batch, 3, 320, 320)
        model = tiny.affine_model(shape)
        name = "X"
    else:
        from ortcapture.cli import models

        model = str(models.reference_model())
        name, shape = "images", (batch, 3, 320, 320)
    sess = ortcapture.InferenceSession(model, **session_args(provider, True, so))
    rng = np.random.default_rng(0)
    host = rng.random(shape, dtype=np.float32)
    g = sess.capture({name: host}, verify=False)
    cs = g._cs
    src = sess.allocate(shape, np.float32)
    ortcapture.update_inplace(src, host)
    dst = g.inputs[name]
    gsess, ro = g.session, g._run_options
    webgpu = provider == "webgpu"
    ort_run = compat.ORT_RUN_WITH_IOBINDING
    copy_tensors = compat.ort_copy_tensors

    def binding():
        return g._binding  # re-read: a new thread's capture or a compaction may rebind

    if webgpu:
        def raw_feed():
            copy_tensors([src], [dst], None)
    else:
        def raw_feed():
            dst.update_inplace(src)

    def raw_replay():
        raw_feed()
        ort_run(gsess, binding(), ro)

    feeds = {name: src}

    def ours_replay():
        g.run(feeds, copy_outputs=False)

    res = {"case": args.case, "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None, "pkg": os.path.dirname(ortcapture.__file__), "provider": provider, "ort": ort.__version__,
           "batch": batch, "shape": list(shape)}
    iters = args.iters
    # correctness first: both arms give the uncaptured run's outputs
    want = [np.asarray(v) for v in sess.run(None, {name: host}, uncaptured_run_options())]
    got = g.run({name: host})
    res["max_abs_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(got, want))

    # -- overhead on the same graph -----------------------------------------------------------------------------
    a, b = _paired(raw_replay, ours_replay, iters)
    res["overhead"] = {"raw_p50_us": _med(a), "ours_p50_us": _med(b), "paired_extra_us": _paired_extra(a, b)}

    # -- per-step profile ---------------------------------------------------------------------------------------
    clock_ns = _clock_overhead_ns(time.perf_counter_ns)
    steps = {}
    probe = getattr(cs, "capture_probe", None)
    if probe is not None:
        steps["foreign-capture probe"] = probe
    guard = cs.guard

    def guard_step():
        with guard:
            pass
    steps["session guard (gate + lock)"] = guard_step
    steps["per-thread lookup"] = lambda: cs.thread_has(g.graph_id)

    def copy_step():
        with guard:
            transfer.copy_feeds(getattr(g, "_targets", None) or g.inputs, feeds)
    steps["feed copy (copy_feeds, OrtValue)"] = copy_step
    steps["raw feed copy (update_inplace)"] = raw_feed
    steps["ORT run_with_iobinding"] = lambda: ort_run(gsess, binding(), ro)
    outs = list(g._output_list)
    steps["ReplayOutput wraps"] = lambda: [ortcapture.ReplayOutput(v, g, 0) for v in outs]
    steps["readback (to_numpy)"] = lambda: [transfer.to_numpy(v) for v in outs]
    steps["g.run(None, copy_outputs=False)"] = lambda: g.run(None, copy_outputs=False)
    steps["g.run({OrtValue}, copy_outputs=False)"] = ours_replay
    steps["raw replay (update_inplace + run_with_iobinding)"] = raw_replay
    prof = {}
    for _ in range(3):  # rounds, interleaved
        for k, fn in steps.items():
            prof.setdefault(k, []).extend(_time_each(fn, max(20, iters // 3)))
    prof = {k: max(0.0, _med(v) - clock_ns / 1e3) for k, v in prof.items()}
    prof["python around ORT (whole - feed copy - ORT call)"] = (
        prof["g.run({OrtValue}, copy_outputs=False)"] - prof["feed copy (copy_feeds, OrtValue)"]
        - prof["ORT run_with_iobinding"])
    res["steps_us"] = prof
    res["clock_overhead_ns"] = clock_ns

    # -- the same steps right after a replay's wait for the GPU ----------------------------------------------------
    # Back to back (above) every step finds its code and data in the caches; in a stream of replays each one runs
    # right after ORT's wait for the GPU. "whole, ORT stubbed": g.run with its one ORT call replaced by a no-op, so
    # the time is ortcapture's own host work, timed where it happens.
    clock = time.perf_counter_ns

    def after_wait(fn, n):
        xs = []
        for _ in range(n):
            ort_run(gsess, binding(), ro)
            t0 = clock()
            fn()
            xs.append((clock() - t0) / 1e3)
        return xs

    def stubbed(fn):
        def call():
            attr = "_replay_run" if getattr(g, "_replay_run", None) is not None else "_replay"
            real = getattr(g, attr)
            setattr(g, attr, _noop)
            try:
                fn()
            finally:
                setattr(g, attr, real)
        return call

    def no_probe(fn):
        def call():
            real = cs.capture_probe
            cs.capture_probe = None
            try:
                fn()
            finally:
                cs.capture_probe = real
        return call

    cold = {"timer only": _noop}
    if probe is not None:
        cold["foreign-capture probe"] = probe
    cold["session guard (gate + lock)"] = guard_step
    cold["per-thread lookup"] = steps["per-thread lookup"]
    cold["raw feed copy (update_inplace)"] = raw_feed
    cold["ReplayOutput wraps"] = steps["ReplayOutput wraps"]
    # the stub swap itself is timed too: "stub swap only" is subtracted below
    cold["stub swap only"] = stubbed(_noop)
    cold["g.run({OrtValue}), ORT stubbed"] = stubbed(ours_replay)
    cold["g.run(None), ORT stubbed"] = stubbed(lambda: g.run(None, copy_outputs=False))
    if probe is not None:
        cold["g.run({OrtValue}), ORT stubbed, no probe"] = stubbed(no_probe(ours_replay))
    aw = {}
    for _ in range(3):
        for k, fn in cold.items():
            aw.setdefault(k, []).extend(after_wait(fn, max(20, iters // 3)))
    aw = {k: max(0.0, _med(v) - clock_ns / 1e3) for k, v in aw.items()}
    swap = aw.pop("stub swap only")
    for k in list(aw):
        if "stubbed" in k:
            aw[k] = aw[k] - swap
    res["after_wait_us"] = aw

    # -- paired ablations: what each part adds to a replay, in the same alternation as "overhead" ----------------
    def ort_call():
        ort_run(gsess, binding(), ro)

    abl = {}
    a, b = _paired(ort_call, lambda: g.run(None, copy_outputs=False), iters)
    abl["g.run(None) over ORT's call alone"] = _paired_extra(a, b)
    if probe is not None:
        a, b = _paired(ort_call, lambda: (probe(), ort_call()), iters)
        abl["the probe before ORT's call"] = _paired_extra(a, b)
        a, b = _paired(raw_replay, no_probe(ours_replay), iters)
        abl["g.run({OrtValue}) without the probe over raw"] = _paired_extra(a, b)
    a, b = _paired(raw_replay, raw_replay, iters)
    abl["raw over raw (the method's own noise)"] = _paired_extra(a, b)
    res["paired_us"] = abl
    res["torch_imported"] = "torch" in sys.modules
    try:
        with open("/proc/self/stat") as fh:
            res["last_cpu"] = int(fh.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        pass

    # -- numpy in -> numpy out ------------------------------------------------------------------------------------
    if args.numpy:
        arms = {}
        arms["device-resident replay"] = lambda: g.run(None, copy_outputs=False)
        if webgpu:
            def raw_numpy(x=host):
                copy_tensors([ort.OrtValue.ortvalue_from_numpy(x)], [dst], None)
                ort_run(gsess, binding(), ro)
                return [transfer.to_numpy(v) for v in outs]
            arms["device-resident replay"] = lambda: _wg_sync(g, transfer)
        else:
            def raw_numpy(x=host):
                dst.update_inplace(x)
                ort_run(gsess, binding(), ro)
                return [v.numpy() for v in outs]
        raw = "raw ORT update_inplace(numpy) + run + numpy()"
        arms[raw] = raw_numpy
        arms["g.run(numpy)"] = lambda: g.run({name: host})  # the same array every call (a request buffer reused)
        # 8 arrays in turn: more than ortcapture keeps page-locked in place (REGISTER_KEEP, 4), so each call's array
        # is as new to the graph as a request's; "in turn" leaves each one out of the caches by its next use, "just
        # written" rewrites the next one (untimed) right before its call, as a decoder or preprocessing would
        preps = {}
        for label, written in ((", 8 arrays in turn", False), (", a new array just written", True)):
            ring = [rng.random(shape, dtype=np.float32) for _ in range(8)]  # each arm its own 8 arrays
            turn = [0]

            def next_array(ring=ring, turn=turn):
                turn[0] += 1
                return ring[turn[0] % 8]
            arms["g.run(numpy)" + label] = lambda f=next_array: g.run({name: f()})
            arms[raw + label] = lambda f=next_array: raw_numpy(f())
            if written:
                def write_next(ring=ring, turn=turn):
                    np.multiply(host, 1.0, out=ring[(turn[0] + 1) % 8])
                preps["g.run(numpy)" + label] = preps[raw + label] = write_next
        staging = getattr(g, "host_inputs", None)
        if staging is not None:
            hin = g.host_inputs
            hin[name][...] = host
            arms["host_inputs fill (user's copy into the staging buffer)"] = lambda: np.copyto(hin[name], host)
            arms["g.run(g.host_inputs, copy_outputs='pinned')"] = lambda: g.run(hin, copy_outputs="pinned")
            arms["g.run(numpy, copy_outputs='pinned')"] = lambda: g.run({name: host}, copy_outputs="pinned")
            stage = getattr(g, "_staging", None)
            if stage is not None and hasattr(stage, "profile"):
                for k, fn in stage.profile(name, host).items():
                    arms["staging: " + k] = fn
            res["staging_kind"] = getattr(g, "host_staging", None)
            # where the tree under test keeps the setting: ortcapture._ort.sync (the process-wide state), before that
            # ortcapture._transfer.host_copy, ortcapture._staging, ortcapture.transfer
            where = [sys.modules.get(n) for n in ("ortcapture._ort.sync", "ortcapture._transfer.host_copy",
                                                  "ortcapture._staging")] + [transfer]
            res["staging_threads"] = next((m.STAGING_THREADS for m in where if hasattr(m, "STAGING_THREADS")), None)
            if hasattr(os, "sched_getaffinity"):
                res["usable_cpus"] = len(os.sched_getaffinity(0))
        times = {}
        for _ in range(3):
            for k, fn in arms.items():
                times.setdefault(k, []).extend(_time_each(fn, max(10, iters // 3), prep=preps.get(k)))
        res["numpy_us"] = {k: _med(v) for k, v in times.items()}
        if staging is not None:
            check = g.run(hin, copy_outputs="pinned")
            res["pinned_max_abs_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(check, want))

    # -- a stream of numpy requests -----------------------------------------------------------------------------
    if args.stream:
        n = args.stream
        reqs = [rng.random(shape, dtype=np.float32) for _ in range(4)]
        stream = [reqs[i % len(reqs)] for i in range(n)]

        def device_resident():
            for _ in range(n):
                g.run(None, copy_outputs=False)
            if webgpu:
                _wg_sync(g, transfer)

        def serial():
            for x in stream:
                g.run({name: x})
        kinds = {"device-resident replays": device_resident, "g.run(numpy) loop": serial}
        g2 = None
        if hasattr(g, "run_many"):
            g2 = sess.capture({name: host}, verify=False, copies=2)

            def many():
                for _ in g2.run_many({name: x} for x in stream):
                    pass
            kinds["g.run_many(numpy), copies=2"] = many

            def many1():
                for _ in g.run_many({name: x} for x in stream):
                    pass
            kinds["g.run_many(numpy), copies=1"] = many1
            ok = [r for r in g2.run_many({name: x} for x in reqs)]
            wants = [[np.asarray(v) for v in sess.run(None, {name: x}, uncaptured_run_options())] for x in reqs]
            res["run_many_max_abs_diff"] = max(float(np.abs(a - b).max()) for r, w in zip(ok, wants)
                                               for a, b in zip(r, w))
        thr = {}
        for _ in range(args.stream_rounds):
            for k, fn in kinds.items():
                fn()  # warm
                t0 = time.perf_counter()
                fn()
                thr.setdefault(k, []).append(n / (time.perf_counter() - t0))
        res["stream_per_s"] = {k: _med(v) for k, v in thr.items()}
        if g2 is not None:
            g2.release()
    g.release()
    return res


def _noop():
    return None


def _wg_sync(g, transfer):
    """WebGPU's run returns before the GPU finishes: a readback of the smallest output ends the call."""
    outs = g.run(None, copy_outputs=False)
    return transfer.to_numpy(min(outs, key=lambda v: v.tensor_size_in_bytes()))


# ---------------------------------------------------------------------------------------------------------------
# orchestrator
# ---------------------------------------------------------------------------------------------------------------
def _spawn(tree: str | None, case: str, args) -> dict | None:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as fh:
        path = fh.name
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--case", case, "--provider", args.provider,
           "--iters", str(args.iters), "--json-out", path]
    if tree:
        cmd += ["--pkg", tree]
    if args.cpus:
        cmd += ["--cpus", args.cpus]
    if args.sched != "auto":
        cmd += ["--sched", args.sched]
    if args.intra_op_threads is not None:
        cmd += ["--intra-op-threads", str(args.intra_op_threads)]
    for kv in args.session_config:
        cmd += ["--session-config", kv]
    if case in HOST_IO_CASES:
        cmd += ["--numpy", "--stream", str(args.stream), "--stream-rounds", str(args.stream_rounds)]
    else:
        cmd += ["--stream", "0"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
    try:
        with open(path) as fh:
            out = json.load(fh)
    except (OSError, ValueError):
        out = None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    if out is None:
        sys.stderr.write(f"worker {case} {tree or 'tree'} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}\n")
        return None
    out["wall_s"] = time.time() - t0
    return out


def _aggregate(runs: list[dict]) -> dict:
    """Median over processes of every numeric leaf."""
    def leaves(d, prefix=()):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from leaves(v, prefix + (k,))
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                yield prefix + (k,), v
    acc: dict = {}
    for r in runs:
        for key, v in leaves(r):
            acc.setdefault(key, []).append(v)
    out: dict = {}
    for key, vs in acc.items():
        d = out
        for k in key[:-1]:
            d = d.setdefault(k, {})
        d[key[-1]] = float(statistics.median(vs))
    out["processes"] = len(runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--provider", choices=["cuda", "webgpu"], default="cuda")
    ap.add_argument("--baseline", help="an older checkout of the package (DIR/ortcapture or the package dir)")
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--cases", default="tiny,yolo1,yolo8", help=f"comma list of {sorted(CASES)}")
    ap.add_argument("--stream", type=int, default=64, help="requests per stream pass (yolo8, affine8)")
    ap.add_argument("--stream-rounds", type=int, default=3)
    ap.add_argument("--worker-timeout", type=float, default=300)
    ap.add_argument("--cpus", default=None, metavar="2-5",
                    help="run every worker process on these CPUs only (os.sched_setaffinity; both trees alike): a "
                         "setup that takes the scheduler's placement out of the numbers; say so with them")
    ap.add_argument("--sched", choices=["auto", "spin", "yield", "blocking"], default="auto",
                    help="how CUDA waits for the GPU in every worker (cudaSetDeviceFlags; both trees alike)")
    ap.add_argument("--intra-op-threads", type=int, default=None,
                    help="SessionOptions.intra_op_num_threads in every worker (both trees alike; ORT's own default "
                         "otherwise)")
    ap.add_argument("--session-config", action="append", default=[], metavar="KEY=VALUE",
                    help="SessionOptions.add_session_config_entry in every worker (repeatable), e.g. "
                         "session.intra_op.allow_spinning=0")
    ap.add_argument("--out", help="JSON path (default $OUT/profile_replay.json, else none)")
    # worker mode
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pkg", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--numpy", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        res = worker(args)
        with open(args.json_out, "w") as fh:
            json.dump(res, fh)
        return 0

    trees = {"new": None}
    if args.baseline:
        trees = {"old": args.baseline, "new": None}
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}")
    report: dict = {"provider": args.provider, "procs": args.procs, "iters": args.iters, "cpus": args.cpus,
                    "sched": args.sched, "intra_op_threads": args.intra_op_threads,
                    "session_config": args.session_config, "env": {k: v for k, v in os.environ.items()
                                                                   if k.startswith(("ORTCAPTURE_", "GLIBC_"))},
                    "cases": {}}
    for case in cases:
        runs: dict[str, list] = {t: [] for t in trees}
        for p in range(args.procs):
            order = list(trees) if p % 2 == 0 else list(trees)[::-1]
            for t in order:
                r = _spawn(trees[t], case, args)
                if r is not None and "arms" in r:  # the bucket arms
                    runs[t].append(r)
                    print(f"{case:6} {t:4} proc {p}: " + "; ".join(
                        f"{k} x{v['median per-pair ratio']:.3f}" for k, v in r["arms"].items())
                        + f"; mixed 1-8 {r['mixed 1-8']['us per request']:.0f} µs/request", flush=True)
                elif r is not None:
                    runs[t].append(r)
                    ov = r["overhead"]
                    aw = r.get("after_wait_us", {})
                    print(f"{case:6} {t:4} proc {p}: raw {ov['raw_p50_us']:8.1f} µs, ours {ov['ours_p50_us']:8.1f} µs,"
                          f" paired extra {ov['paired_extra_us']:+6.2f} µs; after a wait: ortcapture's host work"
                          f" {aw.get('g.run({OrtValue}), ORT stubbed', float('nan')):5.2f} µs, raw feed copy"
                          f" {aw.get('raw feed copy (update_inplace)', float('nan')):5.2f} µs; cpu {r.get('last_cpu')}",
                          flush=True)
        report["cases"][case] = {t: {"median": _aggregate(rs), "runs": rs} for t, rs in runs.items()}
    report["goals"] = goals(report)
    _print_summary(report)
    for g in report["goals"]:
        print(f"GOAL {'PASS' if g['pass'] else 'FAIL'}: {g['goal']}: {g['value']:.3f} (limit {g['limit']})")
    out = args.out or (os.path.join(os.environ["OUT"], "profile_replay.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {out}")
    return 0


#: issue 32's goals on the new code: (case, what, limit, at most?)
GOALS = [("tiny", "extra µs per call over the same graph driven raw", 3.0, True),
         ("yolo1", "extra µs per call over the same graph driven raw", 5.0, True),
         ("yolo8", "extra µs per call over the same graph driven raw", 5.0, True),
         ("yolo8", "host_inputs + pinned views / device-resident replay", 1.25, True),
         ("yolo8", "plain numpy in and out / device-resident replay", 1.45, True),
         ("yolo8", "plain numpy in and out, 8 arrays in turn / device-resident replay", 1.45, True),
         ("yolo8", "plain numpy in and out, a new array just written / device-resident replay", 1.45, True),
         ("yolo8", "run_many(numpy), copies=2 throughput / device-resident replays'", 0.90, False),
         # issue 42: buckets at CapturedGraph.run's speed (median per-pair ratio), the mixed stream per request
         ("buckets", "buckets run() / g.run(numpy), batch 8, same array", 1.05, True),
         ("buckets", "buckets run() / g.run(numpy), batch 8, new array", 1.05, True),
         ("buckets", "buckets run() / g.run(numpy), batch 1, same array", 1.05, True),
         ("buckets", "buckets run() / g.run(numpy), batch 1, new array", 1.05, True),
         ("buckets", "mixed batch 1-8 stream, µs per request", 1800.0, True),
         ("buckets_matmul", "buckets run() / g.run(numpy), batch 8, same array", 1.05, True),
         ("buckets_matmul", "buckets run() / g.run(numpy), batch 8, new array", 1.05, True)]


def goals(report: dict) -> list[dict]:
    """The goals that the run measured, each with its value and whether it holds (the new tree's medians)."""
    out = []
    for case, what, limit, at_most in GOALS:
        m = report["cases"].get(case, {}).get("new", {}).get("median")
        if not m:
            continue
        np_, st = m.get("numpy_us", {}), m.get("stream_per_s", {})
        dev, base = np_.get("device-resident replay"), st.get("device-resident replays")
        if what.startswith("buckets run()"):
            v = m.get("arms", {}).get(what.split(", ", 1)[1], {}).get("median per-pair ratio")
        elif what.startswith("mixed"):
            v = m.get("mixed 1-8", {}).get("us per request")
        elif what.startswith("extra"):
            v = m.get("overhead", {}).get("paired_extra_us")
        elif what.startswith("host_inputs"):
            v = np_.get("g.run(g.host_inputs, copy_outputs='pinned')", 0) / dev if dev else None
        elif what.startswith("plain") and "in turn" in what:
            v = np_["g.run(numpy), 8 arrays in turn"] / dev if dev and "g.run(numpy), 8 arrays in turn" in np_ else None
        elif what.startswith("plain") and "just written" in what:
            k = "g.run(numpy), a new array just written"
            v = np_[k] / dev if dev and k in np_ else None
        elif what.startswith("plain"):
            v = np_.get("g.run(numpy)", 0) / dev if dev else None
        else:
            v = st.get("g.run_many(numpy), copies=2", 0) / base if base else None
        if v is None:
            continue
        out.append({"case": case, "goal": f"{case}: {what} {'<=' if at_most else '>='} {limit}", "value": v,
                    "limit": limit, "pass": bool(v <= limit if at_most else v >= limit)})
    return out


def _print_summary(report: dict) -> None:
    for case, trees in report["cases"].items():
        print(f"\n== {case} ({report['provider']}), medians over processes")
        names = list(trees)
        rows: dict = {}
        for t in names:
            m = trees[t]["median"]
            for sect in ("overhead", "steps_us", "after_wait_us", "paired_us", "numpy_us", "stream_per_s"):
                for k, v in m.get(sect, {}).items():
                    rows.setdefault((sect, k), {})[t] = v
            for arm, vals in m.get("arms", {}).items():  # the bucket arms
                for k, v in vals.items():
                    rows.setdefault((arm, k), {})[t] = v
            for k, v in m.get("mixed 1-8", {}).items():
                rows.setdefault(("mixed 1-8", k), {})[t] = v
        print(f"{'':62}" + "".join(f"{t:>12}" for t in names))
        for (sect, k), vals in rows.items():
            print(f"{sect + ': ' + k:62.62}" + "".join(f"{vals[t]:12.2f}" if t in vals else f"{'-':>12}"
                                                      for t in names))
        for t in names:
            m = trees[t]["median"]
            if "staging_threads" in m:
                print(f"  {t}: staging threads {m['staging_threads']:.0f} of {m.get('usable_cpus', 0):.0f} usable CPUs")
            np_ = m.get("numpy_us", {})
            dev = np_.get("device-resident replay")
            if dev:
                for k in ("g.run(g.host_inputs, copy_outputs='pinned')", "g.run(numpy)", "g.run(numpy), 8 arrays in turn",
                          "g.run(numpy), a new array just written"):
                    if k in np_:
                        print(f"  {t}: {k} / device-resident = {np_[k] / dev:.3f}x")
            raw = "raw ORT update_inplace(numpy) + run + numpy()"
            for suffix in ("", ", 8 arrays in turn", ", a new array just written"):
                if raw + suffix in np_ and "g.run(numpy)" + suffix in np_:
                    print(f"  {t}: g.run(numpy){suffix} / raw ORT's = {np_['g.run(numpy)' + suffix] / np_[raw + suffix]:.3f}x")
            st = m.get("stream_per_s", {})
            base = st.get("device-resident replays")
            if base:
                for k, v in st.items():
                    if k != "device-resident replays":
                        print(f"  {t}: {k} throughput = {100 * v / base:.1f}% of device-resident")


if __name__ == "__main__":
    sys.exit(main())
