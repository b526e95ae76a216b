#!/usr/bin/env python3
"""Where the time goes: GPU kernel time vs wall time per call, captured replay vs IOBinding without graph (CUDA).

Raw ORT only (no ortcapture): this measures the model and the machine, to say what any capture can gain. For each
CUDA EP option set and batch size it builds two sessions on the reference model with its input dims fixed to that
batch (as ``ortcapture bench`` does; ``enable_cuda_graph=1`` and without), binds the input and output on the GPU,
and reports per call:
  wall p50 (µs; ``run_with_iobinding`` returns after ORT's stream synchronization), kernels per call, GPU busy time
  (µs; union of the kernel/memcpy/memset intervals CUPTI reports through ``torch.profiler``), and the top kernels.
If the captured replay is GPU-bound (busy ≈ wall), no capture can beat ``wall_no_graph / busy_captured``.
Usage: python benchmarks/profile_gpu.py [--batch 1,8] [--iters 300] [--profile-iters 50] [--options SET ...] [--json F]
  SET: ``default`` or comma-separated CUDA EP options, e.g. ``prefer_nhwc=1,fuse_conv_bias=1``.
Needs onnxruntime-gpu and torch (for the profiler); exits 2 without them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _arm(ort, torch, model: bytes, opts, capture, batch, iters, prof_iters):
    from ortcapture._ort.providers import session_args

    so = ort.SessionOptions()
    so.log_severity_level = 3
    ep_opts = dict(opts)
    sess = ort.InferenceSession(model, **session_args("cuda", capture, so, ep_options=ep_opts))
    x = np.random.default_rng(0).random((batch, 3, 320, 320), dtype=np.float32)
    xin = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    out = ort.OrtValue.ortvalue_from_shape_and_type((batch, 22, 2100), np.float32, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("images", xin)
    io.bind_ortvalue_output("output0", out)
    ro = ort.RunOptions()
    if capture:
        ro.add_run_config_entry("gpu_graph_id", "1")
    for _ in range(20):
        sess.run_with_iobinding(io, ro)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        sess.run_with_iobinding(io, ro)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_iters):
            sess.run_with_iobinding(io, ro)
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    per_name: dict[str, float] = {}
    for e in gpu:
        per_name[e.name] = per_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:8]
    result = np.empty((batch, 22, 2100), np.float32)
    result[...] = out.numpy()
    return {
        "wall_p50_us": statistics.median(times),
        "wall_min_us": min(times),
        "kernels_per_call": len(gpu) / prof_iters,
        "gpu_busy_us_per_call": _busy_us([(e.time_range.start, e.time_range.end) for e in gpu]) / prof_iters,
        "gpu_sum_us_per_call": sum(per_name.values()) / prof_iters,
        "top_kernels_us_per_call": [[n[:90], round(t / prof_iters, 2)] for n, t in top],
        "output": result,
    }


def _parse_set(text: str) -> dict[str, str]:
    if text == "default":
        return {}
    return dict(kv.split("=", 1) for kv in text.split(","))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--profile-iters", type=int, default=50)
    ap.add_argument("--options", nargs="*", default=["default", "prefer_nhwc=1"])
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        import onnxruntime as ort
        import torch
    except ImportError as exc:
        print(f"needs onnxruntime-gpu and torch: {exc}", file=sys.stderr)
        return 2
    if "CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available():
        print("needs the CUDA EP and a CUDA GPU", file=sys.stderr)
        return 2
    from ortcapture.cli import models
    from ortcapture._ort import specialize as shapes

    torch.cuda.init()
    path = str(models.reference_model())
    res = {"ort": ort.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "runs": []}
    for text in args.options:
        opts = _parse_set(text)
        for batch in (int(b) for b in args.batch.split(",")):
            model = shapes.fix_input_shapes(path, {"images": (batch, 3, 320, 320)})
            try:
                arms = {name: _arm(ort, torch, model, opts, cap, batch, args.iters, args.profile_iters)
                        for name, cap in (("no_graph", False), ("captured", True))}
            except Exception as exc:  # e.g. an option that moves nodes off the CUDA EP: capture refused
                res["runs"].append({"options": opts, "batch": batch, "error": f"{type(exc).__name__}: {exc}"})
                print(f"[{text}] batch {batch}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            diff = float(np.max(np.abs(arms["no_graph"].pop("output") - arms["captured"].pop("output"))))
            if not diff <= 1e-3:  # NaN included: a wrong option (e.g. fuse_conv_bias=1 on 1.31.1) shows here
                print(f"[{text}] batch {batch}: captured and uncaptured outputs differ by {diff}", flush=True)
            ng, cg = arms["no_graph"], arms["captured"]
            row = {"options": opts, "batch": batch, "arms": arms, "max_abs_diff": diff,
                   "speedup_p50": ng["wall_p50_us"] / cg["wall_p50_us"],
                   "bound_no_graph_wall_over_captured_busy": ng["wall_p50_us"] / cg["gpu_busy_us_per_call"]}
            res["runs"].append(row)
            print(f"[{text}] batch {batch}: no graph {ng['wall_p50_us']:.0f} µs wall, {ng['gpu_busy_us_per_call']:.0f}"
                  f" busy, {ng['kernels_per_call']:.0f} kernels | captured {cg['wall_p50_us']:.0f} µs wall, "
                  f"{cg['gpu_busy_us_per_call']:.0f} busy, {cg['kernels_per_call']:.0f} kernels | speedup "
                  f"{row['speedup_p50']:.2f}x, bound {row['bound_no_graph_wall_over_captured_busy']:.2f}x, "
                  f"diff {diff:.2e}", flush=True)
            for name, t in cg["top_kernels_us_per_call"]:
                print(f"    {t:8.2f} µs  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
