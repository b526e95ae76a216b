#!/usr/bin/env python3
"""Where ortcapture's extra time per replay goes (CUDA, reference model, one process), for the open part of issue 6.

Every variant below is timed call by call against the same baseline, raw ORT's hand-written replay
``A = x.update_inplace(src); raw.run_with_iobinding(binding)`` (``ortcapture.cli.timing.paired``; both call orders
weighted alike by ``timing.paired_extra``), and reported as µs more (+) or less (-) than A per call:

  A2  raw, its fixed buffers from the session allocator (what ortcapture allocates from)
  B   ``CapturedGraph.run({"images": src}, copy_outputs=False)``
  D   raw ORT calls on ortcapture's session and binding (same copy): the captured graph itself
  E   raw, no input copy (what the copy costs)
  F   ``CapturedGraph.run(None, copy_outputs=False)`` (no feed: the wrapper around the replay)
  G   ortcapture's foreign-capture probe, then E
  H   E inside ortcapture's session guard (CUDA gate + session lock)
  I   ``_oc_replay`` on ortcapture's session (no probe, no guard, no copy): compare with E for the two sessions
So B - D is ortcapture's cost with the graph held equal, F - I the wrapper's, I - E the two sessions' GPU difference.
Measured on the H200 host (2026-11-29, onnxruntime-gpu 1.31.1): I - E within ±20 µs, random per process (two
sessions of one model differ by that much); F - I +10 to +38 µs, more than the whole wrapper costs on a 1x64 model
(+6 µs, ``tools/bench_overhead.py``). Explained by ``tools/host_timeline.py`` (2026-11-29, later): Python run right
after a replay's ~1 ms wait for the GPU costs several times what it costs back to back, by an amount that varies
between hosts and processes (ortcapture's part of a replay: 5-10 µs on one host, 8-26 µs on another).
Usage: python tools/overhead_breakdown.py [--batch 1,8] [--pairs 400] [--provider-option KEY=VALUE ...] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--pairs", type=int, default=400)
    ap.add_argument("--provider-option", action="append", default=[], metavar="KEY=VALUE")
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
    from ortcapture._providers import session_args
    from ortcapture.cli.options import parse_provider_options
    from ortcapture.session import run_options_for

    ep_options = parse_provider_options(args.provider_option)

    def so():
        o = ort.SessionOptions()
        o.log_severity_level = 3
        return o

    path = str(models.reference_model())
    res = {"ort": ort.__version__, "provider_options": ep_options, "pairs": args.pairs, "extra_us": {}}
    for batch in (int(b) for b in args.batch.split(",")):
        model = shapes.fix_input_shapes(path, {"images": (batch, 3, 320, 320)})
        raw = ort.InferenceSession(model, **session_args("cuda", True, so(), ep_options=ep_options))
        ours = ortcapture.InferenceSession(model, **session_args("cuda", True, so(), ep_options=ep_options))
        shp, oshp = (batch, 3, 320, 320), (batch, 22, 2100)
        x = np.random.default_rng(0).random(shp, dtype=np.float32)
        src = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)

        def raw_binding(alloc, gid):
            xin, out = alloc(shp), alloc(oshp)
            b = raw.io_binding()
            b.bind_ortvalue_input("images", xin)
            b.bind_ortvalue_output("output0", out)
            ro = run_options_for(gid)
            raw.run_with_iobinding(b, ro)  # the first run of the id captures
            return xin, b, ro

        xin, io, ro = raw_binding(lambda s: ort.OrtValue.ortvalue_from_shape_and_type(s, np.float32, "cuda", 0), 0)
        xin2, io2, ro2 = raw_binding(
            lambda s: ort.InferenceSession.create_ortvalue_from_shape_and_type(raw, list(s), np.float32, "cuda", 0), 1)
        g = ours.capture({"images": x})
        gin, probe, guard = g.inputs["images"], ours._oc_check_foreign_capture, ours._oc_guard

        def guarded(i):
            with guard:
                raw.run_with_iobinding(io, ro)

        def base(i):
            xin.update_inplace(src)
            raw.run_with_iobinding(io, ro)

        variants = {
            "A2 raw, session-allocator buffers": lambda i: (xin2.update_inplace(src), raw.run_with_iobinding(io2, ro2)),
            "B CapturedGraph.run(src)": lambda i: g.run({"images": src}, copy_outputs=False),
            "D raw calls on ortcapture's graph": lambda i: (
                gin.update_inplace(src), ort.InferenceSession.run_with_iobinding(ours, g._binding, g._run_options)),
            "E raw, no input copy": lambda i: raw.run_with_iobinding(io, ro),
            "F CapturedGraph.run(None)": lambda i: g.run(None, copy_outputs=False),
            "G probe + E": lambda i: (probe(), raw.run_with_iobinding(io, ro)),
            "H guard around E": guarded,
            "I _oc_replay, ortcapture's session": lambda i: ours._oc_replay(g._binding, g._run_options, g._record),
        }
        out = res["extra_us"][str(batch)] = {}
        for name, fn in variants.items():
            a, b = timing.paired(base, fn, args.pairs, warmup=20)
            out[name] = timing.paired_extra(a, b)
            print(f"batch {batch}: {out[name]:+7.1f} µs against raw  {name}", flush=True)
        g.release()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
