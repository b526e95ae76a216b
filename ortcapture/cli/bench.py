"""``ortcapture bench``: captured replay against raw ORT, per batch size, in fresh processes with the arms alternating.

``ortcapture bench [MODEL.onnx] [--provider auto|cuda|webgpu] [--batch 1,8] [--procs 5] [--iters N] [--json F]
[--plot F.png] [--graph-capture/--no-graph-capture] [--sync readback|device] [--provider-option KEY=VALUE ...]
[--intra-op-threads N] [--session-config KEY=VALUE ...] [--pin-thread]``

Method. For each batch size the model's input dims are fixed (:func:`ortcapture._ort.specialize.fix_input_shapes`; raw ORT
needs fixed dims to capture a dynamic-dims model) and that one fixed model is used by every arm. ``--procs``
fresh processes (``python -m ortcapture.cli.bench worker ...``, one after another, results as one JSON line on
stdout) each build the sessions, capture, warm every arm up (``--warmup`` untimed calls), then time the arms in
round-robin blocks (``--rounds`` blocks of about ``iters / rounds`` calls per arm, the arm order rotated each
round, one untimed call at the start of every block, the garbage collector off), and finally check every arm's
outputs against the uncaptured ``run``. Timings are host wall time per call (µs), pooled across processes; the
spread of the per-process p50s is reported too.

Arms. Every timed call ends with the GPU done. ``--sync readback`` (the default): every output is on the host as
a numpy array at the end of every call — the readback is what waits for the GPU (WebGPU's ``run_with_iobinding``
returns before the work completes; CUDA's synchronizes anyway), and it is the same in every arm. ``--sync device``
(CUDA only; needs cuda-python): the device-resident arms (``iobinding``, ``raw_capture``, ``captured_ortvalue``)
leave their outputs on the GPU and end with an explicit ``cudaDeviceSynchronize()`` instead, so the comparison is
of the GPU work and its launch alone, without the device→host copy that capture does not change; ``plain`` and
``captured_numpy`` return numpy by nature and still read back. (WebGPU has no synchronisation call in ORT's Python
API, so there the readback is the only honest end of a call.) The inputs alternate between two feeds.

* ``plain``: ``onnxruntime.InferenceSession.run(None, numpy feeds)`` on a session without capture: host→device
  copy, run, device→host copy of ORT-allocated outputs.
* ``iobinding``: the same session through an ``onnxruntime.IOBinding`` of fixed device buffers: device→device
  copy of each input from a device-resident source OrtValue (CUDA ``OrtValue.update_inplace(OrtValue)``, or
  ``ortcapture.update_inplace`` before ORT 1.26; WebGPU ``onnxruntime.copy_tensors``), ``run_with_iobinding``,
  ``ortcapture.to_numpy`` of each fixed output.
* ``raw_capture``: exactly that, hand-written with raw onnxruntime on a plain ``onnxruntime.InferenceSession``
  created with the capture option (``enable_cuda_graph`` / ``enableGraphCapture``) and ``gpu_graph_id=0``: the
  first run captures, the timed runs replay.
* ``captured_ortvalue``: ``CapturedGraph.run({name: device OrtValue}, copy_outputs=False)`` on an
  ``ortcapture.InferenceSession`` (its device→device input copy, the replay, the ``ReplayOutput`` wrappers), then
  ``ReplayOutput.numpy()`` of each output (``ortcapture.to_numpy`` of the fixed buffer).
* ``captured_numpy``: ``CapturedGraph.run({name: numpy})``: host→device copy into the fixed inputs, replay,
  ``ortcapture.to_numpy`` of each output.

``--provider-option KEY=VALUE`` (repeatable) passes an EP option to every arm's session alike (e.g. CUDA
``prefer_nhwc=1``, ``cudnn_conv_algo_search=HEURISTIC``); the capture switch itself is refused there.
``--intra-op-threads N`` and ``--session-config KEY=VALUE`` (``SessionOptions.add_session_config_entry``, e.g.
``session.intra_op.allow_spinning=0``) likewise set every arm's ``SessionOptions``; ``--pin-thread`` pins the
worker's calling thread, where every arm runs, to one CPU once the sessions exist (threads made before keep every
CPU; threads ORT or CUDA make later inherit the pin). These are host settings, for
matching a deployment; measured on H200 hosts (``benchmarks/README.md (host timeline)``): ORT's default intra-op pool is 16
threads per session there, and ``intra_op_num_threads=1`` took the uncaptured IOBinding arm at batch 8 from 3137 to
2180 µs on one host and from 1961 to 1863 µs on another; pinning the calling thread changed nothing measurable.

``--no-graph-capture`` builds the ``raw_capture`` and ``captured_*`` arms' sessions with the capture option off and
changes nothing else (same buffers, bindings, run options, warm-up and timing boundaries; the ``captured_*`` arms
still call ``CapturedGraph.run``, on a graph object whose binding was never captured), so comparing two runs
isolates what capture itself buys.

Reported per batch: p50/p90/min/mean per arm, the per-process p50s, speedups (``captured_ortvalue`` against
``iobinding``, ``captured_numpy`` against ``plain``, raw capture against ``iobinding``) and ortcapture's overhead
ratio ``captured_ortvalue`` p50 / ``raw_capture`` p50 (computed and drawn by :mod:`ortcapture.cli.bench_report`) — from
the blocks, and again from a call-by-call alternation of just those two arms (``--iters`` pairs per process after
the blocks, the order within a pair alternating; the per-pair differences, both orders weighted alike
(:func:`ortcapture.cli.timing.paired_extra`), give ortcapture's extra cost per call, free of the drift between blocks
that a ~1 % ratio drowns in). Exit code 0 on success, 1 when an arm's outputs disagree with the uncaptured run, 2 on
errors (bad arguments, no capture-capable provider, a failed worker).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

from ortcapture.cli.bench_report import ARMS, CAPTURE_ARMS, _print_batch, _stats, batch_label, plot  # noqa: F401 - re-exported

from ortcapture.cli.bench_common import _PROGRESS, BenchError, session_args  # noqa: F401 - re-exported


# ---------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="ONNX model file (default: the reference YOLOv8n, as in `demo`; with "
                   "--soak: 'small', and 'reference' or 'small' name the built-in models)")
    p.add_argument("--provider", choices=["auto", "cuda", "webgpu"], default="auto",
                   help="capture-capable EP (auto: CUDA when available, else WebGPU)")
    p.add_argument("--batch", default="1", metavar="1,8",
                   help="comma-separated batch sizes (the first dim of inputs whose first dim is dynamic)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=1x3x320x320",
                   help="input shape used verbatim (as in `ortcapture demo`); other dynamic dims default to 320")
    p.add_argument("--procs", type=int, default=5, help="fresh processes per batch size (default 5)")
    p.add_argument("--iters", type=int, default=100, help="timed calls per arm per process (default 100)")
    p.add_argument("--rounds", type=int, default=None,
                   help="round-robin blocks per process (default min(iters, 10))")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per arm per process first (default 5)")
    p.add_argument("--json", metavar="FILE", help="write the results (stats and every sample) as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the latency distributions per arm and batch (PNG)")
    p.add_argument("--graph-capture", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-graph-capture: same harness with the capture option off in the capture arms")
    p.add_argument("--sync", choices=["readback", "device"], default="readback",
                   help="how each timed call waits for the GPU: read every output back to the host (default), or "
                        "(CUDA only) leave outputs on the device and call cudaDeviceSynchronize()")
    p.add_argument("--provider-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an execution provider option for every arm's session (repeatable), e.g. prefer_nhwc=1")
    p.add_argument("--intra-op-threads", type=int, default=None, metavar="N",
                   help="SessionOptions.intra_op_num_threads for every arm's session (default: ORT's own choice)")
    p.add_argument("--session-config", action="append", default=[], metavar="KEY=VALUE",
                   help="SessionOptions.add_session_config_entry for every arm's session (repeatable), e.g. "
                        "session.intra_op.allow_spinning=0")
    p.add_argument("--stream", metavar="LO-HI",
                   help="instead: a seeded stream of requests with batch sizes uniform in LO-HI through plain run(): "
                        "single plain session(s), one plain session per size, ortcapture buckets (ms per request)")
    p.add_argument("--buckets", default="1,2,4,8", metavar="1,2,4,8", help="--stream: the bucket sizes")
    p.add_argument("--axis", metavar="INPUT:AXIS",
                   help="--stream: stream a sequence dim instead of the batch, e.g. ids:1 (every input axis sharing "
                        "its dim_param varies with it; other dims from --shape; int inputs are ones, float random). "
                        "Arms: single plain session (unpadded, the reference), plain sessions per bucket fed "
                        "hand-padded requests, ortcapture buckets. MODEL 'attention' is a built-in masked-attention "
                        "encoder (ids, attention_mask [batch, seq])")
    p.add_argument("--pad-value", action="append", default=[], metavar="NAME=VALUE",
                   help="--stream --axis: pad_values= for the buckets (and the hand-padded arm), repeatable")
    p.add_argument("--requests", type=int, default=200, help="--stream: requests in the stream (default 200)")
    p.add_argument("--single-requests", type=int, default=24,
                   help="--stream: requests timed for the single-session arms, whose every batch-size change is "
                        "slow (default 24)")
    p.add_argument("--passes", type=int, default=5, help="--stream: timed passes after the warm pass (default 5)")
    p.add_argument("--seed", type=int, default=0, help="--stream: the stream's seed (default 0)")
    p.add_argument("--pin-thread", action="store_true",
                   help="each worker pins its calling thread (every arm runs in it) to the CPU it is on, once the "
                        "sessions exist (threads made before keep every CPU, later ones inherit the pin); Linux only")
    from ortcapture.cli import soak

    soak.add_arguments(p)


#: session config keys ORT reads as booleans ("0"/"1"); anything else there is a typo ORT would not report
_BOOLEAN_CONFIG_KEYS = frozenset({
    "session.intra_op.allow_spinning", "session.inter_op.allow_spinning", "session.set_denormal_as_zero",
    "session.use_env_allocators", "session.disable_prepacking", "session.use_device_allocator_for_initializers",
    "session.disable_cpu_ep_fallback", "session.use_ort_model_bytes_directly", "session.disable_quant_qdq",
})


def _session_config(items: list[str]) -> dict[str, str]:
    """``--session-config KEY=VALUE`` items as a dict; raises :class:`BenchError` for a malformed item or a key given
    twice (:func:`ortcapture._ort.providers.parse_key_values`), an EP option (``ep.*``: the capture switch lives there;
    EP options go through ``--provider-option``) or a boolean key whose value is not 0/1."""
    from ortcapture.errors import CaptureError
    from ortcapture.cli.options import parse_key_values

    try:
        out = parse_key_values(items, "--session-config", "session.intra_op.allow_spinning=0")
    except CaptureError as exc:
        raise BenchError(str(exc)) from None
    for key, value in out.items():
        if key.lower().startswith("ep."):
            raise BenchError(f"--session-config {key}: EP options (and the capture switch among them) go through "
                             "--provider-option KEY=VALUE and --graph-capture/--no-graph-capture")
        if key in _BOOLEAN_CONFIG_KEYS and value not in ("0", "1"):
            raise BenchError(f"--session-config {key} takes 0 or 1, got {value!r}")
    return out


def _batches(text: str) -> list[int]:
    from ortcapture.cli.options import int_list

    try:
        out = int_list(text, "--batch")
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    if not out or any(b < 1 for b in out):
        raise BenchError(f"--batch needs batch sizes >= 1, got {text!r}")
    if any(b > 2**31 - 1 for b in out):
        raise BenchError(f"--batch sizes must be below 2**31, got {text!r}")
    return list(dict.fromkeys(out))


def _check_args(args) -> tuple[list[int], int]:
    batches = _batches(args.batch)
    from ortcapture.cli import models

    try:
        args.model = models.model_or_reference(args.model)
    except models.ModelUnavailable as exc:
        raise BenchError(str(exc)) from None
    from ortcapture.cli.demo import check_model_file  # a directory, a missing or empty file: one line, exit 2
    from ortcapture.errors import CaptureError

    try:
        check_model_file(args.model)
    except CaptureError as exc:
        raise BenchError(str(exc)) from None
    for name in ("procs", "iters"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name} must be >= 1")
    if args.warmup < 0:
        raise BenchError("--warmup must be >= 0")
    rounds = min(args.iters, 10) if args.rounds is None else args.rounds
    if not 1 <= rounds <= args.iters:
        raise BenchError(f"--rounds must be between 1 and --iters ({args.iters})")
    from ortcapture._ort import specialize as shapes
    from ortcapture.errors import CaptureError
    from ortcapture.cli.options import parse_provider_options

    try:
        shapes.parse_shape_args(args.shape)
        args.ep_options = parse_provider_options(args.provider_option)
    except CaptureError as exc:
        raise BenchError(str(exc)) from None
    max_threads = 4 * (os.cpu_count() or 1)
    if args.intra_op_threads is not None and not 0 <= args.intra_op_threads <= max_threads:
        raise BenchError(f"--intra-op-threads must be between 0 (ORT's default) and {max_threads} (4x this host's "
                         f"CPUs: more only oversubscribes it), got {args.intra_op_threads}")
    args.session_config_entries = _session_config(args.session_config)
    if args.pin_thread and not hasattr(os, "sched_setaffinity"):
        raise BenchError("--pin-thread needs os.sched_setaffinity (Linux)")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise BenchError(f"the directory of {flag} {path} does not exist")
        if os.path.isdir(path) or not os.access(folder, os.W_OK) or (os.path.exists(path)
                                                                     and not os.access(path, os.W_OK)):
            raise BenchError(f"{flag} {path} is a directory or cannot be written")
        try:  # really writable (os.access says yes to root under /proc and on read-only mounts): a new file is made
            # and removed (O_EXCL: never through a link); an existing regular file is opened to append, untouched; a
            # link, FIFO or device is left to the final write
            if not os.path.lexists(path):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                os.remove(path)
            elif os.path.isfile(path) and not os.path.islink(path):
                open(path, "ab").close()
        except OSError as exc:
            raise BenchError(f"{flag} {path} cannot be written: {exc.strerror}") from None
    if args.plot and not args.plot.lower().endswith(".png"):
        raise BenchError(f"--plot writes a PNG: give a file name ending in .png, got {args.plot!r}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BenchError("--plot needs matplotlib (pip install 'ortcapture[bench]')") from None
    return batches, rounds


# ---------------------------------------------------------------------------------------------------------------
# the parent: processes, progress, statistics, output
# ---------------------------------------------------------------------------------------------------------------
class _Progress:
    """A rich progress bar when stdout is a TTY (and rich is installed), else plain lines."""

    def __init__(self, total: int):
        self._bar = None
        if sys.stdout.isatty():
            try:
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                           TimeRemainingColumn)
            except ImportError:
                pass
            else:
                self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn())
                self._task = self._bar.add_task("bench", total=total)
                self._bar.start()
        self._base = 0

    def job(self, description: str) -> None:
        """A new worker starts; its progress reports count from the current position."""
        if self._bar is not None:
            self._base = int(self._bar.tasks[0].completed)
            self._bar.update(self._task, description=description)
        else:
            print(f"  {description} ...", flush=True)

    def worker(self, done: int, phase: str, description: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self._base + done, description=f"{description} · {phase}")

    def finished(self, description: str, units: int, line: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self._base + units, description=description)
        else:
            print(f"  {line}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _run_worker(cmd: list[str], on_progress) -> tuple[dict | None, str]:
    """Run one worker; feed its progress lines to ``on_progress(done, phase)``; return (result JSON, stderr tail)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    tail: deque[str] = deque(maxlen=30)
    for line in proc.stderr:
        if line.startswith(_PROGRESS):
            try:
                _, done, _total, phase = line.rstrip("\n").split(" ", 3)
                on_progress(int(done), phase)
            except ValueError:
                pass
        elif line.strip():
            tail.append(line.rstrip("\n"))
    rc = proc.wait()
    reader.join()
    result = None
    for line in reversed("".join(out).splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                pass
            break
    if result is None or rc != 0 and result.get("ok"):
        why = f"exit code {rc}" if rc >= 0 else f"killed by signal {-rc}"
        result = {"ok": False, "error": (result or {}).get("error") or f"worker {why} without a result"}
    elif not result.get("ok"):
        tail.clear()  # the worker said what failed; its traceback is noise here
    return result, "\n".join(tail)



def run(args) -> int:
    if getattr(args, "soak", None) is not None or getattr(args, "soak_count", None) is not None:
        from ortcapture.cli import soak

        return soak.run(args)
    try:
        return _run(args)
    except BenchError as exc:
        print(f"ortcapture bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ortcapture bench: interrupted", file=sys.stderr)
        return 130


def _run(args) -> int:
    if args.stream and (args.axis or args.pad_value):
        from ortcapture.cli import bench_seq

        return bench_seq.run_command(args)
    if args.stream:
        from ortcapture.cli import bench_stream

        return bench_stream.run_command(args)
    stream_only = [flag for flag, default in (("buckets", "1,2,4,8"), ("requests", 200), ("single_requests", 24),
                                              ("passes", 5), ("seed", 0), ("axis", None), ("pad_value", []))
                   if hasattr(args, flag) and getattr(args, flag) not in (default, None, [])]
    if stream_only:
        raise BenchError(f"--{', --'.join(f.replace('_', '-') for f in stream_only)} go with --stream")
    batches, rounds = _check_args(args)

    from ortcapture._ort import specialize as shapes
    from ortcapture.cli.demo import example_shapes
    from ortcapture.errors import CaptureError, CaptureUnsupportedError
    from ortcapture.cli import pick_provider

    jobs = []  # (batch, shapes)
    seen = {}
    try:
        for b in batches:
            shp = example_shapes(args.model, b, args.shape)
            if shapes.shape_signature(example_shapes(args.model, b + 1, args.shape)) == shapes.shape_signature(shp):
                # no dynamic first dim (or --shape fixes it): no batch to report ("batch": null, "fixed shapes")
                if args.batch != "1" and None not in seen.values():  # said once, where --batch was given
                    print("ortcapture bench: --batch does not apply (the model has no dynamic first dim, or --shape "
                          "fixes it): its shapes as they are, reported as fixed shapes", file=sys.stderr)
                b = None
            sig = shapes.shape_signature(shp)
            if sig in seen and seen[sig] is None:
                continue  # said above
            if sig in seen:
                print(f"ortcapture bench: batch {b} gives the same input shapes as batch {seen[sig]} (the model's batch dim "
                      "is fixed, or --shape fixes it); skipped", file=sys.stderr)
                continue
            seen[sig] = b
            jobs.append((b, shp))
    except CaptureError as exc:  # a bad or unknown --shape
        raise BenchError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - onnx load errors
        raise BenchError(f"cannot read the input shapes of {args.model}: {exc}") from None
    try:
        provider = pick_provider(args.provider, cuda_must_load=True)
    except CaptureUnsupportedError as exc:
        raise BenchError(str(exc)) from None
    if args.sync == "device":
        from ortcapture._ort import compat

        if provider != "cuda":
            raise BenchError(f"--sync device is CUDA-only: ORT's Python API has no way to wait for {provider}'s "
                             "GPU work other than reading outputs back (use --sync readback)")
        if not compat.has_cuda_python():
            raise BenchError("--sync device needs cuda-python for cudaDeviceSynchronize "
                             "(pip install 'ortcapture[cuda]')")

    import onnxruntime as ort

    capture = bool(args.graph_capture)
    print(f"ortcapture bench: {args.model} on {provider} (onnxruntime {ort.__version__}), graph capture "
          f"{'on' if capture else 'OFF'}; {len(jobs)} batch size(s) x {args.procs} process(es) x {args.iters} calls "
          f"per arm in {rounds} round-robin blocks; each call ends with "
          f"{'the outputs read back' if args.sync == 'readback' else 'cudaDeviceSynchronize() (outputs on the GPU)'}"
          + (f"; EP options {args.ep_options}" if args.ep_options else "")
          + (f"; intra_op_num_threads={args.intra_op_threads}" if args.intra_op_threads is not None else "")
          + (f"; session config {args.session_config_entries}" if args.session_config_entries else "")
          + ("; calling thread pinned to one CPU" if args.pin_thread else ""), flush=True)
    units = len(ARMS) * (1 + rounds) + 1  # warm-up and blocks per arm, then the paired raw/ortcapture phase
    bar = _Progress(len(jobs) * args.procs * units)
    result = {"model": os.path.abspath(args.model), "provider": provider, "ort": ort.__version__,
              "graph_capture": capture, "procs": args.procs, "iters": args.iters, "rounds": rounds,
              "warmup": args.warmup, "sync": args.sync, "provider_options": args.ep_options,
              "intra_op_threads": args.intra_op_threads, "session_config": args.session_config_entries,
              "pin_thread": bool(args.pin_thread), "arms": dict(ARMS),
              "batches": []}
    try:
        with tempfile.TemporaryDirectory(prefix="ortcapture-bench-") as tmp:
            for b, shp in jobs:
                fixed = os.path.join(tmp, f"batch{b or 0}.onnx")
                try:
                    with open(fixed, "wb") as fh:
                        fh.write(shapes.fix_input_shapes(args.model, shp))
                except CaptureError as exc:
                    raise BenchError(str(exc)) from None
                workers = []
                for i in range(args.procs):
                    desc = f"{batch_label(b)} · process {i + 1}/{args.procs}"
                    cmd = [sys.executable, "-m", "ortcapture.cli.bench", "worker", "--model", fixed, "--provider",
                           provider, "--shapes", json.dumps({n: list(s) for n, s in shp.items()}),
                           "--iters", str(args.iters), "--rounds", str(rounds), "--warmup", str(args.warmup),
                           "--capture", str(int(capture)), "--index", str(i), "--sync", args.sync,
                           "--ep-options", json.dumps(args.ep_options),
                           "--session-config", json.dumps(args.session_config_entries)]
                    if args.intra_op_threads is not None:
                        cmd += ["--intra-op-threads", str(args.intra_op_threads)]
                    if args.pin_thread:
                        cmd.append("--pin-thread")
                    t0 = time.perf_counter()
                    bar.job(desc)
                    res, tail = _run_worker(cmd, lambda done, phase, d=desc: bar.worker(done, phase, d))
                    if not res.get("ok"):
                        raise BenchError(f"the worker for {desc} failed: {res.get('error')}"
                                         + (f"\n{tail}" if tail else ""))
                    p50s = ", ".join(f"{a} {float(_median(res['samples_us'][a])):.0f}" for a in ARMS)
                    bar.finished(desc, units, f"{desc}: done in {time.perf_counter() - t0:.1f} s "
                                              f"(setup {res['setup_s']:.1f} s; p50 µs {p50s})")
                    workers.append(res)
                entry = {"batch": b, "shapes": {n: list(s) for n, s in shp.items()}, **_stats(workers)}
                entry["max_abs_diff"] = {a: max(w["max_abs_diff"][a] for w in workers) for a in ARMS}
                entry["tolerance"] = min(w["tolerance"] for w in workers)
                entry["verified"] = all(w["verified"] for w in workers)
                entry["processes"] = [{k: w[k] for k in ("pid", "ep", "providers", "setup_s", "raw_first_run_s",
                                                         "ortcapture_capture_s", "pinned_cpu", "verified")}
                                      for w in workers]
                entry["samples_us"] = {a: [w["samples_us"][a] for w in workers] for a in ARMS}  # per process
                entry["paired_us"] = [w["paired_us"] for w in workers]  # per process, a first in even pairs
                result["ep"] = workers[0]["ep"]
                result["batches"].append(entry)
    finally:
        bar.close()

    for entry in result["batches"]:
        _print_batch(entry, args.procs, args.iters, capture)
    ok = all(e["verified"] for e in result["batches"])
    result["ok"] = ok
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    if not ok:
        print("ortcapture bench: some arm's outputs disagree with the uncaptured run (see MISMATCH above)", file=sys.stderr)
    return 0 if ok else 1


def _median(xs):
    import numpy as np

    return np.percentile(np.asarray(xs, dtype=np.float64), 50)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        from ortcapture.cli.bench_worker import main as worker_main

        sys.exit(worker_main(sys.argv[2:]))
    parser = argparse.ArgumentParser(prog="python -m ortcapture.cli.bench")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
