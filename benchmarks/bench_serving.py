#!/usr/bin/env python3
"""Serving numbers for issues 29 and 44: ``ortcapture serve``'s deployments against what a user writes instead,
YOLOv8n (nudenet 320n), clients in separate processes sending one image per request.

Arms (server side; one Ray Serve application each, deployed in turn on one local Ray cluster):
  noop1..noop8   a hand-written no-op deployment (answers an empty "outputs", runs no model) with 1/2/4/8 replicas:
                 Ray's ceiling for the request alone
  noop4-out      the no-op with 4 replicas answering zeros of the model's outputs' shapes (the reference
                 model: 185 KB a row): Ray's ceiling for a request AND its answer, which every deployment sends back
  hand-buckets   hand-written (~30 lines, below): @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.002), the
                 requests concatenated, one ortcapture.InferenceSession(buckets=[1,2,4,8]), rows sliced back
  hand-padded    the same with a plain onnxruntime.InferenceSession, every batch padded to 8 rows
  product        ortcapture serve's deployments with their defaults (the batching tier "Model" in front of one
                 "ModelSession" replica)
  product-2rep   the same with 2 session replicas at 0.5 GPU each
  product-tput   the product with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 in its replicas' runtime_env (Ray Serve's own
                 throughput settings: user code on the replica's event loop, fewer log writes, gRPC between
                 replicas); since 2026-12-06 the product's default, so the same as "product" (kept to re-run the
                 runs that measured it, which also had the mode's direct ingress on and Ray's 4 MiB gRPC cap)
  product-notput the product with Ray Serve's default threads in its replicas (serve_throughput_optimized=False;
                 until 2026-12-06 the default, measured as "product" in the JSON of earlier dates)
  product-sep0   only the thread hops of those settings (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0,
                 RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 in the replicas)
  product-gil5 / product-gil01 / product-t1 / product-i2 / product-i2t1 / product-noslots
                 the product with one setting changed: Python's 5 ms GIL switch interval; 0.1 ms; one batch in flight per
                 tier replica; 2 tier replicas; both of the last two; batches by value through Ray's object store
                 instead of the batch slots (node-local shared memory)
  product-st1 / product-stpin
                 the session replica's host copies: one staging thread (ORTCAPTURE_STAGING_THREADS=1), or the
                 staging threads pinned to CPUs (ORTCAPTURE_STAGING_PIN=1), in every replica's environment
  product-noreg  the batch slots not page-locked by the session replica (ORTCAPTURE_REGISTER=0: a batch's rows are
                 copied into the graph's staging, then sent, and its outputs copied into the slot; the default since
                 2026-12-07 sends the rows with one DMA and reads the outputs into the slot with one DMA)
  product-inline the replicas' answers up to 4 MiB returned inline by Ray (RAY_max_direct_call_object_size)
  product-prefetch / product-noprefetch  the next merged run joined on a thread of its own while one runs
                 (merge_prefetch=True; the default from 2026-12-07 until the thirteenth session measured it slower),
                 or right before each run on the replay thread (merge_prefetch=False: the default since then, so the
                 same as "product")
  product-i6 / product-i8  6 or 8 batching-tier replicas instead of the default 4
  product-listed a merged run's rows in page-locked batch slots copied to the device one DMA per part
                 (merge_listed=True) instead of joined on the host first (the default)
  product-2rep-listed  product-2rep with merge_listed=True
Each product run also records where a batch's time went (``session``): the tier's Ray calls to the session
replicas (count, mean round trip ms), the time those calls spent inside the session replicas (arrival to answer,
and arrival to the start of their round on the replay thread) and the session replicas' own time per batch run
(mean ms; and per batch-8 run, ``run8_ms``, against ``run8_plain``: the same bucket session's batch-8 ``run()``
timed in this process before Ray starts), from ``/stats``, and where the machine's CPU time went during the
measurement (``cpu``: cores used per process group, benchmarks/cpu_use.py; ``--py-spy-level N`` records stacks).
The hand-written arms are reached through a handle only (they have no HTTP routes). Per arm, client level and
path (``handle``: a Ray ``DeploymentHandle`` to the ``Model`` deployment; ``http``: ``tritonclient.http`` binary
tensors to the Open Inference Protocol; ``grpc``: ``tritonclient.grpc`` raw tensors through Ray Serve's gRPC proxy;
``shm``: ``tritonclient.grpc`` with the image and the answer in system shared memory regions registered once per
client, ``tritonclient.utils.shared_memory``; ``cudashm``: the same with CUDA regions on device 0
(``tritonclient.utils.cuda_shared_memory``: the image copied host to device by the client per request, as a client
whose data starts on the host does); ``http-shm`` and ``http-cudashm``: the same two through ``tritonclient.http``
(the request's body then only names the regions); ``http-stalled``: ``http`` measured while ``--stalled`` (1,100)
other connections send an infer request's headers and stall; the last three with ``--paths
handle,http,grpc,shm,http-stalled``): images/s, p50/p99
latency (ms),
the batch-size histogram (rows per batch run, from the replicas' reports), and every response checked against the
CPU EP's answer for the same image (4 fixed images; a response off by more than 1e-2 of the output's max counts as
wrong). Clients: up to 8 processes (one thread per client each: 32 clients = 8 x 4), started once, connected to
the cluster once. Writes serving.json (+ serving.png with matplotlib) to --out (default $OUT).

Usage (H200): python benchmarks/bench_serving.py --model PATH/320n.onnx [--seconds 3] --arms product,hand-buckets
Quick CPU check: python benchmarks/bench_serving.py --provider cpu --arms product,noop1 --levels 1,4 --seconds 1 ...
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import threading
import time
import urllib.request

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_use  # noqa: E402 - benchmarks/cpu_use.py, beside this file

ARMS = {**{f"noop{n}": {"hand": "noop", "replicas": n} for n in (1, 2, 4, 8)},
        "noop4-out": {"hand": "noop-out", "replicas": 4},
        "hand-buckets": {"hand": "buckets"}, "hand-padded": {"hand": "padded"},
        "product": {}, "product-2rep": {"replicas": 2, "gpus_per_replica": 0.5},
        # Ray Serve's throughput-optimised settings, in the replicas' runtime_env only (issue 44, item 3)
        "product-tput": {"env": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}},
        # Ray Serve's default threads in the replicas (the product's default before 2026-12-06)
        "product-notput": {"serve_throughput_optimized": False},
        # only the two thread hops of those settings: user code on the replica's own event loop, the handle's router
        # on the caller's loop (no gRPC between replicas, no direct ingress)
        "product-sep0": {"serve_throughput_optimized": False,
                         "env": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                                 "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}},
        # one setting changed each, against "product" in the same run (issue 44: where a request's time goes)
        "product-gil5": {"switch_interval_ms": 0}, "product-gil01": {"switch_interval_ms": 0.1},
        "product-t1": {"max_concurrent_batches": 1},
        "product-i2": {"ingress_replicas": 2}, "product-i2t1": {"ingress_replicas": 2, "max_concurrent_batches": 1},
        # more batching-tier replicas than the default's 4 (each used ~1 core at 32 clients on the H100, 2026-12-07)
        "product-i6": {"ingress_replicas": 6}, "product-i8": {"ingress_replicas": 8},
        "product-noslots": {"batch_slots": False},
        # merged runs joined on the replay thread right before each run, as before 2026-12-07 (twelfth session)
        "product-noprefetch": {"merge_prefetch": False}, "product-prefetch": {"merge_prefetch": True},
        # merged runs' rows in page-locked slots copied to the device one DMA per part (merge_listed), instead of
        # joined on the host first (into the merge scratch, one DMA): the default until measured on a GPU
        "product-listed": {"merge_listed": True},
        # two session replicas on the one GPU (each its own process, GIL and graphs), with merge_listed
        "product-2rep-listed": {"replicas": 2, "gpus_per_replica": 0.5, "merge_listed": True},
        # the session replica's host copies under load (issue 44, item 4: its batch-8 run 1.8x a plain process's):
        # one staging thread (the replay thread copies alone), or the staging threads pinned to CPUs
        "product-st1": {"env": {"ORTCAPTURE_STAGING_THREADS": "1"}},
        # the batch slots not page-locked in the session replica (ORTCAPTURE_REGISTER=0: rows copied into the graph's
        # staging first, as before 2026-12-07), and Ray returning answers up to 4 MiB inline instead of through its
        # object store
        "product-noreg": {"env": {"ORTCAPTURE_REGISTER": "0"}},
        "product-inline": {"env": {"RAY_max_direct_call_object_size": str(4 << 20)}},
        "product-stpin": {"env": {"ORTCAPTURE_STAGING_PIN": "1"}}}
TOL = 1e-2
GRPC_PATHS = ("grpc", "shm", "cudashm")  # the paths that speak gRPC (tritonclient.grpc)
PREPARED_PATHS = GRPC_PATHS + ("http-shm", "http-cudashm")  # a client per thread, regions registered once


# -- what a user writes instead (handle only; ~30 lines each) -------------------------------------------------------
def _user_session(model, provider, dims, capture, buckets=None, input_name=None, replay_thread=True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    for name, size in dims.items():
        so.add_free_dimension_override_by_name(name, size)
    if provider == "cuda":
        providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1" if capture else "0"}), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    if buckets:
        import ortcapture

        return ortcapture.InferenceSession(model, so, providers=providers, buckets={(input_name, 0): buckets},
                                           replay_thread=replay_thread)
    return ort.InferenceSession(model, so, providers=providers)


def _plain_run8(model, provider, dims, input_name, shape, n):
    """A batch-8 ``run()`` through buckets [1, 2, 4, 8] in this plain process (no Ray), a new array each call
    (8 arrays in turn): ``{"p50_ms", "mean_ms", "runs"}`` — what the session replica's batch-8 run is measured
    against (issue 44, item 4: within 1.2x under load)."""
    import gc

    sess = _user_session(model, provider, dims, provider != "cpu", [1, 2, 4, 8], input_name, replay_thread=False)
    rng = np.random.default_rng(8)
    arrays = [rng.random((8, *shape[1:]), dtype=np.float32) for _ in range(8)]
    for x in arrays:  # warm-up: every array once
        sess.run(None, {input_name: x})
    times = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        sess.run(None, {input_name: arrays[i % len(arrays)]})
        times.append(time.perf_counter_ns() - t0)
    del sess
    gc.collect()
    return {"p50_ms": round(float(np.median(times)) / 1e6, 3), "mean_ms": round(float(np.mean(times)) / 1e6, 3),
            "runs": n}


def _user_deployments():
    """The two hand-written deployments of issue 44 and the no-op one, as classes for ``serve.deployment``."""
    from ray import serve

    class UserBuckets:
        def __init__(self, model, provider, dims, input_name):
            self.sess = _user_session(model, provider, dims, provider != "cpu", [1, 2, 4, 8], input_name)
            self.input = input_name
            shape = [1, *(d if isinstance(d, int) else dims.get(d, 1) for d in self.sess.get_inputs()[0].shape[1:])]
            self.sess.warmup({input_name: np.zeros(shape, np.float32)})  # every bucket captured before traffic

        @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.002)
        async def infer(self, requests: list[dict]) -> list[dict]:
            rows = [r[self.input].shape[0] for r in requests]
            out = self.sess.run(None, {self.input: np.concatenate([r[self.input] for r in requests])})
            names = [o.name for o in self.sess.get_outputs()]
            answers, start = [], 0
            for n in rows:
                answers.append({"outputs": {k: v[start:start + n] for k, v in zip(names, out)}})
                start += n
            return answers

    class UserPadded(UserBuckets):
        def __init__(self, model, provider, dims, input_name):
            self.sess = _user_session(model, provider, dims, False)
            self.input = input_name

        @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.002)
        async def infer(self, requests: list[dict]) -> list[dict]:
            rows = [r[self.input].shape[0] for r in requests]
            x = np.concatenate([r[self.input] for r in requests])
            x = np.concatenate([x, np.zeros((8 - x.shape[0], *x.shape[1:]), x.dtype)]) if x.shape[0] < 8 else x
            out = self.sess.run(None, {self.input: x})
            names = [o.name for o in self.sess.get_outputs()]
            answers, start = [], 0
            for n in rows:
                answers.append({"outputs": {k: v[start:start + n] for k, v in zip(names, out)}})
                start += n
            return answers

    class UserNoop:
        def __init__(self, *args):
            pass

        async def infer(self, request: dict) -> dict:
            return {"outputs": {}}

    class UserNoopOut:
        def __init__(self, model, provider, dims, input_name):
            import onnxruntime as ort

            so = ort.SessionOptions()
            for name, size in dims.items():
                so.add_free_dimension_override_by_name(name, size)
            cpu = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            shape = [1, *(d if isinstance(d, int) else dims.get(d, 1) for d in cpu.get_inputs()[0].shape[1:])]
            row = cpu.run(None, {input_name: np.zeros(shape, np.float32)})  # one row's outputs: their shapes
            self.zeros = {o.name: np.zeros((8, *v.shape[1:]), v.dtype) for o, v in zip(cpu.get_outputs(), row)}
            self.input = input_name

        async def infer(self, request: dict) -> dict:
            n = request[self.input].shape[0]
            return {"outputs": {k: v[:n] for k, v in self.zeros.items()}}

    return {"buckets": UserBuckets, "padded": UserPadded, "noop": UserNoop, "noop-out": UserNoopOut}


def _images(shape, n=4):
    rng = np.random.default_rng(0)
    return [rng.random(shape, dtype=np.float32) for _ in range(n)]


# -- client processes -----------------------------------------------------------------------------------------------
def _client_main(conn, address, shape, refs, input_name, output_name, model_name):
    """A client process: waits for ("handle"|"http", app, url, threads, seconds) and answers with the latencies (s)
    of every request each thread sent in a closed loop, and the count of wrong answers."""
    import ray
    from ray import serve

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    images = _images(shape)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        path, app, url, threads, seconds, warm, check = msg
        lat, wrong, errors = [], [0], []
        lock = threading.Lock()
        # the gRPC clients (and the shm paths' regions, registered once per client) are set up before the clock, here
        # (tritonclient's CUDA regions make its one CUDA stream on first use: not from several threads at once)
        try:
            prepared = {k: _grpc_call(path, url, k, input_name, output_name, model_name, images[0].nbytes,
                                      refs[0].nbytes, refs[0].shape) for k in range(threads)} \
                if path in PREPARED_PATHS else {}
        except Exception as exc:  # noqa: BLE001 - the cell fails, counted; this process stays for the next ones
            conn.send({"latencies": [], "wrong": 0, "errors": [f"set-up: {exc!r}"[:200]], "n_errors": threads})
            continue
        t_end = time.perf_counter() + warm + seconds
        t_meas = time.perf_counter() + warm

        def run_thread(k):
            try:
                _run_thread(k)
            except Exception as exc:  # noqa: BLE001 - a thread that died is an error of the cell, not a silent gap
                with lock:
                    errors.append(f"thread {k}: {exc!r}"[:200])

        def _run_thread(k):
            mine, cleanup = [], None
            if path == "handle":
                handle = serve.get_deployment_handle("Model", app)

                def call(x):
                    r = handle.infer.remote({input_name: x}).result(timeout_s=60)
                    if "error" in r:
                        raise RuntimeError(r["error"])
                    return r["outputs"].get(output_name) if check else None
            elif path in PREPARED_PATHS:
                call, cleanup = prepared[k]
            else:
                import tritonclient.http as http

                client = http.InferenceServerClient(url.replace("http://", ""), network_timeout=60,
                                                    connection_timeout=60)

                def call(x):
                    inp = http.InferInput(input_name, list(x.shape), "FP32")
                    inp.set_data_from_numpy(x, binary_data=True)
                    out = http.InferRequestedOutput(output_name, binary_data=True)
                    return client.infer(model_name, [inp], outputs=[out]).as_numpy(output_name)
            i = k
            while True:
                t0 = time.perf_counter()
                if t0 > t_end:
                    break
                j = i % len(images)
                try:
                    y = call(images[j])
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    with lock:
                        errors.append(repr(exc)[:200])
                    time.sleep(0.01)
                    continue
                t1 = time.perf_counter()
                ref = refs[j]
                if check and (y.shape != ref.shape or not np.allclose(y, ref, rtol=0,
                                                                      atol=TOL * float(np.abs(ref).max()))):
                    with lock:
                        wrong[0] += 1
                if t0 >= t_meas:
                    mine.append(t1 - t0)
                i += 1
            with lock:  # kept whatever the clean-up does
                lat.extend(mine)
            if cleanup is not None:
                try:
                    cleanup()
                except Exception as exc:  # noqa: BLE001 - counted and reported, the thread's latencies kept
                    with lock:
                        errors.append(f"clean-up: {exc!r}"[:200])

        ts = [threading.Thread(target=run_thread, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        conn.send({"latencies": lat, "wrong": wrong[0], "errors": errors[:5], "n_errors": len(errors)})
    ray.shutdown()


def _answer(conn, threads: int) -> dict:
    """A client process's answer for a cell; one that died meanwhile answers with every thread an error."""
    try:
        return conn.recv()
    except EOFError:
        return {"latencies": [], "wrong": 0, "errors": ["the client process is gone"], "n_errors": threads}


