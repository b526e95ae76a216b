"""Strict in-place updates and copies (CPU OrtValues; device paths are covered in test_capture/test_cuda)."""
from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ortcapture
from ortcapture import TransferError, can_copy, update_inplace


def ov(arr):
    return ort.OrtValue.ortvalue_from_numpy(np.require(arr, requirements="C"))


class DLPackOnly:
    """A minimal DLPack producer (not an ndarray): what torch/cupy tensors look like to ortcapture."""

    def __init__(self, arr):
        self._arr = arr
        self.shape, self.dtype, self.flags = arr.shape, arr.dtype, arr.flags

    def __dlpack__(self, *, stream=None, **kw):
        return self._arr.__dlpack__()

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def test_dtype_mismatch_is_refused_not_reinterpreted():
    dst = ov(np.zeros((2, 3), np.float32))
    with pytest.raises(TransferError, match="dtype mismatch: numpy source is int32, destination is float32"):
        update_inplace(dst, np.ones((2, 3), np.int32))
    np.testing.assert_array_equal(dst.numpy(), 0)
    update_inplace(dst, np.arange(6, dtype=np.int32).reshape(2, 3), cast=True)
    np.testing.assert_array_equal(dst.numpy(), np.arange(6).reshape(2, 3))


@pytest.mark.parametrize("dst_dtype, src, bad", [
    (np.int32, np.array([[0, 1, 2], [3, 4, 2**32 + 5]], np.int64), "4294967301 at index (1, 2)"),  # wraps to 5
    (np.int32, np.array([[0, 1, 2], [3, 4, 5.5]]), "5.5"),  # fraction truncated
    (np.int64, np.array([[0, 1, 2], [3, 4, np.nan]]), "nan"),
    (np.uint8, np.array([[0, 1, 2], [3, -1, 5]], np.int64), "-1 at index (1, 1)"),
    (np.float32, np.array([[0, 1, 2], [3, 4, 1e300]]), "1e+300"),  # overflows to inf
    (np.float32, np.array([[0, 1, 2], [3, 4, 1 + 2j]]), "(1+2j)"),  # the imaginary part dropped
    (np.bool_, np.array([[0, 1, 0], [1, 2, 1]], np.int64), "2 at index (1, 1)"),
    (np.int64, np.array([[0, 1, 2], [3, 4, 2**64 - 1]], np.uint64), "18446744073709551615"),  # would be -1
    (np.uint32, np.array([[0, 1, 2], [3, 4, -1]], np.int8), "-1 at index (1, 2)"),  # a sign flip
    (np.float16, np.array([[0, 1, 2], [3, 4, 70000]], np.int32), "70000"),  # an integer overflowing to inf
    (np.int32, np.array([[0, 1, 2], [3, 4, 5]], object), "numbers only"),
    (np.int32, np.array([["0", "1", "2"], ["3", "4", "5"]]), "numbers only"),
])
def test_cast_refuses_values_the_buffer_cannot_hold(dst_dtype, src, bad):
    """numpy's astype wraps, truncates and overflows silently; cast=True refuses instead, naming one value, and
    leaves the buffer as it was. Values that survive (rounding to a narrower float included) are converted."""
    dst = ov(np.full((2, 3), 9, dst_dtype))
    with pytest.raises(TransferError, match=re.escape(bad)):
        update_inplace(dst, src, cast=True)
    np.testing.assert_array_equal(dst.numpy(), np.full((2, 3), 9, dst_dtype))
    if src.dtype.kind not in "biufc":
        return
    update_inplace(dst, np.ones((2, 3), src.dtype), cast=True)  # values that survive are converted
    np.testing.assert_array_equal(dst.numpy(), np.ones((2, 3), dst_dtype))
    if dst_dtype == np.float32:  # rounding to the narrower float is no loss it refuses
        update_inplace(dst, np.full((2, 3), 0.1), cast=True)
        np.testing.assert_array_equal(dst.numpy(), np.full((2, 3), 0.1, np.float32))


def test_shape_must_match_exactly_not_just_element_count():
    dst = ov(np.zeros((2, 3), np.float32))
    with pytest.raises(TransferError, match=r"shape mismatch: numpy source has shape \(3, 2\)"):
        update_inplace(dst, np.ones((3, 2), np.float32))
    with pytest.raises(TransferError, match="shape mismatch"):
        update_inplace(dst, ov(np.ones(6, np.float32)))


