"""``ortcapture serve --grpc-port`` as a user runs it (issue 45): ``tritonclient.grpc`` live/ready/metadata/infer,
errors as gRPC status codes with the REST messages, and system shared memory (``tritonclient.utils.shared_memory``)
register -> infer (input and output in regions) -> status -> unregister through gRPC and REST, every answer equal
to the CPU EP's; bad regions are each refused (400 / ``INVALID_ARGUMENT``) and the server keeps serving.

One server for the module (CPU provider, one replica: a local Ray cluster costs ~15 s on 2 cores), loopback only;
every loop is bounded. Skipped where Ray or tritonclient is missing (failed with ``ORTCAPTURE_REQUIRE_SERVE=1``).
"""
from __future__ import annotations

import base64

import json
import os
import time
import uuid

import numpy as np
import pytest

from tests import tiny
from tests.test_serving_server import Server, _get, _listening_beyond_loopback, _post

if os.environ.get("ORTCAPTURE_REQUIRE_SERVE") == "1":
    import ray  # noqa: F401 - required here: fail, do not skip
    import tritonclient.grpc as grpcclient
    import tritonclient.http as http
else:
    pytest.importorskip("ray")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402
from tritonclient.utils import shared_memory as shm  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")]
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    before = _listening_beyond_loopback()
    registries = _registry_files()
    srv = Server(tmp_path_factory.mktemp("grpc"), provider="cpu", replicas=1, grpc=True)
    try:
        srv.wait_ready()
        srv.beyond_loopback = _listening_beyond_loopback() - before
        yield srv
    finally:
        srv.stop()
    # the shared memory registry's count of changes (ortcapture.serving.shm_version): unlinked at the stop
    assert not _registry_files() - registries


def _registry_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("ortcapture-registry-")}


@pytest.fixture(scope="module")
def reference():
    """The CPU EP's answer for a request (the model run alone, uncaptured)."""
    return tiny.bucket_cpu_answer()


@pytest.fixture
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


@pytest.fixture
def regions():
    """Shared memory regions made by the test (``make(name, size)``), destroyed afterwards."""
    made = []

    def make(name: str, size: int):
        key = f"/ortc-{name}-{uuid.uuid4().hex[:8]}"
        h = shm.create_shared_memory_region(name, key, size)
        made.append(h)
        return key, h
    yield make
    for h in made:
        shm.destroy_shared_memory_region(h)


def _x(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 4)).astype(np.float32)


