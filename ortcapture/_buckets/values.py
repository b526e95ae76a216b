"""The feed and output values a bucketed run handles: numpy arrays, OrtValues and DLPack tensors.

The values :mod:`ortcapture._buckets.run` handles: shape, dtype, CUDA device pointer and host copy of numpy arrays,
OrtValues and DLPack/CUDA-array-interface tensors; ORT input type strings as numpy dtypes; the byte a pad value
repeats; OrtValue-wrapped outputs. Moved verbatim from ``_bucket_run``.
"""
from __future__ import annotations

import numpy as np

from ortcapture._ort import compat
from ortcapture._ort.values import ONNX_TO_NP


def input_dtype(ort_type: str):
    """numpy dtype of an ORT input type string (``"tensor(float)"``; ortcapture's one table,
    :data:`ortcapture._ort.values.ONNX_TO_NP`), ``None`` for non-numeric ones (strings, sequences, maps)."""
    return ONNX_TO_NP.get(ort_type)


def repeated_byte(value) -> int | None:
    """The byte ``value`` repeats (0 for 0, 0xFF for int -1), or ``None`` when its bytes differ (most non-zero
    floats): then only a host copy can pad with it."""
    b = np.asarray(value).tobytes()
    return b[0] if b == b[:1] * len(b) else None


def np_dtype(value) -> np.dtype:
    from ortcapture._transfer.check import np_dtype_of

    return np_dtype_of(value)


def shape_of(v) -> tuple:
    if isinstance(v, np.ndarray):
        return v.shape
    s = v.shape() if callable(getattr(v, "shape", None)) else v.shape
    return tuple(int(x) for x in s)


def dtype_of(v):
    if isinstance(v, np.ndarray):
        return v.dtype
    if isinstance(v, compat.OrtValue):
        return np_dtype(v)
    return str(getattr(v, "dtype", "?")).replace("torch.", "")


def cuda_ptr(v) -> int | None:
    if isinstance(v, compat.OrtValue):
        return v.data_ptr() if v.device_name().lower() == "cuda" else None
    if hasattr(v, "__dlpack_device__") and int(v.__dlpack_device__()[0]) == 2:
        if hasattr(v, "is_contiguous") and not v.is_contiguous():
            return None
        if hasattr(v, "data_ptr"):
            return int(v.data_ptr())
        cai = getattr(v, "__cuda_array_interface__", None)
        if cai and cai.get("strides") is None:
            return int(cai["data"][0])
    return None


def to_host(v) -> np.ndarray:
    from ortcapture._transfer.copy import to_numpy

    if isinstance(v, compat.OrtValue):
        return to_numpy(v)
    if hasattr(v, "cpu") and hasattr(v, "numpy"):
        return v.detach().cpu().numpy() if hasattr(v, "detach") else v.cpu().numpy()
    if hasattr(v, "get"):
        return v.get()
    return np.asarray(v)


def wrap_outputs(outs: list, ort_values: bool) -> list:
    if not ort_values:
        return outs
    return [compat.OrtValue.ortvalue_from_numpy(np.require(o, requirements="C")) for o in outs]
