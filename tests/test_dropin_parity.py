"""The drop-in behaves as ORT does for what it cannot serve from a graph (issue 30 item 5): run options ORT honours
(``terminate``), output names ORT refuses, and ``run_async``, serialised like ``run`` on both EPs. Each case is
compared with a raw onnxruntime session side by side."""
from __future__ import annotations

import textwrap
import warnings

import numpy as np
import onnxruntime as ort
import pytest

import ortcapture
from tests import tiny


def _raw(backend, model):
    return ort.InferenceSession(model, **backend.session_args(False))


def _ort_error(fn):
    with pytest.raises(Exception) as info:
        fn()
    return info.value


@pytest.fixture
def patched_session(backend):
    model = tiny.dynamic_model()
    with ortcapture.patched(backend.name), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sess = ort.InferenceSession(model)
    return sess, _raw(backend, model)


def test_terminate_raises_as_ort_raises_and_nothing_replays(patched_session, rng):
    sess, raw = patched_session
    x = rng.random((2, 4), np.float32)
    sess.run(None, {"X": x})  # a graph exists for this shape now
    replayed = sess.stats["replayed"]
    ro = ort.RunOptions()
    ro.terminate = True
    want = _ort_error(lambda: raw.run(None, {"X": x}, ro))
    got = _ort_error(lambda: sess.run(None, {"X": x}, ro))
    assert type(got) is type(want) and "terminate" in str(got)
    assert sess.stats["replayed"] == replayed  # no replay returned outputs instead
    assert ro.terminate  # the caller's run options are left as given


@pytest.mark.parametrize("names", [["nope"], ["Y", "nope"], "Y"], ids=["unknown", "one-unknown", "a-string"])
def test_output_names_ort_refuses_get_orts_error_before_any_replay(patched_session, rng, names):
    sess, raw = patched_session
    x = rng.random((2, 4), np.float32)
    out = sess.get_outputs()[0].name
    names = [out if n == "Y" else n for n in names] if isinstance(names, list) else out
    sess.run(None, {"X": x})
    replayed = sess.stats["replayed"]
    want = _ort_error(lambda: raw.run(names, {"X": x}))
    got = _ort_error(lambda: sess.run(names, {"X": x}))
    assert type(got) is type(want)
    assert sess.stats["replayed"] == replayed


