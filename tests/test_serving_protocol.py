"""The Open Inference Protocol module and its HTTP router, without Ray or a server (issue 29, item 3).

Requests are made the way ``tritonclient.http`` makes them where it is installed (its own request builder), else by
hand in the same shape. The hypothesis-made bodies are in test_serving_protocol_fuzz.py.
"""
from __future__ import annotations

import asyncio
import gzip
import json
import re
import zlib

import numpy as np
import pytest

from ortcapture.serving import protocol, routes
from ortcapture.serving.protocol import HEADER_LENGTH, ModelSpec, ProtocolError, TensorSpec

SPEC = ModelSpec(
    name="tiny",
    inputs=(TensorSpec("X", np.dtype(np.float32), (-1, 4)), TensorSpec("T", np.dtype(np.int64), ())),
    outputs=(TensorSpec("Y", np.dtype(np.float32), (-1, 3)), TensorSpec("M", np.dtype(np.bool_), (-1,))),
    batch_axes={"X": 0}, max_rows=8, max_body_bytes=4096)


def _tensor(name, a: np.ndarray, binary: bool):
    t = {"name": name, "shape": list(a.shape), "datatype": protocol.datatype_of(a.dtype)}
    if binary:
        t["parameters"] = {"binary_data_size": a.nbytes}
    else:
        t["data"] = a.ravel().tolist()
    return t


def body_of(feeds: dict, binary=(), outputs=None, params=None, rid=None) -> tuple[bytes, str | None]:
    """A request body and its header-length value, as tritonclient builds them (JSON first, then the binary
    inputs' bytes in input order)."""
    req = {"inputs": [_tensor(n, a, n in binary) for n, a in feeds.items()]}
    if rid is not None:
        req["id"] = rid
    if outputs is not None:
        req["outputs"] = outputs
    if params is not None:
        req["parameters"] = params
    head = json.dumps(req).encode()
    blobs = b"".join(a.tobytes() for n, a in feeds.items() if n in binary)
    return (head + blobs, str(len(head))) if blobs else (head, None)


def feeds(rows=2, t=3):
    return {"X": np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) / 7, "T": np.array(t, np.int64)}


@pytest.mark.parametrize("binary", [(), ("X",), ("X", "T")])
def test_parse_json_and_binary_inputs(binary):
    f = feeds()
    body, hl = body_of(f, binary, rid="r1")
    req = protocol.parse_infer_request(body, hl, SPEC)
    assert req.id == "r1"
    for n, a in f.items():
        got = req.inputs[n]
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a)
    assert req.outputs == [("Y", False), ("M", False)]


@pytest.mark.parametrize("binary", [("X",), ("X", "T"), ("T",)])
def test_binary_tensors_as_separate_pieces_parse_as_one_joined_body(binary):
    """gRPC's raw_input_contents reach the parser as pieces (no joined copy of the tensors): the same arrays, views
    of the pieces themselves, and the same refusals as one joined body."""
    f = feeds()
    body, hl = body_of(f, binary, rid="r1")
    head = body[:int(hl)]
    pieces = [f[n].tobytes() for n in f if n in binary]
    req = protocol.parse_infer_request(head, len(head), SPEC, (), pieces)
    joined = protocol.parse_infer_request(body, hl, SPEC)
    assert req.id == joined.id == "r1" and req.outputs == joined.outputs
    for n, a in f.items():
        assert req.inputs[n].dtype == a.dtype and np.array_equal(req.inputs[n], a)
    first = [n for n in f if n in binary][0]
    assert np.shares_memory(req.inputs[first], np.frombuffer(pieces[0], np.uint8))  # not copied
    for bad, words in ((pieces[:-1], "binary bytes declared, 0 sent"),
                       ([p[:-1] for p in pieces], "binary bytes declared"),
                       (pieces + [b"\0" * 4], "binary tensor(s) that no input declares")):
        with pytest.raises(ProtocolError, match=re.escape(words)):
            protocol.parse_infer_request(head, len(head), SPEC, (), bad)


