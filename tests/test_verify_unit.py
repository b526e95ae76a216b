"""The verification module's comparison and varied input set (issue 15 item 1), without a session."""
import numpy as np
import pytest

from ortcapture._verify import compare as _verify
from ortcapture.errors import CaptureError


def test_levels():
    assert _verify.level_of(True) == "full"
    assert _verify.level_of(False) == "off"
    assert _verify.level_of("example") == "example"
    with pytest.raises(CaptureError):
        _verify.level_of("sometimes")


def test_vary_changes_every_variable_input_and_reports_the_rest():
    feeds = {"x": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "ids": np.array([1, 7, 3], np.int64),
             "same": np.full(3, 4, np.int32), "mask": np.array([True, False]), "shape": np.array([2, 3], np.int64)}
    out, kept = _verify.vary(feeds, keep=["shape"])
    assert not np.array_equal(out["x"], feeds["x"]) and out["x"].dtype == np.float32
    assert not np.array_equal(out["ids"], feeds["ids"])
    assert out["ids"].min() >= 1 and out["ids"].max() <= 7  # within the example's range
    assert np.array_equal(out["mask"], ~feeds["mask"])
    assert sorted(kept) == ["same", "shape"]
    again, _ = _verify.vary(feeds, keep=["shape"])
    assert np.array_equal(again["x"], out["x"])  # seeded


def test_compare_exact_and_relative():
    a = np.array([1.0, 2.0, 100.0], np.float32)
    b = a + np.float32(0.05)
    assert _verify.compare(["y"], [a], [a])[0] == []
    assert _verify.compare(["y"], [b], [a])[0] == ["y"]
    assert _verify.compare(["y"], [b], [a], rtol=1e-3)[0] == []  # 0.05 / 100
    assert _verify.compare(["y"], [a[:2]], [a], rtol=1.0)[0] == ["y"]  # shape
    assert _verify.compare(["n"], [np.array([np.nan])], [np.array([np.nan])])[0] == []
    assert _verify.compare(["i"], [np.array([1, 2])], [np.array([1, 3])], rtol=0.9)[0] == ["i"]


def test_verify_catches_a_replay_that_kept_capture_time_values():
    feeds = {"x": np.arange(4, dtype=np.float32)}
    frozen = feeds["x"] * 2

    def reference(f):
        return [f["x"] * 2]

    with pytest.raises(_verify.VerificationError) as err:
        _verify.verify(lambda f: [frozen], reference, feeds, ["y"], what="graph 1")
    assert err.value.outputs == ["y"] and err.value.input_set == "varied"
    rep = _verify.verify(lambda f: [frozen], reference, feeds, ["y"], level="example")
    assert rep.input_sets == ["example"]
    assert _verify.verify(lambda f: 1 / 0, reference, feeds, ["y"], level="off").input_sets == []
    ok = _verify.verify(lambda f: [f["x"] * 2], reference, feeds, ["y"])
    assert ok.input_sets == ["example", "varied"] and ok.max_error["y"] == 0.0


def test_vary_keeps_0d_inputs_arrays():
    """numpy arithmetic on a 0-d array returns a numpy scalar, which ORT's run() refuses ("Unable to handle object of
    type numpy.float32"): a 0-d temperature input must stay a 0-d array."""
    out, kept = _verify.vary({"t": np.array(2.0, np.float32), "b": np.array(True), "i": np.array(3, np.int64)})
    assert all(isinstance(v, np.ndarray) and v.shape == () for v in out.values())
    assert out["t"].dtype == np.float32 and out["t"] != 2.0 and sorted(kept) == ["b", "i"]
