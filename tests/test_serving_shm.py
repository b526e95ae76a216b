"""System shared memory and the gRPC conversion without Ray (issue 45): the region registry, every bound check, the
mappings, the REST endpoints and infer requests through :class:`ortcapture.serving.routes.Router`, and
``ModelInferRequest`` -> the REST path's decoded request -> ``ModelInferResponse``."""
from __future__ import annotations

import asyncio
import json
import os
import uuid

import numpy as np
import pytest

from ortcapture.serving import protocol, shm
from ortcapture.serving.protocol import ModelSpec, ProtocolError, TensorSpec
from ortcapture.serving.routes import Router
from ortcapture.serving.shm import Maps, Regions, ShmError
from ortcapture.serving.shm_store import LocalRegistry, ShmStore

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm")

SPEC = ModelSpec(name="m", inputs=(TensorSpec("X", np.dtype(np.float32), (-1, 4)),),
                 outputs=(TensorSpec("Y", np.dtype(np.float32), (-1, 4)), TensorSpec("S", np.dtype(np.int64), (-1,))),
                 batch_axes={"X": 0}, max_rows=8)


def _model(x: np.ndarray) -> dict:
    return {"Y": x * 2.0 + 1.0, "S": np.arange(x.shape[0], dtype=np.int64)}


@pytest.fixture
def obj():
    """A shared memory object of 4096 bytes (``/dev/shm/<key>``), removed afterwards."""
    key = f"/ortc-test-{uuid.uuid4().hex[:12]}"
    path = os.path.join(shm.SHM_DIR, key[1:])
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    yield key, path
    if os.path.exists(path):
        os.unlink(path)


def run(coro):
    return asyncio.run(coro)


# -- the registry --------------------------------------------------------------------------------------------------
def test_regions_register_refuses_a_taken_name_and_bad_fields():
    r = Regions()
    a = r.register("a", "/k", 0, 16)
    with pytest.raises(ShmError, match="'a' is registered already"):
        r.register("a", "/k2", 0, 16)
    for name, key, off, size, msg in [("", "/k", 0, 1, "non-empty"), ("b", "/x/y", 0, 1, "not the name"),
                                      ("b", "/..", 0, 1, "not the name"), ("b", "/k", -1, 1, "offset"),
                                      ("b", "/k", 0, 0, "at least 1"), ("b", "/k", 0, True, "byte_size"),
                                      ("b", 5, 0, 1, "key must be a string")]:
        with pytest.raises(ShmError, match=msg):
            r.register(name, key, off, size)
    assert r.status() == [a.status()]
    with pytest.raises(ShmError, match="'zz' is not registered"):
        r.status("zz")
    b = r.register("b", "/k", 8, 8)
    assert b.generation > a.generation
    assert r.unregister("nope") == [] and len(r) == 2
    assert r.unregister("a") == ["a"] and r.unregister(None) == ["b"] and len(r) == 0


def test_reference_bounds():
    region = Regions().register("r", "/k", 100, 64)
    regions = {"r": region}
    ref = shm.reference({shm.REGION: "r", shm.OFFSET: 16, shm.BYTE_SIZE: 48}, "input 'X'", regions)
    assert (ref.offset, ref.byte_size) == (16, 48)
    cases = [({shm.REGION: "nope", shm.BYTE_SIZE: 4}, "shared_memory_region 'nope' is not a registered"),
             ({shm.REGION: "r", shm.OFFSET: 65, shm.BYTE_SIZE: 0}, "shared_memory_offset 65 is past the end"),
             ({shm.REGION: "r", shm.OFFSET: 64, shm.BYTE_SIZE: 1}, "shared_memory_offset 64 is past the end"),
             ({shm.REGION: "r", shm.OFFSET: 0, shm.BYTE_SIZE: 65}, "shared_memory_byte_size 65 .* past the end"),
             ({shm.REGION: "r", shm.OFFSET: 32, shm.BYTE_SIZE: 33}, "shared_memory_byte_size 33 .* past the end"),
             ({shm.REGION: "r", shm.OFFSET: -1, shm.BYTE_SIZE: 4}, "shared_memory_offset must be"),
             ({shm.REGION: "r", shm.BYTE_SIZE: "4"}, "shared_memory_byte_size must be"),
             ({shm.REGION: "r"}, "shared_memory_byte_size is missing"),
             ({shm.REGION: 3, shm.BYTE_SIZE: 4}, "shared_memory_region must be a string")]
    for params, msg in cases:
        with pytest.raises(ShmError, match=msg) as e:
            shm.reference(params, "input 'X'", regions)
        assert e.value.status == 400 and "input 'X'" in str(e.value)


def test_maps_read_write_and_shrunk_object(obj):
    key, path = obj
    region = Regions().register("r", key, 1000, 64)
    shm.check_object(region)
    maps = Maps()
    data = np.arange(16, dtype=np.float32)
    maps.write(shm.Ref(region, 0, 64), data, "output 'Y'")
    with open(path, "rb") as f:
        f.seek(1000)
        assert f.read(64) == data.tobytes()  # at the region's offset in the object
    assert maps.read(shm.Ref(region, 4, 8)) == data[1:3].tobytes()
    with pytest.raises(ShmError, match="do not fit"):
        maps.write(shm.Ref(region, 0, 8), data, "output 'Y'")
    os.truncate(path, 1010)  # the client shrinks its object: a 400, never a SIGBUS
    with pytest.raises(ShmError, match="shrank"):
        maps.read(shm.Ref(region, 0, 64))
    with pytest.raises(ShmError, match="past the end of shared memory object"):
        shm.check_object(region)
    maps.close()
    assert len(maps) == 0