def _grpc_call(path, url, k, input_name, output_name, model_name, in_bytes, out_bytes, out_shape):
    """One client thread's call for the ``grpc`` path (raw tensors) or a shared memory path (the image written to
    this client's input region, the answer read from its output region: both registered once, here): ``shm`` and
    ``cudashm`` through ``tritonclient.grpc``, ``http-shm`` and ``http-cudashm`` through ``tritonclient.http`` (the
    request then carries only the regions' names: its JSON body is ~300 bytes)."""
    if path.startswith("http-"):
        import tritonclient.http as http

        client = _PerThread(lambda: http.InferenceServerClient(url.replace("http://", ""), network_timeout=60,
                                                               connection_timeout=60))
        return _shm_call(client, http, path.endswith("cudashm"), k, input_name, output_name, model_name, in_bytes,
                         out_bytes, out_shape)
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    if path == "grpc":
        def call(x):
            inp = grpcclient.InferInput(input_name, list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            return client.infer(model_name, [inp], outputs=[grpcclient.InferRequestedOutput(output_name)],
                                client_timeout=60).as_numpy(output_name)
        return call, client.close
    return _shm_call(client, grpcclient, path == "cudashm", k, input_name, output_name, model_name, in_bytes,
                     out_bytes, out_shape)


class _PerThread:
    """A ``tritonclient.http`` client per thread behind one object (geventhttpclient's clients work only in the
    thread that made them): regions registered from the process's main thread, requests sent from a client thread."""

    def __init__(self, make):
        self._make, self._local = make, threading.local()

    def __getattr__(self, name):
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._make()
        return getattr(client, name)


#: shared memory set-ups of this client process: each one's region names are its own (``b<pid>-<n>-<k>``)
_SETUPS = itertools.count()


def _shm_call(client, lib_client, cuda, k, input_name, output_name, model_name, in_bytes, out_bytes, out_shape):
    """A shared memory path through ``client`` (of ``lib_client``: ``tritonclient.grpc`` or ``tritonclient.http``,
    which share these calls): system shared memory (``cuda`` false, ``tritonclient.utils.shared_memory``) or CUDA
    regions on device 0 (``tritonclient.utils.cuda_shared_memory``; the client copies the image host to device per
    request): the image written to this client's input region, the answer read from its output region, both
    registered once, here."""
    if cuda:
        import tritonclient.utils.cuda_shared_memory as lib

        tag = f"c{os.getpid()}-{next(_SETUPS)}-{k}"
        regions = [lib.create_shared_memory_region(f"{tag}-{io}", n, 0) for io, n in (("in", in_bytes),
                                                                                        ("out", out_bytes))]
        # written once here, before the client threads start: tritonclient makes its one CUDA stream per device on
        # first use, and two threads doing so at once destroy the other's (a segfault in the client, on an H100)
        lib.set_shared_memory_region(regions[0], [np.zeros(in_bytes, np.uint8)])
        for (io, n), h in zip((("in", in_bytes), ("out", out_bytes)), regions):
            client.register_cuda_shared_memory(f"{tag}-{io}", lib.get_raw_handle(h), 0, n)

        def unregister(name):  # looked up in the thread that calls it: a _PerThread's client is that thread's own
            client.unregister_cuda_shared_memory(name)
    else:
        import tritonclient.utils.shared_memory as lib

        tag = f"b{os.getpid()}-{next(_SETUPS)}-{k}"
        regions = [lib.create_shared_memory_region(f"{tag}-{io}", f"/{tag}-{io}", n) for io, n in
                   (("in", in_bytes), ("out", out_bytes))]
        for io, n in (("in", in_bytes), ("out", out_bytes)):
            client.register_system_shared_memory(f"{tag}-{io}", f"/{tag}-{io}", n)

        def unregister(name):  # (as above)
            client.unregister_system_shared_memory(name)
    hin, hout = regions
    out = lib_client.InferRequestedOutput(output_name)
    out.set_shared_memory(f"{tag}-out", out_bytes)
    timeout = {"client_timeout": 60} if lib_client.__name__.endswith("grpc") else {}  # http: network_timeout

    def call(x):
        lib.set_shared_memory_region(hin, [x])
        inp = lib_client.InferInput(input_name, list(x.shape), "FP32")
        inp.set_shared_memory(f"{tag}-in", in_bytes)
        client.infer(model_name, [inp], outputs=[out], **timeout)
        return np.array(lib.get_contents_as_numpy(hout, np.float32, list(out_shape)))

    def cleanup():
        failed = []
        for step in [lambda n=name: unregister(n) for name in (f"{tag}-in", f"{tag}-out")] + \
                [lambda h=h: lib.destroy_shared_memory_region(h) for h in regions] + [client.close]:
            try:  # each step whatever the others did: a region left registered would refuse the next cell's
                step()
            except Exception as exc:  # noqa: BLE001 - raised together below
                failed.append(repr(exc)[:100])
        if failed:
            raise RuntimeError("; ".join(failed))
    return call, cleanup


def _commit() -> str | None:
    """The code's commit: ``git describe --always --dirty`` (``-dirty``: the tree had changes not committed, as it
    has when numbers are measured before their commit), else ``.gpu/commit.txt`` (what tools/device_run.sh carries to
    a device machine, whose copy of the tree may have no ``.git``), else ``None``."""
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open(os.path.join(ROOT, ".gpu", "commit.txt")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _stats(url, model_name):
    try:
        with urllib.request.urlopen(f"{url}/v2/models/{model_name}/stats", timeout=10) as r:
            return json.loads(r.read())["model_stats"][0]
    except Exception as exc:  # noqa: BLE001 - reported in the results
        return {"error": repr(exc)}


def _histogram(stats) -> dict:
    h = {}
    for rep in stats.get("ortcapture", {}).get("replicas", []):
        for k, v in (rep.get("batch_size_histogram") or {}).items():
            h[int(k)] = h.get(int(k), 0) + v
    return h


class _Stalled:
    """``n`` connections to ``url`` that each send an infer request's headers (``Content-Length`` 1.2 MB) and 16
    bytes of its body, then stall — opened when the block starts, closed when it ends (bounded in count and time:
    each connect waits at most 2 s). The faults issue's stalled-body clients, beside a measured HTTP run."""

    def __init__(self, url: str | None, model: str, n: int):
        self.n = int(n) if url else 0
        self.url, self.model = url, model
        self.socks: list = []
        self.opened = 0

    def __enter__(self):
        if not self.n:
            return self
        import resource
        import socket
        from urllib.parse import urlparse

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < self.n + 256:  # this process holds the sockets
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, self.n + 1024), hard))
        u = urlparse(self.url)
        head = (f"POST /v2/models/{self.model}/infer HTTP/1.1\r\nHost: {u.hostname}\r\n"
                "Content-Type: application/octet-stream\r\nInference-Header-Content-Length: 64\r\n"
                "Content-Length: 1228864\r\n\r\n").encode() + b"\0" * 16
        deadline = time.monotonic() + 60
        for _ in range(self.n):
            if time.monotonic() > deadline:
                break
            try:
                s = socket.create_connection((u.hostname, u.port), timeout=2)
                s.sendall(head)
                s.setblocking(False)
            except OSError:
                continue
            self.socks.append(s)
        self.opened = len(self.socks)
        return self

    def held(self) -> int:
        """Connections the server still holds without an answer (one answered — a 503 or 408 — or closed is not)."""
        n = 0
        for s in self.socks:
            try:
                s.recv(1 << 16)  # an answer or EOF: the server let go of it
            except BlockingIOError:
                n += 1  # nothing to read: still waiting for its body
            except OSError:
                pass
        return n

    def __exit__(self, *exc):
        for s in self.socks:
            s.close()
        self.socks = []
        return False


