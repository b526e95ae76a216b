"""Transfer sources: DLPack producers wrapped zero-copy (torch, cupy), numpy arrays made ready for a buffer.

Moved out of :mod:`ortcapture.transfer` unchanged; the public module re-exports the public names.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ortcapture._ort import compat
from ortcapture._ort.compat import C_OrtValue, OrtValue
from ortcapture._ort.values import ValueMeta
from ortcapture._transfer.check import _check_int32_range, _check_match, _is_c_contiguous, _unsupported
from ortcapture.errors import TransferError



# DLPack device types (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


# id(producer) -> (weakref, revalidator, wrapping OrtValue): re-wrapping a torch tensor
# through DLPack costs tens of µs, while its address, shape and dtype are cheap to re-check. Keyed by id() with a
# weakref check, not a WeakKeyDictionary: tensors compare elementwise, so they cannot be dictionary keys.
_WRAPPED: dict[int, tuple] = {}


def _address(src: Any) -> int | None:
    if hasattr(src, "data_ptr"):  # torch
        return int(src.data_ptr())
    data = getattr(src, "data", None)
    return int(data.ptr) if hasattr(data, "ptr") else None  # cupy


def _revalidator(src: Any):
    """A function ``hit(producer) -> bool`` built once per wrapped CUDA producer: True when the producer still has
    the wrapped buffer's address, shape, dtype and C-contiguity — having then ordered ORT's coming legacy-stream
    device-to-device copy after the producer's pending work (work on the legacy default stream is ordered already;
    another current stream is synchronised). The replay hot path pays a handful of attribute reads."""
    address, shape, dtype = _address(src), tuple(src.shape), src.dtype
    mod = type(src).__module__.split(".", 1)[0]
    if mod == "torch":
        import torch

        index = src.get_device()
        raw = compat.torch_raw_stream_getter(torch)  # an int; much cheaper than current_stream()

        def hit(s, raw=raw, index=index, torch=torch):
            if s.data_ptr() != address or s.dtype is not dtype or s.shape != shape or not s.is_contiguous():
                return False
            if raw is None or raw(index) != 0:
                stream = torch.cuda.current_stream(index)
                if stream.cuda_stream != 0:
                    stream.synchronize()
            return True
        return hit
    if mod == "cupy":
        import cupy

        def hit(s, cupy=cupy):
            if s.data.ptr != address or s.dtype != dtype or s.shape != shape or not s.flags.c_contiguous:
                return False
            stream = cupy.cuda.get_current_stream()
            if stream.ptr != 0:
                stream.synchronize()
            return True
        return hit

    def hit(s):  # other producers: only their first wrap is ordered (through __dlpack__(stream=1))
        return _address(s) == address and s.dtype == dtype and tuple(s.shape) == shape and _is_c_contiguous(s)
    return hit


def _dlpack_value(src: Any, dev_id: int | None) -> OrtValue:
    """``OrtValue.from_dlpack`` of a producer on CUDA device ``dev_id`` (``None``: a host producer), exported with
    ``stream=1`` (the legacy default stream, on which ORT's device-to-device copy runs: the producer makes it wait
    for its pending work, DLPack stream semantics).

    Bool tensors: ORT <= 1.31's converter refuses DLPack's bool type with a bare ``RuntimeError`` ("Unsupported code
    6"), so they are exported as a zero-copy uint8 view (bool and uint8 share one byte per element) with ORT's
    ``is_bool_tensor`` flag, which makes the converter read them as bool (:func:`ortcapture._ort.compat.
    dlpack_takes_bool_flag`). Raises :class:`TransferError` for anything ORT's converter still refuses."""
    is_bool = str(getattr(src, "dtype", "")).endswith("bool")
    takes_flag = compat.dlpack_takes_bool_flag()
    producer = _uint8_view(src) if is_bool and takes_flag else src
    if dev_id is None:
        capsule = producer.__dlpack__()
    else:
        from ortcapture._ort.cudart import current_device

        with current_device(int(dev_id)):  # the producer's device must be current to export with a stream
            try:
                capsule = producer.__dlpack__(stream=1)
            except TypeError:
                capsule = producer.__dlpack__()
    try:
        value = C_OrtValue.from_dlpack(capsule, is_bool) if takes_flag else C_OrtValue.from_dlpack(capsule)
    except RuntimeError as exc:
        raise TransferError(f"ORT's DLPack converter refused this {type(src).__name__} "
                            f"({getattr(src, 'dtype', '?')}): {exc}".rstrip()) from exc
    return OrtValue(value)


def _uint8_view(src: Any) -> Any:
    """A bool DLPack producer's bytes as a uint8 view of the same memory (torch, cupy, numpy: ``view(<lib>.uint8)``)."""
    import sys

    lib = sys.modules.get(type(src).__module__.split(".", 1)[0])
    try:
        return src.view(lib.uint8)
    except Exception as exc:  # noqa: BLE001 - any producer without a same-size view
        raise TransferError(
            f"bool {type(src).__name__}: this onnxruntime's DLPack converter cannot take bool tensors and the source "
            f"has no uint8 view ({exc}); convert it to uint8 and feed a bool OrtValue, or upgrade to onnxruntime "
            ">= 1.32"
        ) from exc


def _cached_wrap(src: Any) -> OrtValue | None:
    """The OrtValue that wrapped this same CUDA producer before, if still valid (see :func:`_revalidator`)."""
    cached = _WRAPPED.get(id(src))
    if cached is not None and cached[0]() is src and cached[1](src):
        return cached[2]
    return None


def _from_dlpack(src: Any) -> OrtValue | np.ndarray:
    """Wrap a DLPack producer zero-copy: a numpy view for host memory, a device OrtValue for CUDA memory."""
    value = _cached_wrap(src)
    if value is not None:
        return value
    try:
        dev_type, dev_id = src.__dlpack_device__()
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
    value = _dlpack_value(src, int(dev_id))
    address = _address(src)
    if address is not None:
        ident, table = id(src), _WRAPPED
        try:
            ref = weakref.ref(src, lambda _r: table.pop(ident, None))
        except TypeError:
            return value
        table[ident] = (ref, _revalidator(src), value)
    return value


def _as_source(src: Any) -> OrtValue | np.ndarray:
    """A non-OrtValue source as an OrtValue (C OrtValue, CUDA DLPack producer) or a host numpy array."""
    if isinstance(src, np.ndarray):
        return src
    if hasattr(src, "__dlpack__"):
        return _from_dlpack(src)
    if isinstance(src, C_OrtValue):
        return OrtValue(src)
    raise TransferError(_unsupported(src))


def _as_numpy(src: np.ndarray, dm: ValueMeta, cast: bool) -> np.ndarray:
    if src.dtype != dm.dtype:
        if not cast:
            _check_match(dm, tuple(src.shape), src.dtype, "numpy source")
        src = _cast(src, dm.dtype)
    _check_match(dm, tuple(src.shape), src.dtype, "numpy source")
    if dm.kind == "webgpu" and src.dtype == np.int64 and src.size:
        _check_int32_range(src)
    return np.require(src, requirements="C")  # ascontiguousarray would turn 0-d into (1,)


def _cast(src: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``src`` as ``dtype`` (``update_inplace(cast=True)``) when every value survives: into an integer or bool
    buffer (or from complex into real) each value must come back unchanged (no wrap-around, no sign flip between
    signed and unsigned, no truncated fraction, no NaN), into a float buffer no finite value may overflow to infinity
    (rounding to the nearest value the float holds — a narrower float, or a large integer into float32 — is
    accepted). Numbers only: a source of another kind (object, string, datetime) is refused. Raises
    TransferError."""
    import warnings

    sk, dk = src.dtype.kind, dtype.kind
    floaty = _float_like(dtype)
    if sk not in "biufc" and not _float_like(src.dtype):
        raise TransferError(f"cast=True converts numbers only; the source is {src.dtype} (convert it yourself)")
    with warnings.catch_warnings(), np.errstate(invalid="ignore", over="ignore"):
        warnings.simplefilter("ignore")  # numpy's ComplexWarning / cast warnings: checked below instead
        out = src.astype(dtype)
        if not src.size or dtype == src.dtype:
            return out
        if dk in "iub" or (sk == "c" and dk != "c"):
            bad = out.astype(src.dtype) != src
            if sk not in "iub":
                bad |= ~np.isfinite(src)
            if sk in "iu" and dk in "iu":  # uint64 max into int64 is -1, and back again it is uint64 max
                bad |= (out < 0) != (src < 0)
        elif floaty:
            bad = np.isfinite(src) & ~np.isfinite(out)
        else:
            return out
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        value = np.asarray(src)[where]
        raise TransferError(f"cast=True: the {src.dtype} source holds values {dtype} cannot hold (e.g. "
                            f"{getattr(value, 'item', lambda: value)()!r} at index {where}); convert it yourself if "
                            "that is meant")
    return out


def _float_like(dtype: np.dtype) -> bool:
    """numpy's floats and complex, and ml_dtypes' (bfloat16, float8 ...: kind ``V``)."""
    return dtype.kind in "fc" or (dtype.kind == "V" and dtype.type.__module__.startswith("ml_dtypes"))