def test_object_checks(obj, tmp_path):
    with pytest.raises(ShmError, match="cannot open"):
        shm.object_size("/ortc-test-does-not-exist")
    link = os.path.join(shm.SHM_DIR, f"ortc-link-{uuid.uuid4().hex[:8]}")
    os.symlink(obj[1], link)
    try:
        with pytest.raises(ShmError, match="cannot open"):  # a link is not followed
            shm.object_size("/" + os.path.basename(link))
    finally:
        os.unlink(link)
    assert shm.object_size(obj[0]) == 4096


@pytest.mark.parametrize("peer,loop", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
                                       ("ipv4:127.0.0.1:5555", True), ("ipv6:[::1]:5555", True),
                                       ("ipv6:%5B::1%5D:5555", True), ("::ffff:127.0.0.1", True),
                                       ("10.1.2.3", False), ("ipv4:192.168.1.5:80", False),
                                       ("ipv6:[2001:db8::1]:80", False), (None, False), ("", False),
                                       ("garbage", False)])
def test_is_loopback(peer, loop):
    assert shm.is_loopback(peer) is loop


# -- the store and the REST endpoints ------------------------------------------------------------------------------
def _router(allow_remote: bool = False, peers_known: bool = True):
    store = ShmStore(LocalRegistry(), allow_remote=allow_remote, peers_known=peers_known)
    seen = []

    async def ready():
        return True

    async def infer(feeds):
        seen.append(feeds)
        return {"outputs": _model(feeds["X"])}
    return Router(SPEC, ready, infer, shm=store), store, seen


def _call(router, method, path, body=b"", headers=None, client="127.0.0.1"):
    async def read_body(cap):
        return body
    return run(router.handle(method, path, {k.lower(): v for k, v in (headers or {}).items()}, read_body, client))


def _register(router, name, key, offset, size, client="127.0.0.1"):
    body = json.dumps({"key": key, "offset": offset, "byte_size": size}).encode()
    return _call(router, "POST", f"/v2/systemsharedmemory/region/{name}/register", body, client=client)


def test_rest_register_status_unregister(obj):
    key, _ = obj
    router, store, _ = _router()
    assert _register(router, "a", key, 0, 4096).status == 200
    res = _register(router, "a", key, 0, 16)
    assert res.status == 400 and b"registered already" in res.body
    res = _call(router, "GET", "/v2/systemsharedmemory/region/a/status")
    assert res.status == 200 and json.loads(res.body) == [{"name": "a", "key": key, "offset": 0, "byte_size": 4096}]
    assert _call(router, "GET", "/v2/systemsharedmemory/region/zz/status").status == 400
    for off, size, msg in [(0, 4097, b"past the end of shared memory object"), (4096, 1, b"past the end"),
                           (0, 0, b"at least 1")]:
        res = _register(router, "b", key, off, size)
        assert res.status == 400 and msg in res.body, res.body
    res = _register(router, "c", "/ortc-test-does-not-exist", 0, 8)
    assert res.status == 400 and b"cannot open" in res.body
    res = _register(router, "r", key, 0, 8, client="10.1.2.3")  # a remote client: refused, named
    assert res.status == 400 and b"loopback" in res.body and b"10.1.2.3" in res.body
    res = _register(router, "r", key, 0, 8, client=None)
    assert res.status == 400 and b"loopback" in res.body
    assert _call(router, "POST", "/v2/systemsharedmemory/region/a/status").status == 405
    assert _call(router, "GET", "/v2/systemsharedmemory/region/a/register").status == 405
    assert _call(router, "POST", "/v2/systemsharedmemory/region/a/register", b"{nope").status == 400
    assert _call(router, "POST", "/v2/systemsharedmemory/region/a/unregister").status == 200
    assert json.loads(_call(router, "GET", "/v2/systemsharedmemory/status").body) == []
    assert _register(router, "a", key, 0, 64).status == 200 and _register(router, "b", key, 64, 64).status == 200
    assert _call(router, "POST", "/v2/systemsharedmemory/unregister").status == 200
    assert json.loads(_call(router, "GET", "/v2/systemsharedmemory/status").body) == []
    remote_ok, _, _ = _router(allow_remote=True)
    assert _register(remote_ok, "r", key, 0, 8, client="10.1.2.3").status == 200
    assert b"system_shared_memory" in _call(router, "GET", "/v2").body


def test_behind_haproxy_on_a_wide_host_no_peer_is_trusted_as_local(obj):
    """Behind Ray Serve's HAProxy ingress (``--haproxy``) every request reaches the tier from HAProxy's 127.0.0.1, so
    on a server listening beyond loopback a remote client would read as local: registration is refused for every
    peer there (system and CUDA regions), unless --allow-remote-shared-memory."""
    key, _ = obj
    router, _, _ = _router(peers_known=False)
    res = _register(router, "r", key, 0, 8, client="127.0.0.1")
    assert res.status == 400 and b"HAProxy" in res.body and b"--allow-remote-shared-memory" in res.body
    assert json.loads(_call(router, "GET", "/v2/systemsharedmemory/status").body) == []
    store = ShmStore(LocalRegistry(), cuda_open=lambda r: asyncio.sleep(0), peers_known=False)
    with pytest.raises(ShmError, match="HAProxy"):
        run(store.register_cuda("c", b"\0" * 64, 0, 8, "127.0.0.1"))
    ok, _, _ = _router(allow_remote=True, peers_known=False)
    assert _register(ok, "r", key, 0, 8, client="127.0.0.1").status == 200