def _where(after: dict, before: dict) -> dict:
    """Where a batch's time went between two ``/stats`` reads: the tier's calls to the session replicas
    (``calls``, mean round trip ``rtt_ms``) and the session replicas' own time per batch (``run_ms``); the
    difference is Ray's hop both ways and the wait in the session replica's queue."""
    def ingress(s):
        return s.get("ortcapture", {}).get("ingress", {}) if isinstance(s, dict) else {}

    def compute(s):
        return (s.get("inference_stats", {}) or {}).get("compute_infer", {}) if isinstance(s, dict) else {}

    calls = ingress(after).get("session_calls", 0) - ingress(before).get("session_calls", 0)
    rtt = ingress(after).get("session_call_ns", 0) - ingress(before).get("session_call_ns", 0)
    runs = compute(after).get("count", 0) - compute(before).get("count", 0)
    run_ns = compute(after).get("ns", 0) - compute(before).get("ns", 0)
    def ms(ns, n):
        return round(ns / n / 1e6, 3) if n else None

    inside = _sum(after, "calls") - _sum(before, "calls")
    full = _rows_stat(after, "8") - _rows_stat(before, "8")
    return {"calls": calls, "rtt_ms": ms(rtt, calls), "run_ms": ms(run_ns, runs),
            # inside the session replicas: arrival to answer, and arrival to the start of the call's round
            "in_replica_ms": ms(_sum(after, "call_ns") - _sum(before, "call_ns"), inside),
            "wait_ms": ms(_sum(after, "wait_ns") - _sum(before, "wait_ns"), inside),
            # a batch-8 run in the replica (feed, replay, outputs back), against the plain process's (run8_plain_ms)
            "run8_ms": ms(full[1], full[0]), "runs8": int(full[0])}


