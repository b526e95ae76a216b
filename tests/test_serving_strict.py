"""A server you can put on a network: strict JSON out and in (RFC 8259), BOOL binary bytes, and compressed bodies
decoded as RFC 1950/1952 define them, under the body cap (ortcapture.serving.protocol, no Ray)."""
from __future__ import annotations

import asyncio
import gzip
import json
import struct
import time
import zlib

import numpy as np
import pytest

from ortcapture.serving import protocol, routes
from ortcapture.serving.protocol import DEFAULT_MAX_BODY_BYTES, HEADER_LENGTH, ModelSpec, ProtocolError, TensorSpec

try:  # the BF16 cases skip without it
    import ml_dtypes as _ml

    BF16 = np.dtype(_ml.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes ships with onnx
    BF16 = None

FLOATS = {"FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64), "BF16": BF16}


def _float_types():
    return [pytest.param(k, marks=pytest.mark.skipif(v is None, reason="no ml_dtypes")) for k, v in FLOATS.items()]


def strict_loads(raw):
    """``json.loads`` that refuses what RFC 8259 does not allow (NaN, Infinity, -Infinity), as JS and Go do."""
    def refuse(token):
        raise ValueError(f"{token} is not JSON")
    return json.loads(raw, parse_constant=refuse)


def _model(datatype: str, bool_input=False) -> ModelSpec:
    dt = FLOATS[datatype]
    x = TensorSpec("x", np.dtype(np.bool_) if bool_input else dt, (-1,))
    return ModelSpec("m", (x,), (TensorSpec("y", dt, (-1,)), TensorSpec("z", np.dtype(np.int64), (-1,))),
                     {"x": 0}, 64)


def _json_request(datatype: str, data, name="x") -> bytes:
    return json.dumps({"id": "r", "inputs": [{"name": name, "datatype": datatype, "shape": [len(data)],
                                              "data": data}]}).encode()


# -- 1. strict JSON out -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("datatype", _float_types())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_json_output_with_non_finite_values_is_refused(datatype, bad):
    model = _model(datatype)
    y = np.array([1.0, bad, 2.0]).astype(FLOATS[datatype])
    req = protocol.InferRequest("r", {}, [("z", False), ("y", False)])
    with pytest.raises(ProtocolError) as info:
        protocol.encode_infer_response(model, req, {"y": y, "z": np.arange(3)})
    msg = str(info.value)
    assert info.value.status == 400
    assert "output 'y'" in msg and "non-finite" in msg and "binary_data" in msg and "RFC 8259" in msg, msg


@pytest.mark.parametrize("datatype", _float_types())
def test_binary_output_with_non_finite_values_is_sent(datatype):
    model = _model(datatype)
    dt = FLOATS[datatype]
    y = np.array([np.nan, np.inf, -np.inf, 1.5]).astype(dt)
    req = protocol.InferRequest("r", {}, [("y", True), ("z", False)])
    payload, headers = protocol.encode_infer_response(model, req, {"y": y, "z": np.arange(4)})
    n = int(headers[HEADER_LENGTH])
    head = strict_loads(payload[:n])
    assert head["outputs"][0]["parameters"] == {"binary_data_size": y.nbytes}
    assert head["outputs"][1]["data"] == [0, 1, 2, 3]
    back = np.frombuffer(payload[n:], dtype=dt)
    assert np.array_equal(back.astype(np.float64), y.astype(np.float64), equal_nan=True)


@pytest.mark.parametrize("datatype", _float_types())
def test_json_output_extremes_are_strict_json(datatype):
    dt = FLOATS[datatype]
    big = float(_ml.finfo(dt).max) if datatype == "BF16" else float(np.finfo(dt).max)
    y = np.array([big, -big, 0.0, -0.0, 1e-3]).astype(dt)
    req = protocol.InferRequest(None, {}, [("y", False)])
    payload, headers = protocol.encode_infer_response(_model(datatype), req, {"y": y})
    data = strict_loads(payload)["outputs"][0]["data"]
    assert headers["Content-Type"] == "application/json"
    assert data == y.astype(np.float64).tolist() and np.array(data).astype(dt).tobytes() == y.tobytes()


def test_router_answers_a_non_finite_json_output_with_a_strict_400():
    model = _model("FP32")

    async def ready():
        return True

    async def infer(feeds):
        return {"outputs": {"y": feeds["x"] * np.float32(np.inf), "z": np.arange(len(feeds["x"]))}}

    r = routes.Router(model, ready, infer)

    async def read(cap):
        return body
    body = _json_request("FP32", [1.0, 2.0])
    res = asyncio.run(r.handle("POST", "/v2/models/m/infer", {}, read))
    assert res.status == 400 and "binary_data" in strict_loads(res.body)["error"]
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}],
                       "parameters": {"binary_data_output": True}}).encode()
    res = asyncio.run(r.handle("POST", "/v2/models/m/infer", {}, read))
    n = int(res.headers[HEADER_LENGTH])
    assert res.status == 200 and np.isinf(np.frombuffer(res.body[n:n + 8], np.float32)).all()
    strict_loads(res.body[:n])


