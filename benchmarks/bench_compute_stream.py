#!/usr/bin/env python3
"""Raw ORT (no ortcapture): what a CUDA-graph replay's feed copy costs, and whether it can skip its host wait.

ORT's ``OrtValue.update_inplace(OrtValue)`` is a synchronous ``cudaMemcpy`` on the legacy stream: on a tiny model it is
about half of a replay. Where the session's compute stream is known (``user_compute_stream``, set here with a
stream made through cuda-python), the copy can be queued on that stream with ``cudaMemcpyAsync`` ahead of the
graph launch, with no host wait; ORT's replay then synchronises the stream before returning. This script measures,
in one process, alternating call by call on the same model (``--model tiny``: Y = 2X + 1 at 1x64, or
``--model FILE.onnx`` with ``--shape``):

* ``raw``: ``dst.update_inplace(src)`` + ``run_with_iobinding`` (no user stream: ORT's own, as today);
* ``user-stream sync``: the same on a session with a user compute stream (does the stream alone change anything?);
* ``async``: ``cudaMemcpyAsync(dst, src, stream)`` + ``run_with_iobinding`` on that session;
* ``async after legacy``: ``cudaEventRecord(ev, cudaStreamLegacy)`` + ``cudaStreamWaitEvent(stream, ev)`` +
  ``cudaMemcpyAsync`` (the copy also waits for work queued on the legacy stream, as ``update_inplace``'s does);

for non-blocking and blocking user streams, and checks every arm's outputs against the first session's (new source
contents each checked call, so a copy the replay did not wait for shows) and that the stream is idle when
``run_with_iobinding`` returns. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--shape", default="1,64")
    ap.add_argument("--input", default="X")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--checks", type=int, default=50)
    args = ap.parse_args()

    import numpy as np
    import onnxruntime as ort
    from cuda.bindings import runtime as rt

    def ck(res, what):
        err = res[0] if isinstance(res, tuple) else res
        if int(err):
            raise SystemExit(f"{what}: {err}")
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    shape = tuple(int(s) for s in args.shape.split(","))
    if args.model == "tiny":
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests import tiny

        model = tiny.affine_model(shape)
    else:
        model = args.model
    ck(rt.cudaSetDevice(0), "cudaSetDevice")
    ck(rt.cudaFree(0), "cudaFree")

    def session(stream=None):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        opts = {"enable_cuda_graph": "1", "device_id": "0", "use_tf32": "0"}
        if stream is not None:
            opts["user_compute_stream"] = str(int(stream))
        return ort.InferenceSession(model, so, providers=[("CUDAExecutionProvider", opts)])

    rng = np.random.default_rng(0)
    host = rng.random(shape, dtype=np.float32)
    nbytes = host.nbytes

    cpu = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    out_shapes = [o.shape for o in cpu.run(None, {args.input: host})]
    del cpu

    def prepared(sess):
        out_meta = sess.get_outputs()
        src = ort.OrtValue.ortvalue_from_numpy(host, "cuda", 0)
        dst = ort.OrtValue.ortvalue_from_numpy(host, "cuda", 0)
        b = sess.io_binding()
        b.bind_ortvalue_input(args.input, dst)
        outs = []
        for m, oshape in zip(out_meta, out_shapes):
            o = ort.OrtValue.ortvalue_from_shape_and_type(list(oshape), np.float32, "cuda", 0)
            b.bind_ortvalue_output(m.name, o)
            outs.append(o)
        ro = ort.RunOptions()
        ro.add_run_config_entry("gpu_graph_id", "1")
        sess.run_with_iobinding(b, ro)  # capture
        sess.run_with_iobinding(b, ro)
        return src, dst, b, ro, outs

    base = session()
    bsrc, bdst, bb, bro, bouts = prepared(base)
    c_run = base.run_with_iobinding
    report = {"ort": ort.__version__, "model": str(args.model)[:80], "shape": list(shape), "arms": {}}

    arms = {}

    def raw():
        bdst.update_inplace(bsrc)
        c_run(bb, bro)
    arms["raw (update_inplace + run)"] = raw
    kinds = {}
    legacy = rt.cudaStream_t(int(rt.cudaStreamLegacy))
    for kind, flags in (("non-blocking", rt.cudaStreamNonBlocking), ("blocking", rt.cudaStreamDefault)):
        stream = ck(rt.cudaStreamCreateWithFlags(flags), "cudaStreamCreateWithFlags")
        ev = ck(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreate")
        sess = session(stream)
        src, dst, b, ro, outs = prepared(sess)
        run = sess.run_with_iobinding
        ib = b
        dptr, sptr = dst.data_ptr(), src.data_ptr()
        d2d = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        memcpy_async, record, wait = rt.cudaMemcpyAsync, rt.cudaEventRecord, rt.cudaStreamWaitEvent

        def sync_copy(dst=dst, src=src, run=run, ib=ib, ro=ro):
            dst.update_inplace(src)
            run(ib, ro)

        def async_copy(run=run, ib=ib, ro=ro, dptr=dptr, sptr=sptr, stream=stream):
            memcpy_async(dptr, sptr, nbytes, d2d, stream)
            run(ib, ro)

        def async_after_legacy(run=run, ib=ib, ro=ro, dptr=dptr, sptr=sptr, stream=stream, ev=ev):
            record(ev, legacy)
            wait(stream, ev, 0)
            memcpy_async(dptr, sptr, nbytes, d2d, stream)
            run(ib, ro)
        arms[f"{kind}: user-stream sync"] = sync_copy
        arms[f"{kind}: async"] = async_copy
        arms[f"{kind}: async after legacy"] = async_after_legacy
        kinds[kind] = (stream, src, outs, sess)

    # correctness: new source contents, each arm against the ORT-stream session's result
    bad = {}
    idle_violations = {}
    for k, fn in arms.items():
        kind = k.split(":")[0]
        for i in range(args.checks):
            x = rng.random(shape, dtype=np.float32)
            bsrc.update_inplace(x)
            raw()
            want = [o.numpy() for o in bouts]
            if kind in kinds:
                stream, src, outs, _ = kinds[kind]
                src.update_inplace(x)
                fn()
                q = rt.cudaStreamQuery(stream)[0]
                if int(q):
                    idle_violations[k] = idle_violations.get(k, 0) + 1
                got = [o.numpy() for o in outs]
            else:
                got = want
            if any(not np.array_equal(a, g) for a, g in zip(want, got)):
                bad[k] = bad.get(k, 0) + 1
    report["mismatches"] = bad
    report["stream_busy_after_run"] = idle_violations

    clock = time.perf_counter_ns
    samples = {k: [] for k in arms}
    names = list(arms)
    for _ in range(5):
        for k in names:
            arms[k]()
    for i in range(args.iters):
        order = names if i % 2 == 0 else names[::-1]
        for k in order:
            fn = arms[k]
            t0 = clock()
            fn()
            samples[k].append((clock() - t0) / 1e3)
    for k, xs in samples.items():
        report["arms"][k] = {"p50_us": round(statistics.median(xs), 2),
                             "p10_us": round(sorted(xs)[len(xs) // 10], 2)}
    print(json.dumps(report, indent=1))
    return 1 if bad or idle_violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