def test_an_unaligned_binary_input_is_copied_unless_the_caller_copies_it_anyway():
    """The JSON header's length decides where the binary tensors start: an odd one leaves a float32 input
    unaligned. It is copied to aligned memory by default (ORT reads aligned buffers); ``align=False`` (the batching
    tier's router: it copies each request's rows into its batch) keeps the view — no copy of a 1.2 MB image."""
    f = feeds()
    body, hl = body_of(f, ("X",))
    head = body[:int(hl)]
    head += b" " * ((1 - len(head)) % 4)  # JSON may end in spaces: the tensor now starts at an odd offset
    body = head + f["X"].tobytes()
    copied = protocol.parse_infer_request(body, len(head), SPEC)
    kept = protocol.parse_infer_request(body, len(head), SPEC, align=False)
    base = np.frombuffer(body, np.uint8)
    assert copied.inputs["X"].flags.aligned and not np.shares_memory(copied.inputs["X"], base)
    assert not kept.inputs["X"].flags.aligned and np.shares_memory(kept.inputs["X"], base)
    assert np.array_equal(copied.inputs["X"], f["X"]) and np.array_equal(kept.inputs["X"], f["X"])


def test_tritonclient_request_round_trip():
    """tritonclient's own request builder (binary and JSON inputs, binary and JSON outputs) parses back exactly, and
    its InferResult reads our response."""
    http = pytest.importorskip("tritonclient.http")
    from tritonclient.http import _utils

    f = feeds(3)
    x = http.InferInput("X", list(f["X"].shape), "FP32")
    x.set_data_from_numpy(f["X"], binary_data=True)
    t = http.InferInput("T", [], "INT64")
    t.set_data_from_numpy(f["T"], binary_data=False)
    outs = [http.InferRequestedOutput("Y", binary_data=True), http.InferRequestedOutput("M", binary_data=False)]
    body, json_size = _utils._get_inference_request([x, t], "abc", outs, 0, False, False, 0, None, None)
    req = protocol.parse_infer_request(body, json_size, SPEC)
    assert np.array_equal(req.inputs["X"], f["X"]) and req.inputs["T"] == 3 and req.inputs["T"].shape == ()
    assert req.outputs == [("Y", True), ("M", False)]
    y = np.linspace(-1, 1, 9, dtype=np.float32).reshape(3, 3)
    m = np.array([True, False, True])
    payload, headers = protocol.encode_infer_response(SPEC, req, {"Y": y, "M": m})
    res = http.InferResult.from_response_body(payload, header_length=int(headers.get(HEADER_LENGTH, 0)) or None)
    assert np.array_equal(res.as_numpy("Y"), y) and np.array_equal(res.as_numpy("M"), m)
    assert res.get_response()["id"] == "abc"
    # outputs=None: tritonclient asks for every output in binary (parameters.binary_data_output)
    body, json_size = _utils._get_inference_request([x, t], "", None, 0, False, False, 0, None, None)
    req = protocol.parse_infer_request(body, json_size, SPEC)
    assert req.outputs == [("Y", True), ("M", True)]


def test_response_json_outputs():
    req = protocol.InferRequest(None, {}, [("Y", False)])
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    payload, headers = protocol.encode_infer_response(SPEC, req, {"Y": y, "M": np.ones(2, bool)})
    assert headers["Content-Type"] == "application/json" and HEADER_LENGTH not in headers
    out = json.loads(payload)
    assert out["outputs"] == [{"name": "Y", "datatype": "FP32", "shape": [2, 3], "data": y.ravel().tolist()}]
    assert out["model_name"] == "tiny" and "id" not in out


def _bad(feeds_=None, binary=(), mutate=None, hl_delta=0, tail=b""):
    f = feeds() if feeds_ is None else feeds_
    body, hl = body_of(f, binary)
    if mutate is not None:
        head = json.loads(body[:int(hl)] if hl else body)
        mutate(head)
        raw = json.dumps(head).encode()
        body = raw + (body[int(hl):] if hl else b"")
        hl = str(len(raw)) if hl else None
    if hl is not None and hl_delta:
        hl = str(int(hl) + hl_delta)
    return body + tail, hl