def test_non_contiguous_numpy_is_normalised():
    dst = ov(np.zeros((3, 2), np.float32))
    src = np.arange(6, dtype=np.float32).reshape(2, 3).T  # Fortran-ordered view
    update_inplace(dst, src)
    np.testing.assert_array_equal(dst.numpy(), src)


def test_ortvalue_and_dlpack_sources():
    dst = ov(np.zeros(4, np.float32))
    update_inplace(dst, ov(np.arange(4, dtype=np.float32)))
    np.testing.assert_array_equal(dst.numpy(), np.arange(4))
    update_inplace(dst, DLPackOnly(np.full(4, 9.0, np.float32)))
    np.testing.assert_array_equal(dst.numpy(), 9.0)
    strided = DLPackOnly(np.arange(8, dtype=np.float32)[::2])
    with pytest.raises(TransferError, match="not C-contiguous"):
        update_inplace(dst, strided)


def test_same_buffer_is_a_noop_and_overlap_is_refused():
    base = np.arange(8, dtype=np.float32)
    whole = ort.OrtValue.ortvalue_from_numpy(base[0:4])
    assert update_inplace(whole, whole) is whole
    overlapping = ort.OrtValue.ortvalue_from_numpy(base[2:6])
    with pytest.raises(TransferError, match="overlap"):
        update_inplace(whole, overlapping)


def test_bad_sources_and_destinations():
    dst = ov(np.zeros(2, np.float32))
    with pytest.raises(TransferError, match="unsupported source type"):
        update_inplace(dst, [1.0, 2.0])
    with pytest.raises(TransferError, match="must be an onnxruntime.OrtValue"):
        update_inplace(np.zeros(2, np.float32), dst)


def test_copy_checks_every_pair_before_copying():
    a, b, c = ov(np.ones(4, np.float32)), ov(np.zeros(4, np.float32)), ov(np.zeros(4, np.float32))
    ortcapture.copy([a], [b])
    np.testing.assert_array_equal(b.numpy(), 1)
    with pytest.raises(TransferError, match="same or overlapping"):
        ortcapture.copy([a], [a])  # aliased pair: std::terminate in ORT before #32315
    with pytest.raises(TransferError, match="shape mismatch"):
        ortcapture.copy([a], [ov(np.zeros(2, np.float32))])  # undersized destination
    with pytest.raises(TransferError, match="destinations #0 and #1"):
        ortcapture.copy([a, c], [b, b])
    with pytest.raises(TransferError, match="as many sources"):
        ortcapture.copy([a, c], [b])
    for src, dst in ((a, b), ([a], b), (a, [b]), (None, [b]), ("ab", [b])):  # single values: not sequences
        with pytest.raises(TransferError, match="sequences of OrtValues"):
            ortcapture.copy(src, dst)
    c2 = ov(np.full(4, 5.0, np.float32))
    with pytest.raises(TransferError, match="dtype mismatch"):
        ortcapture.copy([a, ov(np.zeros(4, np.int32))], [c2, b])
    np.testing.assert_array_equal(c2.numpy(), 5.0)  # nothing copied when any pair is bad


def dev(kind, vendor=-1):
    # explicit vendor ids: OrtDevice.make("cuda") carries no vendor id on older ORT (1.24.4: vendor 0, like WebGPU)
    kind, vendor = {"cuda": ("gpu", 0x10DE), "webgpu": ("gpu", 0)}.get(kind, (kind, vendor))
    return ort.OrtDevice.make(kind, 0, vendor)


@pytest.mark.parametrize("src, dst, ok", [
    ("cpu", "cpu", True),
    ("cpu", "webgpu", True), ("webgpu", "cpu", True), ("webgpu", "webgpu", True),
    ("cpu", "cuda", True), ("cuda", "cuda", True),
    ("cuda", "webgpu", False), ("webgpu", "cuda", False),
    ("webgpu", ("gpu", 0x1002), False), (("gpu", 0x8086), "webgpu", False), ("webgpu", ("gpu", 0x1414), False),
])
def test_can_copy_vendor_guard(src, dst, ok):
    def mk(x):
        return dev(*x) if isinstance(x, tuple) else dev(x)

    assert can_copy(mk(src), mk(dst)) is ok
    assert can_copy(ov(np.zeros(1, np.float32)), ov(np.zeros(1, np.float32)))