def test_error_body_is_strict_json():
    assert strict_loads(protocol.error_body("bad: nan")) == {"error": "bad: nan"}


def test_statistics_never_holds_nan():
    reports = [{"replica": "a", "success": {"count": 2, "ns": float("nan")}, "inference_count": float("inf"),
                "execution_count": np.float32("nan"), "last_inference": 5,
                "batch_stats": {"2": {"count": 1, "ns": float("-inf")}},
                "padding_waste": float("nan"), "per_bucket": {"4": [np.float64("inf"), 0.5, (1.0, float("nan"))]}},
               {"replica": "b", "success": {"count": 1, "ns": 10}, "inference_count": 3, "padding_waste": 0.25}]
    stats = protocol.statistics(_model("FP32"), reports)
    back = strict_loads(json.dumps(stats, allow_nan=False))
    s = back["model_stats"][0]
    assert s["inference_stats"]["success"] == {"count": 3, "ns": 10}
    assert s["inference_count"] == 3 and s["execution_count"] == 0 and s["last_inference"] == 5
    assert s["batch_stats"][0]["compute_infer"] == {"count": 1, "ns": 0}
    a, b = s["ortcapture"]["replicas"]
    assert a["padding_waste"] is None and a["per_bucket"] == {"4": [None, 0.5, [1.0, None]]}
    assert a["success"] == {"count": 2, "ns": None} and b == reports[1]


# -- 2. strict JSON in ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("datatype, value", [
    ("FP16", 65520.0), ("FP16", -65520.0), ("FP16", 65520), ("FP16", 1e5), ("FP16", 1e39),
    ("FP32", 1e39), ("FP32", -1e39), ("FP32", 3.4028236e38), ("FP32", 10 ** 39), ("FP32", -(2 ** 128)),
    ("FP32", 10 ** 400),
    pytest.param("BF16", 3.3961776e38, marks=pytest.mark.skipif(BF16 is None, reason="no ml_dtypes")),
    pytest.param("BF16", 1e39, marks=pytest.mark.skipif(BF16 is None, reason="no ml_dtypes")),
    pytest.param("BF16", 10 ** 39, marks=pytest.mark.skipif(BF16 is None, reason="no ml_dtypes")),
    ("FP64", 10 ** 400), ("FP64", -(10 ** 400)), ("FP64", 2 ** 1024), ("FP64", "1e400"), ("FP32", "-1e400"),
])
def test_json_number_past_the_float_range_is_400(datatype, value):
    raw = _json_request(datatype, [1.0, value])
    if isinstance(value, str):  # a literal JSON number text Python would read as infinity
        raw = raw.replace(json.dumps(value).encode(), value.encode())
    with pytest.raises(ProtocolError) as info:
        protocol.parse_infer_request(raw, None, _model(datatype))
    assert info.value.status == 400
    assert "input 'x'" in str(info.value) and f"out of {datatype}'s range" in str(info.value), str(info.value)


