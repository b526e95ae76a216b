"""CUDA shared memory (issue 45): registration checks, the one namespace with system regions, references checked in
the tier, requests from CUDA regions checked and batched as references (no device here), the session replica's
merge joining them with each other only, its isolation of a failed batch and its writes of each request's outputs —
and, marked ``cuda`` (run on the GPU machine), ``ortcapture serve`` on CUDA driven by
``tritonclient.utils.cuda_shared_memory`` over HTTP and gRPC: inputs and outputs in device memory, every answer equal
to the CPU EP, bad regions each a 400 and the server up."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
import time

import numpy as np
import pytest

from ortcapture.serving import cuda_shm, protocol, shm
from ortcapture.serving.requests import HostRows
from ortcapture.serving.cuda_shm import DeviceRows, DeviceTensor, check_register
from ortcapture.serving.merge import merge_runs
from ortcapture.serving.protocol import ModelSpec, TensorSpec
from ortcapture.serving.requests import RequestCheck, RequestError, group_key, join, on_device
from ortcapture.serving.routes import Router
from ortcapture.serving.shm import Regions, ShmError
from ortcapture.serving.shm_store import LocalRegistry, ShmStore

SPEC = ModelSpec(name="m", inputs=(TensorSpec("X", np.dtype(np.float32), (-1, 4)),),
                 outputs=(TensorSpec("Y", np.dtype(np.float32), (-1, 4)),), batch_axes={"X": 0}, max_rows=8)
HANDLE = bytes(range(64))


def run(coro):
    return asyncio.run(coro)


# -- registration --------------------------------------------------------------------------------------------------
def test_check_register_takes_base64_or_raw_handles_and_refuses_the_rest():
    assert check_register("a", {"b64": base64.b64encode(HANDLE).decode()}, 0, 16) == HANDLE
    assert check_register("a", base64.b64encode(HANDLE), 0, 16) == HANDLE  # what tritonclient.http puts in b64
    assert check_register("a", HANDLE, 0, 16) == HANDLE  # gRPC's raw bytes
    for handle, dev, size, msg in [({"b64": "not base64!"}, 0, 16, "not base64"),
                                   ({"b64": base64.b64encode(b"short").decode()}, 0, 16, "is 5 bytes"),
                                   (12, 0, 16, "raw_handle must be"), (HANDLE, -1, 16, "device_id"),
                                   (HANDLE, 0, True, "byte_size"), (HANDLE, "0", 16, "device_id"),
                                   (HANDLE, 2**64, 16, "device_id")]:  # past gRPC's status field
        with pytest.raises(ShmError, match=msg):
            check_register("a", handle, dev, size)


def test_cuda_and_system_regions_share_names_and_keep_their_own_status():
    r = Regions()
    c = r.register_cuda("c", HANDLE, 0, 64)
    assert c.kind == "cuda" and c.status() == {"name": "c", "device_id": 0, "byte_size": 64}
    with pytest.raises(ShmError, match="registered already"):
        r.register("c", "/k", 0, 8)
    s = r.register("s", "/k", 0, 8)
    with pytest.raises(ShmError, match="registered already"):
        r.register_cuda("s", HANDLE, 0, 8)
    with pytest.raises(ShmError, match="at least 1"):
        r.register_cuda("z", HANDLE, 0, 0)
    assert r.status(kind="cuda") == [c.status()] and r.status() == [s.status()]
    with pytest.raises(ShmError, match="cuda shared memory region 's' is not registered"):
        r.status("s", "cuda")
    assert r.unregister("c") == [] and r.unregister(None) == ["s"]  # system unregister leaves CUDA regions
    assert r.unregister(None, "cuda") == ["c"] and len(r) == 0


def _router(cuda_open=None, provider="cuda"):
    store = ShmStore(LocalRegistry(), cuda_open=cuda_open, provider=provider)
    seen = []

    async def ready():
        return True

    async def infer(feeds, device_outputs=None):
        seen.append((feeds, device_outputs))
        x = feeds["X"]
        rows = x.shape[0]
        return {"outputs": {"Y": np.full((rows, 4), 7.0, np.float32)}}
    return Router(SPEC, ready, infer, shm=store), store, seen


def _call(router, method, path, body=b"", headers=None, client="127.0.0.1"):
    async def read_body(cap):
        return body
    return run(router.handle(method, path, {k.lower(): v for k, v in (headers or {}).items()}, read_body, client))


def _register(router, name, size, client="127.0.0.1", handle=HANDLE):
    body = json.dumps({"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": 0,
                       "byte_size": size}).encode()
    return _call(router, "POST", f"/v2/cudasharedmemory/region/{name}/register", body, client=client)


def test_rest_cuda_register_is_checked_opened_and_refused_off_cuda():
    opened = []

    async def cuda_open(region):
        if region.byte_size > 1024:
            raise ShmError(f"region {region.name!r}: byte_size {region.byte_size} is past the end of the allocation")
        opened.append(region.name)
    router, _, _ = _router(cuda_open)
    assert _register(router, "a", 256).status == 200 and opened == ["a"]
    res = _register(router, "a", 256)
    assert res.status == 400 and b"registered already" in res.body and opened == ["a"]  # not opened again
    res = _register(router, "big", 4096)  # the replica could not open it: refused, the name stays free
    assert res.status == 400 and b"past the end of the allocation" in res.body
    assert json.loads(_call(router, "GET", "/v2/cudasharedmemory/status").body) == [
        {"name": "a", "device_id": 0, "byte_size": 256}]
    assert json.loads(_call(router, "GET", "/v2/systemsharedmemory/status").body) == []
    res = _register(router, "r", 64, client="10.1.2.3")
    assert res.status == 400 and b"loopback" in res.body
    res = _register(router, "h", 64, handle=b"x" * 10)
    assert res.status == 400 and b"is 10 bytes" in res.body
    assert _call(router, "POST", "/v2/cudasharedmemory/region/a/register", b"{}").status == 400
    assert _call(router, "POST", "/v2/cudasharedmemory/region/a/unregister").status == 200
    assert json.loads(_call(router, "GET", "/v2/cudasharedmemory/status").body) == []
    assert "cuda_shared_memory" in json.loads(_call(router, "GET", "/v2").body)["extensions"]
    off_cuda, _, _ = _router(None, provider="webgpu")
    assert "cuda_shared_memory" not in json.loads(_call(off_cuda, "GET", "/v2").body)["extensions"]
    res = _register(off_cuda, "a", 256)
    assert res.status == 400 and b"CUDA shared memory needs the CUDA provider; this server runs webgpu" in res.body


def _infer_body(inputs, outputs=None):
    head = json.dumps({"inputs": inputs, **({"outputs": outputs} if outputs is not None else {})}).encode()
    return head, {protocol.HEADER_LENGTH: str(len(head))}


def test_rest_infer_from_a_cuda_region_sends_a_reference_and_names_the_output_region():
    async def cuda_open(region):
        return None
    router, _, seen = _router(cuda_open)
    assert _register(router, "in", 256).status == 200 and _register(router, "out", 256).status == 200
    body, headers = _infer_body([{"name": "X", "datatype": "FP32", "shape": [3, 4],
                                  "parameters": {shm.REGION: "in", shm.OFFSET: 16, shm.BYTE_SIZE: 48}}],
                                [{"name": "Y", "parameters": {shm.REGION: "out", shm.OFFSET: 32, shm.BYTE_SIZE: 48}}])
    res = _call(router, "POST", "/v2/models/m/infer", body, headers)
    assert res.status == 200, res.body
    feeds, outs = seen[-1]
    x = feeds["X"]
    assert isinstance(x, DeviceTensor) and x.shape == (3, 4) and x.dtype == np.float32
    assert (x.ref.region.name, x.ref.offset, x.ref.byte_size) == ("in", 16, 48)
    assert list(outs) == ["Y"] and (outs["Y"].region.name, outs["Y"].offset) == ("out", 32)
    out = json.loads(res.body)["outputs"]
    assert out == [{"name": "Y", "datatype": "FP32", "shape": [3, 4],
                    "parameters": {shm.REGION: "out", shm.OFFSET: 32, shm.BYTE_SIZE: 48}}]
    n = len(seen)
    for inputs, msg in [
        ([{"name": "X", "datatype": "FP32", "shape": [3, 4], "parameters": {shm.REGION: "in", shm.BYTE_SIZE: 32}}],
         "its shape and datatype take 48 bytes"),
        ([{"name": "X", "datatype": "FP32", "shape": [3, 4],
           "parameters": {shm.REGION: "in", shm.OFFSET: 240, shm.BYTE_SIZE: 48}}], "past the end of region 'in'"),
        ([{"name": "X", "datatype": "INT64", "shape": [3, 4], "parameters": {shm.REGION: "in", shm.BYTE_SIZE: 96}}],
         "needs the model's datatype"),
        ([{"name": "X", "datatype": "FP32", "shape": [3, 4], "parameters": {shm.REGION: "zz", shm.BYTE_SIZE: 48}}],
         "'zz' is not a registered"),
        ([{"name": "X", "datatype": "FP32", "shape": [1, 2**31, 2**31, 2**31 + 1],  # wraps in int64: not here
           "parameters": {shm.REGION: "in", shm.BYTE_SIZE: 4}}], "its shape and datatype take")]:
        body, headers = _infer_body(inputs)
        res = _call(router, "POST", "/v2/models/m/infer", body, headers)
        assert res.status == 400 and msg in json.loads(res.body)["error"], (msg, res.body)
    assert len(seen) == n  # nothing ran


# -- the tier's check and batching, the session replica's merge ----------------------------------------------------
def _dev(rows: int, name: str = "in", offset: int = 0, dtype=np.float32, cols: int = 4) -> DeviceTensor:
    region = Regions().register_cuda(name, HANDLE, 0, 4096)
    return DeviceTensor(shm.Ref(region, offset, rows * cols * np.dtype(dtype).itemsize), (rows, cols), np.dtype(dtype))


def test_request_check_checks_a_device_tensor_by_shape_and_dtype():
    check = RequestCheck([("X", np.float32, (-1, 4))], {"X": 0}, 8)
    assert check.rows({"X": _dev(3)}) == 3
    with pytest.raises(RequestError, match="'X'"):
        check.rows({"X": _dev(3, cols=5)})
    with pytest.raises(RequestError, match="more than the 8"):
        check.rows({"X": _dev(9)})
    unbatched = RequestCheck([("X", np.float32, (-1, 4)), ("T", np.float32, (4,))], {"X": 0}, 8)
    with pytest.raises(RequestError, match="CUDA shared memory is for inputs batched on axis 0"):
        unbatched.rows({"X": np.zeros((1, 4), np.float32), "T": DeviceTensor(_dev(1).ref, (4,), np.dtype("f4"))})


def test_device_requests_group_apart_join_as_references_and_merge_only_with_device_runs():
    host, a, b = {"X": np.zeros((2, 4), np.float32)}, {"X": _dev(1, offset=0)}, {"X": _dev(2, "b", 64)}
    assert group_key(host, ["X"], {"X": 0}) != group_key(a, ["X"], {"X": 0}) == group_key(b, ["X"], {"X": 0})
    assert on_device(a) and not on_device(host)
    joined = join([a, b], [(0, 0, 1), (1, 0, 2)], ["X"], {"X": 0})["X"]
    assert isinstance(joined, DeviceRows) and joined.shape == (3, 4) and joined.dtype == np.float32
    assert [(t.ref.region.name, s, e) for t, s, e in joined.parts] == [("in", 0, 1), ("b", 0, 2)]
    other = join([{"X": _dev(1, "c", 0)}], [(0, 0, 1)], ["X"], {"X": 0})["X"]
    runs = [({"X": np.zeros((1, 4), np.float32)}, [1]), ({"X": joined}, [1, 2]), ({"X": other}, [1]),
            ({"X": np.zeros((1, 4), np.float32)}, [1]), ({"X": np.zeros((2, 4), np.float32)}, [2])]
    merged = merge_runs(runs, 8)
    # device runs join device runs only, as references listed in order (nothing gathered or copied here)
    assert [m for m, _, _ in merged] == [[0], [1, 2], [3, 4]]
    dev = merged[1][1]["X"]
    assert isinstance(dev, DeviceRows) and dev.shape == (4, 4) and merged[1][2] == [1, 2, 1]
    assert [(t.ref.region.name, s, e) for t, s, e in dev.parts] == [("in", 0, 1), ("b", 0, 2), ("c", 0, 1)]
    assert [m for m, _, _ in merge_runs(runs, 3)] == [[0], [1], [2], [3, 4]]  # never past max_rows
    assert [m for m, _, _ in merge_runs(runs[1:2], 8)] == [[0]] and merge_runs(runs[1:2], 8)[0][1]["X"] is joined
    # any other non-numpy feed (a CUDA OrtValue) stays alone
    assert [m for m, _, _ in merge_runs([({"X": object()}, [1]), ({"X": object()}, [1])], 8)] == [[0], [1]]


def test_split_feeds_cuts_device_rows_one_part_per_request():
    from ortcapture.serving.requests import split_feeds

    rows = DeviceRows.of([(_dev(1, "a"), 0, 1), (_dev(3, "b"), 1, 3)])
    z = np.arange(3, dtype=np.float32).reshape(3, 1)
    own = split_feeds({"X": rows, "Z": z}, [1, 2], {"X": 0, "Z": 0})
    assert [o["X"].parts for o in own] == [(rows.parts[0],), (rows.parts[1],)]
    assert own[1]["X"].shape == (2, 4) and own[1]["Z"].tolist() == [[1.0], [2.0]]
    with pytest.raises(ValueError, match="cannot be cut"):
        split_feeds({"X": rows}, [3], {"X": 0})


def test_region_entries_name_each_output_region():
    region = Regions().register_cuda("out", HANDLE, 0, 4096)
    entries = cuda_shm.region_entries({"Y": np.zeros((2, 4), np.float32)}, {"Y": (shm.Ref(region, 8, 64), "FP32")})
    assert entries == [{"name": "Y", "datatype": "FP32", "shape": [2, 4],
                        "parameters": {shm.REGION: "out", shm.OFFSET: 8, shm.BYTE_SIZE: 32}}]


grpc_mod = pytest.importorskip("tritonclient.grpc")


def test_grpc_decode_with_a_cuda_region():
    from ortcapture.serving.grpc_service import decode_infer
    from tritonclient.grpc import service_pb2 as pb

    store = ShmStore(LocalRegistry(), cuda_open=lambda r: asyncio.sleep(0))
    run(store.register_cuda("in", HANDLE, 0, 256, "ipv4:127.0.0.1:5555"))
    msg = pb.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="X", datatype="FP32", shape=[2, 4])
    t.parameters[shm.REGION].string_param = "in"
    t.parameters[shm.BYTE_SIZE].int64_param = 32
    req, plan = run(decode_infer(msg, SPEC, store))
    assert isinstance(req.inputs["X"], DeviceTensor) and req.inputs["X"].shape == (2, 4)
    assert plan is not None and list(plan.device_inputs) == ["X"]


# -- on the GPU: a served model on CUDA, the client's tensors in device memory --------------------------------------
@pytest.fixture(scope="module")
def cuda_server(tmp_path_factory):
    if os.environ.get("ORTCAPTURE_SERVE_TEST_PROVIDER") != "cuda":
        pytest.skip("a CUDA server: ORTCAPTURE_SERVE_TEST_PROVIDER=cuda on the GPU machine")
    pytest.importorskip("ray")
    pytest.importorskip("cuda.bindings")
    from tests.test_serving_server import Server

    srv = Server(tmp_path_factory.mktemp("cudashm"), provider="cuda", replicas=1, grpc=True)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.mark.cuda
def test_cuda_shared_memory_in_and_out_over_http_and_grpc(cuda_server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.cuda_shared_memory as cudashm
    from tests import tiny

    ref = tiny.bucket_cpu_answer()
    url = cuda_server.url.split("://", 1)[1]
    hc = httpclient.InferenceServerClient(url)
    gc = grpcclient.InferenceServerClient(cuda_server.grpc_url)
    errors, handles, regions, done = [], [], {}, []
    # regions made and first written here, one thread: tritonclient's cuda_shared_memory makes its one CUDA stream
    # per device on first use, and two threads doing so at once destroy the other's (a segfault in the client)
    for k in range(6):
        c = gc if k % 2 == 1 else hc
        hin = cudashm.create_shared_memory_region(f"in{k}", 8 * 4 * 4, 0)
        hout = cudashm.create_shared_memory_region(f"out{k}", 8 * 3 * 4, 0)
        cudashm.set_shared_memory_region(hin, [np.zeros((8, 4), np.float32)])
        handles.extend([hin, hout])
        regions[k] = (hin, hout)
        c.register_cuda_shared_memory(f"in{k}", cudashm.get_raw_handle(hin), 0, 8 * 4 * 4)
        c.register_cuda_shared_memory(f"out{k}", cudashm.get_raw_handle(hout), 0, 8 * 3 * 4)

    def client(k: int, use_grpc: bool) -> None:
        # a client per thread: tritonclient.http's client (geventhttpclient) is not for several threads at once
        lib = grpcclient if use_grpc else httpclient
        c = grpcclient.InferenceServerClient(cuda_server.grpc_url) if use_grpc else \
            httpclient.InferenceServerClient(url, network_timeout=60)
        hin, hout = regions[k]
        try:
            _requests(k, lib, c, hin, hout)
        except Exception as exc:  # noqa: BLE001 - a thread's failure fails the test below
            errors.append((k, repr(exc)[:300]))

    def _requests(k, lib, c, hin, hout) -> None:
        for i in range(12):
            rows = 1 + (k + i) % 4
            x = (np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) - 5.0) * (1 + k) + i  # unique per request
            cudashm.set_shared_memory_region(hin, [x])
            inp = lib.InferInput("X", [rows, 4], "FP32")
            inp.set_shared_memory(f"in{k}", x.nbytes)
            o = lib.InferRequestedOutput("scores")
            o.set_shared_memory(f"out{k}", rows * 3 * 4)
            p = lib.InferRequestedOutput("probs")
            res = c.infer("tiny", [inp], outputs=[o, p])
            got = cudashm.get_contents_as_numpy(hout, np.float32, [rows, 3])
            want = ref(x)
            if not (np.allclose(got, want["scores"], rtol=3e-3, atol=1e-4)
                    and np.allclose(res.as_numpy("probs"), want["probs"], rtol=3e-3, atol=1e-4)):
                errors.append((k, i, got, want["scores"]))
            done.append(k)

    threads = [threading.Thread(target=client, args=(k, k % 2 == 1)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:2]
    assert not any(t.is_alive() for t in threads) and len(done) == 6 * 12, len(done)
    # the "scores" outputs went into their regions device to device from the graphs' own buffers (issue 45: no host
    # round trip), none from the host; the replicas report every second
    deadline, writes = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        writes = [r.get("cuda_region_writes") for r in cuda_server.stats()["ortcapture"]["replicas"]]
        if writes and sum(w["device_to_device"] for w in writes) >= 6 * 12:
            break
        time.sleep(0.5)
    assert writes and sum(w["device_to_device"] for w in writes) >= 6 * 12, writes
    assert sum(w["from_host"] for w in writes) == 0, writes
    status = {r["name"] for r in hc.get_cuda_shared_memory_status()}
    assert {f"in{k}" for k in range(6)} <= status
    # bad references and registrations: each a 400 naming the parameter, the server up afterwards
    from tritonclient.utils import InferenceServerException

    x = np.zeros((2, 4), np.float32)
    for region, size, msg in [("in0", 8 * 4 * 4 + 4, "shared_memory_byte_size"), ("nope", 32, "not a registered")]:
        inp = httpclient.InferInput("X", [2, 4], "FP32")
        inp.set_shared_memory(region, size)
        with pytest.raises(InferenceServerException, match=msg):
            hc.infer("tiny", [inp])
    big = cudashm.create_shared_memory_region("big", 256, 0)
    handles.append(big)
    with pytest.raises(InferenceServerException, match="past the end of the CUDA allocation"):
        hc.register_cuda_shared_memory("big", cudashm.get_raw_handle(big), 0, 1 << 20)
    with pytest.raises(InferenceServerException, match="registered already"):
        hc.register_cuda_shared_memory("in0", cudashm.get_raw_handle(big), 0, 64)
    with pytest.raises(InferenceServerException, match="cudaIpcOpenMemHandle|CUDA IPC"):
        hc.register_cuda_shared_memory("junk", base64.b64encode(bytes(64)), 0, 64)
    hc.unregister_cuda_shared_memory()
    assert hc.get_cuda_shared_memory_status() == []
    inp = httpclient.InferInput("X", [2, 4], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_allclose(hc.infer("tiny", [inp]).as_numpy("scores"), ref(x)["scores"], rtol=3e-3, atol=1e-4)
    for h in handles:
        cudashm.destroy_shared_memory_region(h)


# -- the session replica's side, with the device memory stood in by host arrays -------------------------------------
class _FakeIpc:
    """:class:`ortcapture.serving.cuda_ipc.IpcMemory` with host arrays for device memory: ``mem[region]`` float32."""

    def __init__(self, mem):
        self.mem, self.gathers, self.written, self.host_gathers = mem, 0, {}, []

    def gather(self, name, rows: DeviceRows):
        if isinstance(rows, HostRows):  # host parts (listed merged rows): one copy each, as IpcMemory's DMAs
            self.host_gathers.append((name, [p.__array_interface__["data"][0] for p in rows.parts]))
            return np.concatenate(rows.parts)
        self.gathers += 1
        parts = []
        for t, start, stop in rows.parts:
            if t.ref.region.name not in self.mem:  # as IpcMemory for a handle that no longer opens
                raise ShmError(f"region {t.ref.region.name!r}: the CUDA IPC handle does not open")
            flat = self.mem[t.ref.region.name][t.ref.offset // 4:(t.ref.offset + t.ref.byte_size) // 4]
            parts.append(flat.reshape(t.shape)[start:stop])
        return np.concatenate(parts)

    def write(self, ref, a, where):
        if a.nbytes > ref.byte_size:
            raise ShmError(f"{where}: {a.nbytes} bytes do not fit its shared_memory_byte_size of {ref.byte_size}")
        self.written[(ref.region.name, ref.offset)] = np.array(a)

    def close(self):  # the replica's __del__ closes it
        pass


def _double_model() -> bytes:
    """Y = 2 X + 0 Z with X [batch, 4], Z [batch, 1] (both batched on axis 0)."""
    from onnx import helper, numpy_helper

    from tests import tiny

    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    nodes = [helper.make_node("Mul", ["X", "two"], ["x2"]), helper.make_node("Mul", ["Z", "zero"], ["z0"]),
             helper.make_node("Add", ["x2", "z0"], ["Y"])]
    return tiny._model(nodes, [tiny.vi("X", ["batch", 4]), tiny.vi("Z", ["batch", 1])], [tiny.vi("Y", ["batch", 4])],
                       [two, zero])


def _device_core(healthy: bool = True):
    """A real :class:`ortcapture.serving.replica.ReplicaCore` (its ``run_joined``, counters and ``answers``' health
    rule) over a real :class:`BatchRunner` of a CPU session of :func:`_double_model`, whose runs fail for a batch
    holding a negative value (a model error); ``check_health`` fails unless ``healthy`` (a broken device)."""
    import collections

    import ortcapture
    from ortcapture.serving import BatchRunner
    from ortcapture.serving.replica import ReplicaCore

    sess = ortcapture.InferenceSession(_double_model(), providers=["CPUExecutionProvider"])
    core = ReplicaCore.__new__(ReplicaCore)
    core.runner = BatchRunner(sess, dim="batch", max_rows=8)
    core._lock, core._t, core._batch_ns = threading.Lock(), collections.defaultdict(int), {}
    core.runs, core.health_checks, real = [], 0, sess.run

    def run(names, feeds, run_options=None):
        core.runs.append(int(feeds["X"].shape[0]))
        assert feeds["Z"].shape[0] == feeds["X"].shape[0]  # host rows cut per request with the device rows
        if (feeds["X"] < 0).any():
            raise RuntimeError("Gather index out of range")
        return real(names, feeds, run_options)

    def check_health():
        core.health_checks += 1
        if not healthy:
            raise RuntimeError("the device is broken")

    sess.run, core.check_health, core.close = run, check_health, lambda: None
    return core


class _Metrics:
    """The session replica's metrics (its own ``batch``), counting requests by outcome instead of Ray's metrics."""

    def __init__(self):
        self.rows, self.ok, self.failed = [], 0, 0
        self.tags = {}
        self._rows = type("R", (), {"observe": lambda *a, **k: None})()

    def requests(self, outcome, n=1):
        setattr(self, outcome, getattr(self, outcome) + n)

    def batch(self, rows, parts, requests):
        from ortcapture.serving.session_replica import _Metrics as Real

        Real.batch(self, rows, parts, requests)
        self.rows.append(rows)


def _device_replica(mem, healthy: bool = True, ipc=None):
    pytest.importorskip("ray")
    from ortcapture.serving import session_replica

    ms = session_replica.ModelSession.__new__(session_replica.ModelSession)
    ms.core, ms._ipc = _device_core(healthy), ipc or _FakeIpc(mem)
    ms._merge_rows, ms._mergeable, ms.merged_runs = 8, True, 0
    ms._metrics = _Metrics()
    from ortcapture.serving.slots import SlotReader

    ms._slot_reader = SlotReader()  # as every session replica has (no batch slots in these calls)
    ms._scratch = None  # a session replica off its replay thread: merged rows joined into new arrays
    ms._prefetch = None  # ... and on its caller's thread
    ms._listed = None  # ... and never listed (merge_listed: a CUDA replica's page-locked slots)
    return ms


def _z(n):
    return np.zeros((n, 1), np.float32)


def _placed(part) -> list:
    """The shapes of "Y" in a run part's per-request answers, each written into its CUDA region: the answer holds an
    :class:`~ortcapture.serving.cuda_shm.InRegion` (no rows), a few hundred bytes pickled (Ray's hop to the tier)."""
    import pickle

    from ortcapture.serving.cuda_shm import InRegion

    got = [a["outputs"]["Y"] for a in part["answers"]]
    assert all(isinstance(y, InRegion) and y.dtype == np.float32 for y in got), got
    assert len(pickle.dumps(part)) < 400 * len(got)
    return [y.shape for y in got]


def test_session_replica_merges_device_runs_gathers_once_and_writes_each_requests_outputs():
    mem = {"a": np.arange(8, dtype=np.float32), "b": np.arange(100, 116, dtype=np.float32),
           "c": np.arange(50, 54, dtype=np.float32)}
    ms = _device_replica(mem)
    ta, tb, tc = _dev(1, "a", 16), _dev(2, "b", 0), _dev(1, "c", 0)
    out_a = shm.Ref(Regions().register_cuda("oa", HANDLE, 0, 64), 0, 16)
    out_b = shm.Ref(Regions().register_cuda("ob", HANDLE, 0, 64), 8, 32)
    out_c = shm.Ref(Regions().register_cuda("oc", HANDLE, 0, 64), 0, 16)
    # two calls of the tier: one run of two requests (outputs into two regions), one run of one (into a third)
    calls = [([({"X": DeviceRows.of([(ta, 0, 1), (tb, 0, 2)]), "Z": _z(3)}, [1, 2], [{"Y": out_a}, {"Y": out_b}])],
              [[0, 0]], None),
             ([({"X": DeviceRows.of([(tc, 0, 1)]), "Z": _z(1)}, [1], [{"Y": out_c}])], [[0]], None)]
    answers = ms._run_calls(calls)
    assert ms._ipc.gathers == 1 and ms.core.runs == [4] and ms.merged_runs == 1  # one merged run, one gather
    np.testing.assert_array_equal(ms._ipc.written[("oa", 0)], mem["a"][4:8].reshape(1, 4) * 2)
    np.testing.assert_array_equal(ms._ipc.written[("ob", 8)], mem["b"][:8].reshape(2, 4) * 2)
    np.testing.assert_array_equal(ms._ipc.written[("oc", 0)], mem["c"].reshape(1, 4) * 2)
    assert _placed(answers[0][0]) == [(1, 4), (2, 4)] and _placed(answers[1][0]) == [(1, 4)]
    # a region too small for its request's rows: that request's own 400, the others their outputs
    small = shm.Ref(Regions().register_cuda("os", HANDLE, 0, 64), 0, 8)
    calls[0][0][0] = (calls[0][0][0][0], [1, 2], [{"Y": small}, None])
    answers = ms._run_calls(calls)
    got = answers[0][0]["answers"]
    assert got[0]["status"] == 400 and "do not fit" in got[0]["error"]
    np.testing.assert_array_equal(got[1]["outputs"]["Y"], mem["b"][:8].reshape(2, 4) * 2)  # no region: the rows
    assert _placed(answers[1][0]) == [(1, 4)]
    # the metrics count the region's 400 as a failed request (first round: 3 ok; this one: 2 ok, 1 failed)
    assert ms._metrics.rows == [4, 4] and (ms._metrics.ok, ms._metrics.failed) == (5, 1)


def test_session_replica_runs_each_device_request_alone_when_the_batch_fails():
    mem = {"a": np.arange(8, dtype=np.float32), "bad": -np.ones(8, np.float32), "c": np.ones(8, np.float32)}
    ms = _device_replica(mem)
    rows = DeviceRows.of([(_dev(1, "a"), 0, 1), (_dev(1, "bad"), 0, 1), (_dev(1, "c"), 0, 1)])
    out = shm.Ref(Regions().register_cuda("o", HANDLE, 0, 64), 0, 16)
    z = np.arange(3, dtype=np.float32).reshape(3, 1)  # a batched input sent with the request: cut per request too
    (got,), = ms._run_calls([([({"X": rows, "Z": z}, [1, 1, 1], [None, None, {"Y": out}])], [[0, 0, 0]], None)])
    assert ms.core.runs == [3, 1, 1, 1] and ms._ipc.gathers == 4  # the batch, then each request gathered alone
    got = got["answers"]
    np.testing.assert_array_equal(got[0]["outputs"]["Y"], mem["a"][:4].reshape(1, 4) * 2)
    assert got[1]["status"] == 400 and "Gather index" in got[1]["error"]
    np.testing.assert_array_equal(ms._ipc.written[("o", 0)], np.full((1, 4), 2.0, np.float32))


def test_session_replica_answers_400_for_a_region_that_cannot_be_read():
    mem = {"a": np.arange(8, dtype=np.float32)}
    ms = _device_replica(mem)
    rows = DeviceRows.of([(_dev(1, "a"), 0, 1), (_dev(1, "gone"), 0, 1)])
    (got,), = ms._run_calls([([({"X": rows, "Z": _z(2)}, [1, 1])], [[0, 0]], None)])
    got = got["answers"]
    np.testing.assert_array_equal(got[0]["outputs"]["Y"], mem["a"][:4].reshape(1, 4) * 2)
    assert got[1]["status"] == 400 and "gone" in got[1]["error"]


class _BrokenIpc(_FakeIpc):
    """Every copy fails as after a sticky CUDA error (e.g. ``cudaErrorIllegalAddress`` left by a model kernel)."""

    def gather(self, name, rows):
        from ortcapture.serving.cuda_ipc import DeviceCopyError

        self.gathers += 1
        raise DeviceCopyError("cudaStreamSynchronize: cudaErrorIllegalAddress")


def test_a_failed_device_copy_is_the_servers_fault_not_the_clients():
    mem = {"a": np.arange(8, dtype=np.float32)}
    ms = _device_replica(mem, healthy=False, ipc=_BrokenIpc(mem))
    (got,), = ms._run_calls([([({"X": DeviceRows.of([(_dev(1, "a"), 0, 1)]), "Z": _z(1)}, [1])], [[0]], None)])
    # a lone request on a broken device: 500 after one health check, never the client's 400 with the CUDA error
    assert got["answers"][0]["status"] == 500 and "IllegalAddress" not in got["answers"][0]["error"]
    assert ms.core.health_checks == 1 and ms._metrics.failed == 1
    # on a healthy device the same failure of one request beside others is that request's (the health rule)
    ms = _device_replica(mem, healthy=True, ipc=_BrokenIpc(mem))
    (got,), = ms._run_calls([([({"X": DeviceRows.of([(_dev(1, "a"), 0, 1)]), "Z": _z(1)}, [1])], [[0]], None)])
    assert got["answers"][0]["status"] == 400 and ms.core.health_checks == 1


def test_a_failed_copy_into_one_output_region_is_that_requests_500_only():
    """A merged run whose member's output region cannot be written on the device (DeviceCopyError): that request's
    500; the run's other requests, of this member and the other, get their answers and regions."""
    from ortcapture.serving.cuda_ipc import DeviceCopyError

    class _WriteFails(_FakeIpc):
        def write(self, ref, a, where):
            if ref.region.name == "broken":
                raise DeviceCopyError("cudaMemcpy: cudaErrorIllegalAddress")
            super().write(ref, a, where)

    mem = {"a": np.arange(8, dtype=np.float32), "b": np.arange(100, 108, dtype=np.float32)}
    ms = _device_replica(mem, ipc=_WriteFails(mem))
    ok = shm.Ref(Regions().register_cuda("ok", HANDLE, 0, 64), 0, 16)
    broken = shm.Ref(Regions().register_cuda("broken", HANDLE, 0, 64), 0, 16)
    calls = [([({"X": DeviceRows.of([(_dev(1, "a"), 0, 1), (_dev(1, "b"), 0, 1)]), "Z": _z(2)}, [1, 1],
                [{"Y": broken}, None])], [[0, 0]], None),
             ([({"X": DeviceRows.of([(_dev(1, "b"), 0, 1)]), "Z": _z(1)}, [1], [{"Y": ok}])], [[0]], None)]
    first, second = ms._run_calls(calls)
    got = first[0]["answers"]
    assert got[0]["status"] == 500 and "DeviceCopyError" in got[0]["error"]
    np.testing.assert_array_equal(got[1]["outputs"]["Y"], mem["b"][:4].reshape(1, 4) * 2)
    np.testing.assert_array_equal(ms._ipc.written[("ok", 0)], mem["b"][:4].reshape(1, 4) * 2)
    assert _placed(second[0]) == [(1, 4)] and ms._metrics.failed == 1



def _own(name: str):
    """A CUDA region of 64 bytes with an IPC handle of its own (``_dev``'s inputs share ``HANDLE``: one allocation)."""
    return Regions().register_cuda(name, name.encode().ljust(64, b"\0"), 0, 64)


class _TapIpc(_FakeIpc):
    """:class:`_FakeIpc` that also takes device-to-device copies (``copy_from_device``: ``src`` a host address here,
    as the fake staging's "device" buffers), counting both kinds as :class:`IpcMemory` does."""

    def __init__(self, mem):
        super().__init__(mem)
        self.device_writes = self.host_writes = 0

    def copy_from_device(self, ref, src, nbytes, stream, where):
        import ctypes

        if nbytes > ref.byte_size:
            raise ShmError(f"{where}: {nbytes} bytes do not fit its shared_memory_byte_size of {ref.byte_size}")
        raw = bytes((ctypes.c_char * nbytes).from_address(src))
        self.written[(ref.region.name, ref.offset)] = np.frombuffer(raw, np.float32).reshape(-1, 4).copy()
        self.device_writes += 1

    def write(self, ref, a, where):
        super().write(ref, a, where)
        self.host_writes += 1


def _tapping(ms):
    """The replica's session reads its outputs as a page-locked CUDA staging does: each offered first to the open
    :func:`ortcapture.transfer.tap_device_outputs` block, with its buffer's address and the rows read."""
    from ortcapture._transfer.arena import current_tap

    runner = ms.core.runner
    inner = runner.session.run

    def run(names, feeds, run_options=None):
        outs = inner(names, feeds, run_options)
        tap = current_tap()
        if tap is not None:
            for name, o in zip(runner._output_names, outs):
                tap(name, o.ctypes.data, o.shape, o.dtype, "stream")
        return outs

    runner.session.run = run
    return ms


def test_output_regions_are_written_device_to_device_from_the_runs_own_buffers():
    """Issue 45: a run's outputs reach the CUDA regions its requests name device to device, as the staging reads
    them (:class:`ortcapture.serving.cuda_ipc.RegionTap`), each request's own rows of a merged run — no host
    round trip; a region too small is still its own request's 400 (the host write after the run says so)."""
    mem = {"a": np.arange(8, dtype=np.float32), "b": np.arange(100, 116, dtype=np.float32),
           "c": np.arange(50, 54, dtype=np.float32)}
    ms = _tapping(_device_replica(mem, ipc=_TapIpc(mem)))
    ta, tb, tc = _dev(1, "a", 16), _dev(2, "b", 0), _dev(1, "c", 0)
    out_a = shm.Ref(_own("oa"), 0, 16)
    out_b = shm.Ref(_own("ob"), 8, 32)
    out_c = shm.Ref(_own("oc"), 0, 16)
    calls = [([({"X": DeviceRows.of([(ta, 0, 1), (tb, 0, 2)]), "Z": _z(3)}, [1, 2], [{"Y": out_a}, {"Y": out_b}])],
              [[0, 0]], None),
             ([({"X": DeviceRows.of([(tc, 0, 1)]), "Z": _z(1)}, [1], [{"Y": out_c}])], [[0]], None)]
    answers = ms._run_calls(calls)
    assert ms.core.runs == [4] and ms.merged_runs == 1
    assert (ms._ipc.device_writes, ms._ipc.host_writes) == (3, 0)
    np.testing.assert_array_equal(ms._ipc.written[("oa", 0)], mem["a"][4:8].reshape(1, 4) * 2)
    np.testing.assert_array_equal(ms._ipc.written[("ob", 8)], mem["b"][:8].reshape(2, 4) * 2)
    np.testing.assert_array_equal(ms._ipc.written[("oc", 0)], mem["c"].reshape(1, 4) * 2)
    assert _placed(answers[0][0]) == [(1, 4), (2, 4)] and _placed(answers[1][0]) == [(1, 4)]
    # too small for its request's rows: not copied on the device; the host write answers its own 400
    small = shm.Ref(_own("os"), 0, 8)
    calls[0][0][0] = (calls[0][0][0][0], [1, 2], [{"Y": small}, {"Y": out_b}])
    ms._ipc.written.clear()
    answers = ms._run_calls(calls)
    got = answers[0][0]["answers"]
    assert got[0]["status"] == 400 and "do not fit" in got[0]["error"]
    assert _placed({"answers": got[1:]}) == [(2, 4)]
    np.testing.assert_array_equal(ms._ipc.written[("ob", 8)], mem["b"][:8].reshape(2, 4) * 2)
    assert ("os", 0) not in ms._ipc.written and ms._ipc.device_writes == 5  # ob and oc again, on the device


def test_after_a_failed_batch_each_requests_region_is_written_from_its_own_run_alone():
    """A batch that fails is run again one request at a time; those runs read fewer rows than the batch, so the tap
    copies nothing and each request's region gets its own run's answer from the host."""
    mem = {"a": np.arange(8, dtype=np.float32), "bad": -np.ones(8, np.float32), "c": np.ones(8, np.float32)}
    ms = _tapping(_device_replica(mem, ipc=_TapIpc(mem)))
    rows = DeviceRows.of([(_dev(1, "a"), 0, 1), (_dev(1, "bad"), 0, 1), (_dev(1, "c"), 0, 1)])
    out = shm.Ref(_own("o"), 0, 16)
    z = np.arange(3, dtype=np.float32).reshape(3, 1)
    (got,), = ms._run_calls([([({"X": rows, "Z": z}, [1, 1, 1], [None, None, {"Y": out}])], [[0, 0, 0]], None)])
    assert ms.core.runs == [3, 1, 1, 1] and got["answers"][1]["status"] == 400
    assert (ms._ipc.device_writes, ms._ipc.host_writes) == (0, 1)
    np.testing.assert_array_equal(ms._ipc.written[("o", 0)], np.full((1, 4), 2.0, np.float32))


def test_a_batch_that_fails_after_its_outputs_were_copied_writes_each_region_from_the_requests_own_run():
    """The batch's outputs were read (and copied into the regions) but the run failed after that: each request is
    run alone and its region written from that answer on the host — never left with the failed batch's rows."""
    from ortcapture._transfer.arena import current_tap

    mem = {"a": np.arange(8, dtype=np.float32), "c": np.ones(8, np.float32)}
    ms = _device_replica(mem, ipc=_TapIpc(mem))
    runner = ms.core.runner
    inner = runner.session.run
    junk = np.full((2, 4), -7.0, np.float32)

    def run(names, feeds, run_options=None):
        outs = inner(names, feeds, run_options)
        if feeds["X"].shape[0] == 2:  # the batch: its (junk) outputs offered to the tap, then the run fails
            current_tap()("Y", junk.ctypes.data, junk.shape, junk.dtype, "stream")
            raise RuntimeError("the batch failed after its outputs were read")
        return outs

    runner.session.run = run
    out = shm.Ref(_own("o"), 0, 16)
    rows = DeviceRows.of([(_dev(1, "a"), 0, 1), (_dev(1, "c"), 0, 1)])
    (got,), = ms._run_calls([([({"X": rows, "Z": _z(2)}, [1, 1], [{"Y": out}, None])], [[0, 0]], None)])
    assert ms.core.runs == [2, 1, 1] and "answers" in got
    assert ms._ipc.device_writes == 1 and ms._ipc.host_writes == 1  # copied during the batch, then rewritten
    np.testing.assert_array_equal(ms._ipc.written[("o", 0)], mem["a"][:4].reshape(1, 4) * 2)


def test_an_output_region_overlapping_the_runs_inputs_is_written_from_the_host_after_the_run():
    """A request whose output region overlaps the bytes its run's inputs were gathered from: not copied during the
    read (a failed batch would gather its requests' inputs again from there), written from the host answer after;
    the other request's region still device to device."""
    mem = {"a": np.arange(8, dtype=np.float32), "b": np.arange(100, 108, dtype=np.float32)}
    ms = _tapping(_device_replica(mem, ipc=_TapIpc(mem)))
    ta, tb = _dev(1, "a", 16), _dev(1, "b", 0)
    onto_a = shm.Ref(ta.ref.region, 16, 16)  # the very bytes request 0's input came from
    other = shm.Ref(_own("o"), 0, 16)
    calls = [([({"X": DeviceRows.of([(ta, 0, 1), (tb, 0, 1)]), "Z": _z(2)}, [1, 1], [{"Y": onto_a}, {"Y": other}])],
              [[0, 0]], None)]
    (got,), = ms._run_calls(calls)
    assert (ms._ipc.device_writes, ms._ipc.host_writes) == (1, 1)
    np.testing.assert_array_equal(ms._ipc.written[("a", 16)], mem["a"][4:8].reshape(1, 4) * 2)
    np.testing.assert_array_equal(ms._ipc.written[("o", 0)], mem["b"][:4].reshape(1, 4) * 2)


def test_merged_host_rows_in_page_locked_slots_are_listed_and_copied_part_by_part():
    """merge_listed (a CUDA session replica): a merged run whose host rows all lie in page-locked slots is not joined
    on the host; each input reaches the gather as :class:`HostRows` whose parts are the runs' own arrays (no copy),
    one run for all; a part that is not in such memory (``listed`` says no) joins that input as before. A merged run
    that fails runs each request alone from its own rows."""
    mem = {}
    ms = _device_replica(mem)
    xs = [np.arange(8, dtype=np.float32).reshape(2, 4), np.arange(100, 104, dtype=np.float32).reshape(1, 4),
          np.arange(50, 62, dtype=np.float32).reshape(3, 4)]
    zs = [_z(2), _z(1), _z(3)]
    in_slot = {id(a) for a in xs + zs}
    ms._listed = lambda part: id(part) in in_slot
    calls = [([({"X": x, "Z": z}, [n])], [[0]], None) for x, z, n in zip(xs, zs, (2, 1, 3))]
    answers = ms._run_calls(calls)
    assert ms.core.runs == [6] and ms.merged_runs == 2
    assert [(n, ptrs) for n, ptrs in ms._ipc.host_gathers] == [
        ("X", [x.__array_interface__["data"][0] for x in xs]), ("Z", [z.__array_interface__["data"][0] for z in zs])]
    for (got,), x in zip(answers, xs):
        np.testing.assert_array_equal(got["outputs"]["Y"], x * 2)
    # Z of the second run not in a slot: Z joined on the host, X still listed
    in_slot.discard(id(zs[1]))
    ms._ipc.host_gathers.clear()
    answers = ms._run_calls(calls)
    assert [n for n, _ in ms._ipc.host_gathers] == ["X"] and ms.core.runs[-1] == 6
    for (got,), x in zip(answers, xs):
        np.testing.assert_array_equal(got["outputs"]["Y"], x * 2)
    # a bad value in the second run: the merged run fails, each request runs alone from its own rows
    bad = -np.ones((1, 4), np.float32)
    in_slot.add(id(bad))
    in_slot.add(id(zs[1]))
    calls[1] = ([({"X": bad, "Z": zs[1]}, [1])], [[0]], None)
    answers = ms._run_calls(calls)
    assert ms.core.runs[-4:] == [6, 2, 1, 3]
    np.testing.assert_array_equal(answers[0][0]["answers"][0]["outputs"]["Y"], xs[0] * 2)
    assert answers[1][0]["answers"][0]["status"] == 400
    np.testing.assert_array_equal(answers[2][0]["answers"][0]["outputs"]["Y"], xs[2] * 2)


def test_host_rows_take_and_split_across_parts():
    from ortcapture.serving.requests import split_feeds

    a, b = np.arange(8, dtype=np.float32).reshape(2, 4), np.arange(8, 20, dtype=np.float32).reshape(3, 4)
    rows = HostRows.of([a, b])
    assert rows.shape == (5, 4) and rows.dtype == np.float32
    joined = np.concatenate([a, b])
    for start, stop in [(0, 2), (1, 4), (2, 5), (0, 5), (4, 5), (3, 3)]:
        np.testing.assert_array_equal(rows.take(start, stop), joined[start:stop])
    assert np.shares_memory(rows.take(2, 4), b)  # within one part: a view
    parts = split_feeds({"X": rows}, [1, 3, 1], {"X": 0})
    for got, want in zip(parts, (joined[0:1], joined[1:4], joined[4:5])):
        np.testing.assert_array_equal(got["X"], want)
    with pytest.raises(ValueError, match="cannot follow"):
        HostRows.of([a, b.astype(np.float64)])
    with pytest.raises(ValueError, match="cannot follow"):
        HostRows.of([a, np.ones((4, 2), np.float32).T])  # (2, 4), not C-contiguous


def test_a_slot_reader_says_which_arrays_lie_in_its_page_locked_pools():
    from ortcapture.serving.slots import SlotReader

    buf = np.zeros(1024, np.uint8)

    class _Pin:
        def __init__(self, ptr, nbytes, closed=False):
            self.ptr, self.nbytes, self.closed = ptr, nbytes, closed

    reader = SlotReader()
    base = buf.__array_interface__["data"][0]
    reader._pins = {"p": _Pin(base + 256, 512)}
    assert reader.in_pinned_pool(buf[256:768]) and reader.in_pinned_pool(buf[300:400])
    assert not reader.in_pinned_pool(buf[200:300]) and not reader.in_pinned_pool(buf[700:800])
    assert not reader.in_pinned_pool(buf[:100])
    reader._pins = {"p": _Pin(base + 256, 512, closed=True)}  # unpinned since: no
    assert not reader.in_pinned_pool(buf[300:400])
    reader._pins = {}


@pytest.mark.cuda
def test_ipc_memory_gathers_host_parts_in_page_locked_memory_onto_the_device():
    """IpcMemory.gather of :class:`HostRows` (merge_listed, on the GPU): each part copied host to device into one CUDA
    OrtValue, equal to the parts joined; the value is reused for the next gather of that input and shape."""
    from tests.conftest import cuda_available

    if not cuda_available():
        pytest.skip("CUDA EP unavailable (onnxruntime-gpu on an NVIDIA GPU)")
    pytest.importorskip("cuda.bindings")
    from ortcapture.serving.cuda_ipc import IpcMemory
    from ortcapture.transfer import pin_host_memory

    pool = np.zeros(4096, np.uint8)  # a batch slot pool's stand-in, page-locked as a CUDA session replica's are
    pin = pin_host_memory(memoryview(pool))
    try:
        rng = np.random.default_rng(5)
        views = [pool[0:96].view(np.float32).reshape(2, 3, 4), pool[512:560].view(np.float32).reshape(1, 3, 4),
                 pool[1024:1168].view(np.float32).reshape(3, 3, 4)]
        for v in views:
            v[...] = rng.standard_normal(v.shape, dtype=np.float32)
        ipc = IpcMemory()
        got = ipc.gather("X", HostRows.of(views))
        assert got.device_name() == "cuda" and got.shape() == [6, 3, 4]
        np.testing.assert_array_equal(got.numpy(), np.concatenate(views))
        views[1][...] = 7.0
        again = ipc.gather("X", HostRows.of(views))
        assert again.data_ptr() == got.data_ptr() and ipc.host_gathers == 2
        np.testing.assert_array_equal(again.numpy(), np.concatenate(views))
        ipc.close()
    finally:
        pin.close()


def test_listed_parts_that_host_rows_cannot_take_are_joined():
    """merge_listed: parts HostRows refuses (not C-contiguous) are joined as before, not a failed merged run."""
    from ortcapture.serving.merge import iter_merged_runs

    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.asfortranarray(np.arange(8, 16, dtype=np.float32).reshape(2, 4))
    (members, feeds, rows), = iter_merged_runs([({"X": a}, [2]), ({"X": b}, [2])], 8, listed=lambda p: True)
    assert members == [0, 1] and rows == [2, 2] and isinstance(feeds["X"], np.ndarray)
    np.testing.assert_array_equal(feeds["X"], np.concatenate([a, b]))
    (_, feeds, _), = iter_merged_runs([({"X": a}, [2]), ({"X": a[::-1].copy()}, [2])], 8, listed=lambda p: True)
    assert isinstance(feeds["X"], HostRows) and feeds["X"].parts[0] is a
