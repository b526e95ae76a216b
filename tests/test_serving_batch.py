"""The serving batch runner (issue 29, item 1): requests validated alone, grouped, concatenated, run through the
buckets, split back; one result or one exception per request, in order."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortcapture
from ortcapture.errors import CaptureError
from ortcapture.serving import BatchRunner, RequestError
from tests import tiny
from tests.bucket_checks import TOL, close, cpu, run_threads

OUTPUTS = ("scores", "probs", "feat")


def scaled_model() -> bytes:
    """Y = X * t + 1 with X [batch, 3] and t a 0-d float (one value for the whole batch)."""
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    nodes = [helper.make_node("Mul", ["X", "t"], ["m"]), helper.make_node("Add", ["m", "one"], ["Y"])]
    return tiny._model(nodes, [tiny.vi("X", ["batch", 3]), tiny.vi("t", [])], [tiny.vi("Y", ["batch", 3])], [one])


def _x(rng, n, cols=4):
    return rng.standard_normal((n, cols)).astype(np.float32)


class Recorder:
    """Wraps ``sess.run`` (an instance attribute, as the runner calls it): the feeds and outputs of every run the
    runner makes (without run options)."""

    def __init__(self, sess, fail=None):
        self.real = sess.run
        self.runs: list[tuple[dict, list]] = []
        self.fail = fail
        sess.run = self

    def __call__(self, names, feeds, run_options=None):
        if run_options is not None:  # the bucket verification's own gpu_graph_id=-1 reference runs
            return self.real(names, feeds, run_options)
        if self.fail is not None and self.fail(feeds):
            raise RuntimeError("this run failed")
        outs = self.real(names, feeds, run_options)
        self.runs.append(({k: v.copy() for k, v in feeds.items()}, [o.copy() for o in outs]))
        return outs


def _exact_slice(runner, rec, request, result):
    """``result`` is bit-for-bit the slice of one recorded run whose feeds hold ``request`` at that offset."""
    axes = runner.input_axes
    for feeds, outs in rec.runs:
        for name, axis in axes.items():
            x, big = request[name], feeds[name]
            n = x.shape[axis]
            for off in range(big.shape[axis] - n + 1):
                if np.array_equal(np.take(big, range(off, off + n), axis=axis), x):
                    if all(np.array_equal(np.take(o, range(off, off + n), axis=runner.output_axes[nm]), result[nm])
                           for nm, o in zip(runner._output_names, outs)):
                        return
    raise AssertionError("the response is no exact slice of a recorded session run")


def test_public_bucket_accessors(backend):
    sess = backend.session(tiny.bucket_model(), buckets={"batch": [1, 2, 4, 8]})
    assert sess.bucket_dims() == {"batch": {"sizes": (1, 2, 4, 8), "sites": (("X", 0),)}}
    # decided now (no run yet) by two uncaptured probes; the batch axis of each output, named or not
    assert sess.bucket_output_axes() == {"scores": {"batch": (0,)}, "probs": {"batch": (0,)}, "feat": {"batch": (1,)}}
    assert sess.bucket_stats()["captured"] == 0
    last = backend.session(tiny.batch_last_model(), buckets={("X", 1): [2, 4]})
    assert last.bucket_dims() == {"X[1]": {"sizes": (2, 4), "sites": (("X", 1),)}}
    assert last.bucket_output_axes() == {"Y": {"X[1]": (1,)}}
    pooled = backend.session(tiny.batch_pooled_model(), buckets={"batch": [2, 4]})
    assert pooled.bucket_output_axes() == {"Y": {}}
    plain = ortcapture.InferenceSession(tiny.bucket_model(), providers=["CPUExecutionProvider"])
    for call in (plain.bucket_dims, plain.bucket_output_axes):
        with pytest.raises(CaptureError, match="buckets="):
            call()
    assert ortcapture.DEFAULT_RTOL == 1e-2


def test_metadata_and_defaults(backend):
    sess = backend.session(tiny.bucket_model(), buckets={"batch": [1, 2, 4, 8]})
    r = BatchRunner(sess)
    assert r.inputs == [("X", np.dtype(np.float32), (-1, 4))]
    assert r.outputs == [("scores", np.dtype(np.float32), (-1, 3)), ("probs", np.dtype(np.float32), (-1, 3)),
                         ("feat", np.dtype(np.float32), (3, -1))]
    assert (r.max_rows, r.split, r.dim, r.output_axes) == (8, False, "batch", {"scores": 0, "probs": 0, "feat": 1})
    assert BatchRunner(sess, max_rows=4).max_rows == 4
    for bad in (0, -1, True, 2.0, "8"):
        with pytest.raises(ValueError, match="max_rows"):
            BatchRunner(sess, max_rows=bad)


def test_one_group_is_bit_exact_with_sess_run_of_the_concatenation(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [1, 2, 4, 8]})
    r = BatchRunner(sess)
    rng = np.random.default_rng(0)
    requests = [{"X": _x(rng, n)} for n in (1, 2, 3, 2)]
    saved = [q["X"].copy() for q in requests]
    results = r.run(requests)
    whole = sess.run(None, {"X": np.concatenate([q["X"] for q in requests])})
    ref = cpu(model)
    start = 0
    for q, res in zip(requests, results):
        n = q["X"].shape[0]
        assert list(res) == list(OUTPUTS)
        for name, axis, big in zip(OUTPUTS, (0, 0, 1), whole):
            assert np.array_equal(res[name], np.take(big, range(start, start + n), axis=axis))
            assert res[name].flags.c_contiguous
        alone = sess.run(None, q)
        for name, a, w in zip(OUTPUTS, alone, ref.run(None, q)):
            close(res[name], a, ortcapture.DEFAULT_RTOL)
            close(res[name], w, TOL[backend.name])
        start += n
    assert all(np.array_equal(q["X"], s) for q, s in zip(requests, saved))  # requests never written
    stats = r.stats()
    assert stats == {"requests": 4, "failed_requests": 0, "bad_requests": 0, "batches": 1, "failed_batches": 0,
                     "isolation_runs": 0, "rows": 8, "batch_rows": {8: 1}}


def test_groups_are_cut_into_runs_of_whole_requests(backend):
    sess = backend.session(tiny.bucket_model(), buckets={"batch": [1, 2, 4, 8]})
    r = BatchRunner(sess)
    rec = Recorder(sess)
    rng = np.random.default_rng(1)
    sizes = (5, 4, 3, 2, 6, 1, 8)
    requests = [{"X": _x(rng, n)} for n in sizes]
    results = r.run(requests)
    assert all(f["X"].shape[0] <= 8 for f, _ in rec.runs)
    assert sum(f["X"].shape[0] for f, _ in rec.runs) == sum(sizes)
    assert len(rec.runs) == 4  # 29 rows: first-fit decreasing needs ceil(29 / 8) = 4 runs
    for q, res in zip(requests, results):
        assert res["scores"].shape == (q["X"].shape[0], 3) and res["feat"].shape == (3, q["X"].shape[0])
        _exact_slice(r, rec, q, res)
    assert r.stats()["batches"] == 4 and sum(r.stats()["batch_rows"].values()) == 4


def test_split_cuts_a_large_request_and_joins_it_back(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [2, 4]})
    rng = np.random.default_rng(2)
    big, small = {"X": _x(rng, 11)}, {"X": _x(rng, 3)}
    res = BatchRunner(sess).run([big, small])
    assert isinstance(res[0], RequestError) and "11 rows" in str(res[0]) and res[0].input == "X"
    close(res[1]["probs"], cpu(model).run(["probs"], small)[0], TOL[backend.name])
    r = BatchRunner(sess, split=True)
    rec = Recorder(sess)
    res = r.run([small, big])
    assert [f["X"].shape[0] for f, _ in rec.runs] == [4, 4, 4, 2]  # 14 rows, densely
    ref = cpu(model)
    for q, out in zip([small, big], res):
        for name, w in zip(OUTPUTS, ref.run(None, q)):
            close(out[name], w, TOL[backend.name])
    assert sess.bucket_stats()["uncaptured"] == 0  # every run served by a bucket


def test_each_kind_of_bad_request_fails_alone(backend):
    model = tiny.add_model(shape=("batch", 4))
    sess = backend.session(model, buckets={"batch": [1, 2, 4]})
    r = BatchRunner(sess)
    rng = np.random.default_rng(3)

    def good(n):
        return {"A": _x(rng, n), "B": _x(rng, n)}

    bad = [
        ({"A": _x(rng, 2)}, "B", "missing"),
        ({**good(1), "C": _x(rng, 1)}, "C", "unknown"),
        ({"A": _x(rng, 2).astype(np.float64), "B": _x(rng, 2)}, "A", "float32 in the model"),
        ({"A": _x(rng, 2)[None], "B": _x(rng, 2)}, "A", "rank 2"),
        ({"A": _x(rng, 2, cols=5), "B": _x(rng, 2)}, "A", "fixed at 4"),
        ({"A": _x(rng, 2).tolist(), "B": _x(rng, 2)}, "A", "numpy array"),
        ({"A": np.float32(1.0), "B": _x(rng, 1)}, "A", "numpy array"),
        ({"A": _x(rng, 2), "B": _x(rng, 3)}, None, "disagree"),
        ({"A": _x(rng, 0), "B": _x(rng, 0)}, "A", "0 rows"),
        ({"A": _x(rng, 5), "B": _x(rng, 5)}, "A", "more than the 4"),
        ([("A", _x(rng, 1))], None, "mapping"),
    ]
    for q, name, text in bad:
        with pytest.raises(RequestError, match=text) as info:
            r.rows(q)
        assert info.value.input == name
        requests = [good(1), q, good(3)]
        results = r.run(requests)
        assert isinstance(results[1], RequestError) and text in str(results[1])
        for i in (0, 2):
            np.testing.assert_array_equal(results[i]["C"], requests[i]["A"] + requests[i]["B"])
    assert r.stats()["bad_requests"] == len(bad) and r.stats()["failed_requests"] == len(bad)


def test_inputs_without_the_bucketed_dim_must_be_equal_to_share_a_run(backend):
    sess = backend.session(scaled_model(), buckets={"batch": [1, 2, 4, 8]})
    r = BatchRunner(sess)
    assert r.inputs == [("X", np.dtype(np.float32), (-1, 3)), ("t", np.dtype(np.float32), ())]
    rec = Recorder(sess)
    rng = np.random.default_rng(4)
    ts = (2.0, 3.0, 2.0, -0.5, 3.0)
    requests = [{"X": _x(rng, 2, cols=3), "t": np.array(t, np.float32)} for t in ts]
    results = r.run(requests)
    assert sorted(float(f["t"]) for f, _ in rec.runs) == [-0.5, 2.0, 3.0]  # one run per value
    for q, res in zip(requests, results):
        close(res["Y"], q["X"] * q["t"] + 1, 1e-6)
        _exact_slice(r, rec, q, res)
    # a failing run fails only its own group's requests
    rec = Recorder(sess, fail=lambda feeds: float(feeds["t"]) == 3.0)
    results = r.run(requests)
    for q, res in zip(requests, results):
        if float(q["t"]) == 3.0:
            assert isinstance(res, RuntimeError) and "this run failed" in str(res)
        else:
            close(res["Y"], q["X"] * q["t"] + 1, 1e-6)
    stats = r.stats()
    assert stats["failed_batches"] == 1 and stats["failed_requests"] == 2 and stats["bad_requests"] == 0
    assert stats["isolation_runs"] == 2  # the failed run's two requests, each run alone (and failing alone)


def test_0d_inputs_and_outputs_keep_their_shape_through_the_buckets(backend):
    """A 0-d input is captured 0-d (not (1,)); a 0-d output comes back 0-d from run_with_ort_values too."""
    nodes = [helper.make_node("Mul", ["X", "t"], ["Y"]), helper.make_node("Mul", ["t", "t"], ["u"])]
    model = tiny._model(nodes, [tiny.vi("X", ["batch", 3]), tiny.vi("t", [])],
                        [tiny.vi("Y", ["batch", 3]), tiny.vi("u", [])])
    sess = backend.session(model, buckets={"batch": [2, 4]})
    feeds = {"X": np.ones((3, 3), np.float32), "t": np.array(3.0, np.float32)}
    y, u = sess.run(None, feeds)
    assert y.shape == (3, 3) and u.shape == () and float(u) == 9.0
    vals = sess.run_with_ort_values(None, {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feeds.items()})
    assert vals[1].shape() == [] and sess.bucket_stats()["replayed"] == 2
    with pytest.raises(CaptureError, match="output 'u' has no axis"):
        BatchRunner(sess)


def test_outputs_that_do_not_follow_the_batch_are_refused_when_made(backend):
    pooled = backend.session(tiny.batch_pooled_model(), buckets={"batch": [2, 4]})
    with pytest.raises(CaptureError, match=r"output 'Y' has no axis that follows"):
        BatchRunner(pooled)
    doubled = backend.session(tiny.batch_doubled_model(), buckets={"batch": [2, 4]},
                              output_axes={"Y": {0: lambda n: 2 * n}})
    with pytest.raises(CaptureError, match=r"output 'Y' has no axis"):
        BatchRunner(doubled)
    never = backend.session(tiny.bucket_model(), buckets={"batch": [2, 4]}, output_axes={"feat": None})
    with pytest.raises(CaptureError, match=r"output 'feat'"):
        BatchRunner(never)
    with pytest.raises(CaptureError, match="buckets="):
        BatchRunner(ortcapture.InferenceSession(tiny.bucket_model(), providers=["CPUExecutionProvider"]))
    with pytest.raises(TypeError, match="ortcapture.InferenceSession"):
        BatchRunner(ort.InferenceSession(tiny.bucket_model(), providers=["CPUExecutionProvider"]))


@pytest.mark.parametrize("make", [cpu, lambda m: ortcapture.InferenceSession(m, providers=["CPUExecutionProvider"])])
def test_dim_batches_a_session_without_capture(make):
    """The CPU EP baseline: no buckets, no capture; the runner still groups, measuring the output axes itself."""
    model = tiny.bucket_model()
    sess = make(model)
    r = BatchRunner(sess, dim="batch", max_rows=6)
    assert (r.dim, r.sizes, r.max_rows, r.input_axes, r.output_axes) == (
        "batch", (), 6, {"X": 0}, {"scores": 0, "probs": 0, "feat": 1})
    assert r.inputs == [("X", np.dtype(np.float32), (-1, 4))]
    assert BatchRunner(sess, dim=("X", 0), max_rows=4).dim == "X[0]"
    rec = Recorder(sess)
    rng = np.random.default_rng(5)
    requests = [{"X": _x(rng, n)} for n in (2, 5, 1, 3, 6)]
    requests.insert(2, {"X": _x(rng, 7)})
    results = r.run(requests)
    assert isinstance(results[2], RequestError) and "more than the 6" in str(results[2])
    assert sorted(f["X"].shape[0] for f, _ in rec.runs) == [5, 6, 6]  # 17 rows: 3 runs of whole requests
    ref = cpu(model)
    for q, res in zip(requests, results):
        if isinstance(res, RequestError):
            continue
        _exact_slice(r, rec, q, res)
        for name, w in zip(OUTPUTS, ref.run(None, q)):
            close(res[name], w, 1e-5)
    with pytest.raises(ValueError, match="max_rows"):
        BatchRunner(sess, dim="batch")
    for bad, text in (("nope", "no input dim is named"), (("X", 1), "fixed at 4"), (("Y", 0), "names no input"),
                      (3, "dim_param")):
        with pytest.raises(CaptureError, match=text):
            BatchRunner(sess, dim=bad, max_rows=4)
    with pytest.raises(CaptureError, match="output 'Y' has no axis"):
        BatchRunner(cpu(tiny.batch_pooled_model()), dim="batch", max_rows=4)


def test_dim_is_refused_on_capturing_sessions(backend):
    with pytest.raises(CaptureError, match="leave dim= out"):
        BatchRunner(backend.session(tiny.bucket_model(), buckets={"batch": [2, 4]}), dim="batch", max_rows=4)
    with pytest.raises(CaptureError, match="without capture"):
        BatchRunner(backend.session(tiny.affine_model()), dim=("X", 0), max_rows=4)


def test_runs_from_several_threads_never_cross(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [1, 2, 4, 8]})
    r = BatchRunner(sess)
    errors = []

    def work(i):
        rng = np.random.default_rng(100 + i)
        for _ in range(5):
            requests = [{"X": _x(rng, int(n))} for n in rng.integers(1, 5, size=4)]
            for q, res in zip(requests, r.run(requests)):
                want = tiny.bucket_reference(q["X"])
                try:
                    for name in OUTPUTS:
                        close(res[name], want[name], TOL[backend.name])
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

    run_threads(work, 4)
    assert not errors
    assert r.stats()["requests"] == 80 and r.stats()["failed_requests"] == 0


def test_import_serving_imports_no_ray():
    code = "import sys, ortcapture.serving; assert not any(m.split('.')[0] == 'ray' for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


_SESSIONS: dict = {}
BUCKET_SETS = [(1, 2, 4, 8), (2, 4), (3,), (1, 5)]
BAD = ["dtype", "rank", "missing", "too_many", "not_array"]


def _session(backend, sizes):
    key = (backend.name, sizes)
    if key not in _SESSIONS:
        _SESSIONS[key] = backend.session(tiny.bucket_model(), buckets={"batch": list(sizes)})
    return _SESSIONS[key]


def test_property_random_sizes_buckets_and_a_bad_request(backend):
    """Random request sizes, bucket sets and split modes with one bad request of a random kind anywhere (hypothesis,
    25 examples): in order, the bad one alone fails, every other is an exact slice of its run and equals the
    request alone within DEFAULT_RTOL."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    settings = hypothesis.settings(max_examples=25, deadline=None,
                                   suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
    settings(hypothesis.given(data=st.data())(lambda data: _property_example(backend, data, st)))()


