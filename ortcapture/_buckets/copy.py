"""The request's region in a bucket graph's fixed buffers: CUDA region copies in and out, the host staging fill.

Used by :mod:`ortcapture._buckets.run`: CUDA region copies in and out (cuda-python), the host staging array's fill,
the host slice of an output.

``entry`` is a ``_bucket_run._Entry`` (its ``graph``, ``staging``, ``filled`` and ``layouts``); the functions were
``BucketRunner`` methods, moved verbatim (the runner's ``pad_values``/pad bytes are now parameters).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ortcapture._ort import cudart as _cudart
from ortcapture._buckets.values import cuda_ptr, dtype_of, np_dtype, shape_of
from ortcapture._buckets.spec import sliced_lengths
from ortcapture._ort.sync import CUDA_GATE
from ortcapture._ort.values import device_id_of
from ortcapture._transfer.copy import to_numpy


# CUDA: feeds go straight into the fixed buffer's leading region (host or device source, one strided
# cudaMemcpy2D), only the rows the previous request wrote beyond this one are zeroed on the device, and outputs
# come back as just the request's region. Measured on the H200 (YOLOv8n, batch 1-8 stream): this path against a
# host staging copy of the padded batch and a full readback: see the note of issue 16.
def layout(entry, name: str, buf, axis: int) -> tuple:
    """(buffer, shape, dtype, bytes per step of ``axis``, rows before it, device pointer, CUDA device) of a fixed
    buffer, computed once per buffer object (compaction may hand the graph new buffers)."""
    lay = entry.layouts.get(name)
    if lay is None or lay[0] is not buf:
        full = tuple(buf.shape())
        dtype = np_dtype(buf)
        inner = math.prod(full[axis + 1:]) * np.dtype(dtype).itemsize
        dev = device_id_of(buf) if buf.device_name().lower() == "cuda" else None
        lay = entry.layouts[name] = (buf, full, dtype, inner, math.prod(full[:axis]), buf.data_ptr(), dev)
    return lay


def cuda_fill(entry, name: str, v: Any, axis: int, pad_byte: Mapping[str, int | None]) -> bool:
    """Copy ``v`` into ``name``'s fixed buffer's leading region along ``axis``, zeroing only the rows the previous
    request wrote beyond it (set to the pad value's repeated byte); False (the caller falls back) when ``v`` is
    not a C-contiguous host array or CUDA tensor of the buffer's dtype and rank."""
    _, full, dtype, inner, outer, dst, dev = layout(entry, name, entry.graph.inputs[name], axis)
    if isinstance(v, np.ndarray):
        if not v.flags.c_contiguous or v.dtype != dtype or v.ndim != len(full):
            return False
        src, shape = v.ctypes.data, v.shape
    else:
        src = cuda_ptr(v)
        shape = shape_of(v)
        if src is None or str(dtype_of(v)) != str(dtype) or len(shape) != len(full):
            return False
    n = shape[axis]
    width, pitch = n * inner, full[axis] * inner
    last = entry.filled.get(name)
    last_n = full[axis] if last is None else last[axis]
    with CUDA_GATE.shared:  # no CUDA call while another thread captures (ortcapture._ort.sync)
        _cudart.copy_and_zero_2d(dst, pitch, src, width, outer, (last_n - n) * inner if last_n > n else 0,
                                 device=dev, fill=pad_byte.get(name, 0) or 0)
    entry.filled[name] = shape
    return True


def cuda_read(entry, name: str, out, rel: Mapping[int, tuple], sizes: dict) -> np.ndarray:
    """The request's region of a fixed output buffer, as a new host array (one strided copy)."""
    buf = entry.graph.outputs.get(name, out)  # the fixed buffer (the ReplayOutput wrapper is new each replay)
    lengths = sliced_lengths(rel, sizes, shape_of(buf), name) if rel else {}  # never beyond the buffer
    if len(lengths) != 1:
        return slice_output(to_numpy(out), rel, sizes, name) if lengths else to_numpy(out)
    (axis, n), = lengths.items()
    _, full, dtype, inner, outer, src, dev = layout(entry, "->" + name, buf, axis)
    host = np.empty(full[:axis] + (n,) + full[axis + 1:], dtype)
    if host.size:
        with CUDA_GATE.shared:
            _cudart.copy_and_zero_2d(host.ctypes.data, n * inner, src, n * inner, outer, 0,
                                     spitch=full[axis] * inner, device=dev)
    return host


def fill_staging(entry, name: str, x: np.ndarray, axes, pad_values: Mapping[str, Any]) -> np.ndarray:
    stage = entry.staging[name]
    pad = pad_values.get(name, 0)
    if x.dtype != stage.dtype or x.ndim != stage.ndim:
        stage = entry.staging[name] = np.full(stage.shape, pad, x.dtype)  # the graph's copy says what is wrong
    region = tuple(slice(0, x.shape[ax]) for ax in range(x.ndim))
    last = entry.filled.get(name)
    if last is not None and last != x.shape:
        if len(axes) == 1:
            ax = axes[0][0]
            if last[ax] > x.shape[ax]:
                tail = [slice(None)] * x.ndim
                tail[ax] = slice(x.shape[ax], last[ax])
                stage[tuple(tail)] = pad
        else:
            stage.fill(pad)
    stage[region] = x
    entry.filled[name] = x.shape
    return stage


def slice_output(out: np.ndarray, rel: Mapping[int, tuple], sizes: dict, name: str = "output") -> np.ndarray:
    if not rel:
        return out
    lengths = sliced_lengths(rel, sizes, out.shape, name)
    region = tuple(slice(0, lengths[ax]) if ax in lengths else slice(None) for ax in range(out.ndim))
    y = out[region]
    return y if y.flags.c_contiguous else np.ascontiguousarray(y)