def test_rest_refuses_the_servers_own_memory_and_deeply_nested_json():
    """A found bug: a local client registered the server's own batch-slot object and had outputs written into it
    (another batch's memory); and JSON nested past Python's recursion limit was a 500 here."""
    router, _, _ = _router()
    pool = f"/ortcapture-{os.getpid()}-{uuid.uuid4().hex}"
    with open(os.path.join(shm.SHM_DIR, pool[1:]), "wb") as f:
        f.write(b"\0" * 64)
    try:
        res = _register(router, "slot", pool, 0, 64)
        assert res.status == 400 and b"the server's own memory" in res.body, res.body
    finally:
        os.unlink(os.path.join(shm.SHM_DIR, pool[1:]))
    deep = b"[" * 50000
    for kind in ("system", "cuda"):
        res = _call(router, "POST", f"/v2/{kind}sharedmemory/region/a/register", deep)
        assert res.status == 400 and b"not valid JSON" in res.body, (kind, res.status, res.body[:200])
    body = b'{"inputs": ' + b"[" * 50000 + b'"shared_memory_region"'
    res = _call(router, "POST", "/v2/models/m/infer", body, {protocol.HEADER_LENGTH: str(len(body))})
    assert res.status == 400, res.body[:200]


def _infer_body(inputs, outputs=None, binary=b""):
    head = json.dumps({"inputs": inputs, **({"outputs": outputs} if outputs is not None else {})}).encode()
    return head + binary, {protocol.HEADER_LENGTH: str(len(head))}