def test_repeated_output_names_are_separate_arrays(patched_session, rng):
    sess, raw = patched_session
    x = rng.random((2, 4), np.float32)
    out = sess.get_outputs()[0].name
    sess.run(None, {"X": x})
    a, b = sess.run([out, out], {"X": x})
    assert sess.stats["replayed"] >= 1 and a is not b
    np.testing.assert_allclose(a, raw.run([out], {"X": x})[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(a, b)


def test_run_async_gives_orts_results_and_errors(patched_session, rng):
    import threading

    sess, raw = patched_session
    x = rng.random((2, 4), np.float32)

    def call(s, names, feeds, ro=None):
        done, box = threading.Event(), []
        s.run_async(names, feeds, lambda res, ud, err: (box.append((res, ud, err)), done.set()), "ud", ro)
        assert done.wait(60)
        return box[0]

    res, ud, err = call(sess, None, {"X": x})
    assert ud == "ud" and err == ""
    np.testing.assert_allclose(res[0], raw.run(None, {"X": x})[0], rtol=1e-5, atol=1e-6)
    for names in (["nope"],):  # ORT reports run failures through the callback: so does the drop-in
        r_res, _, r_err = call(raw, names, {"X": x})
        g_res, _, g_err = call(sess, names, {"X": x})
        assert g_res == r_res == [] and g_err == r_err != ""
    ro = ort.RunOptions()
    ro.terminate = True
    r_res, _, r_err = call(raw, None, {"X": x}, ro)
    g_res, _, g_err = call(sess, None, {"X": x}, ro)
    assert g_res == r_res == [] and g_err == r_err != ""
    # what ORT raises at once (a missing input, a feed it cannot convert) is raised at once, as ORT raises it
    for feeds in ({}, {"X": np.float32(1.0)}):
        want = _ort_error(lambda: raw.run_async(None, feeds, lambda *a: None, None))
        got = _ort_error(lambda: sess.run_async(None, feeds, lambda *a: None, None))
        assert type(got) is type(want) and str(got) == str(want)


# run_async of a patched session beside another session replaying on the same device, in a child process (unguarded,
# WebGPU ended in a segfault about every other run; CUDA: error 901 in the capturing thread)
_CONCURRENT = textwrap.dedent("""
    import sys, threading, warnings
    import numpy as np, onnxruntime as ort
    import ortcapture
    from tests import tiny
    from tests.conftest import Backend

    backend = Backend(sys.argv[1])
    rng = np.random.default_rng(0)
    errors = []
    other = backend.session(tiny.affine_model((64, 64)))
    x64 = rng.random((64, 64), np.float32)
    stop = threading.Event()

    def replays():  # another session: replays (and on CUDA, captures) while run_async runs
        try:
            for i in range(400):
                if stop.is_set():
                    break
                if backend.name == "cuda" and i % 20 == 0:
                    g = other.capture({"X": x64}, verify="off")
                else:
                    g = graphs[0]
                y = g.run({"X": x64})[0]
                assert np.allclose(y, x64 * 2 + 1), "wrong replay"
                if g is not graphs[0]:
                    g.release()
        except BaseException as exc:
            errors.append(repr(exc))

    graphs = [other.capture({"X": x64})]
    with ortcapture.patched(backend.name), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sess = ort.InferenceSession(tiny.dynamic_model())
    t = threading.Thread(target=replays)
    t.start()
    for i in range(60):
        x = rng.random((2 + i % 3, 4), np.float32)
        done, box = threading.Event(), []
        sess.run_async(None, {"X": x}, lambda res, ud, err: (box.append((res, err)), done.set()), None)
        if not done.wait(60):
            errors.append("callback never came")
            break
        res, err = box[0]
        if err or res[0].shape != (x.shape[0], 4):
            errors.append(f"run_async: {err!r}")
            break
    stop.set()
    t.join(120)
    print("ERRORS", errors)
    sys.exit(1 if errors else 0)
""")


def _concurrent(name: str) -> None:
    from tests.children import run_python

    proc = run_python(_CONCURRENT, name, timeout=300)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert "Command encoding already finished" not in tail and "already finished" not in tail, tail


def test_run_async_is_serialised_beside_another_sessions_replays(backend):
    _concurrent(backend.name)


def test_run_options_of_the_wrong_type_get_orts_error_type(patched_session, rng):
    sess, raw = patched_session
    x = rng.random((2, 4), np.float32)
    for bad in ({"gpu_graph_id": "-1"}, "terminate"):
        want = _ort_error(lambda: raw.run(None, {"X": x}, bad))
        got = _ort_error(lambda: sess.run(None, {"X": x}, bad))
        assert type(got) is type(want) is TypeError


def test_run_with_ortvaluevector_runs_as_ort_runs_it(patched_session, rng):
    """A library's ``run_with_ortvaluevector`` (no gpu_graph_id) is ORT's run, not a CaptureError."""
    from onnxruntime.capi import _pybind_state as C

    from ortcapture._ort.compat import c_device

    sess, raw = patched_session
    x = rng.random((2, 4), np.float32)
    out = sess.get_outputs()[0].name
    cpu = c_device(ort.OrtDevice.make("cpu", 0))
    results = []
    for s in (raw, sess):
        feeds, fetches = C.OrtValueVector(), C.OrtValueVector()
        feeds.push_back(ort.OrtValue.ortvalue_from_numpy(x)._ortvalue)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            s.run_with_ortvaluevector(ort.RunOptions(), ["X"], feeds, [out], fetches, [cpu])
        results.append(np.array(fetches[0].numpy()))
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6)
