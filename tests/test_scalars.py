"""Scalar (0-d) inputs work wherever arrays do (issue 30 item 2): capture and its varied input set, g.run, buckets
(no bucketed dim: passed through, part of the graph key) and the drop-in's replays. A numpy scalar
(``np.float32(0.5)``, not an ndarray) is a TransferError naming the input in ortcapture's API, and ORT's own error
under ORT's API (buckets=, the drop-in)."""
from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest

import ortcapture
from ortcapture.errors import TransferError
from tests import tiny


def _raw_error(feeds):
    """ORT's own exception for ``feeds`` (CPU EP: the numpy bridge refuses before any EP is involved)."""
    raw = ort.InferenceSession(tiny.scalar_input_model(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as info:
        raw.run(None, feeds)
    return info.value


def test_capture_verifies_and_replays_a_scalar_input(backend, rng):
    sess = backend.session(tiny.scalar_input_model(), static_shapes={"X": (2, 4)})
    x = rng.random((2, 4), np.float32)
    g = sess.capture({"X": x, "T": np.array(0.5, np.float32)})  # verify="full": the varied set varies T too
    assert g.verification.input_sets == ["example", "varied"] and "T" not in g.verification.not_varied
    assert g.inputs["T"].shape() == []
    np.testing.assert_allclose(g.run()[0], x * 0.5, rtol=1e-6)
    np.testing.assert_allclose(g.run({"T": np.array(3.0, np.float32)})[0], x * 3, rtol=1e-6)
    g.release()


def test_a_numpy_scalar_is_a_transfer_error_naming_the_input(backend, rng):
    sess = backend.session(tiny.scalar_input_model(), static_shapes={"X": (2, 4)})
    x = rng.random((2, 4), np.float32)
    with pytest.raises(TransferError, match=r"'T'.*numpy scalar \(float32\)"):
        sess.capture({"X": x, "T": np.float32(0.5)})
    g = sess.capture({"X": x, "T": np.array(0.5, np.float32)}, verify="off")
    with pytest.raises(TransferError, match=r"input 'T'.*numpy scalar"):
        g.run({"T": np.float32(2.0)})
    with pytest.raises(TransferError, match="numpy scalar"):
        ortcapture.update_inplace(g.inputs["T"], np.float64(2.0))
    np.testing.assert_allclose(g.run()[0], x * 0.5, rtol=1e-6)  # nothing was changed
    g.release()


def test_buckets_pass_a_scalar_input_through(backend, rng):
    sess = backend.session(tiny.scalar_input_model(), buckets={"batch": [1, 2, 4]})
    x = rng.random((3, 4), np.float32)
    for t in (0.5, 2.0, -1.0):
        y = sess.run(None, {"X": x, "T": np.array(t, np.float32)})[0]
        np.testing.assert_allclose(y, x * t, rtol=1e-6)
    stats = sess.bucket_stats()
    assert stats["captured"] == 1 and stats["replayed"] == 3 and stats["uncaptured"] == 0  # T's value: no new graph
    # a numpy scalar: ORT's own error, as ORT gives it
    want = _raw_error({"X": x, "T": np.float32(2.0)})
    with pytest.raises(type(want)) as got:
        sess.run(None, {"X": x, "T": np.float32(2.0)})
    assert str(got.value) == str(want)


def test_the_drop_in_replays_scalar_inputs(backend, rng):
    model = tiny.scalar_input_model()
    x = rng.random((2, 4), np.float32)
    with ortcapture.patched(backend.name), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing runs uncaptured here
        sess = ort.InferenceSession(model)
        for t in (0.5, 2.0, 3.0):
            np.testing.assert_allclose(sess.run(None, {"X": x, "T": np.array(t, np.float32)})[0], x * t, rtol=1e-6)
    assert sess.stats == {"captured": 1, "replayed": 3, "uncaptured": 0}
    for bad in (np.float32(2.0), 2.0):  # ORT's numpy bridge refuses these: so does the drop-in, with ORT's error
        want = _raw_error({"X": x, "T": bad})
        with pytest.raises(type(want)) as got:
            sess.run(None, {"X": x, "T": bad})
        assert str(got.value) == str(want)
    assert sess.stats["replayed"] == 3
