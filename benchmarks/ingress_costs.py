#!/usr/bin/env python3
"""What a batching-tier replica spends per request on the steps the fifteenth session changed (issues 44, 45),
each beside what it replaced, timed in alternating blocks in one process (``benchmarks/paired.py``; no GPU,
no server: the tier's own code).

Arms (median µs per request over ``--iters`` calls each, and their ratio):

* ``http_parse``: :func:`ortcapture.serving.protocol.parse_infer_request` of a REST body (the reference model's
  1.2 MB float32 image behind a JSON header of odd length, as tritonclient sends it) with ``align=True`` (the old
  path: the unaligned image copied) against ``align=False`` (the tier's router now);
* ``grpc_decode``: :func:`ortcapture.serving.grpc_service.decode_infer` of a ``ModelInferRequest`` with the image in
  ``raw_input_contents``, against the old path emulated in the same run (the REST body joined, then parsed with the
  alignment copy);
* ``rest_shm`` (sixteenth session): a REST request whose image is in a system shared memory region (what
  ``tritonclient.http`` with shared memory sends: a JSON body only), ``ShmStore.prepare_http`` then
  ``parse_infer_request``: the region's bytes joined into a body (the old path) against passed as pieces;
* ``shm_lookup`` (needs Ray: a local cluster of 1 CPU): ``ActorRegistry.lookup`` of a registered region through the
  registry actor every time (the old path) against the lookup answered in the replica while the registry's count of
  changes has not moved.

Usage::

    python benchmarks/ingress_costs.py --iters 300 --out benchmarks/measured/cpu-ingress-costs-1207.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paired  # noqa: E402 - benchmarks/paired.py, beside this file
from ortcapture.serving import grpc_service, protocol  # noqa: E402
from ortcapture.serving.protocol import ModelSpec, TensorSpec  # noqa: E402

SPEC = ModelSpec(name="ref", inputs=(TensorSpec("images", np.dtype(np.float32), (-1, 3, 320, 320)),),
                 outputs=(TensorSpec("output0", np.dtype(np.float32), (-1, 22, 2100)),), batch_axes={"images": 0},
                 max_rows=8, max_body_bytes=64 << 20)


def _compare(old, new, iters: int) -> dict:
    t_old, t_new = paired.time_blocks(old, new, iters)
    return {"old_us": round(statistics.median(t_old), 1), "new_us": round(statistics.median(t_new), 1),
            "saved_us": round(statistics.median(t_old) - statistics.median(t_new), 1),
            "old_over_new": round(paired.median_ratio(t_old, t_new), 3)}


def http_parse(iters: int) -> dict:
    x = np.random.default_rng(0).random((1, 3, 320, 320), dtype=np.float32)
    head = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": list(x.shape),
                                   "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    head += b" " * ((1 - len(head)) % 4)  # an odd header length: the image starts unaligned
    body = head + x.tobytes()
    return _compare(lambda: protocol.parse_infer_request(body, len(head), SPEC),
                  lambda: protocol.parse_infer_request(body, len(head), SPEC, align=False), iters)


def grpc_decode(iters: int) -> dict:
    pb2 = grpc_service.pb2()
    x = np.random.default_rng(0).random((1, 3, 320, 320), dtype=np.float32)
    msg = pb2.ModelInferRequest(model_name="ref")
    t = msg.inputs.add(name="images", datatype="FP32", shape=list(x.shape))
    del t
    msg.raw_input_contents.append(x.tobytes())
    wire = msg.SerializeToString()

    def new():  # without a shared memory store decode_infer never waits: driven without an event loop's cost
        coro = grpc_service.decode_infer(grpc_service.message(wire, "ModelInferRequest"), SPEC)
        try:
            coro.send(None)
        except StopIteration:
            return
        raise RuntimeError("decode_infer waited")

    def old():  # what decode_infer did before: the REST body joined, then parsed (the image copied to align it)
        m = grpc_service.message(wire, "ModelInferRequest")
        raw = list(m.raw_input_contents)
        head = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 3, 320, 320],
                                       "parameters": {"binary_data_size": len(raw[0])}}],
                           "parameters": {"binary_data_output": True}}).encode()
        protocol.parse_infer_request(head + b"".join(raw), len(head), SPEC)

    return _compare(old, new, iters)


def _done(coro):
    """Drive a coroutine that never waits (a LocalRegistry's lookups), without an event loop's cost."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("the coroutine waited")


def rest_shm(iters: int) -> dict:
    from ortcapture.serving.shm_store import LocalRegistry, ShmStore

    x = np.random.default_rng(0).random((1, 3, 320, 320), dtype=np.float32)
    key = f"/ortc-bench-rest-{os.getpid()}"
    path = os.path.join("/dev/shm", key[1:])
    with open(path, "wb") as f:
        f.write(x.tobytes())
    store = ShmStore(LocalRegistry())
    try:
        _done(store.register("in", key, 0, x.nbytes, "127.0.0.1"))
        body = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": list(x.shape), "parameters": {
            "shared_memory_region": "in", "shared_memory_byte_size": x.nbytes}}]}).encode()

        def new():
            head, n, plan = _done(store.prepare_http(body, None, SPEC))
            protocol.parse_infer_request(head, n, SPEC, plan.device_inputs, plan.pieces, align=False)

        def old():  # the region's bytes joined after the header, then parsed (prepare_http before)
            head, n, plan = _done(store.prepare_http(body, None, SPEC))
            protocol.parse_infer_request(head + b"".join(plan.pieces), n, SPEC, plan.device_inputs, align=False)

        return _compare(old, new, iters)
    finally:
        store.close()
        os.unlink(path)