def _rows_stat(stats: dict, rows: str) -> np.ndarray:
    """``[count, ns]`` of the session replicas' runs of ``rows`` rows (their ``batch_stats``), summed."""
    got = np.zeros(2, dtype=np.int64)
    for r in stats.get("ortcapture", {}).get("replicas", []) if isinstance(stats, dict) else []:
        b = (r.get("batch_stats") or {}).get(rows) or {}
        got += [int(b.get("count") or 0), int(b.get("ns") or 0)]
    return got


def _sum(stats: dict, key: str) -> int:
    """``key`` summed over the session replicas' reports."""
    return sum(int(r.get(key) or 0) for r in stats.get("ortcapture", {}).get("replicas", []))


def _diff(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] - before.get(k, 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="YOLOv8n ONNX file (default: the cached reference model, nudenet 320n)")
    ap.add_argument("--provider", default="cuda", choices=["cuda", "webgpu", "cpu"])
    ap.add_argument("--arms", default="noop1,noop4,hand-buckets,hand-padded,product",
                    help=f"comma-separated, from {list(ARMS)}")
    ap.add_argument("--levels", default="1,8,32,64", help="concurrent clients")
    ap.add_argument("--paths", default="handle,http")
    ap.add_argument("--stalled", type=int, default=1100,
                    help="connections that send headers and stall beside each 'http-stalled' run (path http-stalled: "
                         "HTTP like 'http', measured while they are held; default 1100)")
    ap.add_argument("--stalled-settle", type=float, default=0.0,
                    help="seconds between opening the stalled connections and the measured clients' start (default "
                    "0: measured in the burst itself; the server refuses or evicts most of them within seconds)")
    ap.add_argument("--all-paths-arms", default=None,
                    help="comma-separated arms measured on every --paths; the others on the handle only (default: "
                         "every arm on every path)")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per arm, level and path")
    ap.add_argument("--repeats", type=int, default=1, help="measurements per arm, level and path (the JSON keeps "
                    "each; the log and plot show the median images/s)")
    ap.add_argument("--warm", type=float, default=0.7, help="unmeasured seconds before each measurement")
    ap.add_argument("--procs", type=int, default=8, help="client processes (at most)")
    ap.add_argument("--buckets", default="1,2,4,8")
    ap.add_argument("--batch-wait-ms", type=float, default=2.0)
    ap.add_argument("--dims", default="height=320,width=320",
                    help="the model's other dynamic dims, NAME=SIZE,... (default the 320x320 images)")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--grpc-port", type=int, default=8012, help="the gRPC port (paths grpc and shm)")
    ap.add_argument("--num-gpus", type=int, default=None,
                    help="GPUs of the local Ray cluster (default: Ray detects them; 0 without CUDA)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--plain-runs", type=int, default=200,
                    help="batch-8 runs timed in this process before Ray starts (the session replica's run8_ms is "
                    "compared with them: issue 44, item 4); 0 skips them")
    ap.add_argument("--py-spy-level", type=int, default=None,
                    help="at this client level (first repeat, --py-spy-paths, product arms): py-spy records the "
                         "session replicas and one tier replica during the measurement (raw collapsed stacks in --out)")
    ap.add_argument("--py-spy-paths", default="handle",
                    help="the paths --py-spy-level records, comma-separated (default handle)")
    ap.add_argument("--py-spy-bin", default="py-spy", help="the py-spy executable")
    ap.add_argument("--smoke", action="store_true", help="only start Ray, one noop replica, one request; say where "
                    "Ray's object store and session live")
    args = ap.parse_args()

    import onnxruntime as ort

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the cluster on 127.0.0.1 (see `ortcapture serve`)
    import ray

    from ortcapture.cli import models
    from ortcapture.serving import deployment, grpc_service
    from ortcapture.serving.config import ServeOptions, model_layout

    os.makedirs(args.out, exist_ok=True)
    model = args.model or str(models.reference_model())
    dims = {k: int(v) for k, v in (kv.split("=") for kv in args.dims.split(",") if kv)}
    levels = [int(x) for x in args.levels.split(",")]
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}: from {list(ARMS)}")
    paths = [p for p in args.paths.split(",") if p]
    known = {"handle", "http", "http-stalled"} | set(PREPARED_PATHS)
    if set(paths) - known:
        ap.error(f"unknown path(s) {sorted(set(paths) - known)}")
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)  # noqa: E731

    grpc_port = args.grpc_port if set(GRPC_PATHS) & set(paths) else None
    base = ServeOptions(model, name="yolo", buckets=args.buckets, provider=args.provider, port=args.port,
                        grpc_port=grpc_port,
                        batch_wait_ms=args.batch_wait_ms, dims=dims,
                        graceful_shutdown_s=2.0).checked()
    layout = model_layout(base)
    (input_name, _, in_shape), = [(s.name, s.dtype, s.shape) for s in layout.spec.inputs]
    output_name = layout.spec.outputs[0].name
    shape = tuple(1 if d < 0 else d for d in in_shape)
    cpu = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    refs = [cpu.run([output_name], {input_name: x})[0] for x in _images(shape)]
    log(f"model {model}, input {input_name} {shape}, CPU EP references for 4 images")
    plain = None  # the hand-written session captures on CUDA only (its CPU arm runs plain ORT, no buckets)
    if args.plain_runs and args.provider == "cuda":
        plain = _plain_run8(model, args.provider, dims, input_name, shape, args.plain_runs)
    if plain:
        log(f"plain process, buckets run() at 8 rows, a new array each call: {plain}")

    num_gpus = args.num_gpus if args.num_gpus is not None else (None if args.provider == "cuda" else 0)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env=grpc_service.proxy_runtime_env(base),  # the gRPC proxy on --host, as ortcapture serve
             **({} if num_gpus is None else {"num_gpus": num_gpus}))
    if args.provider == "cuda" and not ray.cluster_resources().get("GPU"):
        log("Ray sees no GPU: pass --num-gpus N")
        return 2
    ctx = ray.get_runtime_context()
    address = ray.get_runtime_context().gcs_address
    node = ray.nodes()[0]
    import shutil

    where = {"gcs": address, "dev_shm_free_bytes": shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm")
             else None,
             "object_store_bytes": node.get("Resources", {}).get("object_store_memory"),
             "plasma": node.get("ObjectStoreSocketName"), "resources": ray.cluster_resources(),
             "job": ctx.get_job_id()}
    log(f"Ray up: {where}")
    results = {"model": model, "provider": args.provider, "dims": dims, "buckets": list(base.buckets),
               "batch_wait_ms": args.batch_wait_ms, "seconds": args.seconds, "ray": where, "runs": [],
               "onnxruntime": ort.__version__, "ray_version": ray.__version__, "run8_plain": plain,
               "commit": _commit()}
    if args.smoke:
        opts = ServeOptions(**{**base.__dict__, "app_name": "smoke"}).checked()
        url = deployment.start(opts, args.provider, on_status=log)
        x = _images(shape, 1)[0]
        r = deployment.model_handle(opts.app_name).infer.remote({input_name: x}).result(timeout_s=60)
        log(f"smoke: one noop request answered {sorted(r.get('outputs', r))}; stats {_stats(url, 'yolo').get('name')}")
        results["smoke"] = {"ok": "outputs" in r}
        deployment.stop(opts)
        json.dump(results, open(os.path.join(args.out, "serving_smoke.json"), "w"), indent=1, default=str)
        return 0

    # Serve once, with the product's HTTP and gRPC options: the hand-written arms (serve.run) would otherwise start
    # it on Serve's default port first, and Serve keeps its first options
    deployment.ray_serve.start(http_options={"host": base.host, "port": base.port}, proxy_location="HeadOnly",
                               **({"grpc_options": grpc_service.grpc_options(base)} if grpc_port else {}))
    nproc = min(args.procs, max(levels))
    ctx_mp = mp.get_context("spawn")
    clients = []
    for _ in range(nproc):
        a, b = ctx_mp.Pipe()
        p = ctx_mp.Process(target=_client_main, args=(b, address, shape, refs, input_name, output_name, "yolo"),
                           daemon=True)
        p.start()
        b.close()  # the child's end: a client process that dies is an EOFError here, not a wait for ever
        clients.append((p, a))
    log(f"{nproc} client processes")
    named = {**{p.pid: "client" for p, _ in clients}, os.getpid(): "bench driver"}  # cpu_use's groups by pid

    user = _user_deployments()
    for arm in arms:
        spec = dict(ARMS[arm])
        hand = spec.pop("hand", None)
        opts = ServeOptions(**{**base.__dict__, **spec, "app_name": f"bench-{arm}".replace("_", "-")}).checked()
        t0 = time.perf_counter()
        try:
            if hand:  # what a user writes instead: one deployment named Model, handle only
                gpus = 1 if args.provider == "cuda" and not hand.startswith("noop") else 0
                dep = deployment.ray_serve.deployment(user[hand], name="Model", num_replicas=spec.get("replicas", 1),
                                                      max_ongoing_requests=64,
                                                      ray_actor_options={"num_gpus": gpus, "num_cpus": 1})
                deployment.ray_serve.run(dep.bind(model, args.provider, dims, input_name), name=opts.app_name,
                                         route_prefix=None)
                url = None
            else:
                url = deployment.start(opts, args.provider, on_status=None, startup_timeout_s=150)
        except Exception as exc:  # noqa: BLE001 - recorded, next arm
            log(f"arm {arm}: failed to start: {exc}")
            results["runs"].append({"arm": arm, "error": str(exc)})
            deployment.ray_serve.shutdown()
            continue
        startup = time.perf_counter() - t0
        log(f"arm {arm} up in {startup:.1f} s ({ARMS[arm]})")
        app = opts.app_name  # the handle's deployment "Model": the batching tier, or the hand-written one
        for level in levels:
            if arm == "product-2rep" and level == 1:
                continue
            procs = min(nproc, level)
            per = [level // procs + (1 if k < level % procs else 0) for k in range(procs)]
            wide = args.all_paths_arms is None or arm in args.all_paths_arms.split(",")
            for path, rep in ((p, k) for p in paths if (url and wide) or p == "handle" for k in range(args.repeats)):
                before = _stats(url, "yolo") if url else {}
                stalled = _Stalled(url, "yolo", args.stalled if path == "http-stalled" else 0)
                with stalled:
                    if stalled.n and args.stalled_settle:  # past the burst: measured beside those still held
                        time.sleep(args.stalled_settle)
                    for (p, conn), n in zip(clients, per):
                        target = f"{base.host}:{grpc_port}" if path in GRPC_PATHS else url
                        conn.send(("http" if path == "http-stalled" else path, app, target, n, args.seconds,
                                   args.warm, not (hand or "").startswith("noop")))
                    time.sleep(args.warm)  # the clients' measured window starts: where the CPU time goes in it
                    cpu0 = cpu_use.sample(named)
                    spy = None
                    spied_paths = [p.strip() for p in args.py_spy_paths.split(",")]
                    if level == args.py_spy_level and rep == 0 and not hand and path in spied_paths:
                        tiers = cpu_use.pids_of(":Model")
                        targets = {f"session{k}": pid for k, pid in enumerate(cpu_use.pids_of(":ModelSession"))}
                        targets.update({"tier0": tiers[0]} if tiers else {})
                        tag = f"{arm}-{level}" + ("" if path == "handle" else f"-{path}")
                        spy = cpu_use.PySpy(args.py_spy_bin, targets, args.seconds - 0.3, args.out, tag)
                    outs = [_answer(conn, n) for (p, conn), n in zip(clients, per)]
                    cpu = cpu_use.use(cpu0, cpu_use.sample(named))
                    spied = spy.wait() if spy is not None else None
                    held = stalled.held()
                time.sleep(1.3)  # the replicas push their counters every second
                after = _stats(url, "yolo") if url else {}
                lat = np.array(sorted(x for o in outs for x in o["latencies"]))
                run = {"arm": arm, "level": level, "path": path, "repeat": rep, "startup_s": round(startup, 2),
                       "requests": int(lat.size), "images_per_s": round(lat.size / args.seconds, 1),
                       "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3) if lat.size else None,
                       "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3) if lat.size else None,
                       "wrong": sum(o["wrong"] for o in outs) if not (hand or "").startswith("noop") else None,
                       # a cell that measured no request at all is an error of its own (its clients' threads died)
                       "errors": sum(o["n_errors"] for o in outs) + (0 if lat.size else 1),
                       "error_sample": [e for o in outs for e in o["errors"]][:3],
                       "batch_histogram": _diff(_histogram(after), _histogram(before)),
                       "session": _where(after, before) if url else None,
                       **({"stalled": {"opened": stalled.opened, "held_at_end": held,
                                       "settle_s": args.stalled_settle}} if stalled.n else {}),
                       "merged_runs": _sum(after, "merged_runs") - _sum(before, "merged_runs") if url else None,
                       # merged inputs copied to the device part by part from page-locked slots (merge_listed)
                       "listed_gathers": _sum(after, "merge_listed_gathers") - _sum(before, "merge_listed_gathers")
                       if url else None,
                       "cpu": cpu, **({"py_spy": spied} if spied else {}),
                       "replicas": [{k: r.get(k) for k in ("replica", "device", "cuda_visible_devices",
                                                           "graphs_per_bucket", "uncaptured", "padding_waste")}
                                    for r in after.get("ortcapture", {}).get("replicas", [])]}
                results["runs"].append(run)
                log(f"{arm:6} {level:3} clients {path:6}: {run['images_per_s']:8.1f} img/s  p50 {run['p50_ms']} ms  "
                    f"p99 {run['p99_ms']} ms  wrong {run['wrong']} errors {run['errors']}  "
                    f"batches {run['batch_histogram']}  session {run['session']} merged {run['merged_runs']} "
                    f"listed {run['listed_gathers']}")
                log(f"    cpu: machine {cpu['machine_busy_cores']}/{cpu['cpus']} cores busy; " + ", ".join(
                    f"{g} {v['cores']} ({v['procs']}, max {v['max_proc_cores']})"
                    for g, v in list(cpu["groups"].items())[:8]))
        if not hand:
            deployment.ray_serve.delete(deployment.model_app_name(opts))
        deployment.ray_serve.delete(opts.app_name)
        json.dump(results, open(os.path.join(args.out, "serving.json"), "w"), indent=1, default=str)
    for p, conn in clients:
        conn.send(None)
    for p, _ in clients:
        p.join(30)
    deployment.ray_serve.shutdown()
    ray.shutdown()
    results["total_s"] = round(time.perf_counter() - t_start, 1)
    json.dump(results, open(os.path.join(args.out, "serving.json"), "w"), indent=1, default=str)
    _plot(results, os.path.join(args.out, "serving.png"))
    print(_table(results), flush=True)
    log(f"done: {os.path.join(args.out, 'serving.json')}")
    return 0


def _medians(results) -> dict:
    """``{(arm, level, path): run}``: the median-throughput repeat of each."""
    groups: dict = {}
    for r in results["runs"]:
        if "error" not in r:
            groups.setdefault((r["arm"], r["level"], r["path"]), []).append(r)
    return {k: sorted(v, key=lambda x: x["images_per_s"])[len(v) // 2] for k, v in groups.items()}


def _table(results) -> str:
    """A markdown table for docs/SERVING.md: images/s (p50 / p99 ms) per arm, level and path."""
    med = _medians(results)
    arms = list(dict.fromkeys(k[0] for k in med))
    rows = sorted({(k[2], k[1]) for k in med})
    out = ["| clients | path | " + " | ".join(arms) + " |", "| --- | --- | " + " | ".join("---" for _ in arms) + " |"]
    for path, level in rows:
        cells = []
        for arm in arms:
            r = med.get((arm, level, path))
            cells.append(f"{r['images_per_s']:.0f} ({r['p50_ms']:.1f} / {r['p99_ms']:.1f})" if r and r["p50_ms"]
                         else "")
        out.append(f"| {level} | {path} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _plot(results, png: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        print("matplotlib missing: no plot", flush=True)
        return
    runs = list(_medians(results).values())
    if not runs:  # every arm failed to start: nothing to plot
        return
    paths = sorted({r["path"] for r in runs})
    fig, axes = plt.subplots(2, len(paths), figsize=(6 * len(paths), 8), squeeze=False)
    for j, path in enumerate(paths):
        for arm in dict.fromkeys(r["arm"] for r in runs):
            rs = [r for r in runs if r["arm"] == arm and r["path"] == path]
            if not rs:
                continue
            lv = [r["level"] for r in rs]
            axes[0][j].plot(lv, [r["images_per_s"] for r in rs], marker="o", label=arm)
            answered = [(r["level"], r["p50_ms"]) for r in rs if r["p50_ms"]]  # a level with no answer has no p50
            if answered:
                axes[1][j].plot(*zip(*answered), marker="o", label=f"{arm} p50")
        levels = sorted({r["level"] for r in runs})
        axes[0][j].set(title=f"{path}: images/s", xscale="log", xlabel="concurrent clients")
        axes[1][j].set(title=f"{path}: p50 latency (ms)", xscale="log", xlabel="concurrent clients")
        if axes[1][j].lines:  # log scale only with something on it (all levels unanswered: none)
            axes[1][j].set_yscale("log")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xticks(levels, [str(v) for v in levels])
            ax.minorticks_off()
        axes[0][j].legend()
        axes[1][j].legend()
    fig.suptitle(f"ortcapture serve, {results['model'].rsplit('/', 1)[-1]} {results['dims']} on "
                 f"{results['provider']}, buckets {results['buckets']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
