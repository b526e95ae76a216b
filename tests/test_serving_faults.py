"""A server you can put on a network (issue 43), the parts that need no Ray: a client's fault stays its own after
batching (the replica's attribution), the bearer token, refusals that carry ``Retry-After``, strict JSON from the
router, the port check and the new options."""
from __future__ import annotations

import json
import socket

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortcapture.errors import CaptureError
from ortcapture.serving import routes
from ortcapture.serving.config import ServeOptions, check_port, read_token
from tests import tiny
from tests.test_serving_protocol import SPEC, FakeBackend, _call, body_of, feeds

TOKEN = "s3cret-token-0123456789abcdef"


def gather_model() -> bytes:
    """Y = Gather(table, idx) + X: idx int64 [batch, 4] indexes a table of 10 floats; X float [batch, 4]. The CPU EP
    refuses an index outside [-10, 10) with an error naming it — a value that passes every protocol check."""
    table = numpy_helper.from_array(np.arange(10, dtype=np.float32) / 4, "table")
    nodes = [helper.make_node("Gather", ["table", "idx"], ["g"], axis=0), helper.make_node("Add", ["g", "X"], ["Y"])]
    return tiny._model(nodes, [tiny.vi("idx", ["batch", 4], TensorProto.INT64), tiny.vi("X", ["batch", 4])],
                       [tiny.vi("Y", ["batch", 4])], [table])


@pytest.fixture
def core(tmp_path):
    from ortcapture.serving.replica import ReplicaCore

    path = tmp_path / "gather.onnx"
    path.write_bytes(gather_model())
    return ReplicaCore(ServeOptions(str(path), provider="cpu", buckets=[1, 2, 4]).checked(), "cpu")


def _req(rng, n, bad=None):
    idx = rng.integers(0, 10, (n, 4)).astype(np.int64)
    if bad is not None:
        idx[0, 1] = bad
    return {"idx": idx, "X": rng.standard_normal((n, 4)).astype(np.float32)}


def _want(q):
    return (np.arange(10, dtype=np.float32) / 4)[q["idx"]] + q["X"]


def test_a_value_that_fails_the_run_is_the_senders_400_alone_and_never_leaks(core):
    """A batch of three where one request's index is out of range (ORT's own error, after batching): that request
    alone gets a 400 whose text is its own run's (its value, never a batchmate's); the others get their answers;
    the solo runs are counted in the replica's report."""
    rng = np.random.default_rng(1)
    requests = [_req(rng, 1), _req(rng, 2, bad=77777), _req(rng, 1, bad=-55555)]
    requests[0]["idx"][0, 0] = 3
    answers = core.answers(core.run(requests))
    assert answers[0]["outputs"]["Y"].shape == (1, 4)
    np.testing.assert_allclose(answers[0]["outputs"]["Y"], _want(requests[0]), rtol=1e-6)
    for i, own, other in ((1, "77777", "55555"), (2, "55555", "77777")):
        assert answers[i]["status"] == 400, answers[i]
        assert own in answers[i]["error"] and other not in answers[i]["error"]
    rep = core.report()
    assert rep["isolation_runs"] >= 3 and rep["failed_batches"] >= 1 and rep["client_faults_after_run"] == 2


def test_a_lone_request_that_fails_is_a_400_while_the_replica_is_healthy_and_a_500_without_values_if_not(core):
    rng = np.random.default_rng(2)
    bad = _req(rng, 1, bad=424242)
    (answer,) = core.answers(core.run([bad]))
    assert answer["status"] == 400 and "424242" in answer["error"]  # the health replay passed: the value is at fault

    def broken():
        raise CaptureError("health check: the replay differs")

    core.check_health = broken
    (answer,) = core.answers(core.run([bad]))
    assert answer["status"] == 500 and "424242" not in answer["error"] and "model failed" in answer["error"]