def shm_lookup(iters: int) -> dict | None:
    try:
        import ray
    except ImportError:
        return None
    from ortcapture.serving import shm_store

    key = f"/ortc-bench-{os.getpid()}"
    path = os.path.join("/dev/shm", key[1:])
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Replica:
            """Two ingress replicas' ActorRegistry in one Ray worker: one reads the registry's count of changes
            on this node (now), one calls the actor for every lookup (before)."""

            def __init__(self):
                name = f"bench-{os.getpid()}-shm"
                self.regs = {True: shm_store.ActorRegistry(name), False: shm_store.ActorRegistry(name, read_count=False)}

            async def setup(self, key):
                await self.regs[True].register("r", key, 0, 64)

            async def time(self, iters, read_count):
                reg, out = self.regs[read_count], []
                for _ in range(iters):
                    t0 = time.perf_counter_ns()
                    await reg.lookup(["r"])
                    out.append((time.perf_counter_ns() - t0) / 1000)
                return out

            async def calls(self):
                return {str(k): (r.lookups, r.calls) for k, r in self.regs.items()}

            async def stop(self):
                await self.regs[True].shutdown()

        rep = Replica.remote()
        ray.get(rep.setup.remote(key))
        t_old, t_new = [], []
        for _ in range(5):  # blocks by turns
            t_old += ray.get(rep.time.remote(iters // 5, False))
            t_new += ray.get(rep.time.remote(iters // 5, True))
        calls = ray.get(rep.calls.remote())
        ray.get(rep.stop.remote())
        return {"lookups_and_actor_calls": calls, "old_us": round(statistics.median(t_old), 1),
                "new_us": round(statistics.median(t_new), 1),
                "old_over_new": round(statistics.median(t_old) / statistics.median(t_new), 1)}
    finally:
        ray.shutdown()
        os.unlink(path)


def measure(iters: int) -> dict:
    return {"http_parse": http_parse(iters), "grpc_decode": grpc_decode(iters), "rest_shm": rest_shm(iters),
            "shm_lookup": shm_lookup(iters)}


if __name__ == "__main__":
    sys.exit(paired.main(__doc__, measure))
