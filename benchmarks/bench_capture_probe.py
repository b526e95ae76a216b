#!/usr/bin/env python3
"""The foreign-capture probe (issue 32): what each way of asking "is a CUDA graph being captured?" answers, and
what it costs per replay.

``CapturedGraph.run`` asks before every replay whether a foreign CUDA graph capture is in progress that the replay
would break (ORT PR #32081: inside ``torch.cuda.graph()`` a CUDA-graph session run ends in ``std::terminate``). Two
questions, one table each:

* **answers**: every query form in every capture situation — none; this thread capturing a blocking stream in
  global / thread-local / relaxed mode; another thread doing so; a non-blocking stream; ``torch.cuda.graph()``; a
  new thread that has no current CUDA context yet; a blocking stream captured once torch's CUDA is initialised
  (torch's own query of its current stream, the legacy one, then raises ``cudaErrorStreamCaptureImplicit``). Each
  foreign capture is ended afterwards and must still instantiate (a probe must not invalidate what it looks at).
  The new probe is sound where it answers like the old one in every row, or "capturing" where the old one raised.
* **cost**, every arm in turn in each round (drift shared alike): ns per call back to back (10 000 calls, median of
  15 rounds) and right after a real replay's wait for the GPU (a tiny CUDA-graph session replayed, then one call
  timed; median of 2 000), for: an empty closure (a Python frame), two trivial cuda-python calls (the binding's own
  floor), the runtime query (``cudaStreamIsCapturing(cudaStreamLegacy)``), the driver query
  (``cuStreamIsCapturing(CU_STREAM_LEGACY)``) and the driver query of a non-blocking stream, the runtime-only probe
  ortcapture had up to c0a3c78, and ``ortcapture._ort.cudart``'s probe now; then the same two probes with torch
  imported, torch's public check and its C query alone.

Usage (the H200; needs cuda-python, onnxruntime-gpu, torch optional)::

    python benchmarks/bench_capture_probe.py --json "$OUT/capture_probe.json"
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

_CAPTURE_ERRORS = frozenset(range(900, 909))


def runtime_probe(rt):
    """The probe as it was (runtime query of the legacy stream, torch's current stream first)."""
    modules = sys.modules
    legacy = rt.cudaStream_t(0)

    def probe() -> bool:
        torch = modules.get("torch")
        if torch is not None:
            cuda = torch.cuda
            if cuda.is_initialized() and cuda.is_current_stream_capturing():
                return True
        err, status = rt.cudaStreamIsCapturing(legacy)
        if err:
            return int(err) in _CAPTURE_ERRORS
        return bool(status)

    return probe


def answer(err, status) -> str:
    """One query's answer: ``capturing`` / ``none`` / the error code."""
    if int(err) == 0:
        return "capturing" if int(status) else "none"
    return "capturing" if int(err) in _CAPTURE_ERRORS else f"error {int(err)}"


def _said(fn):
    def call():
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a probe that raises is an answer of its own here
            return f"raises {type(exc).__name__}"
    return call


def forms(rt, drv, new_probe):
    legacy_rt = rt.cudaStream_t(int(getattr(rt, "cudaStreamLegacy", 1)))
    legacy_drv = drv.CUstream(int(drv.CU_STREAM_LEGACY))
    old = runtime_probe(rt)
    return {
        "runtime cudaStreamIsCapturing(cudaStreamLegacy)": _said(lambda: answer(*rt.cudaStreamIsCapturing(legacy_rt))),
        "driver cuStreamIsCapturing(CU_STREAM_LEGACY)": _said(lambda: answer(*drv.cuStreamIsCapturing(legacy_drv))),
        "old probe (runtime)": _said(lambda: "capturing" if old() else "none"),
        "new probe (ortcapture)": _said(lambda: "capturing" if new_probe() else "none"),
    }


def _check(err, what):
    if int(err):
        raise RuntimeError(f"{what}: {err}")


def answers(rt, drv, new_probe, torch) -> list[dict]:
    """Each query form's answer in each situation; the foreign capture's fate after the probes."""
    fs = forms(rt, drv, new_probe)
    modes = {"global": rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal,
             "thread-local": rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal,
             "relaxed": rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed}
    rows = []
    err, ctx = drv.cuCtxGetCurrent()
    _check(err, "cuCtxGetCurrent")

    def ask(where):
        got = {}
        if where == "this thread":
            return {k: f() for k, f in fs.items()}
        # "other thread": one thread with this thread's context current first (no runtime call: none is needed);
        # "new thread": each form from a thread of its own with no current context (the runtime's query would make
        # the primary context current for the forms after it)
        groups = [list(fs)] if where == "other thread" else [[k] for k in fs]
        for names in groups:
            def body(names=names):
                if where == "other thread":
                    _check(drv.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")
                got.update({k: fs[k]() for k in names})
            t = threading.Thread(target=body)
            t.start()
            t.join()
        return got

    rows.append({"situation": "no capture", "probed from": "this thread", **ask("this thread")})
    rows.append({"situation": "no capture", "probed from": "new thread (no context)", **ask("new thread")})
    def foreign(blocking, mode, where):
        """Begin a cuda-python capture, ask every form from ``where``, end it: (answers, still valid)."""
        err, s = rt.cudaStreamCreateWithFlags(0 if blocking else 1)  # cudaStreamNonBlocking = 1
        _check(err, "cudaStreamCreateWithFlags")
        (err,) = rt.cudaStreamBeginCapture(s, mode)
        _check(err, "cudaStreamBeginCapture")
        try:
            got = ask(where)
        finally:
            err, graph = rt.cudaStreamEndCapture(s)
        ok = int(err) == 0
        if ok:
            err2, ge = rt.cudaGraphInstantiate(graph, 0)
            ok = int(err2) == 0
            if ok:
                rt.cudaGraphExecDestroy(ge)
            rt.cudaGraphDestroy(graph)
        rt.cudaGetLastError()
        rt.cudaStreamDestroy(s)
        return got, ok

    for blocking in (True, False):
        for mode_name, mode in modes.items():
            for where in ("this thread", "other thread", "new thread"):
                if where == "new thread" and not (blocking and mode_name == "global"):
                    continue
                got, ok = foreign(blocking, mode, where)
                rows.append({"situation": f"{'blocking' if blocking else 'non-blocking'} stream, {mode_name} mode",
                             "probed from": where, **got, "capture still valid": ok})
    if torch is not None:
        torch.zeros(1, device="cuda")  # torch's CUDA initialised: its current stream (the legacy one) is asked too
        for where in ("this thread", "other thread"):
            got, ok = foreign(True, modes["global"], where)
            rows.append({"situation": "blocking stream, global mode, torch initialised", "probed from": where, **got,
                         "capture still valid": ok})
        static = torch.zeros(4, device="cuda")
        tg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(tg):
            static.add_(1)
            got = ask("this thread")
        tg.replay()
        torch.cuda.synchronize()
        rows.append({"situation": "torch.cuda.graph()", "probed from": "this thread", **got,
                     "capture still valid": static.tolist() == [1.0] * 4})
    return rows


def _per_call_ns(arms: dict, n=10_000, batches=15) -> dict:
    """ns per call of each arm back to back: ``batches`` rounds, each arm's ``n`` calls in turn in every round
    (drift shared alike); the median round per arm."""
    clock = time.perf_counter_ns
    out: dict = {name: [] for name in arms}
    for _ in range(batches):
        for name, fn in arms.items():
            t0 = clock()
            for _ in range(n):
                fn()
            out[name].append((clock() - t0) / n)
    return {name: float(statistics.median(v)) for name, v in out.items()}


def _after_wait_ns(arms: dict, replay, n=2000) -> dict:
    """ns of one call of each arm right after a replay's wait for the GPU, the arms in turn; medians."""
    clock = time.perf_counter_ns
    base = []
    for _ in range(2000):
        t0 = clock()
        base.append(clock() - t0)
    zero = statistics.median(base)
    out: dict = {name: [] for name in arms}
    for _ in range(n):
        for name, fn in arms.items():
            replay()
            t0 = clock()
            fn()
            out[name].append(clock() - t0 - zero)
    return {name: float(statistics.median(v)) for name, v in out.items()}


def costs(rt, drv, new_probe, replay, with_torch: bool) -> dict:
    legacy_rt = rt.cudaStream_t(int(getattr(rt, "cudaStreamLegacy", 1)))
    legacy_drv = drv.CUstream(int(drv.CU_STREAM_LEGACY))
    rq, dq = rt.cudaStreamIsCapturing, drv.cuStreamIsCapturing
    old = runtime_probe(rt)

    def empty() -> bool:
        return False

    err, side = rt.cudaStreamCreateWithFlags(1)
    _check(err, "cudaStreamCreateWithFlags")
    side_drv = drv.CUstream(int(side))
    get_ctx, last = drv.cuCtxGetCurrent, rt.cudaGetLastError
    arms = {"empty closure (one Python frame)": empty,
            "cuda-python floor: driver cuCtxGetCurrent()": lambda: get_ctx(),
            "cuda-python floor: runtime cudaGetLastError()": lambda: last(),
            "runtime query": lambda: rq(legacy_rt),
            "driver query": lambda: dq(legacy_drv),
            "driver query of a non-blocking stream": lambda: dq(side_drv),
            "old probe (runtime)": old,
            "new probe (ortcapture)": new_probe}
    if with_torch:
        import torch

        cuda = torch.cuda
        c_query = torch._C._cuda_isCurrentStreamCapturing  # noqa: SLF001 - what the new probe calls
        arms = {"old probe (runtime)": old, "new probe (ortcapture)": new_probe,
                "torch check (is_initialized + is_current_stream_capturing)":
                    lambda: cuda.is_initialized() and cuda.is_current_stream_capturing(),
                "torch's C query alone (torch._C._cuda_isCurrentStreamCapturing)": c_query}
    b2b, after = _per_call_ns(arms), _after_wait_ns(arms, replay)
    rt.cudaStreamDestroy(side)
    return {name: {"back_to_back_ns": round(b2b[name], 1), "after_wait_ns": round(after[name], 1)} for name in arms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch rows even where torch imports")
    args = ap.parse_args()
    import numpy as np

    import ortcapture
    from ortcapture._ort import compat
    from ortcapture._ort.cudart import make_capture_probe
    from tests import tiny

    rt, drv = compat.cudart(), compat.cudadrv()
    if rt is None or drv is None:
        raise SystemExit("needs cuda-python (runtime and driver modules)")
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ortcapture.InferenceSession(tiny.affine_model((1, 64)), so, providers=[
        ("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    g = sess.capture({"X": np.zeros((1, 64), np.float32)}, verify=False)
    new_probe = make_capture_probe()
    report = {"cuda_python": getattr(sys.modules.get("cuda.bindings"), "__version__", "?"),
              "onnxruntime": ort.__version__}
    report["cost"] = costs(rt, drv, new_probe, g.replay, with_torch=False)
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
    report["answers"] = answers(rt, drv, new_probe, torch)
    if torch is not None:
        report["cost_with_torch_imported"] = costs(rt, drv, new_probe, g.replay, with_torch=True)
    forms_ = [k for k in report["answers"][0] if k not in ("situation", "probed from")]
    # sound: the old probe's answer wherever it gave one, "capturing" where it raised inside a capture
    report["new_probe_agrees_with_old"] = all(
        r["new probe (ortcapture)"] == r["old probe (runtime)"]
        or (r["old probe (runtime)"].startswith("raises") and r["new probe (ortcapture)"] == "capturing")
        for r in report["answers"])
    report["captures_left_valid"] = all(r.get("capture still valid", True) for r in report["answers"])
    print("answers:")
    for r in report["answers"]:
        print(f"  {r['situation']:38s} {r['probed from']:24s} " + " | ".join(f"{r[k]}" for k in forms_)
              + (f" | valid={r['capture still valid']}" if "capture still valid" in r else ""))
    print("  columns: " + " | ".join(forms_))
    for key in ("cost", "cost_with_torch_imported"):
        if key in report:
            print(f"{key} (ns per call: back to back / right after a replay's wait):")
            for name, v in report[key].items():
                print(f"  {name:60s} {v['back_to_back_ns']:8.1f} / {v['after_wait_ns']:8.1f}")
    print(f"new probe agrees with the old in every situation: {report['new_probe_agrees_with_old']}; "
          f"every foreign capture still valid: {report['captures_left_valid']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["new_probe_agrees_with_old"] and report["captures_left_valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
