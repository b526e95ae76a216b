"""``ortcapture bench --soak SECONDS``: memory over time, for loops that must not grow.

Two modes (``--soak-mode``):

* ``replay`` (default): one graph captured on the model (``state=`` carried for the built-in small model), then
  ``CapturedGraph.run(copy_outputs=False)`` as fast as it goes for SECONDS.
* ``cycles``: capture -> run -> release as fast as it goes for SECONDS (or ``--soak-cycles N``), one session,
  automatic compaction only (``--compact-threshold BYTES`` sets the session's threshold).

Every ``--soak-sample`` seconds it records replays (or cycles) so far, replays/s since the last sample, host RSS
(``/proc/self/statm``) and device memory in use (CUDA: ``total - free`` from ``cudaMemGetInfo`` through
cuda-python; WebGPU: none: on the software adapter device memory is host memory, so RSS shows it), plus the
session's compactions. ``--json`` writes every sample and the summary (growth after warm-up, peak above start);
``--plot`` draws RSS and device memory against time (matplotlib).

MODEL: an ONNX file, ``reference`` (the cached YOLOv8n, batch 1 at 320x320) or ``small`` (default: a 64x64
recurrent ``state_out = state_in * 0.5 + x``, built with onnx.helper).
"""
from __future__ import annotations

import json
import os
import sys
import time

MiB = 1 << 20


def add_arguments(p) -> None:
    """The ``--soak*`` options of ``ortcapture bench`` (their own group in ``--help``)."""
    soak = p.add_argument_group("soak (ortcapture.cli.soak): memory over time instead of latency")
    soak.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                      help="run one loop for SECONDS, sampling replays/s, host RSS and device memory (MODEL: a file, "
                           "'reference' or 'small' (default: a 64x64 recurrent Add/Mul); --json/--plot write them)")
    soak.add_argument("--soak-mode", choices=["replay", "cycles"], default="replay",
                      help="replay: CapturedGraph.run(copy_outputs=False) in a loop (default); cycles: capture -> "
                           "run -> release in a loop, automatic compaction only")
    soak.add_argument("--soak-count", type=int, default=None, metavar="N",
                      help="stop after N replays/cycles (also a soak without --soak)")
    soak.add_argument("--soak-sample", type=float, default=1.0, metavar="S", help="seconds between samples (1)")
    soak.add_argument("--warmup-replays", type=int, default=1000, metavar="N",
                      help="replay mode: replays before the start sample (1000)")
    soak.add_argument("--compact-threshold", type=int, default=None, metavar="BYTES",
                      help="the session's compact_threshold (default 256 MiB; negative: automatic compaction off)")