def test_rest_infer_with_input_and_output_in_regions(obj):
    key, path = obj
    router, store, seen = _router()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with open(path, "r+b") as f:
        f.seek(256 + 16)
        f.write(x.tobytes())
    assert _register(router, "in", key, 256, 256).status == 200
    assert _register(router, "out", key, 1024, 1024).status == 200
    body, headers = _infer_body(
        [{"name": "X", "datatype": "FP32", "shape": [3, 4],
          "parameters": {shm.REGION: "in", shm.OFFSET: 16, shm.BYTE_SIZE: 48}}],
        [{"name": "Y", "parameters": {shm.REGION: "out", shm.OFFSET: 8, shm.BYTE_SIZE: 48}},
         {"name": "S", "parameters": {"binary_data": False}}])
    res = _call(router, "POST", "/v2/models/m/infer", body, headers)
    assert res.status == 200, res.body
    np.testing.assert_array_equal(seen[-1]["X"], x)
    n = int(res.headers.get(protocol.HEADER_LENGTH, len(res.body)))
    out = {o["name"]: o for o in json.loads(res.body[:n])["outputs"]}
    assert out["S"]["data"] == [0, 1, 2]
    assert out["Y"]["shape"] == [3, 4] and out["Y"]["parameters"] == {shm.REGION: "out", shm.OFFSET: 8,
                                                                       shm.BYTE_SIZE: 48}
    assert "data" not in out["Y"]
    with open(path, "rb") as f:
        f.seek(1024 + 8)
        np.testing.assert_array_equal(np.frombuffer(f.read(48), np.float32).reshape(3, 4), x * 2 + 1)
    # only an output in a region: nothing else comes back
    body, headers = _infer_body([{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
                                [{"name": "S", "parameters": {shm.REGION: "out", shm.BYTE_SIZE: 8}}])
    res = _call(router, "POST", "/v2/models/m/infer", body, headers)
    assert res.status == 200, res.body
    assert [o["name"] for o in json.loads(res.body)["outputs"]] == ["S"]


def test_rest_infer_whose_inputs_all_come_from_regions_reaches_the_parser_as_pieces(obj, monkeypatch):
    """A REST request whose binary inputs are all in regions (what ``tritonclient.http`` with shared memory sends: a
    JSON body, no binary bytes) is parsed from the region's bytes as they were read (``pieces=``), not from a body
    joined around them (a 1.2 MB copy per request); a body that also carries bytes of its own is joined as before,
    and its stray bytes are refused as before."""
    key, path = obj
    router, store, seen = _router()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with open(path, "r+b") as f:
        f.write(x.tobytes())
    assert _register(router, "in", key, 0, 64).status == 200
    calls = []
    real = protocol.parse_infer_request

    def spy(body, header_length, model, external=(), pieces=None, **kw):
        calls.append((bytes(body), pieces))
        return real(body, header_length, model, external, pieces, **kw)
    monkeypatch.setattr(protocol, "parse_infer_request", spy)
    inputs = [{"name": "X", "datatype": "FP32", "shape": [2, 4],
               "parameters": {shm.REGION: "in", shm.BYTE_SIZE: 32}}]
    for header_length in (True, False):  # with and without Inference-Header-Content-Length
        body, headers = _infer_body(inputs)
        res = _call(router, "POST", "/v2/models/m/infer", body, headers if header_length else {})
        assert res.status == 200, res.body
        np.testing.assert_array_equal(seen[-1]["X"], x)
        sent, pieces = calls[-1]
        assert [bytes(p) for p in pieces] == [x.tobytes()]
        assert json.loads(sent)["inputs"][0]["parameters"] == {"binary_data_size": 32}  # the header alone
    body, headers = _infer_body(inputs, binary=b"\0" * 8)  # 8 bytes that no input declares
    res = _call(router, "POST", "/v2/models/m/infer", body, headers)
    assert res.status == 400 and b"8 bytes after the tensors that no input declares" in res.body, res.body
    assert calls[-1][1] is None  # joined: the body's own bytes kept where they were
    store.close()


def test_rest_infer_bad_references_are_400_before_any_run(obj):
    key, _ = obj
    router, store, seen = _router()
    assert _register(router, "in", key, 0, 64).status == 200

    def x_param(**p):
        return [{"name": "X", "datatype": "FP32", "shape": [2, 4], "parameters": p}]
    cases = [(x_param(**{shm.REGION: "nope", shm.BYTE_SIZE: 32}), None, "'nope' is not a registered"),
             (x_param(**{shm.REGION: "in", shm.OFFSET: 65, shm.BYTE_SIZE: 32}), None, "shared_memory_offset 65"),
             (x_param(**{shm.REGION: "in", shm.BYTE_SIZE: 128}), None, "shared_memory_byte_size 128"),
             (x_param(**{shm.REGION: "in", shm.OFFSET: 40, shm.BYTE_SIZE: 32}), None, "shared_memory_byte_size 32"),
             (x_param(**{shm.REGION: "in", shm.BYTE_SIZE: 16}), None, "its shape and datatype take 32"),
             ([{"name": "X", "datatype": "FP32", "shape": [2, 4], "data": [0] * 8}],
              [{"name": "Y", "parameters": {shm.REGION: "in", shm.OFFSET: 48, shm.BYTE_SIZE: 32}}],
              "output 'Y': shared_memory_byte_size 32")]
    for inputs, outputs, msg in cases:
        body, headers = _infer_body(inputs, outputs)
        res = _call(router, "POST", "/v2/models/m/infer", body, headers)
        assert res.status == 400 and msg in json.loads(res.body)["error"], (msg, res.body)
    assert seen == []  # nothing ran
    # an output larger than its reference: refused, nothing written past it
    body, headers = _infer_body([{"name": "X", "datatype": "FP32", "shape": [2, 4], "data": [0] * 8}],
                                [{"name": "Y", "parameters": {shm.REGION: "in", shm.BYTE_SIZE: 16}}])
    res = _call(router, "POST", "/v2/models/m/infer", body, headers)
    assert res.status == 400 and b"do not fit" in res.body


# -- the gRPC conversion -------------------------------------------------------------------------------------------
grpc_mod = pytest.importorskip("tritonclient.grpc")


def _grpc_request(x, outputs=(), raw=True, **kw):
    from ortcapture.serving import grpc_service

    p = grpc_service.pb2()
    msg = p.ModelInferRequest(model_name="m", id="r1")
    t = msg.inputs.add(name="X", datatype=kw.get("datatype", "FP32"), shape=list(kw.get("shape", x.shape)))
    if raw:
        msg.raw_input_contents.append(kw.get("data", x.tobytes()))
    else:
        t.contents.fp32_contents.extend(x.ravel().tolist())
    for name in outputs:
        msg.outputs.add(name=name)
    return msg


def test_grpc_decode_matches_rest_and_encodes_raw_outputs():
    from ortcapture.serving import grpc_service

    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    req, plan = run(grpc_service.decode_infer(_grpc_request(x, ["S"]), SPEC))
    assert plan is None and req.id == "r1" and req.outputs == [("S", True)]
    np.testing.assert_array_equal(req.inputs["X"], x)
    typed, _ = run(grpc_service.decode_infer(_grpc_request(x, raw=False), SPEC))
    np.testing.assert_array_equal(typed.inputs["X"], x)
    assert [n for n, _ in typed.outputs] == ["Y", "S"]
    res = grpc_service.encode_infer(SPEC, typed, _model(x))
    back = grpc_mod.InferResult(res)
    np.testing.assert_array_equal(back.as_numpy("Y"), x * 2 + 1)
    np.testing.assert_array_equal(back.as_numpy("S"), [0, 1])
    # the same message the REST path gives for the same mistake
    rest = pytest.raises(ProtocolError, protocol.parse_infer_request,
                         json.dumps({"inputs": [{"name": "X", "datatype": "FP64", "shape": [2, 4],
                                                 "data": [0] * 8}]}).encode(), None, SPEC)
    grpc = pytest.raises(ProtocolError, run, grpc_service.decode_infer(
        _grpc_request(x.astype(np.float64), datatype="FP64"), SPEC))
    assert str(grpc.value) == str(rest.value) and grpc.value.status == 400


@pytest.mark.parametrize("kw,msg", [
    ({"data": b"\0" * 12}, "raw_input_contents[0] has 12 bytes; shape [2, 4] of FP32 is 32 bytes"),
    ({"shape": [9, 4], "data": b"\0" * 144}, "9 rows along axis 0; a request has 1 to 8"),
    ({"shape": [2, 5], "data": b"\0" * 40}, "axis 1 is 5; the model fixes it at 4"),
])
def test_grpc_decode_refusals(kw, msg):
    from ortcapture.serving import grpc_service

    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ProtocolError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        run(grpc_service.decode_infer(_grpc_request(x, **kw), SPEC))


def test_grpc_decode_refuses_mixed_and_missing_contents():
    from ortcapture.serving import grpc_service

    x = np.zeros((2, 4), np.float32)
    msg = _grpc_request(x)
    msg.raw_input_contents.append(b"\0" * 32)
    with pytest.raises(ProtocolError, match="2 raw_input_contents for 1 input"):
        run(grpc_service.decode_infer(msg, SPEC))
    msg = _grpc_request(x, raw=False)
    msg.inputs[0].contents.ClearField("fp32_contents")
    msg.inputs[0].contents.int_contents.extend([0] * 8)
    with pytest.raises(ProtocolError, match="contents hold int_contents; datatype FP32 takes fp32_contents"):
        run(grpc_service.decode_infer(msg, SPEC))
    msg = _grpc_request(x, raw=False)
    msg.inputs[0].ClearField("contents")
    with pytest.raises(ProtocolError, match="no data"):
        run(grpc_service.decode_infer(msg, SPEC))
    with pytest.raises(ProtocolError, match="not a valid ModelInferRequest"):
        grpc_service.message(b"\xff\xff\xff", "ModelInferRequest")
    assert grpc_service.message(msg.SerializeToString(), "ModelInferRequest") == msg


def test_grpc_decode_with_regions(obj):
    from ortcapture.serving import grpc_service

    key, path = obj
    store = ShmStore(LocalRegistry())
    run(store.register("in", key, 0, 512, "ipv4:127.0.0.1:1"))
    run(store.register("out", key, 512, 512, "ipv6:[::1]:1"))
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with open(path, "r+b") as f:
        f.write(x.tobytes())
    p = grpc_service.pb2()
    msg = p.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="X", datatype="FP32", shape=[2, 4])
    t.parameters[shm.REGION].string_param = "in"
    t.parameters[shm.BYTE_SIZE].int64_param = 32
    o = msg.outputs.add(name="Y")
    o.parameters[shm.REGION].string_param = "out"
    o.parameters[shm.BYTE_SIZE].int64_param = 32
    msg.outputs.add(name="S")
    req, plan = run(grpc_service.decode_infer(msg, SPEC, store))
    np.testing.assert_array_equal(req.inputs["X"], x)
    assert req.outputs == [("S", True)] and list(plan.outputs) == ["Y"]
    entries = store.write_outputs(plan, _model(x), SPEC)
    res = grpc_service.encode_infer(SPEC, req, _model(x), entries)
    assert [o.name for o in res.outputs] == ["S", "Y"] and len(res.raw_output_contents) == 1
    back = grpc_mod.InferResult(res)
    np.testing.assert_array_equal(back.as_numpy("S"), [0, 1])
    with open(path, "rb") as f:
        f.seek(512)
        np.testing.assert_array_equal(np.frombuffer(f.read(32), np.float32).reshape(2, 4), x * 2 + 1)
    with pytest.raises(ShmError, match="loopback"):
        run(store.register("r", key, 0, 8, "ipv4:10.0.0.1:5"))
    t.parameters[shm.OFFSET].int64_param = 500
    with pytest.raises(ShmError, match="input 'X': shared_memory_byte_size 32 at shared_memory_offset 500"):
        run(grpc_service.decode_infer(msg, SPEC, store))
    with pytest.raises(ShmError, match="no shared memory"):
        run(grpc_service.decode_infer(msg, SPEC, None))


def test_an_input_in_a_region_that_also_carries_its_bytes_another_way_is_refused_by_name(obj, monkeypatch):
    """A new user's finding: a REST input naming a region and also carrying ``data`` was refused with "both 'data'
    and binary_data_size" (which it never sent: the region's bytes had been put in its place), one also declaring
    ``binary_data_size`` with "... bytes after the tensors that no input declares"; a gRPC input with a region and
    typed ``contents`` ran with the contents silently ignored. Each is now a 400 naming both, before the region is
    read."""
    from ortcapture.serving import grpc_service

    key, path = obj
    router, store, seen = _router()
    assert _register(router, "in", key, 0, 64).status == 200
    monkeypatch.setattr(store.maps, "read", lambda ref: pytest.fail("the region was read"))
    region = {shm.REGION: "in", shm.BYTE_SIZE: 32}
    for extra, binary, named in [({"data": [0] * 8}, b"", "'data'"),
                                 ({"parameters": {**region, "binary_data_size": 32}}, b"\0" * 32, "binary_data_size")]:
        t = {"name": "X", "datatype": "FP32", "shape": [2, 4], "parameters": dict(region), **extra}
        body, headers = _infer_body([t], binary=binary)
        res = _call(router, "POST", "/v2/models/m/infer", body, headers)
        want = f"input 'X': shared_memory_region and {named} in one input"
        assert res.status == 400 and want in json.loads(res.body)["error"], res.body
    assert seen == []
    msg = _grpc_request(np.zeros((2, 4), np.float32), raw=False)
    for k, v in region.items():
        if isinstance(v, str):
            msg.inputs[0].parameters[k].string_param = v
        else:
            msg.inputs[0].parameters[k].int64_param = v
    with pytest.raises(ShmError, match="input 'X': shared_memory_region and contents in one input"):
        run(grpc_service.decode_infer(msg, SPEC, store))
    store.close()


# -- faults a tester found: a shrinking object, a FIFO, a region unregistered in flight, unknown sizes ------------
def test_a_shrinking_object_is_a_400_never_a_sigbus(obj):
    """A client truncating its object while the ingress read it killed the ingress with SIGBUS through its mmap (and
    every client's registrations with it): reads go through the descriptor, a short read is a :class:`ShmError`.
    The size check before the read is made to lie here, as when the object shrinks between the two; in a child
    process, so a SIGBUS would be its exit status, not the end of pytest."""
    import subprocess
    import sys

    key, path = obj
    code = f"""
import os
from ortcapture.serving import shm
region = shm.Regions().register("r", {key!r}, 0, 4096)
maps = shm.Maps()
maps.read(shm.Ref(region, 0, 64))
real, size = os.fstat, os.stat({path!r}).st_size
os.fstat = lambda fd: os.stat_result((*real(fd)[:6], size, *real(fd)[7:]))  # still the registered size
os.truncate({path!r}, 100)
try:
    maps.read(shm.Ref(region, 0, 4096))
    print("read: no error")
except shm.ShmError as exc:
    print("read:", exc)
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, (got.returncode, got.stderr[-2000:])
    assert "read: region 'r': its shared memory object" in got.stdout and "shrank" in got.stdout
    region, maps = Regions().register("w", key, 0, 64), Maps()
    maps.read(shm.Ref(region, 0, 64))
    os.truncate(path, 10)  # a write past the shrunk end: refused, the object not grown back
    with pytest.raises(ShmError, match="shrank"):
        maps.write(shm.Ref(region, 0, 64), b"x" * 64, "output 'Y'")
    assert os.stat(path).st_size == 10
    maps.close()


def test_a_fifo_is_refused_at_once_not_waited_on():
    """A FIFO registered as a region blocked the ingress's event loop in ``open`` until someone wrote to it (health
    checks and every client timed out): opened without blocking and refused as not a shared memory object."""
    import threading

    key = f"/ortc-fifo-{uuid.uuid4().hex[:8]}"
    path = os.path.join(shm.SHM_DIR, key[1:])
    os.mkfifo(path)
    errors: list = []

    def check():
        for fn in (lambda: shm.object_size(key), lambda: Maps().read(shm.Ref(Regions().register("f", key, 0, 1), 0, 1))):
            try:
                fn()
                errors.append(None)
            except ShmError as exc:
                errors.append(str(exc))

    t = threading.Thread(target=check, daemon=True)
    try:
        t.start()
        t.join(10)
        blocked = t.is_alive()
        if blocked:  # let the thread go: open the FIFO for writing
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            t.join(10)
    finally:
        os.unlink(path)
    assert not blocked, "opening the FIFO blocked"
    assert len(errors) == 2 and all(e and "is not a shared memory object" in e for e in errors), errors


def test_an_output_goes_to_the_object_registered_when_the_request_was_checked(obj):
    """A client unregistered its region while its request ran, unlinked the key, and another client made and
    registered a new object under the same key: the first request's output landed in the second client's object.
    A request's output regions are opened when it is checked, and written through that descriptor."""
    from ortcapture.serving.shm_store import ShmPlan

    key, path = obj
    store = ShmStore(LocalRegistry())
    run(store.register("out", key, 0, 64, "127.0.0.1"))
    plan = ShmPlan()
    store.add_output(plan, "Y", shm.Ref(run(store.regions(["out"]))["out"], 0, 32), SPEC)
    run(store.unregister("out"))
    os.unlink(path)
    with open(path, "wb") as f:  # another client's object, same key
        f.write(b"\x22" * 4096)
    run(store.register("theirs", key, 0, 64, "127.0.0.1"))
    store.write_outputs(plan, {"Y": np.ones((2, 4), np.float32)}, SPEC)
    plan.close()
    with open(path, "rb") as f:
        assert f.read(64) == b"\x22" * 64  # untouched
    assert plan.fds == {}
    store.close()