def test_bearer_token_guards_every_endpoint_but_health():
    be = FakeBackend()
    r = routes.Router(SPEC, be.ready, be.infer, token=TOKEN)
    body, _ = body_of(feeds())
    assert _call(r, "GET", "/v2/health/live").status == 200
    assert _call(r, "GET", "/v2/health/ready").status == 200
    for method, path in (("GET", "/v2"), ("GET", "/v2/models/tiny"), ("GET", "/v2/models/tiny/ready"),
                         ("GET", "/v2/models/tiny/stats"), ("POST", "/v2/models/tiny/infer"), ("GET", "/nowhere")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                        {"Authorization": TOKEN}):
            res = _call(r, method, path, body, headers)
            assert res.status == 401 and res.headers["WWW-Authenticate"] == "Bearer", (path, headers)
            assert TOKEN not in res.body.decode()
    assert be.calls == 0
    ok = {"Authorization": f"Bearer {TOKEN}"}
    assert _call(r, "POST", "/v2/models/tiny/infer", body, ok).status == 200
    assert _call(r, "GET", "/v2/models/tiny/stats", headers={"authorization": f"bearer  {TOKEN} "}).status == 200


def test_refusals_carry_retry_after_and_stats_show_the_ingress():
    class Busy(FakeBackend):
        async def infer(self, feeds_):
            return {"error": "256 requests are queued already", "status": 503, "retry_after": 1}

    be = Busy()
    counters = {"queued": 256, "max_queued": 256}
    r = routes.Router(SPEC, be.ready, be.infer, ingress_stats=lambda: counters)
    res = _call(r, "POST", "/v2/models/tiny/infer", body_of(feeds())[0])
    assert res.status == 503 and res.headers["Retry-After"] == "1"

    async def stalled(cap):
        raise routes.Refusal("the request body made no progress for 10 s", 408, {"Connection": "close"})

    import asyncio

    res = asyncio.run(r.handle("POST", "/v2/models/tiny/infer", {}, stalled))
    assert res.status == 408 and res.headers["Connection"] == "close"
    stats = json.loads(_call(r, "GET", "/v2/models/tiny/stats").body)["model_stats"][0]["ortcapture"]["ingress"]
    assert stats["queued"] == 256 and stats["http_errors"] == {"408": 1, "503": 1}


def test_json_bodies_of_the_router_are_strict():
    with pytest.raises(ValueError):
        routes.json_response(200, {"x": float("nan")})
    assert json.loads(routes.json_response(200, {"x": 1.5}).body) == {"x": 1.5}