@pytest.mark.parametrize("case, status, words", [
    (lambda: (b"not json", None), 400, "not valid JSON"),
    (lambda: (b"[1, 2]", None), 400, "JSON object"),
    (lambda: (b"{" * 100000, None), 400, "not valid JSON"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(datatype="FP64")), 400, "datatype"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape=[8])), 400, "rank"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape=[2, 5])), 400, "fixes it at 4"),
    (lambda: _bad(mutate=lambda h: h["inputs"].pop(1)), 400, "missing"),
    (lambda: _bad(mutate=lambda h: h["inputs"].append(h["inputs"][0])), 400, "twice"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(name="Q")), 400, "not an input"),
    (lambda: _bad(feeds(9)), 400, "1 to 8"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape=[0, 4], data=[])), 400, "1 to 8"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0]["data"].pop()), 400, "elements"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0]["data"].__setitem__(0, "x")), 400, "numbers"),
    (lambda: _bad(mutate=lambda h: h["inputs"][1].update(data=[2 ** 70])), 400, "range"),
    (lambda: _bad(mutate=lambda h: h["inputs"][1].update(data=[1.5])), 400, "integers"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].pop("data")), 400, "neither"),
    (lambda: _bad(binary=("X",), hl_delta=3), 400, "JSON"),
    (lambda: _bad(binary=("X",), hl_delta=10 ** 6), 400, "body has"),
    (lambda: (b'{"inputs": []}', "x"), 400, "integer"),
    (lambda: _bad(binary=("X",), tail=b"\0\0\0\0"), 400, "no input declares"),
    (lambda: _bad(binary=("X",), mutate=lambda h: h["inputs"][0]["parameters"].update(binary_data_size=10 ** 9)),
     400, "binary_data_size"),
    (lambda: _bad(binary=("X",), mutate=lambda h: h["inputs"][0].update(shape=[8, 4],
                                                                       parameters={"binary_data_size": 128})),
     400, "sent"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape=[8, 10 ** 6])), 400, "fixes it"),
    # a zero-size tensor's other dims: numpy's reshape failed past 2**62 and the client got a 500 (a tester)
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape=[0, 2 ** 70], data=[])), 400, "dims up to 2147483647; entry 1 is"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape=[2 ** 62, 0], data=[])), 400, "entry 0 is"),
    (lambda: _bad(mutate=lambda h: h.update(outputs=[{"name": "nope"}])), 400, "not an output"),
    (lambda: _bad(mutate=lambda h: h.update(outputs=[{"name": "Y", "parameters": {"classification": 2}}])),
     400, "classification"),
    (lambda: _bad(mutate=lambda h: h.update(outputs=[{"name": "Y", "parameters": {"binary_data": "yes"}}])),
     400, "true or false"),
])
def test_bad_requests(case, status, words):
    body, hl = case()
    with pytest.raises(ProtocolError) as info:
        protocol.parse_infer_request(body, hl, SPEC)
    assert info.value.status == status and words in str(info.value)


def _binary_size_as(value):
    return _bad(binary=("X",), mutate=lambda h: h["inputs"][0]["parameters"].update(binary_data_size=value))


@pytest.mark.parametrize("case, words", [
    # X is [2, 4] FP32: 32 bytes; the right number of the wrong type is a type error, not a size mismatch
    (lambda: _binary_size_as("32"), "binary_data_size must be a non-negative integer, got string '32'"),
    (lambda: _binary_size_as(32.0), "binary_data_size must be a non-negative integer, got number 32.0"),
    (lambda: _binary_size_as(True), "binary_data_size must be a non-negative integer, got boolean true"),
    (lambda: _binary_size_as(-32), "binary_data_size must be a non-negative integer"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape=["2", 4])), "entry 0 is string '2'"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape=[2, 4.0])), "entry 1 is number 4.0"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape=[True, 4])), "entry 0 is boolean true"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape="2,4")), "got string '2,4'"),
    (lambda: _bad(mutate=lambda h: h["inputs"][0].update(shape=[2, -4])), "entry 1 is -4"),
    (lambda: (b'{"inputs": []}', "14.0"), f"{HEADER_LENGTH} must be a non-negative integer, got string '14.0'"),
    (lambda: (b'{"inputs": []}', "1_4"), f"{HEADER_LENGTH} must be a non-negative integer, got string '1_4'"),
    (lambda: (b'{"inputs": []}', "+14"), f"{HEADER_LENGTH} must be a non-negative integer"),
    (lambda: (b'{"inputs": []}', "\uff11\uff14"), f"{HEADER_LENGTH} must be a non-negative integer"),
    (lambda: (b'{"inputs": []}', 14.0), f"{HEADER_LENGTH} must be a non-negative integer, got number 14.0"),
    (lambda: (b'{"inputs": []}', True), f"{HEADER_LENGTH} must be a non-negative integer, got boolean true"),
    (lambda: _bad(mutate=lambda h: h.update(outputs=[{"name": "Y", "parameters": {"classification": False}}])),
     "classification must be a non-negative integer, got boolean false"),
    (lambda: _bad(mutate=lambda h: h.update(outputs=[{"name": "Y", "parameters": {"classification": 0.0}}])),
     "classification must be a non-negative integer, got number 0.0"),
])
def test_integer_fields_of_the_wrong_type_say_so(case, words):
    body, hl = case()
    with pytest.raises(ProtocolError) as info:
        protocol.parse_infer_request(body, hl, SPEC)
    assert info.value.status == 400 and words in str(info.value), str(info.value)