def _property_example(backend, data, st):
    sizes = data.draw(st.sampled_from(BUCKET_SETS), "buckets")
    split = data.draw(st.booleans(), "split")
    largest = sizes[-1]
    rows = data.draw(st.lists(st.integers(1, largest + (3 if split else 0)), min_size=1, max_size=8), "rows")
    bad_at = data.draw(st.integers(0, len(rows)), "bad_at")
    kind = data.draw(st.sampled_from(BAD), "kind")
    seed = data.draw(st.integers(0, 2**16), "seed")
    sess = _session(backend, sizes)
    r = BatchRunner(sess, split=split)
    rec = Recorder(sess)
    rng = np.random.default_rng(seed)
    requests = [{"X": _x(rng, n)} for n in rows]
    bad = {"dtype": {"X": _x(rng, 1).astype(np.float16)}, "rank": {"X": _x(rng, 4)},
           "missing": {}, "too_many": {"X": _x(rng, largest + 1)}, "not_array": {"X": 1.0}}[kind]
    if kind == "rank":
        bad["X"] = bad["X"].reshape(1, 4, 4)
    requests.insert(bad_at, bad)
    try:
        results = r.run(requests)
    finally:
        sess.run = rec.real
    assert len(results) == len(requests)
    assert all(f["X"].shape[0] <= largest for f, _ in rec.runs)
    if split:  # packed densely in request order: the runs' outputs joined are the group's, request after request
        joined = [np.concatenate([outs[k] for _, outs in rec.runs], axis=ax) for k, ax in enumerate((0, 0, 1))]
    offset = 0
    for i, (q, res) in enumerate(zip(requests, results)):
        if i == bad_at and not (kind == "too_many" and split):
            assert isinstance(res, RequestError), (kind, res)
            continue
        assert isinstance(res, dict), res
        n = q["X"].shape[0]
        assert res["scores"].shape == (n, 3) and res["feat"].shape == (3, n)
        if split:
            for name, big, ax in zip(OUTPUTS, joined, (0, 0, 1)):
                assert np.array_equal(res[name], np.take(big, range(offset, offset + n), axis=ax))
        else:  # whole requests, each an exact slice of one run
            _exact_slice(r, rec, q, res)
        offset += n
        if n <= largest:
            for name, a in zip(OUTPUTS, sess.run(None, q)):
                close(res[name], a, ortcapture.DEFAULT_RTOL)
        want = tiny.bucket_reference(q["X"])
        for name in OUTPUTS:
            close(res[name], want[name], TOL[backend.name])