@pytest.mark.parametrize("datatype, value, want", [
    ("FP16", 65504.0, 65504.0), ("FP16", 65519.0, 65504.0), ("FP16", 65519, 65504.0), ("FP16", -65519.9, -65504.0),
    ("FP32", 3.4028235e38, float(np.finfo(np.float32).max)),  # float32 max's shortest repr, above max in decimal
    ("FP32", 3.40282356e38, float(np.finfo(np.float32).max)), ("FP32", 2 ** 128 - 2 ** 104, 2.0 ** 128 - 2.0 ** 104),
    ("FP32", 1e-50, 0.0), ("FP32", 7, 7.0),
    ("FP64", 1.7976931348623157e308, 1.7976931348623157e308), ("FP64", 10 ** 300, 1e300),
    pytest.param("BF16", 3.3961774e38, 3.3895313892515355e38,
                 marks=pytest.mark.skipif(BF16 is None, reason="no ml_dtypes")),
    pytest.param("BF16", 3, 3.0, marks=pytest.mark.skipif(BF16 is None, reason="no ml_dtypes")),
])
def test_json_number_that_rounds_to_a_finite_value_is_taken(datatype, value, want):
    req = protocol.parse_infer_request(_json_request(datatype, [value, 1]), None, _model(datatype))
    x = req.inputs["x"]
    assert x.dtype == FLOATS[datatype] and x.astype(np.float64).tolist() == [want, 1.0]


@pytest.mark.parametrize("where", ["data", "id", "parameters", "shape"])
@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_tokens_in_a_request_are_400(where, token):
    raw = {"data": b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, %s]}]}',
           "id": b'{"id": %s, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}',
           "parameters": b'{"parameters": {"p": %s}, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], '
                         b'"data": [1.0]}]}',
           "shape": b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [%s], "data": [1.0]}]}'}[where]
    raw = raw % token.encode()
    with pytest.raises(ProtocolError) as info:
        protocol.parse_infer_request(raw, None, _model("FP32"))
    assert info.value.status == 400 and "not valid JSON" in str(info.value) and token in str(info.value)


