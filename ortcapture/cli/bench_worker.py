"""The ``ortcapture bench`` worker: one fresh process that builds, captures, times and checks every arm.

One fresh process that builds every arm's session, captures, warms up, times the arms in round-robin blocks and the
paired raw/ortcapture phase, and checks every arm's outputs against the uncaptured run (see
:mod:`ortcapture.cli.bench` for the method). Started by the parent as ``python -m ortcapture.cli.bench worker ...``;
prints one JSON line on stdout, progress lines on stderr. Moved from ``cli/bench.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ortcapture.cli.bench_common import _PROGRESS, session_args
from ortcapture.cli.bench_report import ARMS


def worker(opts) -> dict:
    import gc

    import numpy as np
    import onnxruntime as ort

    import ortcapture
    from ortcapture import transfer
    from ortcapture._ort import compat
    from ortcapture.cli import timing
    from ortcapture._ort import values
    from ortcapture.session import run_options_for

    provider, capture, model = opts.provider, bool(opts.capture), opts.model
    ep_options = json.loads(opts.ep_options)
    sess_kw = {"intra_op_threads": opts.intra_op_threads, "config": json.loads(opts.session_config)}
    dev_id = int(ep_options.get("device_id", 0)) if provider == "cuda" else 0  # --provider-option device_id=N
    read_timed = opts.sync == "readback"
    dev = "cuda" if provider == "cuda" else "webgpu"
    shapes_ = {n: tuple(s) for n, s in json.loads(opts.shapes).items()}
    t_start = time.perf_counter()

    def progress(done: int, total: int, phase: str) -> None:
        print(f"{_PROGRESS} {done} {total} {phase}", file=sys.stderr, flush=True)

    progress(0, 0, "sessions and capture")
    if provider == "cuda":  # NVIDIA's pip libraries preloaded before the raw arms' first CUDA session: every arm
        from ortcapture._ort import cuda_probe  # then runs on the same library copies (not the loader cache's)

        cuda_probe.status()

    plain = ort.InferenceSession(model, **session_args(provider, False, ep_options, **sess_kw))  # plain, iobinding
    raw = ort.InferenceSession(model, **session_args(provider, capture, ep_options, **sess_kw))  # raw_capture arm
    ours = ortcapture.InferenceSession(model, **session_args(provider, capture, ep_options, **sess_kw))  # captured_*
    if capture and not ours.capture_enabled:
        raise RuntimeError(f"ortcapture session does not capture (deferred={ours.capture_deferred})")
    pinned_cpu = None
    if opts.pin_thread:  # after the sessions: ORT's pool threads made so far keep every CPU (later ones inherit)
        pinned_cpu = current_cpu()
        os.sched_setaffinity(0, {pinned_cpu})

    rng = np.random.default_rng(opts.seed)
    in_types = {m.name: values.ONNX_TO_NP[m.type] for m in plain.get_inputs()}

    def random(shape, dtype):
        if dtype.kind == "f":
            return rng.random(shape).astype(dtype)
        if dtype.kind == "b":
            return rng.random(shape) < 0.5
        return rng.integers(0, 2, size=shape).astype(dtype)

    feeds = [{n: random(shapes_[n], in_types[n]) for n in in_types} for _ in range(2)]
    refs = [plain.run(None, f) for f in feeds]
    out_names = [m.name for m in plain.get_outputs()]
    out_specs = {n: (r.shape, r.dtype) for n, r in zip(out_names, refs[0])}

    def alloc(sess, shape, dtype):
        """A device buffer from ``sess``'s allocator where ORT has one (WebGPU, ORT >= 1.30), as raw ORT code would."""
        t = np.dtype(dtype).type
        if dev == "webgpu" and hasattr(ort.InferenceSession, "create_ortvalue_from_shape_and_type"):
            v = ort.InferenceSession.create_ortvalue_from_shape_and_type(sess, list(shape), t, dev, 0)
        else:
            v = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), t, dev, dev_id)
        return values.remember(v, dev, dev_id)

    def device_sources(sess, make=None):
        """Device-resident copies of both feeds (the OrtValue inputs), allocated from ``sess``."""
        make = make or (lambda shape, dtype: alloc(sess, shape, dtype))
        return [{n: transfer.update_inplace(make(a.shape, a.dtype), a) for n, a in f.items()} for f in feeds]

    to_numpy = ortcapture.to_numpy
    if read_timed:
        device_sync = None
    else:  # --sync device (CUDA): an explicit wait for all of the GPU's work, outputs stay on the device
        rt = compat.cudart()
        device_sync = rt.cudaDeviceSynchronize
    if dev == "cuda" and not compat.has_update_inplace_ortvalue():  # ORT < 1.26: ortcapture's copy instead
        d2d = transfer.update_inplace
    elif dev == "cuda":
        def d2d(dst, src):
            dst.update_inplace(src)
    else:
        def d2d(dst, src):
            ort.copy_tensors([src], [dst], None)

    def iobinding_arm(sess):
        """Hand-written raw ORT: fixed device buffers, device->device input copy, run, readback (``read``) or
        device synchronisation."""
        ins = {n: alloc(sess, a.shape, a.dtype) for n, a in feeds[0].items()}
        outs = [alloc(sess, *out_specs[n]) for n in out_names]
        binding = sess.io_binding()
        for n, v in ins.items():
            binding.bind_ortvalue_input(n, v)
        for n, v in zip(out_names, outs):
            binding.bind_ortvalue_output(n, v)
        srcs = device_sources(sess)
        pairs = [[(ins[n], src[n]) for n in ins] for src in srcs]
        ro = run_options_for(0)

        def fn(i, read=True):
            for dst, src in pairs[i & 1]:
                d2d(dst, src)
            sess.run_with_iobinding(binding, ro)
            if read:
                return [to_numpy(v) for v in outs]
            device_sync()
            return None

        return fn

    fns = {"plain": lambda i: plain.run(None, feeds[i & 1]), "iobinding": iobinding_arm(plain)}
    t0 = time.perf_counter()
    fns["raw_capture"] = iobinding_arm(raw)
    fns["raw_capture"](0)  # the first run of gpu_graph_id 0 captures (CUDA: after ORT's own warm-up runs)
    raw_first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if capture:
        graph = ours.capture(feeds[0])
        cg_srcs = device_sources(ours, ours.allocate)
    else:
        # the same CapturedGraph code (fixed buffers, IOBinding, run()) on the session without capture
        graph = ours.uncaptured_graph(feeds[0], device=f"{dev}:{dev_id}")
        cg_srcs = device_sources(ours)
    capture_s = time.perf_counter() - t0

    def captured_ortvalue(i, read=True):
        outs = graph.run(cg_srcs[i & 1], copy_outputs=False)
        if read:
            return [o.numpy() for o in outs]
        device_sync()
        return None

    fns["captured_ortvalue"] = captured_ortvalue
    fns["captured_numpy"] = lambda i: graph.run(feeds[i & 1])
    # host I/O arms (issue 32), each on graphs of its own: the graph's host_inputs filled once and its outputs as
    # pinned views; a stream of numpy requests through run_many over two buffer sets, timed per request
    if capture:
        graph_p, graph_s = ours.capture(feeds[0]), ours.capture(feeds[0], copies=2)
    else:
        graph_p, graph_s = (ours.uncaptured_graph(feeds[0], device=f"{dev}:{dev_id}") for _ in range(2))

    def pinned_arm(i, k=None):
        if k is not None:  # the check: fill with feeds[k] first
            for n, a in feeds[k].items():
                graph_p.host_inputs[n][...] = a
        return graph_p.run(graph_p.host_inputs, copy_outputs="pinned")

    for n, a in feeds[0].items():
        graph_p.host_inputs[n][...] = a
    stream = {"it": None}

    def requests():
        i = 0
        while True:
            yield feeds[i & 1]
            i += 1

    def overlap_arm(i):
        if stream["it"] is None:
            stream["it"] = graph_s.run_many(requests())
        return next(stream["it"])

    fns["captured_pinned"] = pinned_arm
    fns["captured_overlap"] = overlap_arm
    setup_s = time.perf_counter() - t_start

    arms = list(ARMS)
    verify = dict(fns)  # every arm with its outputs read back, for the check against the uncaptured run
    if not read_timed:
        for arm in ("iobinding", "raw_capture", "captured_ortvalue"):
            fns[arm] = (lambda f: lambda i: f(i, read=False))(verify[arm])
    sizes = [len(b) for b in np.array_split(np.arange(opts.iters), opts.rounds)]
    total, done = len(arms) * (1 + len(sizes)) + 1, 0
    for arm in arms:  # warm-up, and the first replays, before anything is timed
        for i in range(opts.warmup):
            fns[arm](i)
        done += 1
        progress(done, total, "warm-up")
    samples = {arm: [] for arm in arms}
    gc.collect()
    gc.disable()
    try:
        for r, n in enumerate(sizes):
            shift = (r + opts.index) % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                samples[arm].append(timing.measure(fns[arm], n, warmup=1))
                done += 1
                progress(done, total, f"round {r + 1}/{len(sizes)}")
        # the overhead ratio compares two near-identical arms: time them call by call too, alternating, so drift
        # between blocks (GPU clocks, host load) hits both alike
        progress(done, total, "paired raw/ortcapture")
        paired = timing.paired(fns["raw_capture"], fns["captured_ortvalue"], opts.iters, warmup=1)
        progress(total, total, "paired raw/ortcapture")
    finally:
        gc.enable()
        if stream["it"] is not None:
            stream["it"].close()  # run_many holds the session while it iterates
    verify["captured_pinned"] = lambda k: pinned_arm(0, k)
    verify["captured_overlap"] = lambda k: list(graph_s.run_many([feeds[0], feeds[1], feeds[0], feeds[1]]))[k]

    # every arm against the uncaptured run, after timing (so replays that drifted during it are caught)
    diffs = {arm: 0.0 for arm in arms}
    for k in (0, 1):
        for arm in arms:
            for got, want in zip(verify[arm](k), refs[k]):
                d = np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64))
                diffs[arm] = max(diffs[arm], float(d.max()) if d.size else 0.0)
    scale = max([1.0] + [float(np.abs(np.asarray(r, dtype=np.float64)).max()) for rr in refs for r in rr if r.size])
    tol = (1e-3 if dev == "webgpu" else 1e-4) * scale
    info = ours.capture_info
    return {
        "ok": True, "pid": os.getpid(), "index": opts.index, "provider": provider, "graph_capture": capture,
        "ort": ort.__version__, "ep": info.ep.name if info else ours.get_providers()[0], "sync": opts.sync,
        "provider_options": ep_options, "intra_op_threads": opts.intra_op_threads,
        "session_config": sess_kw["config"], "pinned_cpu": pinned_cpu,
        "providers": ours.get_providers(), "shapes": {n: list(s) for n, s in shapes_.items()},
        "setup_s": setup_s, "raw_first_run_s": raw_first_s, "ortcapture_capture_s": capture_s,
        "samples_us": {arm: np.concatenate(samples[arm]).tolist() for arm in arms},
        "paired_us": {"raw_capture": paired[0].tolist(), "captured_ortvalue": paired[1].tolist()},
        "max_abs_diff": diffs, "tolerance": tol, "verified": all(d <= tol for d in diffs.values()),
    }


def current_cpu() -> int:
    """The CPU the calling thread is running on (Linux: field 39 of /proc/thread-self/stat)."""
    with open("/proc/thread-self/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[36])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortcapture.cli.bench worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--provider", choices=["cuda", "webgpu"], required=True)
    ap.add_argument("--shapes", required=True, help='JSON {"input": [dims]}')
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--capture", type=int, choices=[0, 1], default=1)
    ap.add_argument("--index", type=int, default=0, help="process index (rotates the arm order)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync", choices=["readback", "device"], default="readback")
    ap.add_argument("--ep-options", default="{}", help="JSON {key: value} of EP options for every session")
    ap.add_argument("--intra-op-threads", type=int, default=None)
    ap.add_argument("--session-config", default="{}", help="JSON {key: value} of session config entries")
    ap.add_argument("--pin-thread", action="store_true")
    opts = ap.parse_args(argv)
    try:
        result = worker(opts)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as JSON
        import traceback

        traceback.print_exc()
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0