def test_a_port_in_use_is_refused_in_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(CaptureError) as info:
            check_port("127.0.0.1", port)
        assert f"--port {port}" in str(info.value) and "\n" not in str(info.value)
    with socket.socket() as s:  # SO_REUSEPORT, as Ray Serve's proxy binds: still refused
        if hasattr(socket, "SO_REUSEPORT"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(CaptureError):
            check_port("127.0.0.1", s.getsockname()[1])
    check_port("127.0.0.1", port)  # closed: free again (SO_REUSEADDR: TIME_WAIT does not count)


def test_new_options_are_checked(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(tiny.bucket_model())
    token = tmp_path / "token"
    token.write_text(TOKEN + "\nignored\n")
    o = ServeOptions(str(model), token_file=str(token)).checked()
    assert o.token == TOKEN and TOKEN not in repr(o)
    assert (o.request_timeout_s, o.max_queued, o.body_timeout_s, o.max_pending_bodies) == (60.0, 256, 10.0, 64)
    short = tmp_path / "short"
    short.write_text("abc\n")
    for kwargs, words in (({"token_file": str(short)}, "16 visible"), ({"token_file": str(tmp_path / "no")}, "read"),
                          ({"max_queued": 0}, "max_queued"), ({"body_timeout_s": -1}, "body_timeout_s"),
                          ({"request_timeout_s": True}, "request_timeout_s"),
                          ({"max_pending_bodies": 2.5}, "max_pending_bodies"),
                          ({"ssl_certfile": str(token)}, "both"),
                          ({"ssl_certfile": str(tmp_path / "x"), "ssl_keyfile": str(token)}, "no such file")):
        with pytest.raises(CaptureError, match=words):
            ServeOptions(str(model), **kwargs).checked()
    with pytest.raises(CaptureError, match="16 visible"):
        read_token(str(short))


def test_model_config_and_an_empty_body():
    """Triton's model configuration at /config (what tritonclient's get_model_config reads); an empty infer body is
    said to be empty."""
    be = FakeBackend()
    r = routes.Router(SPEC, be.ready, be.infer)
    res = _call(r, "GET", "/v2/models/tiny/config")
    assert res.status == 200
    cfg = json.loads(res.body)
    # SPEC has an input without the batch dim (T): Triton's form for it is max_batch_size 0 and full shapes
    assert any(s.name not in SPEC.batch_axes for s in SPEC.inputs)
    assert cfg["name"] == "tiny" and cfg["max_batch_size"] == 0 and cfg["backend"] == "onnxruntime"
    assert [i["name"] for i in cfg["input"]] == [s.name for s in SPEC.inputs]
    first = SPEC.inputs[0]
    assert cfg["input"][0]["data_type"] == "TYPE_" + first.datatype and cfg["input"][0]["dims"] == list(first.shape)
    res = _call(r, "POST", "/v2/models/tiny/infer", b"")
    assert res.status == 400 and "empty" in json.loads(res.body)["error"]


def test_a_tls_pair_that_does_not_load_is_refused_before_ray_starts(tmp_path):
    """A swapped certificate/key pair (or a key of another certificate) left Ray Serve's proxy not listening while the
    server printed its https URL: now one line before anything starts."""
    from tests.test_serving_server import _self_signed

    cert, key = _self_signed(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _, key2 = _self_signed(other)
    model = tmp_path / "m.onnx"
    model.write_bytes(tiny.bucket_model())
    ServeOptions(str(model), ssl_certfile=str(cert), ssl_keyfile=str(key)).checked()  # the right pair loads
    for c, k in ((key, cert), (cert, key2)):
        with pytest.raises(CaptureError, match="not a certificate and its private key") as info:
            ServeOptions(str(model), ssl_certfile=str(c), ssl_keyfile=str(k)).checked()
        assert "\n" not in str(info.value)


def test_json_that_does_not_parse_names_the_header_it_trusted():
    """tritonclient can leave an Inference-Header-Content-Length in a reused headers dict: the 400 says which part it
    read as JSON."""
    from ortcapture.serving import protocol
    from ortcapture.serving.protocol import ProtocolError

    body = b'{"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}'
    with pytest.raises(ProtocolError, match="Inference-Header-Content-Length"):
        protocol.parse_infer_request(body, "20", SPEC)


def test_property_interleaved_good_and_bad_requests_each_get_exactly_their_own_answer(core):
    """Issue 43, item 8: random interleavings of good requests and bad ones of every kind — a value only the model
    refuses (an index out of range: ORT's own error, found after batching), a wrong dtype, a wrong fixed dim — batched
    together: every good request gets exactly its own right answer, every bad one exactly its own 4xx, whose text
    names no other request's value."""
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    kinds = st.sampled_from(["good", "good", "good", "index", "dtype", "shape"])

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(plan=st.lists(st.tuples(kinds, st.integers(1, 3)), min_size=1, max_size=9), seed=st.integers(0, 2**16))
    def check(plan, seed):
        rng = np.random.default_rng(seed)
        requests, secrets = [], []
        for i, (kind, rows) in enumerate(plan):
            q = _req(rng, rows, bad=(1000 + 97 * i + seed % 89) if kind == "index" else None)
            if kind == "dtype":
                q["X"] = q["X"].astype(np.float64)
            elif kind == "shape":
                q["X"] = np.zeros((rows, 5), np.float32)
            requests.append(q)
            secrets.append(str(1000 + 97 * i + seed % 89) if kind == "index" else None)
        answers = core.answers(core.run(requests))
        assert len(answers) == len(requests)
        for i, ((kind, rows), q, a) in enumerate(zip(plan, requests, answers)):
            if kind == "good":
                assert "outputs" in a, a
                np.testing.assert_allclose(a["outputs"]["Y"], _want(q), rtol=1e-6)
                continue
            assert a.get("status") == 400, (kind, a)
            others = [s for j, s in enumerate(secrets) if s is not None and j != i]
            assert not any(s in a["error"] for s in others), (a["error"], others)
            if kind == "index":
                assert secrets[i] in a["error"]

    check()