# -- 3. BOOL binary bytes -------------------------------------------------------------------------------------
def _bool_binary_body(raw: bytes) -> tuple[bytes, str]:
    head = json.dumps({"inputs": [{"name": "x", "datatype": "BOOL", "shape": [len(raw)],
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return head + raw, str(len(head))


@pytest.mark.parametrize("raw", [b"\x02", b"\x00\x01\xff", b"\x01" * 7 + b"\x80"])
def test_bool_binary_bytes_other_than_0_and_1_are_400(raw):
    body, hl = _bool_binary_body(raw)
    with pytest.raises(ProtocolError) as info:
        protocol.parse_infer_request(body, hl, _model("FP32", bool_input=True))
    assert info.value.status == 400 and "input 'x'" in str(info.value) and "0" in str(info.value)


def test_bool_binary_bytes_0_and_1_are_taken():
    body, hl = _bool_binary_body(b"\x00\x01\x01\x00")
    x = protocol.parse_infer_request(body, hl, _model("FP32", bool_input=True)).inputs["x"]
    assert x.dtype == np.bool_ and x.tolist() == [False, True, True, False]
    assert x.view(np.uint8).max() <= 1


# -- 4. compressed bodies -------------------------------------------------------------------------------------
def test_gzip_multi_member_body_decodes_every_member():
    a, b = b'{"inputs": ', b"[1, 2, 3]}" * 50
    empty = gzip.compress(b"")
    cases = [gzip.compress(a) + gzip.compress(b), empty + gzip.compress(a) + empty + empty + gzip.compress(b) + empty,
             b"".join(gzip.compress(bytes([c])) for c in a + b), empty, gzip.compress(a, mtime=0) * 3]
    wants = [a + b, a + b, a + b, b"", a * 3]
    for body, want in zip(cases, wants):
        assert protocol.decode_body(body, "gzip", 10 ** 6) == want
    # a member with the optional header fields (FEXTRA, FNAME, FCOMMENT, FHCRC) as the gzip tool may write them
    header = b"\x1f\x8b\x08\x1e" + b"\0" * 4 + b"\x00\x03" + struct.pack("<H", 3) + b"abc" + b"x.json\0" + b"hi\0"
    header += struct.pack("<H", zlib.crc32(header) & 0xFFFF)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    member = header + c.compress(b) + c.flush() + struct.pack("<II", zlib.crc32(b), len(b))
    assert protocol.decode_body(gzip.compress(a) + member, "gzip", 10 ** 6) == a + b


def test_many_empty_gzip_members_decode_in_linear_time():
    body = gzip.compress(b"") * 200_000 + gzip.compress(b"{}")  # 4 MB of members
    t = time.perf_counter()
    assert protocol.decode_body(body, "gzip", 10 ** 6) == b"{}"
    assert time.perf_counter() - t < 5


@pytest.mark.parametrize("tail", [b"junk", b"\0", b"\0" * 64, b"\n", b"  ", b"\x1f", b"\x1f\x8b",
                                  b"\x1f\x8b\x08\0\0\0\0\0\0\xff", b"TRAILING" * 100])
@pytest.mark.parametrize("enc", ["gzip", "deflate"])
def test_bytes_after_the_last_member_are_400(enc, tail):
    raw = b'{"inputs": []}'
    body = gzip.compress(raw) if enc == "gzip" else zlib.compress(raw)
    assert protocol.decode_body(body, enc, 10 ** 6) == raw
    with pytest.raises(ProtocolError) as info:
        protocol.decode_body(body + tail, enc, 10 ** 6)
    assert info.value.status == 400 and f"{len(tail)} bytes after" in str(info.value), str(info.value)


@pytest.mark.parametrize("tail", [lambda m: m[:-1], lambda m: m[:12], lambda m: m[:-4] + b"\0\0\0\0",
                                  lambda m: m[:-8] + b"\0\0\0\0" + m[-4:]])
def test_a_bad_or_truncated_second_member_is_400(tail):
    m = gzip.compress(b"[1, 2, 3]")
    with pytest.raises(ProtocolError) as info:
        protocol.decode_body(m + tail(m), "gzip", 10 ** 6)
    assert info.value.status == 400 and "after its 1 complete gzip member" in str(info.value), str(info.value)


def test_two_zlib_streams_are_not_one_deflate_body():
    with pytest.raises(ProtocolError) as info:
        protocol.decode_body(zlib.compress(b"a") + zlib.compress(b"b"), "deflate", 10 ** 6)
    assert info.value.status == 400


def test_the_cap_counts_every_member():
    member = gzip.compress(b"x" * 1000)
    assert len(protocol.decode_body(member * 4, "gzip", 4000)) == 4000
    with pytest.raises(ProtocolError) as info:
        protocol.decode_body(member * 4 + gzip.compress(b"y"), "gzip", 4000)
    assert info.value.status == 413
    with pytest.raises(ProtocolError) as info:
        protocol.decode_body(member * 5, "gzip", 4999)
    assert info.value.status == 413


@pytest.fixture(scope="module")
def gib_bombs() -> dict[str, bytes]:
    """1 GiB of zeros as a valid gzip and a valid zlib (deflate) body of about 1 MB each, built from identical
    fully-flushed 1 MiB deflate blocks (no GiB in memory)."""
    zeros = bytes(1 << 20)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH) == block
    c = zlib.compressobj(9, zlib.DEFLATED, -15)  # the last MiB: its own blocks, the final one flagged
    raw = first + block * 1022 + c.compress(zeros) + c.flush()
    crc = 0
    for _ in range(1024):
        crc = zlib.crc32(zeros, crc)
    gib = 1 << 30
    return {"gzip": b"\x1f\x8b\x08\0\0\0\0\0\x02\xff" + raw + struct.pack("<II", crc, gib & 0xFFFFFFFF),
            "deflate": b"\x78\xda" + raw + struct.pack(">I", ((gib % 65521) << 16) | 1)}  # adler32 of zeros


@pytest.mark.parametrize("enc", ["gzip", "deflate"])
@pytest.mark.parametrize("cap", [4096, DEFAULT_MAX_BODY_BYTES])
def test_a_gib_bomb_is_413_fast(gib_bombs, enc, cap):
    body = gib_bombs[enc]
    assert len(body) < 2 << 20
    if cap == 4096:  # the bomb is a valid body: its start inflates to zeros
        d = zlib.decompressobj(wbits=31 if enc == "gzip" else 15)
        assert d.decompress(body, 1 << 16) == bytes(1 << 16)
    t = time.perf_counter()
    with pytest.raises(ProtocolError) as info:
        protocol.decode_body(body, enc, cap)
    assert info.value.status == 413 and time.perf_counter() - t < 1.0


def test_a_bomb_spread_over_many_members_is_413_fast():
    cap = DEFAULT_MAX_BODY_BYTES
    member = gzip.compress(bytes(cap // 10), 9)
    body = member * 1000  # 1000 members of cap/10 each: 100 caps
    t = time.perf_counter()
    with pytest.raises(ProtocolError) as info:
        protocol.decode_body(body, "gzip", cap)
    assert info.value.status == 413 and time.perf_counter() - t < 1.5
