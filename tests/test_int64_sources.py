"""int64 rules hold for every host source (issue 30 item 3): the int32-range check of WebGPU int64 buffers applies to
numpy arrays, lists, CPU OrtValues and CPU DLPack tensors alike; device sources are checked at capture; input rules
never apply to outputs (an int64 output beyond int32 is restored after verification and compaction)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import ortcapture
from ortcapture._ort.compat import OrtValue
from ortcapture.errors import TransferError
from tests.conftest import Backend, webgpu_available
from tests.tiny import _model, vi

BIG = np.array([1, 2**33 + 5, 3], np.int64)  # 2**33 + 5 keeps its low 32 bits (5) on a 32-bit read


@pytest.fixture
def webgpu() -> Backend:
    webgpu_available()
    return Backend("webgpu")


def ids_model(dims=(3,)) -> bytes:
    """Y = float(I) + 0 for int64 ids I (Cast then Add: no int64 arithmetic)."""
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    return _model([helper.make_node("Cast", ["I"], ["f"], to=TensorProto.FLOAT),
                   helper.make_node("Add", ["f", "zero"], ["Y"])],
                  [vi("I", list(dims), TensorProto.INT64)], [vi("Y", list(dims))], [zero])


class HostDLPack:
    """A CPU DLPack producer that is not a numpy array (as a CPU torch tensor is)."""

    def __init__(self, a: np.ndarray):
        self._a = a
        self.shape, self.dtype, self.flags = a.shape, a.dtype, a.flags

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def host_sources(a: np.ndarray) -> dict:
    return {"numpy": a.copy(), "cpu OrtValue": OrtValue.ortvalue_from_numpy(a.copy()), "cpu DLPack": HostDLPack(a.copy())}


@pytest.mark.parametrize("kind", ["numpy", "cpu OrtValue", "cpu DLPack"])
def test_every_host_source_gets_the_int32_range_check(webgpu, kind):
    sess = webgpu.session(ids_model())
    ok = host_sources(np.array([1, 2, 3], np.int64))[kind]
    g = sess.capture({"I": ok})
    np.testing.assert_array_equal(g.run({"I": host_sources(np.array([4, -5, 2**31 - 1], np.int64))[kind]})[0],
                                  np.array([4, -5, 2**31 - 1], np.float32))
    with pytest.raises(TransferError, match=r"input 'I'.*8589934597 is outside the int32 range"):
        g.run({"I": host_sources(BIG)[kind]})
    with pytest.raises(TransferError, match="outside the int32 range"):
        ortcapture.update_inplace(g.inputs["I"], host_sources(BIG)[kind])
    with pytest.raises(TransferError, match="outside the int32 range"):
        ortcapture.copy([host_sources(BIG)["cpu OrtValue"]], [g.inputs["I"]])
    np.testing.assert_array_equal(g.run()[0], np.array([4, -5, 2**31 - 1], np.float32))  # nothing was written
    with pytest.raises(TransferError, match=r"'I'.*outside the int32 range"):
        sess.capture({"I": host_sources(BIG)[kind]})


def test_lists_get_the_check_as_numpy_does_under_buckets(webgpu):
    sess = webgpu.session(ids_model(("batch", 3)), buckets={"batch": [1, 2]})
    np.testing.assert_array_equal(sess.run(None, {"I": [[1, 2, 3]]})[0], [[1, 2, 3]])
    for feed in (BIG[None], BIG[None].tolist()):
        with pytest.raises(TransferError, match="outside the int32 range"):
            sess.run(None, {"I": feed})


def test_a_device_source_is_checked_at_capture(webgpu):
    sess = webgpu.session(ids_model())
    buf = sess.allocate((3,), np.int64)
    ortcapture._ort.compat.ort_copy_tensors([OrtValue.ortvalue_from_numpy(BIG)], [buf], None)  # around the check
    for verify in ("off", "full"):  # refused by the capture itself, not only by what the verification reads back
        with pytest.raises(TransferError, match=r"input 'I'.*outside the int32 range"):
            sess.capture({"I": buf}, verify=verify)
    ok = sess.allocate((3,), np.int64)
    ortcapture.update_inplace(ok, np.array([7, 8, 9], np.int64))
    g = sess.capture({"I": ok})
    np.testing.assert_array_equal(g.run()[0], [7, 8, 9])


def test_input_rules_never_apply_to_outputs(webgpu):
    """An int64 output that float arithmetic put beyond int32: capture verifies and restores it; so does compact()."""
    model = _model([helper.make_node("Mul", ["X", "X"], ["sq"]),
                    helper.make_node("Cast", ["sq"], ["Y"], to=TensorProto.INT64)],
                   [vi("X", [4])], [vi("Y", [4], TensorProto.INT64)])
    sess = webgpu.session(model)
    x = np.array([1e5, 2e5, 3, 4], np.float32)
    want = (x.astype(np.float64) ** 2).astype(np.int64)
    g = sess.capture({"X": x})  # verify="full", then the example's outputs restored
    np.testing.assert_array_equal(ortcapture.to_numpy(g.outputs["Y"]), want)
    np.testing.assert_array_equal(g.run()[0], want)
    sess.compact()  # outputs restored from their snapshot after the re-capture
    np.testing.assert_array_equal(ortcapture.to_numpy(g.outputs["Y"]), want)
    np.testing.assert_array_equal(g.run()[0], want)


@pytest.mark.parametrize("kind", ["numpy", "cpu OrtValue", "cpu DLPack"])
@pytest.mark.parametrize("buckets", [{"batch": [1, 2, 4]}, {"batch": [1, 2], "seq": [4, 8]}])
def test_a_bad_value_first_in_a_bucket_is_its_own_error_not_the_buckets(webgpu, kind, buckets):
    """The first request of a bucket holding an int64 outside int32: its own TransferError, and the bucket is not
    refused for it — the next request of that bucket is captured and answered (a break-it session found every later
    request of the bucket refused with the first caller's value, sequence buckets too)."""
    dims = ("batch", "seq") if "seq" in buckets else ("batch", 3)
    sess = webgpu.session(ids_model(dims), buckets=buckets)
    bad = np.array([[1, 2**33 + 5, 3]], np.int64)
    with pytest.raises(TransferError, match="outside the int32 range"):
        sess.run(None, {"I": host_sources(bad)[kind]})
    good = np.array([[4, -5, 2**31 - 1]], np.int64)
    np.testing.assert_array_equal(sess.run(None, {"I": host_sources(good)[kind]})[0], good.astype(np.float32))
    stats = sess.bucket_stats()
    assert stats["refused"] == 0 and stats["captured"] == 1 and stats["replayed"] == 1


def test_bad_values_for_an_uncaptured_bucket_evict_and_capture_nothing(webgpu):
    """Under max_graphs=1, a request of a bucket not captured yet whose values the copy refuses is refused before
    any eviction, padding or capture: the captured bucket keeps replaying (a review found each such request evicting
    a live graph)."""
    sess = webgpu.session(ids_model(("batch", 3)), buckets={"batch": [1, 2]}, max_graphs=1)
    good = np.array([[4, -5, 6]], np.int64)
    for _ in range(3):
        np.testing.assert_array_equal(sess.run(None, {"I": good})[0], good.astype(np.float32))
        with pytest.raises(TransferError, match="outside the int32 range"):
            sess.run(None, {"I": np.repeat(BIG[None], 2, axis=0)})
    stats = sess.bucket_stats()
    assert (stats["captured"], stats["evicted"], stats["refused"], stats["replayed"]) == (1, 0, 0, 3)


def test_the_drop_in_refuses_a_bad_value_per_call_and_still_captures_its_shapes():
    """Under ``patched("webgpu")`` a call with an int64 outside int32 gets the plain run's TransferError, and its
    shapes are captured by the next good call (not run uncaptured for the rest of the session)."""
    import onnxruntime as ort

    webgpu_available()
    with ortcapture.patched("webgpu"):
        sess = ort.InferenceSession(ids_model())
    with pytest.raises(TransferError, match="outside the int32 range"):
        sess.run(None, {"I": BIG})
    good = np.array([4, -5, 2**31 - 1], np.int64)
    for _ in range(2):
        np.testing.assert_array_equal(sess.run(None, {"I": good})[0], good.astype(np.float32))
    assert sess.stats == {"replayed": 2, "captured": 1, "uncaptured": 0}


def test_a_feed_of_another_type_gets_orts_type_error_not_the_int32_rule(webgpu):
    """A float32 input fed int64 values beyond int32 on a capturing WebGPU session: ORT's own type error (the feed's
    type is what is wrong), not "keep int64 within int32"; a big-endian int64 feed of an int64 input is still checked."""
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    floats = _model([helper.make_node("Add", ["X", "zero"], ["Y"])], [vi("X", [3])], [vi("Y", [3])], [zero])
    sess = webgpu.session(floats)
    with pytest.raises(Exception, match=r"(?i)type") as err:
        sess.run(None, {"X": BIG}, ortcapture.run_options_for(-1))
    assert "int32" not in str(err.value)
    ids = webgpu.session(ids_model())
    with pytest.raises(TransferError, match="outside the int32 range"):
        ids.run(None, {"I": BIG.astype(">i8")}, ortcapture.run_options_for(-1))
