"""Batch buckets under adversarial use (issue 16 hardening): feeds ORT refuses, aliasing, run options, split, eviction
races, host-read inputs that encode the batch, output lengths beyond a bucket's graph, the CUDA direct copies."""
from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortcapture.errors import CaptureError
from tests import tiny
from tests.bucket_checks import TOL, close, cpu, run_threads
from tests.tiny import _model, vi





def raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return exc
    raise AssertionError("no exception")


# -- feeds ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["float64", "rank3", "fixed_dim", "scalar", "tuple"])
def test_feeds_ort_refuses_raise_orts_error_and_leave_no_graph(backend, bad):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [2, 4]})
    x = np.ones((3, 4), np.float32)
    feed = {"float64": x.astype(np.float64), "rank3": x[None], "fixed_dim": np.ones((3, 5), np.float32),
            "scalar": 3.0, "tuple": ((1.0, 2.0, 3.0, 4.0),)}[bad]
    want = raised(lambda: cpu(model).run(None, {"X": feed}))
    got = raised(lambda: sess.run(None, {"X": feed}))
    assert type(got) is type(want) and not isinstance(got, CaptureError), (got, want)
    st = sess.bucket_stats()
    assert st["refused"] == 0 and st["captured"] == 0 and st["uncaptured"] == 1
    sess.run(None, {"X": x})  # a good request afterwards is served from a graph
    assert sess.bucket_stats()["replayed"] == 1
    if bad in ("float64", "fixed_dim"):  # warmup examples: a clear refusal, nothing captured or refused
        with pytest.raises(CaptureError, match="warmup: input 'X'"):
            sess.warmup({"X": feed})
        assert sess.bucket_stats()["refused"] == 0 and sess.bucket_stats()["captured"] == 1


def test_list_feeds_are_converted_as_ort_converts_them(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [2, 4]})
    rows = [[1, 2, 3, 4], [0, -1, 2, 5], [3, 3, 1, 0]]  # ints for a float input: ORT casts them
    for g, w in zip(sess.run(None, {"X": rows}), cpu(model).run(None, {"X": rows})):
        close(g, w, TOL[backend.name])
    assert sess.bucket_stats()["replayed"] == 1


def test_strided_feeds_and_outputs_never_alias(backend):
    model = tiny.bucket_model()
    ref = cpu(model)
    sess = backend.session(model, buckets={"batch": [4, 8]})
    rng = np.random.default_rng(11)
    base = rng.standard_normal((6, 8)).astype(np.float32)
    feeds = [np.asfortranarray(base[:3, :4]), base[::-2, ::2], base[1:6, 4:][::-1]]  # F order, negative strides
    kept = [f.copy() for f in feeds]
    first = None
    for x in feeds:
        got = sess.run(None, {"X": x})
        for g, w in zip(got, ref.run(None, {"X": np.ascontiguousarray(x)})):
            close(g, w, TOL[backend.name])
        if first is None:
            first = (got, [g.copy() for g in got])
    assert all(np.array_equal(f, k) for f, k in zip(feeds, kept))  # the caller's arrays are never written
    # outputs returned by an earlier run are the caller's: later runs (same graph, other sizes) leave them alone
    assert all(np.array_equal(g, k) for g, k in zip(*first))