def test_an_input_in_a_region_is_checked_before_a_byte_is_read(obj, monkeypatch):
    """A wrong datatype or a shape that is no list of integers made the ingress copy the whole region (1 GiB: 4 GB
    peak memory) before the protocol refused it; an unknown input name too. Now refused before any read, and an
    input larger than the request cap (``max_body_bytes``) as well."""
    import dataclasses

    key, _ = obj
    for spec, inputs, msg in [
            (SPEC, [{"name": "X", "datatype": "FP64", "shape": [2, 4]}], "needs datatype FP32 and a shape of 2"),
            (SPEC, [{"name": "X", "datatype": "FP32", "shape": ["2", 4]}], "needs datatype FP32"),
            (SPEC, [{"name": "Q", "datatype": "FP32", "shape": [2, 4]}], "must be one of the model's inputs"),
            (dataclasses.replace(SPEC, max_body_bytes=16), [{"name": "X", "datatype": "FP32", "shape": [2, 4]}],
             "32 bytes in all are past the cap of 16 bytes")]:
        store = ShmStore(LocalRegistry())
        router = Router(spec, None, None, shm=store)
        assert _register(router, "in", key, 0, 4096).status == 200
        monkeypatch.setattr(store.maps, "read", lambda ref: pytest.fail("the region was read"))
        inputs[0]["parameters"] = {shm.REGION: "in", shm.BYTE_SIZE: 32}
        with pytest.raises(ShmError, match=msg):
            run(store.prepare_http(*_infer_body(inputs)[0:1], None, spec))
        store.close()