DTYPES = [np.float32, np.float16, np.float64, np.int8, np.uint8, np.int32, np.int64, np.bool_]


@settings(max_examples=150, deadline=None)
@given(
    dst_dtype=st.sampled_from(DTYPES), src_dtype=st.sampled_from(DTYPES),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    src_shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    transpose=st.booleans(), source=st.sampled_from(["numpy", "ortvalue", "dlpack"]), data=st.data(),
)
def test_fuzz_update_inplace_copies_exactly_or_raises(dst_dtype, src_dtype, shape, src_shape, transpose,
                                                      source, data):
    dst = ov(np.zeros(shape, dst_dtype))
    before = dst.numpy().copy()
    src = data.draw(hnp.arrays(src_dtype, src_shape, elements={"allow_nan": False}
                               if np.dtype(src_dtype).kind == "f" else None))
    if transpose and src.ndim > 1:
        src = src.T
    contiguous = src.flags.c_contiguous
    source = {"numpy": src, "ortvalue": ov(src), "dlpack": DLPackOnly(src)}[source]
    expect_ok = src.dtype == np.dtype(dst_dtype) and tuple(src.shape) == tuple(shape)
    if isinstance(source, DLPackOnly) and not contiguous:
        expect_ok = False  # non-contiguous DLPack sources are refused, not normalised
    try:
        update_inplace(dst, source)
    except TransferError:
        assert not expect_ok
        np.testing.assert_array_equal(dst.numpy(), before)
    else:
        assert expect_ok
        np.testing.assert_array_equal(dst.numpy(), src)


@pytest.mark.webgpu
def test_webgpu_remembered_ortvalue_feeds_from_two_threads():
    """A WebGPU OrtValue fed again takes the remembered copy (ORT's ``copy_tensors`` called under the session guard,
    which on WebGPU is the process's WEBGPU_LOCK, without taking that lock again): two sessions replayed from two
    threads, each with two device sources fed in turn and rewritten between calls, give the uncaptured answers."""
    import threading

    from tests.conftest import Backend, webgpu_available
    from tests.tiny import affine_model

    webgpu_available()
    be = Backend("webgpu")
    plain = ort.InferenceSession(affine_model(), providers=["CPUExecutionProvider"])  # a plain WebGPU session is
    errors: list = []  # not guarded: its runs would race the other thread's WebGPU work

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            sess = be.session(affine_model())
            x = rng.random((2, 4), np.float32)
            g = sess.capture({"X": x})
            srcs = [sess.allocate((2, 4), np.float32) for _ in range(2)]
            for i in range(60):
                src = srcs[i % 2]
                x = rng.random((2, 4), np.float32)
                update_inplace(src, x)  # the same OrtValue, new contents
                (y,) = g.run({"X": src})
                np.testing.assert_allclose(y, plain.run(None, {"X": x})[0], rtol=1e-5, atol=1e-6)
            g.release()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a replay thread hangs"
    assert not errors, errors


_FIRST_SESSIONS_IN_THREADS = """
import sys, threading
import numpy as np
from tests.conftest import Backend
from tests.tiny import affine_model
be, out = Backend("webgpu"), []
def first():
    s = be.session(affine_model())
    out.append(float(s.capture({"X": np.ones((2, 4), np.float32)}).run({"X": np.ones((2, 4), np.float32)})[0][0, 0]))
threads = [threading.Thread(target=first) for _ in range(3)]
[t.start() for t in threads]
[t.join(120) for t in threads]
print(out)
sys.exit(0 if out == [3.0, 3.0, 3.0] else 1)
"""


@pytest.mark.webgpu
def test_first_webgpu_sessions_made_in_threads_at_once():
    """The first WebGPU sessions of a process made by three threads at once: each registers the plugin EP library
    (``ortcapture._ort.webgpu.register``); ORT's registration twice at once crashed the process (segfault, ORT 1.32),
    now it is registered once under WEBGPU_LOCK. In a fresh process: the first use is what is tested."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import webgpu_available

    webgpu_available()
    root = Path(__file__).resolve().parents[1]
    for _ in range(3):  # the crash came in most runs, not all
        proc = subprocess.run([sys.executable, "-c", _FIRST_SESSIONS_IN_THREADS], capture_output=True, text=True,
                              timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
        assert proc.returncode == 0, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