def test_header_length_takes_ascii_digits_and_ints():
    body, hl = _bad(binary=("X",))
    for value in (hl, f" {hl} ", int(hl), hl.encode()):
        assert protocol.parse_infer_request(body, value, SPEC).inputs["X"].shape == (2, 4)


def test_declared_size_past_the_cap_is_413_before_allocating():
    big = ModelSpec("m", (TensorSpec("X", np.dtype(np.float32), (-1, -1)),), (), {"X": 0}, 8, max_body_bytes=1024)
    body = json.dumps({"inputs": [{"name": "X", "shape": [8, 2 ** 40], "datatype": "FP32", "data": [1.0]}]}).encode()
    with pytest.raises(ProtocolError) as info:
        protocol.parse_infer_request(body, None, big)
    assert info.value.status == 413


def test_decode_body_caps_and_encodings():
    raw = b"a" * 5000
    assert protocol.decode_body(gzip.compress(raw), "gzip", 5000) == raw
    assert protocol.decode_body(zlib.compress(raw), "deflate", 5000) == raw
    for enc, data in (("gzip", gzip.compress(raw)), ("deflate", zlib.compress(raw)), (None, raw)):
        with pytest.raises(ProtocolError) as info:
            protocol.decode_body(data, enc, 4999)
        assert info.value.status == 413
    for enc, data in (("gzip", b"garbage"), ("br", raw), ("gzip", gzip.compress(raw)[:-10])):
        with pytest.raises(ProtocolError) as info:
            protocol.decode_body(data, enc, 10 ** 6)
        assert info.value.status == 400


def test_metadata_and_statistics_shapes():
    meta = protocol.model_metadata(SPEC)
    assert meta["inputs"] == [{"name": "X", "datatype": "FP32", "shape": [-1, 4]},
                              {"name": "T", "datatype": "INT64", "shape": []}]
    assert meta["outputs"][1] == {"name": "M", "datatype": "BOOL", "shape": [-1]}
    reports = [{"success": {"count": 3, "ns": 30}, "inference_count": 5, "execution_count": 2,
                "batch_stats": {"1": {"count": 1, "ns": 4}, "4": {"count": 1, "ns": 9}}, "x": 1},
               {"success": {"count": 1, "ns": 10}, "inference_count": 4, "execution_count": 1,
                "batch_stats": {4: {"count": 1, "ns": 7}}}]
    s = protocol.statistics(SPEC, reports)["model_stats"][0]
    assert s["inference_stats"]["success"] == {"count": 4, "ns": 40}
    assert s["inference_count"] == 9 and s["execution_count"] == 3
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in s["batch_stats"]] == [(1, 1), (4, 2)]
    assert s["ortcapture"]["replicas"] == reports


# -- the router ---------------------------------------------------------------------------------------------------
class FakeBackend:
    def __init__(self, ready=True):
        self.is_ready = ready
        self.calls = 0

    async def ready(self):
        return self.is_ready

    async def infer(self, feeds_):
        self.calls += 1
        x = feeds_["X"]
        if x[0, 0] < -100:
            return {"error": "the replica refuses it", "status": 400}
        return {"outputs": {"Y": x[:, :3] * 2, "M": x[:, 0] > 0}}