def _grpc_infer(client, x, outputs=None):
    inp = grpcclient.InferInput("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(MODEL, [inp], outputs=outputs)


def _refused(call, code: str, text: str) -> str:
    with pytest.raises(InferenceServerException) as e:
        call()
    assert e.value.status() == f"StatusCode.{code}", e.value
    assert text in e.value.message(), e.value.message()
    return e.value.message()


def test_grpc_health_metadata_and_loopback(server, client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "ortcapture" and "system_shared_memory" in meta["extensions"]
    assert "cuda_shared_memory" not in meta["extensions"]  # a CPU server: CUDA shared memory is refused, named
    _refused(lambda: client.register_cuda_shared_memory("c", base64.b64encode(bytes(64)), 0, 64), "INVALID_ARGUMENT",
             "CUDA shared memory needs the CUDA provider; this server runs cpu")
    assert client.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}
    m = client.get_model_metadata(MODEL, as_json=True)
    assert [(t["name"], t["datatype"], t["shape"]) for t in m["inputs"]] == [("X", "FP32", ["-1", "4"])]
    assert [t["name"] for t in m["outputs"]] == ["scores", "probs", "feat"]
    cfg = client.get_model_config(MODEL, as_json=True)["config"]
    assert cfg["name"] == MODEL and cfg["input"][0]["dims"] == ["4"]
    _refused(lambda: client.get_model_metadata("nope"), "NOT_FOUND", "unknown model 'nope'")
    assert not {p for _, p in server.beyond_loopback if p == server.grpc_port}, server.beyond_loopback


def test_grpc_infer_equals_cpu_ep(server, client, reference):
    for rows in (1, 3, 8):
        x = _x(rows, rows)
        res = _grpc_infer(client, x)
        want = reference(x)
        for name in ("scores", "probs", "feat"):
            np.testing.assert_allclose(res.as_numpy(name), want[name], rtol=1e-5, atol=1e-6)
    # typed contents (tritonclient sends raw; a hand-made request with fp32_contents)
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    import grpc

    x = _x(2, 9)
    req = service_pb2.ModelInferRequest(model_name=MODEL)
    t = req.inputs.add(name="X", datatype="FP32", shape=[2, 4])
    t.contents.fp32_contents.extend(x.ravel().tolist())
    req.outputs.add(name="probs")
    with grpc.insecure_channel(server.grpc_url) as ch:
        res = service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert [o.name for o in res.outputs] == ["probs"]
    np.testing.assert_allclose(np.frombuffer(res.raw_output_contents[0], np.float32).reshape(2, 3),
                               reference(x)["probs"], rtol=1e-5, atol=1e-6)
    # the statistics count those requests, as REST's /stats does (the session replicas' reports fetched first)
    import time

    deadline, count = time.monotonic() + 15, 0
    while time.monotonic() < deadline:
        st = client.get_inference_statistics(MODEL, as_json=True)
        count = int(st["model_stats"][0].get("inference_stats", {}).get("success", {}).get("count", 0))
        if count >= 4:
            break
        time.sleep(0.5)
    assert count >= 4, st


def test_grpc_errors_carry_the_rest_messages(server, client):
    x = np.zeros((2, 5), np.float32)
    code, body = _post(f"{server.url}/v2/models/{MODEL}/infer", json.dumps(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 5], "data": [0.0] * 10}]}).encode())
    assert code == 400
    msg = _refused(lambda: _grpc_infer(client, x), "INVALID_ARGUMENT", "axis 1 is 5")
    assert msg == json.loads(body)["error"]
    _refused(lambda: _grpc_infer(client, np.zeros((9, 4), np.float32)), "INVALID_ARGUMENT", "9 rows")
    inp = grpcclient.InferInput("X", [1, 4], "FP64")
    inp.set_data_from_numpy(np.zeros((1, 4)))
    _refused(lambda: client.infer(MODEL, [inp]), "INVALID_ARGUMENT", "the model takes FP32")
    assert client.is_server_live()


def _ingress(server) -> dict:
    """``/stats``' tier counters, after the replicas' next push (about once a second)."""
    time.sleep(1.5)
    code, raw = _get(f"{server.url}/v2/models/{MODEL}/stats")
    assert code == 200, raw
    return json.loads(raw)["model_stats"][0]["ortcapture"]["ingress"]