def small_model(n: int = 64) -> bytes:
    """A recurrent step on [n, n] float32: ``state_out = state_in * 0.5 + x`` (inputs ``state``, ``x``)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Mul", ["state", "half"], ["m"]), helper.make_node("Add", ["m", "x"], ["state_out"])]
    graph = helper.make_graph(
        nodes, "soak_small",
        [helper.make_tensor_value_info("state", TensorProto.FLOAT, [n, n]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("state_out", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what every supported onnxruntime (>= 1.24.4) reads; newer onnx writes a newer one
    return model.SerializeToString()


def rss() -> int:
    """Host resident set size of this process in bytes (``/proc/self/statm``; Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_used(info) -> int | None:
    """Bytes in use on ``info``'s CUDA device (``total - free``, ``cudaMemGetInfo``: device-wide), or ``None``
    (not CUDA, or no cuda-python)."""
    if info is None or info.device_type != "cuda":
        return None
    from ortcapture._memory.ledger import device_in_use

    return device_in_use(info.device_id)


def soak(sess, feeds: dict, *, mode: str = "replay", seconds: float | None = None, count: int | None = None,
         state: dict | None = None, warmup: int = 1000, sample_s: float = 1.0, progress=None) -> dict:
    """Run ``mode`` (``"replay"`` or ``"cycles"``, see the module docstring) on ``sess`` (an
    ``ortcapture.InferenceSession``) for ``seconds`` or ``count`` replays/cycles, whichever ends first.

    Returns ``{"mode", "samples": [{"t_s", "count", "rate_per_s", "rss_bytes", "device_bytes", "compactions",
    "retired_bytes"}], "summary": {...}}``. The first sample is the start, taken after the warm-up (``replay``:
    ``warmup`` replays; ``cycles``: one uncaptured run, ``gpu_graph_id=-1``, so ORT's arena and kernels are set
    up); the summary gives the growth (end - start) and peak above the start of host RSS and device memory.
    """
    if mode not in ("replay", "cycles"):
        raise ValueError(f"mode must be 'replay' or 'cycles', got {mode!r}")
    if seconds is None and count is None:
        raise ValueError("give seconds or count")
    import gc

    from ortcapture.session import run_options_for

    info = sess.requested_capture
    graph = None
    if mode == "replay":
        graph = sess.capture(feeds, state=state)
        for _ in range(warmup):
            graph.run(copy_outputs=False)
        step = graph.run
    else:
        sess.run(None, feeds if state is None else dict(feeds), run_options_for(-1))

        def step(copy_outputs=False):
            g = sess.capture(feeds, state=state)
            g.run(copy_outputs=copy_outputs)
            g.release()

    gc.collect()
    samples = []
    t0 = time.perf_counter()
    last_t, last_n = t0, 0

    def sample(n: int) -> None:
        nonlocal last_t, last_n
        now = time.perf_counter()
        mem = sess.graph_memory
        samples.append({"t_s": now - t0, "count": n, "rate_per_s": (n - last_n) / (now - last_t) if now > last_t else 0.0,
                        "rss_bytes": rss(), "device_bytes": device_used(info),
                        "compactions": mem["compactions"], "retired_bytes": mem["retired_bytes"]})
        last_t, last_n = now, n
        if progress is not None:
            progress(samples[-1])

    sample(0)
    end = t0 + seconds if seconds is not None else float("inf")
    limit = count if count is not None else float("inf")
    n, next_sample = 0, t0 + sample_s
    while n < limit:
        step(copy_outputs=False)
        n += 1
        now = time.perf_counter()
        if now >= next_sample:
            sample(n)
            next_sample = now + sample_s
        if now >= end:
            break
    if graph is not None:  # the replay loop's own readback: everything queued has run
        graph.run()
    sample(n)
    return {"mode": mode, "samples": samples, "summary": summarize(samples)}


def summarize(samples: list[dict]) -> dict:
    """Growth (end - start), peak above start (bytes) of host RSS and device memory, mean rate, compactions."""
    last = samples[-1]
    out = {"count": last["count"], "seconds": last["t_s"],
           "rate_per_s": last["count"] / last["t_s"] if last["t_s"] else 0.0, "compactions": last["compactions"]}
    for key in ("rss_bytes", "device_bytes"):
        vals = [s[key] for s in samples if s[key] is not None]
        if not vals:
            out[key] = None
            continue
        out[key] = {"start": vals[0], "end": vals[-1], "growth": vals[-1] - vals[0],
                    "peak_above_start": max(vals) - vals[0]}
    return out


def plot(result: dict, path: str) -> None:
    """Host RSS and device memory (MiB above the start) and replays/s against time, compactions marked, into the
    PNG ``path`` (matplotlib's Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    samples = result["samples"]
    t = [s["t_s"] for s in samples]
    fig = Figure(figsize=(10, 6), layout="constrained")
    FigureCanvasAgg(fig)
    mem, rate = fig.subplots(2, 1, sharex=True)
    for key, label in (("rss_bytes", "host RSS"), ("device_bytes", "device memory")):
        vals = [s[key] for s in samples]
        if vals and vals[0] is not None:
            mem.plot(t, [(v - vals[0]) / MiB for v in vals], label=label)
    for a, b in zip(samples, samples[1:]):
        if b["compactions"] > a["compactions"]:
            mem.axvline(b["t_s"], color="#bbbbbb", lw=0.6)
    mem.set_ylabel("MiB above start")
    mem.legend(loc="upper left")
    what = "cycles" if result["mode"] == "cycles" else "replays"
    mem.set_title(f"ortcapture soak ({result['mode']}): {result.get('model', '')} on {result.get('provider', '')}; "
                  f"{result['summary']['count']} {what}, {result['summary']['compactions']} compactions (grey)")
    rate.plot(t[1:], [s["rate_per_s"] for s in samples[1:]])
    rate.set_ylabel(f"{what}/s")
    rate.set_xlabel("seconds")
    fig.savefig(path, dpi=110)


def _mib(nbytes: int | None) -> str:
    return "off" if nbytes is None else f"{nbytes / MiB:g} MiB"


def _load(model_arg: str | None, shape_args: list[str]):
    """(model path or bytes, feeds, state, label) for MODEL: None/``small``, ``reference``, or a file."""
    import numpy as np

    if model_arg in (None, "small"):
        n = 64
        return (small_model(n), {"state": np.zeros((n, n), np.float32), "x": np.full((n, n), 0.01, np.float32)},
                {"state_out": "state"}, "small 64x64 recurrent")
    from ortcapture.cli.demo import example_shapes
    from ortcapture.cli.models import reference_model

    path = str(reference_model()) if model_arg == "reference" else model_arg
    shapes = example_shapes(path, 1, shape_args)
    import onnx

    types = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
             for i in onnx.load(path, load_external_data=False).graph.input}
    rng = np.random.default_rng(0)
    feeds = {n: rng.random(s).astype(types.get(n, np.float32)) for n, s in shapes.items()}
    return path, feeds, None, os.path.basename(path)


def run(args) -> int:
    """``ortcapture bench --soak SECONDS`` (or ``--soak-count N``): see the module docstring."""
    import onnxruntime as ort

    import ortcapture
    from ortcapture.cli import pick_provider
    from ortcapture.cli.bench_common import session_args
    from ortcapture.errors import CaptureUnsupportedError

    try:
        provider = pick_provider(args.provider, cuda_must_load=True)
    except CaptureUnsupportedError as exc:
        print(f"ortcapture bench: {exc}", file=sys.stderr)
        return 2
    ort.set_default_logger_severity(3)  # ORT's environment warnings (e.g. the WebGPU software adapter's) off
    model, feeds, state, label = _load(args.model, args.shape)
    sess = ortcapture.InferenceSession(model, **session_args(provider, True))
    if args.compact_threshold is not None:
        sess.compact_threshold = None if args.compact_threshold < 0 else args.compact_threshold
    what = "cycles" if args.soak_mode == "cycles" else "replays"
    print(f"ortcapture bench --soak: {label} on {provider} (onnxruntime {ort.__version__}), {args.soak_mode}, "
          f"{args.soak if args.soak is not None else 'unlimited'} s / {args.soak_count or 'unlimited'} {what}, "
          f"compaction threshold {_mib(sess.compact_threshold)}", flush=True)
    if provider != "cuda":
        print("  device memory: not measured on WebGPU (on the software adapter it is host memory: see RSS)",
              flush=True)

    def progress(s):
        dev = "-" if s["device_bytes"] is None else f"{s['device_bytes'] / MiB:.1f}"
        print(f"  {s['t_s']:8.1f} s  {s['count']:>9} {what}  {s['rate_per_s']:10.1f}/s  RSS {s['rss_bytes'] / MiB:8.1f} "
              f"MiB  device {dev} MiB  compactions {s['compactions']}", flush=True)

    result = soak(sess, feeds, mode=args.soak_mode, seconds=args.soak, count=args.soak_count, state=state,
                  warmup=args.warmup_replays, sample_s=args.soak_sample, progress=progress)
    result.update(model=label, provider=provider, onnxruntime=ort.__version__,
                  compact_threshold=sess.compact_threshold)
    summ = result["summary"]
    for key, name in (("rss_bytes", "host RSS"), ("device_bytes", "device memory")):
        if summ[key] is not None:
            print(f"{name}: start {summ[key]['start'] / MiB:.1f} MiB, end {summ[key]['growth'] / MiB:+.2f} MiB, "
                  f"peak {summ[key]['peak_above_start'] / MiB:+.2f} MiB above start")
    print(f"{summ['count']} {what} in {summ['seconds']:.1f} s ({summ['rate_per_s']:.1f}/s), "
          f"{summ['compactions']} compactions")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0