class Poisoned(Exception):
    """What a session raises for a run that holds a poisoned row: its text names the value, as ORT's errors do."""


def test_a_batchmate_whose_values_fail_the_run_fails_alone_and_never_leaks(backend):
    """Issue 43, item 1: a request whose value passes every check but fails the run (as ORT's own errors do, e.g. a
    Gather index out of range) fails alone, with the text of its own run; its batchmates get their answers, and no
    error text carries another request's values."""
    sess = backend.session(tiny.bucket_model(), buckets={"batch": [1, 2, 4, 8]})
    r = BatchRunner(sess)
    real = sess.run

    def run(names, feeds, run_options=None):
        x = feeds["X"]
        bad = x[(x > 900) & (x < 1000)]
        if run_options is None and bad.size:
            raise Poisoned(f"value {float(bad[0]):.1f} out of range")
        return real(names, feeds, run_options)

    sess.run = run
    rng = np.random.default_rng(7)
    requests = [{"X": _x(rng, n)} for n in (1, 2, 3, 2)]
    requests[1]["X"][1, 2] = 901.0 + 0  # the poisoned request
    requests[3]["X"][0, 0] = 950.0
    secrets = (901.0, 950.0)
    results = r.run(requests)
    ref = cpu(tiny.bucket_model())
    for i, (q, res) in enumerate(zip(requests, results)):
        if i in (1, 3):
            assert isinstance(res, Poisoned)
            own = f"{secrets[(i - 1) // 2]:.1f}"
            other = f"{secrets[1 - (i - 1) // 2]:.1f}"
            assert own in str(res) and other not in str(res)  # its own run's text, never a batchmate's value
        else:
            for name, want in zip(OUTPUTS, ref.run(None, q)):
                close(res[name], want, TOL[backend.name])
    stats = r.stats()
    assert stats["failed_requests"] == 2 and stats["isolation_runs"] >= 2 and stats["failed_batches"] >= 1


