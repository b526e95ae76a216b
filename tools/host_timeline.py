#!/usr/bin/env python3
"""Where the host time of one CUDA replay goes, and what ORT's intra-op thread pool does to it (issue 6).

For each variant (``default``: ORT's own session options; ``threads1``: ``intra_op_num_threads=1``,
``inter_op_num_threads=1``, ``session.intra_op.allow_spinning=0``, every session of the run made alike; ``+pinned``:
the calling thread pinned to the CPU it is on, after the sessions are made), and each
batch size, on the reference model with its dims fixed:

* arm p50s in rotating blocks: ``iobinding`` (no capture), ``raw`` (hand-written capture), ``ours``
  (``CapturedGraph.run({"images": src}, copy_outputs=False)``);
* ortcapture's extra per call over raw, call by call (``timing.paired`` / ``timing.paired_extra``);
* a timeline of each captured call (medians, µs): ``pre`` from the call's start to ORT's ``run_with_iobinding``,
  ``ort`` inside it (the replay and ORT's wait for the GPU), ``post`` from its return to the call's end;
* the process's thread count, the cgroup's CPU throttling during the variant.

Then the host cost of each piece of ortcapture's replay path (on a 1x64 model), back to back and right after a
raw replay of the reference model: does the wrapper's Python cost more after a long ORT call?
Usage: python tools/host_timeline.py [--batch 1,8] [--pairs 400] [--variants default,threads1]
       [--sections arms,interleaved,pieces] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _throttled() -> dict:
    stat = dict(line.split() for line in _read("/sys/fs/cgroup/cpu.stat").splitlines() if " " in line)
    return {k: int(v) for k, v in stat.items() if k in ("nr_throttled", "throttled_usec", "usage_usec")}


def _threads() -> int:
    for line in _read("/proc/self/status").splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


def _tiny_model() -> bytes:
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [64, 64], np.eye(64, dtype=np.float32).ravel().tolist())
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
                          "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8  # onnx newer than the ORT at hand writes an IR version that ORT refuses
    return m.SerializeToString()


def _interleaved(args, ctx) -> dict:
    """Each variant's host time per call (median µs), the variants taking turns call by call, each call right after
    a raw replay of the batch-8 reference model (``cold``) or back to back (``warm``): drift hits every variant
    alike. Run twice: as is, and with the calling thread pinned to one CPU (``os.sched_setaffinity``)."""
    import onnxruntime as ort

    from ortcapture.cli.bench import current_cpu
    from ortcapture.graph import ReplayOutput

    raw, b, ro, tiny, tg, traw, tb = (ctx[k] for k in ("raw", "b", "ro", "tiny", "tg", "traw", "tb"))
    guard, fixed, probe = tiny._oc_guard, tg._output_list[0], tiny._oc_check_foreign_capture
    base = ort.InferenceSession.run_with_iobinding
    binding, gro = tg._binding, tg._run_options

    def ort_only():
        base(tiny, binding, gro)

    def guarded():
        with guard:
            base(tiny, binding, gro)

    variants = {
        "raw session: run_with_iobinding": lambda: traw.run_with_iobinding(tb, ro),
        "ortcapture session: ORT's run_with_iobinding": ort_only,
        "CapturedGraph.run(None)": lambda: tg.run(None, copy_outputs=False),
        "probe + ORT's run": lambda: (probe(), ort_only()),
        "thread check + ORT's run": lambda: (tiny._oc_thread_has(tg.graph_id), ort_only()),
        "session guard around ORT's run": guarded,
        "ORT's run + ReplayOutput": lambda: (ort_only(), [ReplayOutput(fixed, tg, 0)]),
    }
    names = list(variants)
    fns = [variants[k] for k in names]
    clock = time.perf_counter_ns
    n = args.pairs
    out = {}
    for pin in (False, True):
        if pin:
            os.sched_setaffinity(0, {current_cpu()})
        for mode in ("warm", "cold"):
            t = np.empty((len(fns), n))
            for i in range(n * len(fns)):
                k = i % len(fns)
                if mode == "cold":
                    raw.run_with_iobinding(b, ro)
                t0 = clock()
                fns[k]()
                t[k, i // len(fns)] = (clock() - t0) / 1e3
            key = f"{mode}{', pinned' if pin else ''}"
            out[key] = {name: float(np.median(t[j])) for j, name in enumerate(names)}
            print(f"--- {key}", flush=True)
            for name, v in out[key].items():
                print(f"  {name:55s} {v:7.2f} µs", flush=True)
    os.sched_setaffinity(0, ctx["affinity"])
    return out


def _setup(so, path) -> dict:
    """A raw capture of the batch-8 reference model, and a 1x64 model captured by ortcapture and by raw ORT."""
    import onnxruntime as ort

    import ortcapture
    from ortcapture import _specialize as shapes
    from ortcapture._providers import session_args
    from ortcapture.session import run_options_for

    model = shapes.fix_input_shapes(path, {"images": (8, 3, 320, 320)})
    raw = ort.InferenceSession(model, **session_args("cuda", True, so()))
    xin = ort.OrtValue.ortvalue_from_shape_and_type((8, 3, 320, 320), np.float32, "cuda", 0)
    out = ort.OrtValue.ortvalue_from_shape_and_type((8, 22, 2100), np.float32, "cuda", 0)
    b = raw.io_binding()
    b.bind_ortvalue_input("images", xin)
    b.bind_ortvalue_output("output0", out)
    ro = run_options_for(0)
    raw.run_with_iobinding(b, ro)
    tiny = ortcapture.InferenceSession(_tiny_model(), **session_args("cuda", True, so()))
    one = np.ones((1, 64), np.float32)
    tg = tiny.capture({"x": one})
    tsrc = ort.OrtValue.ortvalue_from_numpy(one, "cuda", 0)
    traw = ort.InferenceSession(_tiny_model(), **session_args("cuda", True, so()))
    tin = ort.OrtValue.ortvalue_from_numpy(one, "cuda", 0)
    tout = ort.OrtValue.ortvalue_from_shape_and_type((1, 64), np.float32, "cuda", 0)
    tb = traw.io_binding()
    tb.bind_ortvalue_input("x", tin)
    tb.bind_ortvalue_output("y", tout)
    traw.run_with_iobinding(tb, ro)
    tg.run({"x": tsrc}, copy_outputs=False)
    return {"raw": raw, "b": b, "ro": ro, "tiny": tiny, "tg": tg, "tsrc": tsrc, "traw": traw, "tin": tin, "tb": tb,
            "affinity": os.sched_getaffinity(0)}


def _pieces(args, ctx) -> dict:
    """Host cost (median µs) of each piece of ortcapture's replay path, warm (back to back) and cold (right after
    a raw replay of the batch-8 reference model, i.e. after a ~1.4 ms ORT call and its wait for the GPU; and after a
    1 ms ``time.sleep``)."""
    from ortcapture._sync import CUDA_GATE
    from ortcapture.graph import ReplayOutput

    raw, b, ro, tiny, tg, tsrc, traw, tin, tb = (
        ctx[k] for k in ("raw", "b", "ro", "tiny", "tg", "tsrc", "traw", "tin", "tb"))
    guard, lock, gate, fixed = tiny._oc_guard, tiny._oc_lock, CUDA_GATE.shared, tg._output_list[0]
    objs = [type("O", (), {})() for _ in range(100)]
    for o in objs:
        o.a = 1

    def guarded():
        with guard:
            pass

    def gated():
        with gate:
            pass

    def locked():
        lock.acquire()
        lock.release()

    def touch100():
        for o in objs:
            o.a

    import ctypes

    try:
        ct = ctypes.CDLL("libcudart.so.13")  # ORT's, already loaded: dlopen finds it by soname
        ct.cudaStreamIsCapturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        status = ctypes.c_int(0)
        sref = ctypes.byref(status)
        ct_probe = (lambda: ct.cudaStreamIsCapturing(None, sref))
    except OSError as exc:
        print("no libcudart.so.13 through ctypes:", exc, flush=True)
        ct_probe = None
    pieces = {
        "nothing": lambda: None,
        "foreign-capture probe": tiny._oc_check_foreign_capture,
        "thread check": lambda: tiny._oc_thread_has(tg.graph_id),
        "session guard (gate + lock)": guarded,
        "CUDA gate only": gated,
        "session lock only": locked,
        "ReplayOutput()": lambda: ReplayOutput(fixed, tg, 0),
        "touch 100 Python objects": touch100,
        "ORT update_inplace(OrtValue), 1x64": lambda: tin.update_inplace(tsrc),
        "raw tiny: update_inplace + run_with_iobinding": lambda: (tin.update_inplace(tsrc),
                                                                  traw.run_with_iobinding(tb, ro)),
        "raw tiny: run_with_iobinding": lambda: traw.run_with_iobinding(tb, ro),
        "CapturedGraph.run({x: src}) tiny": lambda: tg.run({"x": tsrc}, copy_outputs=False),
        "CapturedGraph.run(None) tiny": lambda: tg.run(None, copy_outputs=False),
        "raw tiny: C-level _sess.run_with_iobinding": lambda: traw._sess.run_with_iobinding(tb._iobinding, ro),
    }
    if ct_probe is not None:
        pieces["cudaStreamIsCapturing through ctypes"] = ct_probe
    clock = time.perf_counter_ns
    n = args.pairs
    out = {}
    for name, fn in pieces.items():
        row = {}
        for mode in ("warm", "after ORT replay", "after sleep 1 ms"):
            t = np.empty(n)
            for i in range(n):
                if mode == "after ORT replay":
                    raw.run_with_iobinding(b, ro)
                elif mode == "after sleep 1 ms":
                    time.sleep(0.001)
                t0 = clock()
                fn()
                t[i] = (clock() - t0) / 1e3
            row[mode] = float(np.median(t))
        out[name] = row
        print(f"{name:48s} " + "  ".join(f"{k}: {v:6.2f}" for k, v in row.items()), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--pairs", type=int, default=400)
    ap.add_argument("--calls", type=int, default=300, help="calls per arm in the blocks")
    ap.add_argument("--variants", default="default,threads1")
    ap.add_argument("--sections", default="arms,interleaved,pieces",
                    help="which parts: arms (reference model, per batch and variant), interleaved, pieces")
    ap.add_argument("--json")
    args = ap.parse_args()

    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("needs onnxruntime-gpu with the CUDA EP", file=sys.stderr)
        return 2
    import ortcapture
    from ortcapture.cli import models as models
    from ortcapture import _specialize as shapes
    from ortcapture.cli import timing as timing
    from ortcapture.cli.bench import current_cpu
    from ortcapture._providers import session_args
    from ortcapture.session import run_options_for

    facts = {"ort": ort.__version__, "os.cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
             "cgroup cpu.max": _read("/sys/fs/cgroup/cpu.max"), "threads at start": _threads()}
    print(json.dumps(facts), flush=True)
    res = {"facts": facts, "variants": {}}
    facts_affinity = os.sched_getaffinity(0)
    path = str(models.reference_model())
    clock = time.perf_counter_ns

    def so_for(variant):
        def so():
            o = ort.SessionOptions()
            o.log_severity_level = 3
            if "threads1" in variant:
                o.intra_op_num_threads = 1
                o.inter_op_num_threads = 1
                o.add_session_config_entry("session.intra_op.allow_spinning", "0")
            return o
        return so

    def timeline(fn, sess, n):
        """Medians of pre/ort/post (µs) for ``fn(i)``, whose ORT call goes through ``sess.run_with_iobinding``
        (raw session) or ``sess._oc_replay`` (ortcapture session), both patched on the instance."""
        stamps = [0, 0]
        if isinstance(sess, ortcapture.InferenceSession):
            orig = sess._oc_replay

            def patched(b, r, rec):
                stamps[0] = clock()
                orig(b, r, rec)
                stamps[1] = clock()
            sess._oc_replay = patched
        else:
            orig = sess.run_with_iobinding

            def patched(b, r=None):
                stamps[0] = clock()
                orig(b, r)
                stamps[1] = clock()
            sess.run_with_iobinding = patched
        pre, mid, post = np.empty(n), np.empty(n), np.empty(n)
        try:
            for i in range(n):
                t0 = clock()
                fn(i)
                t3 = clock()
                pre[i], mid[i], post[i] = (stamps[0] - t0) / 1e3, (stamps[1] - stamps[0]) / 1e3, (t3 - stamps[1]) / 1e3
        finally:
            if isinstance(sess, ortcapture.InferenceSession):
                del sess._oc_replay
            else:
                del sess.run_with_iobinding
        return {"pre": float(np.median(pre)), "ort": float(np.median(mid)), "post": float(np.median(post))}

    sections = set(args.sections.split(","))
    for variant in (args.variants.split(",") if "arms" in sections else []):
        so = so_for(variant)
        vres = res["variants"][variant] = {}
        for batch in (int(b) for b in args.batch.split(",")):
            th0 = _throttled()
            model = shapes.fix_input_shapes(path, {"images": (batch, 3, 320, 320)})
            plain = ort.InferenceSession(model, **session_args("cuda", False, so()))
            raw = ort.InferenceSession(model, **session_args("cuda", True, so()))
            ours = ortcapture.InferenceSession(model, **session_args("cuda", True, so()))
            shp, oshp = (batch, 3, 320, 320), (batch, 22, 2100)
            x = np.random.default_rng(0).random(shp, dtype=np.float32)
            src = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)

            def bound(sess, gid):
                xin = ort.OrtValue.ortvalue_from_shape_and_type(shp, np.float32, "cuda", 0)
                out = ort.OrtValue.ortvalue_from_shape_and_type(oshp, np.float32, "cuda", 0)
                b = sess.io_binding()
                b.bind_ortvalue_input("images", xin)
                b.bind_ortvalue_output("output0", out)
                ro = run_options_for(gid)
                sess.run_with_iobinding(b, ro)
                return xin, b, ro

            if "pinned" in variant:  # the calling thread only; ORT's threads (made above) keep every CPU
                os.sched_setaffinity(0, {current_cpu()})
            pin, pio, pro = bound(plain, 0)
            rin, rio, rro = bound(raw, 0)
            g = ours.capture({"images": x})
            arms = {
                "iobinding": lambda i: (pin.update_inplace(src), plain.run_with_iobinding(pio, pro)),
                "raw": lambda i: (rin.update_inplace(src), raw.run_with_iobinding(rio, rro)),
                "ours": lambda i: g.run({"images": src}, copy_outputs=False),
            }
            for fn in arms.values():
                timing.measure(fn, 20, warmup=0)
            blocks = {a: [] for a in arms}
            for r in range(6):
                names = list(arms)[r % 3:] + list(arms)[:r % 3]
                for a in names:
                    blocks[a].append(timing.measure(arms[a], args.calls // 6, warmup=1))
            p50 = {a: float(np.median(np.concatenate(v))) for a, v in blocks.items()}
            pa, pb = timing.paired(arms["raw"], arms["ours"], args.pairs, warmup=10)
            out = vres[str(batch)] = {
                "p50_us": p50, "speedup_raw_vs_iobinding": p50["iobinding"] / p50["raw"],
                "ours_over_raw_blocks": p50["ours"] / p50["raw"],
                "paired_extra_us": timing.paired_extra(pa, pb),
                "timeline_raw": timeline(arms["raw"], raw, args.pairs),
                "timeline_ours": timeline(arms["ours"], ours, args.pairs),
                "timeline_ours_no_feed": timeline(lambda i: g.run(None, copy_outputs=False), ours, args.pairs),
                "threads": _threads(),
            }
            th1 = _throttled()
            out["cgroup_delta"] = {k: th1[k] - th0.get(k, 0) for k in th1}
            print(f"{variant} batch {batch}: " + json.dumps(out), flush=True)
            g.release()
            os.sched_setaffinity(0, facts_affinity)

    ctx = _setup(so_for("default"), path) if sections & {"interleaved", "pieces"} else None
    if "interleaved" in sections:
        res["interleaved"] = _interleaved(args, ctx)
    if "pieces" in sections:
        res["pieces"] = _pieces(args, ctx)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