def test_grpc_typed_contents_of_the_wrong_count_say_so():
    from ortcapture.serving import grpc_service

    msg = _grpc_request(np.zeros(3, np.float32), raw=False, shape=[2, 4])
    with pytest.raises(ProtocolError, match=r"input 'X': fp32_contents has 3 values; shape \[2, 4\] takes 8"):
        run(grpc_service.decode_infer(msg, SPEC))


def test_output_regions_opened_for_a_refused_request_are_closed(obj):
    """A request whose second output names an unknown region is refused after its first output's region was opened:
    the descriptor is closed with the refusal, not left to the garbage collector."""
    key, _ = obj
    store = ShmStore(LocalRegistry())
    run(store.register("out", key, 0, 64, "127.0.0.1"))

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    body, headers = _infer_body([{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}],
                                [{"name": "Y", "parameters": {shm.REGION: "out", shm.BYTE_SIZE: 16}},
                                 {"name": "S", "parameters": {shm.REGION: "nope", shm.BYTE_SIZE: 8}}])
    run(store.regions(["out"]))  # the store's own descriptor of the region, opened once
    store.maps.read(shm.Ref(run(store.regions(["out"]))["out"], 0, 4))
    before = fds()
    for _ in range(5):
        with pytest.raises(ShmError, match="'nope' is not a registered"):
            run(store.prepare_http(body, headers[protocol.HEADER_LENGTH], SPEC))
    assert fds() == before
    store.close()



