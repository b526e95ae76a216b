"""hypothesis-made bodies at the router's infer endpoint never crash it nor get a 5xx; valid requests round-trip
(issue 29, item 3). Skipped where hypothesis is not installed (the GPU machine, unless staged)."""
from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ortcapture.serving import protocol, routes  # noqa: E402
from ortcapture.serving.protocol import HEADER_LENGTH, ModelSpec, ProtocolError, TensorSpec  # noqa: E402
from tests.test_serving_protocol import SPEC, FakeBackend, _call, body_of  # noqa: E402
from tests.test_serving_strict import strict_loads  # noqa: E402

_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                            lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                            max_leaves=20)


def _tensor_like():
    return st.fixed_dictionaries(
        {"name": st.sampled_from(["X", "T", "Q", ""]) | st.text(max_size=4)},
        optional={"shape": st.lists(st.integers(-2, 10), max_size=3) | _json_values,
                  "datatype": st.sampled_from(["FP32", "INT64", "FP64", "BYTES", "BOOL"]) | _json_values,
                  "data": st.lists(st.integers(-3, 3) | st.floats(allow_nan=False, width=32), max_size=40)
                  | _json_values,
                  "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-4, 200)})
                  | _json_values})


_requests = st.fixed_dictionaries({}, optional={
    "inputs": st.lists(_tensor_like(), max_size=3) | _json_values,
    "outputs": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["Y", "M", "Z"])},
                                              optional={"parameters": _json_values}), max_size=3) | _json_values,
    "parameters": st.fixed_dictionaries({}, optional={"binary_data_output": st.booleans() | _json_values}),
    "id": st.text(max_size=4) | _json_values})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(req=_requests, tail=st.binary(max_size=64), header=st.none() | st.integers(-5, 400) | st.text(max_size=4),
       raw=st.none() | st.binary(max_size=64))
def test_router_never_5xx_on_fuzzed_bodies(req, tail, header, raw):
    be = FakeBackend()
    r = routes.Router(SPEC, be.ready, be.infer)
    body = raw if raw is not None else json.dumps(req).encode() + tail
    headers = {} if header is None else {HEADER_LENGTH: str(header)}
    res = _call(r, "POST", "/v2/models/tiny/infer", body, headers)
    assert res.status in (200, 400, 413), res.body
    if res.status == 200:  # strict JSON (RFC 8259: no NaN or Infinity), what JS and Go clients parse
        strict_loads(res.body[:int(res.headers.get(HEADER_LENGTH, len(res.body)))])
    else:
        assert set(strict_loads(res.body)) == {"error"}


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 8), binary=st.sets(st.sampled_from(["X", "T"])), t=st.integers(-2 ** 63, 2 ** 63 - 1),
       values=st.floats(width=32, allow_nan=False))
def test_valid_requests_round_trip(rows, binary, t, values):
    f = {"X": np.full((rows, 4), values, np.float32), "T": np.array(t, np.int64)}
    body, hl = body_of(f, binary)
    if "X" not in binary and not math.isfinite(values):  # json.dumps wrote Infinity, which is not JSON
        with pytest.raises(ProtocolError) as info:
            protocol.parse_infer_request(body, hl, SPEC)
        assert info.value.status == 400 and "Infinity" in str(info.value)
        return
    req = protocol.parse_infer_request(body, hl, SPEC)
    assert np.array_equal(req.inputs["X"], f["X"]) and int(req.inputs["T"]) == t


_FLOAT_DTYPES = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}


@settings(max_examples=200, deadline=None)
@given(datatype=st.sampled_from(sorted(_FLOAT_DTYPES)),
       value=st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2 ** 1100), 2 ** 1100))
def test_json_float_inputs_round_to_the_datatype_or_are_400(datatype, value):
    """A finite JSON number for a float datatype becomes the nearest float64 rounded to the datatype, or a 400 naming
    the input when that is infinity (never inf in the tensor, never a crash)."""
    dt = np.dtype(_FLOAT_DTYPES[datatype])
    model = ModelSpec("m", (TensorSpec("x", dt, (1,)),), ())
    body = json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": [1], "data": [value]}]}).encode()
    try:
        wide = float(value)
    except OverflowError:
        wide = math.inf
    with np.errstate(over="ignore"):
        want = np.float64(wide).astype(dt) if math.isfinite(wide) else dt.type(math.inf)
    if not np.isfinite(want):
        with pytest.raises(ProtocolError) as info:
            protocol.parse_infer_request(body, None, model)
        assert info.value.status == 400 and "input 'x'" in str(info.value) and "range" in str(info.value)
    else:
        x = protocol.parse_infer_request(body, None, model).inputs["x"]
        assert x.dtype == dt and x.tobytes() == np.array([want], dt).tobytes()


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.binary(max_size=300), max_size=6), tail=st.none() | st.binary(min_size=1, max_size=40),
       cap=st.integers(0, 1200))
def test_gzip_members_decode_to_their_concatenation(parts, tail, cap):
    """A body of gzip members (empty ones too) is every member's data, under a cap over them all; any bytes after
    the last member (that are not members) are a 400."""
    body = b"".join(gzip.compress(p) for p in parts) + (tail or b"")
    want = b"".join(parts)
    try:
        got = protocol.decode_body(body, "gzip", cap)
    except ProtocolError as exc:
        assert (exc.status == 413 and len(want) > cap) or (exc.status == 400 and (tail or not parts)), str(exc)
        return
    assert got == want and tail is None and parts and len(want) <= cap