def _repeated_batch_model() -> bytes:
    """Y = X * 2, Z = X + 2 for X [batch, 4], with Y listed twice as a graph output."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [helper.make_node("Mul", ["X", "two"], ["Y"]), helper.make_node("Add", ["X", "two"], ["Z"])]
    return _model(nodes, [vi("X", ["batch", 4])], [vi(n, ["batch", 4]) for n in ("Y", "Z", "Y")], [two])


def test_an_output_asked_for_twice_comes_back_as_separate_arrays(backend):
    sess = backend.session(tiny.bucket_model(), buckets={"batch": [4]})
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 5
    a, b = sess.run(["scores", "scores"], {"X": x})
    np.testing.assert_array_equal(a, b)
    assert not np.shares_memory(a, b)  # as ORT returns them: writing one leaves the other alone
    rep = backend.session(_repeated_batch_model(), buckets={"batch": [4]})
    y1, z, y2 = rep.run(None, {"X": x})
    np.testing.assert_array_equal(y1, x * 2)
    np.testing.assert_array_equal(z, x + 2)
    np.testing.assert_array_equal(y2, x * 2)
    assert not np.shares_memory(y1, y2)


def test_run_options_terminate_raises_as_ort_does(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [4]})
    x = np.ones((3, 4), np.float32)
    sess.run(None, {"X": x})  # the bucket is captured: a replay would ignore the flag
    ro = ort.RunOptions()
    ro.terminate = True
    want = raised(lambda: cpu(model).run(None, {"X": x}, ro))
    got = raised(lambda: sess.run(None, {"X": x}, ro))
    assert type(got) is type(want) and "terminate" in str(got)


# -- split ------------------------------------------------------------------------------------------------------------
def _max_over_batch_model() -> bytes:
    """Y = Relu(X) [batch, 4] and M = ReduceMax(Y, axis 0) [4]: zero padding leaves M alone (Y >= 0), so a padded
    bucket verifies, but M of a chunk is not M of the batch."""
    return _model([helper.make_node("Relu", ["X"], ["Y"]),
                   helper.make_node("ReduceMax", ["Y"], ["M"], axes=[0], keepdims=0)],
                  [vi("X", ["batch", 4])], [vi("Y", ["batch", 4]), vi("M", [4])])


def test_split_runs_uncaptured_when_an_output_has_no_batch_axis(backend):
    model = _max_over_batch_model()
    sess = backend.session(model, buckets={"batch": [2, 4]}, oversize="split")
    x = np.random.default_rng(2).standard_normal((9, 4)).astype(np.float32)
    sess.run(None, {"X": x[:3]})  # decides the output axes; the bucket verifies (padding keeps M)
    y, m = sess.run(None, {"X": x})
    want_y, want_m = cpu(model).run(None, {"X": x})
    close(y, want_y, TOL[backend.name])
    close(m, want_m, TOL[backend.name])  # the max of all 9 rows, not of the first chunk
    st = sess.bucket_stats()
    assert st["split"] == 0 and st["uncaptured"] == 1 and st["oversize"] == 1
    (y,) = sess.run(["Y"], {"X": x})  # only outputs with rows: split
    close(y, want_y, TOL[backend.name])
    assert sess.bucket_stats()["split"] == 1


# -- threads ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("replay_thread", [False, True])
def test_eviction_racing_runs_from_other_threads(backend, replay_thread):
    model = tiny.bucket_model()
    ref = cpu(model)
    sess = backend.session(model, buckets={"batch": [1, 2, 4]}, max_graphs=1, replay_thread=replay_thread)
    errors, fed = [], []
    lock = threading.Lock()

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(10):
                n = int(rng.integers(1, 5))
                x = rng.standard_normal((n, 4)).astype(np.float32)
                for g, w in zip(sess.run(None, {"X": x}), ref.run(None, {"X": x})):
                    close(g, w, TOL[backend.name])
                with lock:
                    fed.append(n)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_threads(work, 4)
    assert not errors, errors
    st = sess.bucket_stats()
    assert st["replayed"] == 40 and st["evicted"] >= 1 and len(st["buckets"]) == 1
    padded = sum({1: 1, 2: 2, 3: 4, 4: 4}[n] - n for n in fed)
    assert st["padding_waste"] == pytest.approx(padded / (sum(fed) + padded))  # every replay, evicted graphs' too


# -- models -----------------------------------------------------------------------------------------------------------
def _reshape_model() -> bytes:
    """Y = -Reshape(X, S) with X [batch, 4] and the shape S an int64 graph input (ORT reads it on the host; the Neg:
    an output computed by a kernel, not a view)."""
    return _model([helper.make_node("Reshape", ["X", "S"], ["r"]), helper.make_node("Neg", ["r"], ["Y"])],
                  [vi("X", ["batch", 4]), vi("S", [2], TensorProto.INT64)], [vi("Y", ["a", "b"])], check=False)


def test_a_host_read_input_that_encodes_the_batch_is_a_capture_error(backend):
    model = _reshape_model()
    sess = backend.session(model, buckets={"batch": [2, 4]}, output_axes={"Y": {0: lambda n: 2 * n}})
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    flat = np.array([-1, 2], np.int64)
    np.testing.assert_array_equal(sess.run(None, {"X": x, "S": flat})[0], -x.reshape(-1, 2))
    np.testing.assert_array_equal(sess.run(None, {"X": x[:1], "S": flat})[0], -x[:1].reshape(-1, 2))
    exact = np.array([3, 4], np.int64)  # a plain run takes it; padded to 4 rows it cannot reshape to [3, 4]
    np.testing.assert_array_equal(cpu(model).run(None, {"X": x, "S": exact})[0], -x)
    with pytest.raises(CaptureError, match=r"padded or cut to batch=4.*\['S'\]"):
        sess.run(None, {"X": x, "S": exact})
    with pytest.raises(CaptureError, match="padded or cut"):  # remembered for that value
        sess.run(None, {"X": x, "S": exact})
    np.testing.assert_array_equal(sess.run(None, {"X": x, "S": exact}, _uncaptured())[0], -x)
    st = sess.bucket_stats()
    assert st["captured"] == 2 and st["refused"] == 1 and st["replayed"] == 2


def test_the_relation_probe_failing_in_ort_is_a_capture_error(backend):
    sess = backend.session(_reshape_model(), buckets={"batch": [2, 4]})
    x = np.ones((3, 4), np.float32)
    with pytest.raises(CaptureError, match=r"padded or cut to batch=.*\['S'\]"):
        sess.run(None, {"X": x, "S": np.array([3, 4], np.int64)})


def _uncaptured():
    from ortcapture import run_options_for

    return run_options_for(-1)


def _first_rows_model(k=4) -> bytes:
    """Y = -X[:k] along the batch: min(batch, k) rows — follows the batch at probe sizes <= k, not beyond."""
    ints = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("s", 0), ("e", k), ("a", 0))]
    return _model([helper.make_node("Slice", ["X", "s", "e", "a"], ["r"]), helper.make_node("Neg", ["r"], ["Y"])],
                  [vi("X", ["batch", 4])],
                  [vi("Y", ["rows", 4])], ints)


@pytest.mark.parametrize("verify", [True, False])
def test_an_output_shorter_than_the_request_is_refused_not_sliced_past(backend, verify):
    model = _first_rows_model()
    sess = backend.session(model, buckets={"batch": [2, 4, 8]}, verify=verify)
    x = np.arange(28, dtype=np.float32).reshape(7, 4)
    np.testing.assert_array_equal(sess.run(None, {"X": x[:3]})[0], -x[:3])  # probes at 4 and 2: "follows"
    with pytest.raises(CaptureError, match=r"'Y'.*length 4 along axis 0.*needs 7"):
        sess.run(None, {"X": x})  # bucket 8's graph has 4 rows: never a read past them
    declared = backend.session(model, buckets={"batch": [2, 4, 8]}, output_axes={"Y": {0: lambda n: min(n, 4)}})
    np.testing.assert_array_equal(declared.run(None, {"X": x})[0], -x[:4])


# -- CUDA direct copies -----------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_copies_row_by_row_beyond_the_max_pitch(backend, monkeypatch):
    """The 2-D copies fall back to 1-D calls per row where a pitch exceeds cudaDevAttrMaxPitch (an output or input
    above 2 GiB); forced here with a tiny limit, results must be unchanged."""
    if backend.name != "cuda":
        pytest.skip("CUDA direct copies")
    from ortcapture._ort import cudart as _cudart

    monkeypatch.setattr(_cudart, "MAX_PITCH", 8)
    lead = backend.session(tiny.bucket_model(), buckets={"batch": [4, 8]})
    last = backend.session(tiny.batch_last_model(), buckets={("X", 1): [4, 8]})
    ref = cpu(tiny.bucket_model())
    rng = np.random.default_rng(4)
    t = rng.standard_normal((4, 1)).astype(np.float32)
    for n in (3, 7, 2, 8, 1):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        for g, w in zip(lead.run(None, {"X": x}), ref.run(None, {"X": x})):
            close(g, w, 1e-2)
        got = last.run(None, {"X": x.T.copy(), "T": t})[0]
        np.testing.assert_allclose(got, x.T * 2 + t, rtol=1e-6)
    assert lead.bucket_stats()["replayed"] == 5 and last.bucket_stats()["replayed"] == 5


@pytest.mark.cuda
def test_cuda_buckets_on_a_second_device_from_a_fresh_thread(backend):
    """Feeds are copied with the buffer's device current, whatever device the calling thread last used."""
    if backend.name != "cuda":
        pytest.skip("CUDA")
    from ortcapture._ort import compat as _compat
    from ortcapture._ort import providers as _providers

    import ortcapture

    rt = _compat.cudart()
    if rt is None or int(rt.cudaGetDeviceCount()[1]) < 2:
        pytest.skip("needs two CUDA devices and cuda-python")
    model = tiny.batch_last_model()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ortcapture.InferenceSession(model, **_providers.session_args("cuda", True, so, device_id=1),
                                       buckets={("X", 1): [4, 8]})
    rng = np.random.default_rng(6)
    t = rng.standard_normal((4, 1)).astype(np.float32)
    out, errors = [], []

    def work():
        try:
            rt.cudaSetDevice(0)
            for n in (3, 6, 2):
                x = rng.standard_normal((4, n)).astype(np.float32)
                out.append((sess.run(None, {"X": x, "T": t})[0], x * 2 + t))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert not errors, errors
    for got, want in out:
        np.testing.assert_allclose(got, want, rtol=1e-6)


# -- drop-in ----------------------------------------------------------------------------------------------------------
def test_patched_buckets_warn_only_when_a_bucket_is_refused(backend, tmp_path):
    """Under ``patched(buckets=...)`` the verification's CPU reference is ORT's session: no "without graph capture"
    warning. The caller's own CPU session of a bucketed model gets no buckets, and one warning says so."""
    import warnings

    import ortcapture

    path = tmp_path / "bucket.onnx"
    path.write_bytes(tiny.bucket_model())
    x = np.random.default_rng(8).standard_normal((3, 4)).astype(np.float32)
    want = cpu(tiny.bucket_model()).run(None, {"X": x})
    with ortcapture.patched(backend.name, buckets={str(path): {"batch": [4]}}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any RuntimeWarning fails the test
            sess = ort.InferenceSession(str(path))
            for g, w in zip(sess.run(None, {"X": x}), want):
                close(g, w, TOL[backend.name])
        with pytest.warns(RuntimeWarning, match="not applied"):
            mine = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for g, w in zip(mine.run(None, {"X": x}), want):
            close(g, w, 1e-6)
        assert sess.bucket_stats()["replayed"] == 1 and mine._oc_buckets is None