def int64_model() -> bytes:
    """Y = Cast(ids, float) + X with ids int64 [batch, 4] and X float [batch, 4]."""
    nodes = [helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["f", "X"], ["Y"])]
    return tiny._model(nodes, [tiny.vi("ids", ["batch", 4], TensorProto.INT64), tiny.vi("X", ["batch", 4])],
                       [tiny.vi("Y", ["batch", 4])])


@pytest.mark.webgpu
def test_a_value_the_webgpu_buffer_refuses_is_refused_alone_before_batching():
    """Issue 43, item 1: int64 beyond int32 into a WebGPU graph (its EP keeps the low 32 bits; ortcapture's copy
    refuses it) is found by rows() — the copy's own rule (ortcapture.transfer.value_rules) — so it fails its own
    request with a RequestError naming the input, and its batchmates run."""
    from tests.conftest import Backend, webgpu_available

    webgpu_available()  # skips where the WebGPU plugin cannot capture (ORT < 1.27) or no adapter is there
    sess = Backend("webgpu").session(int64_model(), buckets={"batch": [1, 2, 4]})
    r = BatchRunner(sess)
    rng = np.random.default_rng(3)
    good = [{"ids": rng.integers(-5, 5, (n, 4)).astype(np.int64), "X": _x(rng, n)} for n in (1, 2)]
    bad = {"ids": np.full((1, 4), 2**40 + 7, np.int64), "X": _x(rng, 1)}
    with pytest.raises(RequestError) as info:
        r.rows(bad)
    assert info.value.input == "ids" and "int32" in str(info.value) and "'ids'" in str(info.value)
    results = r.run([good[0], bad, good[1]])
    assert isinstance(results[1], RequestError) and str(2**40 + 7) in str(results[1])
    for q, res in zip(good, (results[0], results[2])):
        close(res["Y"], q["ids"].astype(np.float32) + q["X"], 1e-6)
        assert str(2**40 + 7) not in str(res)
    assert r.stats()["failed_batches"] == 0  # refused before any batch ran
    assert r.rows({"ids": np.full((1, 4), 2**31 - 1, np.int64), "X": _x(rng, 1)}) == 1  # the edge is fine
