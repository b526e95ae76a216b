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


def wrap_outputs(outs: list, ort_values: bool) -> list:
    if not ort_values:
        return outs
    return [compat.OrtValue.ortvalue_from_numpy(np.require(o, requirements="C")) for o in outs]
