"""bfloat16 (issue 20): numpy feeds and outputs through ml_dtypes, OrtValue<->OrtValue copies, WebGPU refused.
CPU here (CI); capture of a bf16 model from numpy and torch sources: tests/test_cuda.py."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import ortcapture
from ortcapture._ort import compat
from ortcapture._memory.buffers import allocate
from ortcapture._ort.providers import CAPTURE_EPS, CaptureInfo
from ortcapture.errors import CaptureUnsupportedError, TransferError

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
BFLOAT16_CODE = 16  # onnx.TensorProto.BFLOAT16


def bf16_value(shape):
    return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), BFLOAT16_CODE)


def test_numpy_round_trip_and_strict_dtype():
    a = (np.arange(12, dtype=np.float32) / 3 - 2).reshape(3, 4).astype(BF16)
    v = bf16_value((3, 4))
    assert ortcapture.update_inplace(v, a) is v
    out = ortcapture.to_numpy(v)
    assert out.dtype == BF16 and out.shape == (3, 4)
    np.testing.assert_array_equal(out.view(np.uint16), a.view(np.uint16))  # bit-exact
    with pytest.raises(TransferError, match="dtype mismatch"):
        ortcapture.update_inplace(v, a.astype(np.float32))  # never reinterpreted
    with pytest.raises(TransferError, match="dtype mismatch"):
        ortcapture.update_inplace(v, a.view(np.uint16))  # same size, other type: refused too
    ortcapture.update_inplace(v, np.full((3, 4), 1.5, np.float32), cast=True)
    np.testing.assert_array_equal(ortcapture.to_numpy(v).astype(np.float32), np.full((3, 4), 1.5, np.float32))
    with pytest.raises(TransferError, match="shape mismatch"):
        ortcapture.update_inplace(v, a[:2])
    f32 = ort.OrtValue.ortvalue_from_numpy(np.zeros((3, 4), np.float32))
    with pytest.raises(TransferError, match="dtype mismatch"):
        ortcapture.copy([v], [f32])


def test_ortvalue_to_ortvalue_copies():
    a = np.linspace(-3, 3, 8, dtype=np.float32).astype(BF16)
    src, dst, other = bf16_value((8,)), bf16_value((8,)), bf16_value((8,))
    ortcapture.update_inplace(src, a)
    ortcapture.update_inplace(dst, src)  # OrtValue -> OrtValue, never through numpy's type table
    np.testing.assert_array_equal(ortcapture.to_numpy(dst).view(np.uint16), a.view(np.uint16))
    ortcapture.copy([src], [other])
    np.testing.assert_array_equal(ortcapture.to_numpy(other).view(np.uint16), a.view(np.uint16))
    with pytest.raises(TransferError, match="undersized|shape mismatch"):
        ortcapture.copy([src], [bf16_value((4,))])


def test_bf16_buffers_are_refused_on_webgpu_with_the_reason():
    info = CaptureInfo(CAPTURE_EPS["WebGpuExecutionProvider"], 0)
    with pytest.raises(CaptureUnsupportedError, match="no bfloat16 kernels"):
        allocate(None, info, (2, 2), BF16)


def test_bf16_pointer_binding_type_is_known():
    from ortcapture._core.binding import onnx_type_of

    assert onnx_type_of(BF16) == "tensor(bfloat16)"
    assert compat.ort_version() >= (1, 24, 4)
