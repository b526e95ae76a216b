"""Strict in-place updates of fixed buffers, and copies between them — all validation lives here.

ORT's own paths accept silently wrong input: ``OrtValue.update_inplace(numpy)`` checks only the element count
(measured, onnxruntime-gpu 1.31.1: int32 bytes accepted into a float32 OrtValue and reinterpreted), copies the raw
memory of non-contiguous arrays (ORT #13548), and before ORT #32315 a ``copy_tensors`` with an aliased pair or an
undersized destination ended in ``std::terminate``. Every check here runs before any native call.

Backends, chosen by :mod:`ortcapture.compat`: ``OrtValue.update_inplace(OrtValue)`` (ORT >= 1.26, device-to-device),
``onnxruntime.copy_tensors`` (WebGPU, batch copies), and a cuda-python ``cudaMemcpyAsync`` + stream sync for CUDA
on ORT versions without the former. Ordering guarantee: every copy has completed on the device when the call
returns, so a replay started afterwards reads the new values.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import onnxruntime as ort

from ortcapture import compat
from ortcapture.buffers import device_kind
from ortcapture.errors import CaptureUnsupportedError, TransferError

_C = ort.capi._pybind_state

CPU, GPU = 0, 1  # OrtDevice::Type
NONE_VENDOR = 0x0000
#: OrtValue.device_name() -> (OrtDevice type, PCI vendor id) — mirrors ORT's get_vendor_id_for_device_type.
_DEVICE_KINDS = {
    "cpu": (CPU, NONE_VENDOR), "cuda": (GPU, 0x10DE), "webgpu": (GPU, NONE_VENDOR), "dml": (GPU, 0x1414),
    "cann": (3, 0x19E5),
}
_ONNX_TO_NP = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(int16)": np.int16, "tensor(uint16)": np.uint16,
    "tensor(int32)": np.int32, "tensor(uint32)": np.uint32, "tensor(int64)": np.int64, "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}
#: Force a device-to-device backend: None (auto), "ort" (OrtValue.update_inplace) or "cuda-python" (cudaMemcpyAsync).
#: Set from $ORTCAPTURE_COPY_BACKEND at import; tests set it directly.
COPY_BACKEND = os.environ.get("ORTCAPTURE_COPY_BACKEND") or None
# DLPack device types (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


# ---------------------------------------------------------------------------------------------------------------
# endpoints and the vendor guard
# ---------------------------------------------------------------------------------------------------------------
def _endpoint(x) -> tuple[int, int, str]:
    """(OrtDevice type, vendor id, kind name) of an OrtValue or OrtDevice."""
    if isinstance(x, ort.OrtValue) or isinstance(x, _C.OrtValue):
        name = device_kind(x) if isinstance(x, ort.OrtValue) else x.device_name().lower()
        if name not in _DEVICE_KINDS:
            raise TransferError(f"unknown OrtValue device {name!r}")
        t, v = _DEVICE_KINDS[name]
        return t, v, name
    dev = x._get_c_device() if isinstance(x, ort.OrtDevice) else x
    if isinstance(dev, _C.OrtDevice):
        t = int(dev.device_type())
        v = int(dev.vendor_id()) if hasattr(dev, "vendor_id") else NONE_VENDOR
        if t == CPU:
            return t, v, "cpu"
        if t == GPU and v == NONE_VENDOR:
            return t, v, "webgpu"
        if t == GPU and v == 0x10DE:
            return t, v, "cuda"
        return t, v, f"gpu(vendor=0x{v:04X})"
    raise TransferError(f"expected an OrtValue or OrtDevice, got {type(x).__name__}")


def can_copy(src, dst) -> bool:
    """Whether ORT can copy from ``src`` to ``dst`` (OrtValues or ``onnxruntime.OrtDevice``s) without misreading memory.

    Mirrors WebGPU ``DataTransfer::CanCopy`` with its vendor guard (ORT #32317): WebGPU buffers (GPU memory with
    vendor id NONE) copy only to and from CPU and other WebGPU buffers; a GPU buffer of a named vendor (CUDA's
    0x10DE, AMD, Intel, Microsoft …) is not a ``WGPUBuffer`` and unpatched ORT would hand its pointer to Dawn.
    CUDA copies to and from CPU and CUDA (any ordinal: peer copies). Any other pair of GPU kinds: no.
    """
    st, sv, sk = _endpoint(src)
    dt, dv, dk = _endpoint(dst)
    if st == CPU and dt == CPU:
        return True
    if "webgpu" in (sk, dk):
        other_t, other_v = (dt, dv) if sk == "webgpu" else (st, sv)
        return other_t == CPU or (other_t == GPU and other_v == NONE_VENDOR)
    if "cuda" in (sk, dk):
        other = dk if sk == "cuda" else sk
        return other in ("cpu", "cuda")
    return False


def _require_copyable(src, dst) -> None:
    if not can_copy(src, dst):
        raise TransferError(
            f"refusing to copy {_endpoint(src)[2]} -> {_endpoint(dst)[2]}: no data transfer in ORT handles that pair "
            "correctly (a WebGPU transfer would reinterpret foreign GPU memory as a WGPUBuffer, ORT #32317). "
            "Copy through the CPU explicitly, or allocate the source on the destination's device."
        )


# ---------------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------------
def _require_tensor(value: ort.OrtValue, role: str) -> None:
    if not isinstance(value, ort.OrtValue):
        raise TransferError(f"{role} must be an onnxruntime.OrtValue, got {type(value).__name__}")
    if not value.is_tensor():
        raise TransferError(f"{role} OrtValue must hold a dense tensor")


def _np_dtype_of(value: ort.OrtValue) -> np.dtype:
    t = value.data_type()
    if t not in _ONNX_TO_NP:
        raise TransferError(f"OrtValue element type {t} is not supported by ortcapture transfers")
    return np.dtype(_ONNX_TO_NP[t])


def _check_match(dst: ort.OrtValue, shape: tuple, dtype: np.dtype, what: str) -> None:
    dshape, ddtype = tuple(dst.shape()), _np_dtype_of(dst)
    if dtype != ddtype:
        raise TransferError(
            f"dtype mismatch: {what} is {dtype}, destination is {ddtype}. ORT would reinterpret the bytes; cast "
            "the source explicitly (update_inplace(..., cast=True) for numpy sources)."
        )
    if tuple(shape) != dshape:
        raise TransferError(
            f"shape mismatch: {what} has shape {tuple(shape)}, destination has {dshape}. Fixed buffers keep the "
            "shape they were captured with."
        )


def _span(value: ort.OrtValue) -> tuple[int, int] | None:
    if device_kind(value) == "webgpu":
        return None
    try:
        start = int(value.data_ptr())
    except Exception:  # noqa: BLE001
        return None
    return start, start + int(value.tensor_size_in_bytes())


def _same_or_overlap(a: ort.OrtValue, b: ort.OrtValue) -> str | None:
    """``"same"`` when a and b are one buffer, ``"overlap"`` when their bytes overlap, else ``None``."""
    if a is b or a._ortvalue is b._ortvalue:
        return "same"
    if device_kind(a) != device_kind(b):
        return None
    sa, sb = _span(a), _span(b)
    if sa is None or sb is None or sa[0] == 0 or sb[0] == 0:
        return None
    if sa == sb:
        return "same"
    if sa[0] < sb[1] and sb[0] < sa[1]:
        return "overlap"
    return None


def _is_c_contiguous(obj: Any) -> bool:
    fn = getattr(obj, "is_contiguous", None)
    if callable(fn):  # torch
        return bool(fn())
    flags = getattr(obj, "flags", None)
    if flags is not None and hasattr(flags, "c_contiguous"):  # numpy, cupy
        return bool(flags.c_contiguous)
    return True  # unknown producers: ORT's from_dlpack is trusted to reject what it cannot read


# ---------------------------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------------------------
def _from_dlpack(src: Any) -> ort.OrtValue | np.ndarray:
    """Wrap a DLPack producer zero-copy: a numpy view for host memory, a device OrtValue for CUDA memory."""
    try:
        dev_type, _dev_id = src.__dlpack_device__()
    except Exception as exc:  # noqa: BLE001
        raise TransferError(f"{type(src).__name__} has no usable __dlpack_device__: {exc}") from exc
    if not _is_c_contiguous(src):
        raise TransferError(
            f"{type(src).__name__} source is not C-contiguous; ORT copies raw memory and would scramble it "
            "(ORT #13548). Make it contiguous first (e.g. tensor.contiguous())."
        )
    if int(dev_type) in (_DL_CPU, _DL_CUDA_HOST):
        return np.from_dlpack(src)
    if int(dev_type) not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise TransferError(f"DLPack device type {int(dev_type)} is not supported (CPU and CUDA are)")
    compat.require("OrtValue.from_dlpack", compat.has_dlpack(), "1.16")
    is_bool = str(getattr(src, "dtype", "")).endswith("bool")
    # stream=1: the legacy default stream, on which ortcapture's copy is ordered; the producer makes it wait for
    # the producer's pending work (DLPack stream semantics), so the copy reads finished data.
    try:
        capsule = src.__dlpack__(stream=1)
    except TypeError:
        capsule = src.__dlpack__()
    return ort.OrtValue(_C.OrtValue.from_dlpack(capsule, is_bool))


def _as_numpy(src: np.ndarray, dst: ort.OrtValue, cast: bool) -> np.ndarray:
    want = _np_dtype_of(dst)
    if src.dtype != want:
        if not cast:
            _check_match(dst, src.shape, src.dtype, "numpy source")
        src = src.astype(want)
    _check_match(dst, src.shape, src.dtype, "numpy source")
    return np.require(src, requirements="C")  # ascontiguousarray would turn 0-d into (1,)


# ---------------------------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------------------------
def update_inplace(dst: ort.OrtValue, src: Any, *, cast: bool = False) -> ort.OrtValue:
    """Copy ``src`` into the fixed buffer ``dst`` in place and return ``dst``.

    ``dst``: a tensor OrtValue on any device (CPU, CUDA, WebGPU). ``src``: a numpy array, an OrtValue on any
    device, or any DLPack producer (``torch.Tensor``, ``cupy.ndarray``: wrapped zero-copy; CUDA sources are copied
    device-to-device, never through the host). Shape and dtype must match exactly (``cast=True`` converts numpy
    sources on the host); numpy sources are made C-contiguous, non-contiguous device sources are refused. ``src``
    that is ``dst`` itself is a no-op; overlapping buffers are refused. The copy has completed when this returns.

    Raises :class:`~ortcapture.errors.TransferError` (a ``ValueError``) for any mismatch, before native code, and
    :class:`~ortcapture.errors.CaptureUnsupportedError` where the installed ORT lacks the needed copy path.
    """
    _require_tensor(dst, "destination")
    if isinstance(src, _C.OrtValue):
        src = ort.OrtValue(src)
    if not isinstance(src, (ort.OrtValue, np.ndarray)):
        if hasattr(src, "__dlpack__"):
            src = _from_dlpack(src)
        elif isinstance(src, np.generic):
            src = np.asarray(src)
        else:
            raise TransferError(
                f"unsupported source type {type(src).__name__}: pass a numpy array, an OrtValue or a DLPack tensor"
            )
    if isinstance(src, np.ndarray):
        arr = _as_numpy(src, dst, cast)
        _copy_host_to(dst, arr)
        return dst
    _require_tensor(src, "source")
    _check_match(dst, tuple(src.shape()), _np_dtype_of(src), f"source ({device_kind(src)})")
    _require_copyable(src, dst)
    alias = _same_or_overlap(src, dst)
    if alias == "same":
        return dst
    if alias == "overlap":
        raise TransferError("source and destination buffers overlap; an in-place copy between them is undefined")
    _copy_value(src, dst)
    return dst


def copy(src: Sequence[ort.OrtValue], dst: Sequence[ort.OrtValue]) -> None:
    """Copy ``src[i]`` into ``dst[i]`` for every i, as ``onnxruntime.copy_tensors`` does, after checking every pair.

    Refused (:class:`~ortcapture.errors.TransferError`) before any copy starts: length mismatch, non-OrtValues,
    shape or dtype mismatch (an undersized destination included), device pairs ORT cannot copy (:func:`can_copy`),
    a pair whose source is its destination, overlapping pairs, and one destination written twice — the aliased and
    undersized cases made ORT ``std::terminate`` before ORT #32315.
    """
    src, dst = list(src), list(dst)
    if len(src) != len(dst):
        raise TransferError(f"copy needs as many sources as destinations ({len(src)} != {len(dst)})")
    for i, (s, d) in enumerate(zip(src, dst)):
        _require_tensor(s, f"source #{i}")
        _require_tensor(d, f"destination #{i}")
        _check_match(d, tuple(s.shape()), _np_dtype_of(s), f"source #{i}")
        _require_copyable(s, d)
        if _same_or_overlap(s, d):
            raise TransferError(f"pair #{i}: source and destination are the same or overlapping buffers")
    for i in range(len(dst)):
        for j in range(i + 1, len(dst)):
            if _same_or_overlap(dst[i], dst[j]):
                raise TransferError(f"destinations #{i} and #{j} are the same or overlapping buffers")
            if _same_or_overlap(dst[i], src[j]) or _same_or_overlap(dst[j], src[i]):
                raise TransferError(f"pairs #{i} and #{j}: one's destination overlaps the other's source")
    if not src:
        return
    if compat.has_copy_tensors() and any(device_kind(v) == "webgpu" for v in (*src, *dst)):
        ort.copy_tensors(src, dst, None)  # one call for the batch; ORT's environment transfers know WebGPU
    else:
        for s, d in zip(src, dst):
            _copy_value(s, d)


def to_numpy(value: ort.OrtValue) -> np.ndarray:
    """A new host numpy array with the contents of ``value`` (any device; WebGPU read back via ``copy_tensors``)."""
    _require_tensor(value, "value")
    if device_kind(value) == "webgpu":
        compat.require("WebGPU readback of an OrtValue", compat.has_copy_tensors(), "1.30")
        host = ort.OrtValue.ortvalue_from_shape_and_type(list(value.shape()), _np_dtype_of(value).type)
        ort.copy_tensors([value], [host], None)
        return host.numpy()
    return value.numpy()


# ---------------------------------------------------------------------------------------------------------------
# backends (inputs already validated)
# ---------------------------------------------------------------------------------------------------------------
def _copy_host_to(dst: ort.OrtValue, arr: np.ndarray) -> None:
    if device_kind(dst) == "webgpu":
        compat.require("copying numpy into a WebGPU OrtValue", compat.has_copy_tensors(), "1.30")
        ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(arr)], [dst], None)
    else:
        dst.update_inplace(arr)


def _copy_value(src: ort.OrtValue, dst: ort.OrtValue) -> None:
    kinds = {device_kind(src), device_kind(dst)}
    if COPY_BACKEND == "cuda-python" and kinds == {"cuda"}:
        from ortcapture.cudart import memcpy_d2d

        memcpy_d2d(int(dst.data_ptr()), int(src.data_ptr()), int(src.tensor_size_in_bytes()))
    elif "webgpu" in kinds:
        compat.require("copying WebGPU OrtValues", compat.has_copy_tensors(), "1.30")
        ort.copy_tensors([src], [dst], None)
    elif compat.has_update_inplace_ortvalue():
        dst.update_inplace(src)
    elif kinds == {"cuda"} and compat.has_cuda_python():
        from ortcapture.cudart import memcpy_d2d

        memcpy_d2d(int(dst.data_ptr()), int(src.data_ptr()), int(src.tensor_size_in_bytes()))
    elif device_kind(src) == "cpu":
        dst.update_inplace(np.require(src.numpy(), requirements="C"))
    else:
        raise CaptureUnsupportedError(
            f"device-to-device update_inplace needs onnxruntime >= 1.26 (OrtValue.update_inplace(OrtValue)) or "
            f"cuda-python for CUDA; this is onnxruntime {ort.__version__}"
        )