def test_a_region_unregistered_through_another_replica_is_closed_here(obj):
    """Two ingress replicas share the registry. Replica B read region ``r``; a client unregistered it through
    replica A and unlinked its key: B kept the object open (its memory allocated) until a request named that very
    region again — for good when none did. B's next request naming any region, or its report loop's sweep (every
    second), now closes it; a region still registered stays open."""
    key, path = obj
    registry = LocalRegistry()
    a, b = ShmStore(registry), ShmStore(registry)
    run(a.register("r", key, 0, 64, "127.0.0.1"))
    run(a.register("keep", key, 0, 64, "127.0.0.1"))
    for name in ("r", "keep"):
        b.maps.read(shm.Ref(run(b.regions([name]))[name], 0, 4))
    assert b.maps.names() == ["keep", "r"]
    run(a.unregister("r"))
    run(b.sweep())
    assert b.maps.names() == ["keep"]
    # the same through a request that names another region only
    run(a.register("r", key, 0, 64, "127.0.0.1"))
    b.maps.read(shm.Ref(run(b.regions(["r"]))["r"], 0, 4))
    run(a.unregister("r"))
    assert set(run(b.regions(["keep"]))) == {"keep"} and b.maps.names() == ["keep"]
    # registered again under the same name (a new generation): the old descriptor goes, the new one opens on use
    run(a.register("r", key, 0, 64, "127.0.0.1"))
    run(b.sweep())
    assert b.maps.names() == ["keep"]
    b.maps.read(shm.Ref(run(b.regions(["r"]))["r"], 0, 4))
    assert b.maps.names() == ["keep", "r"]
    a.close()
    b.close()


def test_a_registry_made_again_never_reuses_a_name_and_generation_another_replica_holds_open(obj, tmp_path):
    """The registry actor dies with the ingress replica that made it and another replica makes a new, empty one.
    Its generations counted from 1 again, so a client registering name "r" again (another key) got the very
    (name, generation) a replica still held open for the old registry's "r": that replica read the old object and
    wrote outputs into it (a session replica's CUDA handles are keyed alike). Each registry now starts at a random
    generation: the replica opens the new key."""
    key_a, path_a = obj
    key_b = f"/ortc-test-{uuid.uuid4().hex[:12]}"
    path_b = os.path.join(shm.SHM_DIR, key_b[1:])
    with open(path_a, "r+b") as f:
        f.write(b"A" * 16)
    with open(path_b, "wb") as f:
        f.write(b"B" * 16 + b"\0" * 4080)
    try:
        store = ShmStore(LocalRegistry())
        run(store.register("r", key_a, 0, 64, "127.0.0.1"))
        assert store.maps.read(shm.Ref(run(store.regions(["r"]))["r"], 0, 4)) == b"AAAA"
        store.registry = LocalRegistry()  # the old registry is gone; this replica's descriptor of "r" is not
        run(store.registry.register("r", key_b, 0, 64))  # a client registers "r" again, through another replica
        region = run(store.regions(["r"]))["r"]
        assert region.key == key_b
        assert store.maps.read(shm.Ref(region, 0, 4)) == b"BBBB"
        assert len({Regions().register("r", key_a, 0, 1).generation for _ in range(50)}) == 50
        store.close()
    finally:
        os.unlink(path_b)


