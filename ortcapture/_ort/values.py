"""What an OrtValue is — device kind, ordinal, shape, dtype, byte span — computed once per OrtValue object.

ORT's Python API does not expose a value's device ordinal, and before ORT 1.30 ``device_name()`` says ``"cuda"`` for
WebGPU buffers; ortcapture records both for the buffers it allocates. A tensor OrtValue's shape, type and buffer
never change, so the answers are cached per object (weakly): the replay hot path then pays dictionary lookups
instead of half a dozen native calls per feed.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnxruntime as ort

from ortcapture._ort.compat import OrtValue
from ortcapture.errors import TransferError

ONNX_TO_NP = {
    "tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16),
    "tensor(double)": np.dtype(np.float64), "tensor(int8)": np.dtype(np.int8), "tensor(uint8)": np.dtype(np.uint8),
    "tensor(int16)": np.dtype(np.int16), "tensor(uint16)": np.dtype(np.uint16), "tensor(int32)": np.dtype(np.int32),
    "tensor(uint32)": np.dtype(np.uint32), "tensor(int64)": np.dtype(np.int64), "tensor(uint64)": np.dtype(np.uint64),
    "tensor(bool)": np.dtype(np.bool_),
}

try:  # bfloat16 through ml_dtypes (an optional dependency: ``ortcapture[bf16]``; onnx itself requires it)
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - onnx >= 1.15 depends on ml_dtypes
    _ml_dtypes = None
#: ``numpy.dtype(ml_dtypes.bfloat16)``, or ``None`` without ml_dtypes
BFLOAT16 = np.dtype(_ml_dtypes.bfloat16) if _ml_dtypes is not None else None
if BFLOAT16 is not None:
    ONNX_TO_NP["tensor(bfloat16)"] = BFLOAT16
#: numpy dtypes that ORT's numpy bridge does not know (``OrtValue.numpy()``: "No corresponding Numpy type",
#: ``ortvalue_from_numpy`` refuses them), with the same-size dtype whose bytes ORT copies unchanged, and the ONNX
#: element type code (``onnx.TensorProto``) to allocate them with
STORAGE: dict[np.dtype, tuple[np.dtype, int]] = {BFLOAT16: (np.dtype(np.uint16), 16)} if BFLOAT16 is not None else {}


class ValueMeta(NamedTuple):
    kind: str  # "cpu" | "cuda" | "webgpu" | ...
    device_id: int
    shape: tuple[int, ...]
    element_type: str  # ORT's type string, e.g. "tensor(float)"
    dtype: np.dtype | None  # None for element types numpy cannot hold (e.g. bfloat16)
    span: tuple[int, int] | None  # [start, end) device address range; None for WebGPU handles
    nbytes: int


# The cache lives in an attribute of the Python OrtValue object (an attribute read is ~20x cheaper than a
# WeakKeyDictionary lookup, and it dies with the object).
_ATTR = "_ortcapture_meta"
_KNOWN_ATTR = "_ortcapture_device"


def remember(value: OrtValue, kind: str, device_id: int) -> OrtValue:
    """Record the device kind and ordinal of a value ortcapture allocated (before its metadata is first read)."""
    setattr(value, _KNOWN_ATTR, (kind, int(device_id)))
    value.__dict__.pop(_ATTR, None)
    return value


_HAS_CUDA_EP = ["CUDAExecutionProvider" in ort.get_available_providers()]


def meta(value: OrtValue) -> ValueMeta:
    """The cached :class:`ValueMeta` of a tensor OrtValue. Raises :class:`TransferError` for non-tensors."""
    m = getattr(value, _ATTR, None)
    if m is not None:
        return m
    if not isinstance(value, OrtValue):
        raise TransferError(f"expected an onnxruntime.OrtValue, got {type(value).__name__}")
    fixed = getattr(value, "fixed_buffer", None)  # a ReplayOutput: a view of a registered buffer
    if fixed is not None:
        return meta(fixed)
    if not value.is_tensor():
        raise TransferError("the OrtValue must hold a dense tensor")
    known = getattr(value, _KNOWN_ATTR, None)
    kind = known[0] if known else value.device_name().lower()
    if kind == "cuda" and not known and not _HAS_CUDA_EP[0]:
        # ORT < 1.30 names WebGPU buffers "cuda"; an ORT build without the CUDA EP has no CUDA buffers at all
        kind = "webgpu"
    element_type = value.data_type()
    nbytes = int(value.tensor_size_in_bytes())
    span = None
    if kind != "webgpu":
        try:
            start = int(value.data_ptr())
            span = (start, start + nbytes) if start else None
        except Exception:  # noqa: BLE001 - opaque handles
            span = None
    if known:
        device_id = known[1]
    elif kind == "cuda" and span is not None:
        from ortcapture._ort.cudart import pointer_device

        dev = pointer_device(span[0])
        device_id = 0 if dev is None else dev
    else:
        device_id = 0
    m = ValueMeta(kind, device_id, tuple(int(d) for d in value.shape()), element_type,
                  ONNX_TO_NP.get(element_type), span, nbytes)
    setattr(value, _ATTR, m)
    return m


#: The largest WebGPU buffer ortcapture allocates or copies (bytes): ORT's ``copy_tensors`` crashed (SIGSEGV) moving
#: a WebGPU buffer of 2**31 bytes or more, up and down (measured, onnxruntime 1.32 + WebGPU plugin 0.4.0; plain ORT
#: alike), and an allocation far past the adapter's limits only logged Vulkan's out-of-memory and returned a value
WEBGPU_MAX_BYTES = 2**31 - 1


def check_webgpu_bytes(nbytes: int, what: str) -> None:
    """Raise :class:`~ortcapture.errors.TransferError` for a WebGPU buffer of more than :data:`WEBGPU_MAX_BYTES`
    (``what`` names it): a clear refusal where ORT would crash or return an unusable buffer."""
    if nbytes > WEBGPU_MAX_BYTES:
        from ortcapture.errors import TransferError

        raise TransferError(f"{what}: {nbytes} bytes on WebGPU; ORT's WebGPU copies crash at 2 GiB and more "
                            f"(at most {WEBGPU_MAX_BYTES} bytes per buffer)")


def device_kind(value: OrtValue) -> str:
    """``"cpu"``, ``"cuda"``, ``"webgpu"``, … (recorded at allocation by ortcapture, else ``device_name()``)."""
    return meta(value).kind


def device_id_of(value: OrtValue) -> int:
    """Device ordinal of ``value``: recorded at allocation by ortcapture, else asked of CUDA, else 0."""
    return meta(value).device_id