def test_grpc_system_shared_memory(server, client, regions, reference):
    x = _x(3, 5)
    in_key, hin = regions("gin", 256)
    out_key, hout = regions("gout", 512)
    shm.set_shared_memory_region(hin, [x], offset=64)
    client.unregister_system_shared_memory()
    client.register_system_shared_memory("gin", in_key, 256)
    client.register_system_shared_memory("gout", out_key, 512)
    status = client.get_system_shared_memory_status(as_json=True)["regions"]
    assert status["gin"]["key"] == in_key and int(status["gout"]["byte_size"]) == 512
    inp = grpcclient.InferInput("X", [3, 4], "FP32")
    inp.set_shared_memory("gin", x.nbytes, offset=64)
    o_scores = grpcclient.InferRequestedOutput("scores")
    o_scores.set_shared_memory("gout", 36, offset=8)
    o_probs = grpcclient.InferRequestedOutput("probs")
    res = client.infer(MODEL, [inp], outputs=[o_scores, o_probs])
    want = reference(x)
    np.testing.assert_allclose(res.as_numpy("probs"), want["probs"], rtol=1e-5, atol=1e-6)
    out = res.get_output("scores")
    assert list(out.shape) == [3, 3] and out.parameters["shared_memory_region"].string_param == "gout"
    got = shm.get_contents_as_numpy(hout, np.float32, [3, 3], offset=8)
    np.testing.assert_allclose(got, want["scores"], rtol=1e-5, atol=1e-6)
    # the same regions again: the tier replicas answer the lookups themselves (the registry's count of changes, in
    # /dev/shm, has not moved), at most one registry call per tier replica for names new to it
    before = _ingress(server)
    for k in range(6):
        xk = _x(3, 10 + k)
        shm.set_shared_memory_region(hin, [xk], offset=64)
        res = client.infer(MODEL, [inp], outputs=[o_scores, o_probs])
        np.testing.assert_allclose(res.as_numpy("probs"), reference(xk)["probs"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(shm.get_contents_as_numpy(hout, np.float32, [3, 3], offset=8),
                                   reference(xk)["scores"], rtol=1e-5, atol=1e-6)
    after = _ingress(server)
    assert after["shm_lookups"] - before["shm_lookups"] >= 6, (before, after)
    assert after["shm_registry_calls"] - before["shm_registry_calls"] <= after["replicas"], (before, after)
    # bad references and registrations: each INVALID_ARGUMENT, the server stays up
    bad = grpcclient.InferInput("X", [3, 4], "FP32")
    bad.set_shared_memory("nope", x.nbytes)
    _refused(lambda: client.infer(MODEL, [bad]), "INVALID_ARGUMENT", "'nope' is not a registered")
    bad.set_shared_memory("gin", x.nbytes, offset=300)
    _refused(lambda: client.infer(MODEL, [bad]), "INVALID_ARGUMENT", "shared_memory_offset 300 is past the end")
    bad.set_shared_memory("gin", x.nbytes, offset=240)
    _refused(lambda: client.infer(MODEL, [bad]), "INVALID_ARGUMENT", "shared_memory_byte_size 48")
    _refused(lambda: client.register_system_shared_memory("gin", in_key, 16), "INVALID_ARGUMENT",
             "'gin' is registered already")
    _refused(lambda: client.register_system_shared_memory("big", in_key, 257), "INVALID_ARGUMENT",
             "past the end of shared memory object")
    client.unregister_system_shared_memory("gin")
    assert list(client.get_system_shared_memory_status(as_json=True).get("regions", {})) == ["gout"]
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
    assert client.is_server_ready()
    np.testing.assert_allclose(_grpc_infer(client, x).as_numpy("scores"), want["scores"], rtol=1e-5, atol=1e-6)


def test_rest_system_shared_memory(server, regions, reference):
    c = http.InferenceServerClient(server.url.split("//", 1)[1])
    x = _x(2, 7)
    in_key, hin = regions("hin", 64)
    out_key, hout = regions("hout", 256)
    shm.set_shared_memory_region(hin, [x])
    c.unregister_system_shared_memory()
    c.register_system_shared_memory("hin", in_key, 64)
    c.register_system_shared_memory("hout", out_key, 256)
    assert sorted(r["name"] for r in c.get_system_shared_memory_status()) == ["hin", "hout"]
    inp = http.InferInput("X", [2, 4], "FP32")
    inp.set_shared_memory("hin", x.nbytes)
    o = http.InferRequestedOutput("feat", binary_data=False)
    o.set_shared_memory("hout", 24, offset=100)
    res = c.infer(MODEL, [inp], outputs=[o, http.InferRequestedOutput("probs")])
    want = reference(x)
    np.testing.assert_allclose(res.as_numpy("probs"), want["probs"], rtol=1e-5, atol=1e-6)
    assert res.get_output("feat")["shape"] == [3, 2]
    np.testing.assert_allclose(shm.get_contents_as_numpy(hout, np.float32, [3, 2], offset=100), want["feat"],
                               rtol=1e-5, atol=1e-6)
    base = f"{server.url}/v2/systemsharedmemory"
    for name, body, text in [("hin", {"key": in_key, "byte_size": 8}, "registered already"),
                             ("x1", {"key": in_key, "offset": 64, "byte_size": 1}, "past the end"),
                             ("x2", {"key": in_key, "byte_size": 65}, "past the end"),
                             ("x3", {"key": "/etc/passwd", "byte_size": 8}, "not the name"),
                             ("x4", {"key": "/ortc-none-" + uuid.uuid4().hex, "byte_size": 8}, "cannot open")]:
        code, raw = _post(f"{base}/region/{name}/register", json.dumps(body).encode())
        assert code == 400 and text in json.loads(raw)["error"], raw
    code, raw = _post(f"{server.url}/v2/models/{MODEL}/infer", json.dumps(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 4],
                     "parameters": {"shared_memory_region": "hin", "shared_memory_byte_size": 64,
                                    "shared_memory_offset": 8}}]}).encode())
    assert code == 400 and "shared_memory_byte_size 64" in json.loads(raw)["error"]
    code, raw = _get(f"{base}/region/zz/status")
    assert code == 400 and "'zz' is not registered" in json.loads(raw)["error"]
    c.unregister_system_shared_memory()
    assert c.get_system_shared_memory_status() == []
    assert _get(f"{server.url}/v2/health/ready")[0] == 200