def test_an_input_named_twice_is_refused_before_its_region_is_read_again(obj, monkeypatch):
    """A 14 KB request naming one 16 MiB region 100 times as input 'X' made the ingress read 1.6 GB (4.8 GB peak)
    before the protocol refused the duplicate (a tester), over REST and gRPC alike: now the second name is refused
    before a second read, and the regions' bytes of one request stay within the request cap together."""
    import dataclasses

    from ortcapture.serving import grpc_service

    key, _ = obj
    store = ShmStore(LocalRegistry())
    router = Router(SPEC, None, None, shm=store)
    assert _register(router, "in", key, 0, 4096).status == 200
    reads = []
    real = store.maps.read
    monkeypatch.setattr(store.maps, "read", lambda ref: reads.append(ref) or real(ref))
    params = {shm.REGION: "in", shm.BYTE_SIZE: 32}
    inputs = [{"name": "X", "datatype": "FP32", "shape": [2, 4], "parameters": dict(params)} for _ in range(100)]
    with pytest.raises(ShmError, match="input 'X' appears twice"):
        run(store.prepare_http(*_infer_body(inputs)[0:1], None, SPEC))
    assert len(reads) == 1
    p = grpc_service.pb2()
    msg = p.ModelInferRequest(model_name="m")
    for _ in range(100):
        t = msg.inputs.add(name="X", datatype="FP32", shape=[2, 4])
        t.parameters[shm.REGION].string_param = "in"
        t.parameters[shm.BYTE_SIZE].int64_param = 32
    reads.clear()
    with pytest.raises(ShmError, match="input 'X' appears twice"):
        run(grpc_service.decode_infer(msg, SPEC, store))
    assert len(reads) == 1
    two = dataclasses.replace(SPEC, inputs=SPEC.inputs + (TensorSpec("Z", np.dtype(np.float32), (-1, 4)),),
                              batch_axes={"X": 0, "Z": 0}, max_body_bytes=48)
    both = [{"name": n, "datatype": "FP32", "shape": [2, 4], "parameters": dict(params)} for n in ("X", "Z")]
    reads.clear()
    with pytest.raises(ShmError, match="64 bytes in all are past the cap of 48"):
        run(store.prepare_http(*_infer_body(both)[0:1], None, two))
    assert len(reads) == 1
    store.close()


class _Ctx:
    """A gRPC servicer context as ``GrpcIngress`` uses it (code, details, peer, metadata)."""
    code = details = None

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def peer(self):
        return "ipv4:127.0.0.1:5000"

    def invocation_metadata(self):
        return []


def _grpc_host(store):
    """A ``GrpcIngress`` host over ``store`` whose ``_infer`` must not run."""
    from ortcapture.serving import grpc_service

    class Host(grpc_service.GrpcIngress):
        spec, options, shm = SPEC, None, store
        router = Router(SPEC, None, None, shm=store)

        async def ready(self):
            return True

        async def _infer(self, feeds, **kw):
            raise AssertionError("a draining tier ran a request")

    return Host


def test_every_grpc_rpc_is_unavailable_while_the_tier_drains(obj):
    """A draining tier answers every RPC ``UNAVAILABLE`` before touching anything, as HTTP answers 503: a shared
    memory registration arriving after the drain unregistered every region must not register (nor make the registry
    again); inference, status and health are refused alike. Before, only ``ModelInfer`` was."""
    pytest.importorskip("tritonclient.grpc")
    from ortcapture.serving import grpc_service

    pb2 = grpc_service.pb2()
    store = ShmStore(LocalRegistry())
    Host = _grpc_host(store)
    key, _ = obj
    host = Host()
    calls = [(host.SystemSharedMemoryRegister, pb2.SystemSharedMemoryRegisterRequest(name="r", key=key, byte_size=64)),
             (host.SystemSharedMemoryStatus, pb2.SystemSharedMemoryStatusRequest()),
             (host.ModelInfer, _grpc_request(np.zeros((1, 4), np.float32))),
             (host.ServerLive, pb2.ServerLiveRequest())]
    ctx = _Ctx()
    run(host.SystemSharedMemoryRegister(calls[0][1].SerializeToString(), ctx))  # not draining: registered
    assert ctx.code is None and [r["name"] for r in run(store.status(None))] == ["r"]
    run(store.unregister(None))
    host._draining = True
    for rpc, msg in calls:
        ctx = _Ctx()
        run(rpc(msg.SerializeToString(), ctx))
        assert ctx.code.name == "UNAVAILABLE" and ctx.details == "the server is shutting down", rpc.__name__
    assert run(store.status(None)) == [] and host._in_flight == 0
    assert "_draining" in vars(host) and "_draining" not in vars(Host)  # set on the instance, not on the class


def test_a_drain_waits_for_a_registration_let_in_before_it(obj):
    """Only ``ModelInfer`` counted in ``_in_flight``: a shared memory registration let in just before the drain
    began was not waited for — the drain unregistered every region and ended the registry, then the registration
    landed (and, through the actor, made the registry again; found by review). Every RPC counts now: a drain that
    waits for ``_in_flight`` then shuts the store down leaves no region behind."""
    pytest.importorskip("tritonclient.grpc")
    from ortcapture.serving import grpc_service

    pb2 = grpc_service.pb2()
    gate = None

    class SlowRegistry(LocalRegistry):
        async def register(self, *a):
            await gate.wait()
            return await super().register(*a)

    store = ShmStore(SlowRegistry())
    host = _grpc_host(store)()
    key, _ = obj
    msg = pb2.SystemSharedMemoryRegisterRequest(name="r", key=key, byte_size=64)

    async def scenario():
        nonlocal gate
        gate = asyncio.Event()
        ctx = _Ctx()
        rpc = asyncio.ensure_future(host.SystemSharedMemoryRegister(msg.SerializeToString(), ctx))
        await asyncio.sleep(0.05)  # past the drain check, waiting for the registry
        counted = host._in_flight
        host._draining = True  # the drain (ModelTier.drain): refuse new RPCs, wait for those in flight, shut down
        asyncio.get_running_loop().call_later(0.1, gate.set)
        for _ in range(100):
            if not host._in_flight:
                break
            await asyncio.sleep(0.02)
        left = host._in_flight
        await store.shutdown()
        await rpc
        return counted, left, ctx, await store.status(None)

    counted, left, ctx, regions = run(scenario())
    assert counted == 1 and left == 0
    assert ctx.code is None  # it was let in: answered, then unregistered by the shutdown
    assert regions == []