def _call(router, method, path, body=b"", headers=None):
    async def read(cap):
        if len(body) > cap:
            raise ProtocolError("past the cap", 413)
        return body
    h = {k.lower(): v for k, v in (headers or {}).items()}
    return asyncio.run(router.handle(method, path, h, read))


def test_router_endpoints():
    be = FakeBackend(ready=False)
    r = routes.Router(SPEC, be.ready, be.infer)
    assert _call(r, "GET", "/v2/health/live").status == 200
    assert _call(r, "GET", "/v2/health/ready").status == 503
    assert _call(r, "GET", "/v2/models/tiny/ready").status == 503
    body, hl = body_of(feeds())
    res = _call(r, "POST", "/v2/models/tiny/infer", body)
    assert res.status == 503 and "not ready" in json.loads(res.body)["error"] and be.calls == 0
    assert res.headers.get("Retry-After") == "1"  # a client may retry: the replicas are warming up
    be.is_ready = True
    assert _call(r, "GET", "/v2/health/ready").status == 200
    assert json.loads(_call(r, "GET", "/v2/models/tiny").body) == protocol.model_metadata(SPEC)
    assert _call(r, "GET", "/v2/models/tiny/versions/1").status == 200
    assert _call(r, "GET", "/v2/models/tiny/versions/2").status == 404
    assert _call(r, "GET", "/v2/models/other").status == 404
    assert _call(r, "POST", "/v2/models/other/infer", body).status == 404
    assert _call(r, "GET", "/v2/models/tiny/infer").status == 405
    assert _call(r, "GET", "/elsewhere").status == 404
    res = _call(r, "POST", "/v2/models/tiny/versions/1/infer", body)
    assert res.status == 200
    out = json.loads(res.body)["outputs"]
    assert out[0]["data"] == (feeds()["X"][:, :3] * 2).ravel().tolist()
    bad = feeds()
    bad["X"][0, 0] = -1000
    res = _call(r, "POST", "/v2/models/tiny/infer", body_of(bad)[0])
    assert res.status == 400 and json.loads(res.body) == {"error": "the replica refuses it"}
    res = _call(r, "POST", "/v2/models/tiny/infer", b"x" * 5000)
    assert res.status == 413
    res = _call(r, "POST", "/v2/models/tiny/infer", b"{}", {"Content-Length": "999999999"})
    assert res.status == 413
    r.report("a", {"inference_count": 2}, now=0.0)
    r.report("b", {"inference_count": 3}, now=100.0)
    assert [x["replica"] for x in r.replicas(now=101.0)] == ["b"]
    stats = json.loads(_call(r, "GET", "/v2/models/tiny/stats").body)
    assert stats["model_stats"][0]["name"] == "tiny"
    assert _call(r, "GET", "/v2/models/stats").status == 200


def test_import_serving_imports_no_ray():
    """``import ortcapture.serving`` (the batch runner, the protocol, the router) never imports Ray."""
    import subprocess
    import sys

    code = ("import sys, ortcapture.serving, ortcapture.serving.protocol, ortcapture.serving.routes; "
            "print([m for m in sys.modules if m == 'ray' or m.startswith('ray.')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_model_config_of_a_model_with_an_input_without_the_batch_dim_gives_full_shapes():
    """Triton's convention gives every tensor an implicit batch dim when max_batch_size > 0: an input that has none
    (one value per request) was listed as if it had one, and a client built from the config sent a wrong rank."""
    spec = ModelSpec(name="m", inputs=(TensorSpec("X", np.dtype(np.float32), (-1, 4)),
                                       TensorSpec("S", np.dtype(np.float32), (4,))),
                     outputs=(TensorSpec("Y", np.dtype(np.float32), (-1, 4)),), batch_axes={"X": 0}, max_rows=8)
    cfg = protocol.model_config(spec)
    assert cfg["max_batch_size"] == 0
    assert {t["name"]: t["dims"] for t in cfg["input"]} == {"X": [-1, 4], "S": [4]}
    assert cfg["output"][0]["dims"] == [-1, 4]
    batched = ModelSpec(name="m", inputs=spec.inputs[:1], outputs=spec.outputs, batch_axes={"X": 0}, max_rows=8)
    cfg = protocol.model_config(batched)
    assert cfg["max_batch_size"] == 8 and cfg["input"][0]["dims"] == [4] and cfg["output"][0]["dims"] == [4]

