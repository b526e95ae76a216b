"""A request's rows in a captured graph's fixed buffers: ``CapturedGraph.feed_rows`` and ``read_rows``.

A bucket (``InferenceSession(buckets=...)``, issue 16) serves requests with fewer rows than its graph's buffers hold:
the request's rows go into the leading region of each fixed input, the rest of what the previous request wrote
there is set to the pad value, and only the request's rows of each output come back. These are the graph's own feed
plan's copies (issue 42: one feed path) — its host staging (page-locked on CUDA, chunked by the staging threads),
its copy stream and its output pool; device sources on CUDA go device to device (one strided copy). A request that
fills the buffers is no special case here: the bucket runner hands it to :meth:`CapturedGraph.run` itself.

Defined here, bound as methods of :class:`ortcapture._core.graph.CapturedGraph`.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from ortcapture._ort import compat
from ortcapture._transfer import check as tcheck
from ortcapture._transfer import copy as tcopy
from ortcapture._transfer import targets as ttargets
from ortcapture._transfer.check import check_rows


def feed_rows(self, feeds: Mapping[str, Any], axes: Mapping[str, tuple[int, ...]], *,
              pad: Mapping[str, Any] | None = None, last: Mapping[str, tuple] | None = None) -> None:
    """Copy each feed into the leading region of its fixed input (no replay).

    Args:
        feeds: ``{input name: value}``; a value whose input is in ``axes`` may have fewer rows than the buffer along
            those axes (equal elsewhere); others are copied whole, as :meth:`CapturedGraph.run` copies them.
            numpy arrays, OrtValues (any device), DLPack tensors; the buffer's dtype and rank.
        axes: ``{input name: (axis, ...)}``: the axes along which a feed may be shorter than its buffer.
        pad: ``{input name: numpy scalar}``: what the rows beyond the request's hold (default 0).
        last: ``{input name: shape}`` of the region each input's previous request wrote (missing: the whole buffer):
            only the rows between the two are set to ``pad`` where the device is written in place.

    Raises:
        TransferError: a value of another dtype or rank, larger than its buffer or different off ``axes``; an
            unknown input (before anything is copied).
        GraphReleasedError: after ``release()``.
    """
    pad = pad or {}
    last = last or {}
    plan = []
    for name, v in feeds.items():
        buf = self.inputs.get(name) if not self._released else None
        ax = axes.get(name)
        if buf is None or not ax:
            plan.append((name, v, None))
            continue
        if isinstance(v, np.ndarray):
            check_rows(name, v.shape, v.dtype, buf, ax)
            plan.append((name, np.ascontiguousarray(v), ax))
            continue
        shape, dtype = tcheck.source_spec(v)
        check_rows(name, shape, dtype, buf, ax)
        if not _device_copyable(buf, v, ax, pad.get(name, 0)):
            # a host OrtValue, a WebGPU tensor, a strided device tensor, another device: through the host
            v = np.ascontiguousarray(to_host(v))
        plan.append((name, v, ax))
    with self._cs.guard:
        if self._released:
            self._raise_released()
        whole = {name: v for name, v, ax in plan if ax is None}
        if whole:
            ttargets.copy_feeds(self._targets, whole)
        for name, v, ax in plan:
            if ax is None:
                continue
            p = pad.get(name, 0)
            if isinstance(v, np.ndarray):
                self.staging_now().upload_rows(name, v, ax, p, _repeated_byte(p, v.dtype), last.get(name))
            else:
                _device_rows(self.inputs[name], name, v, ax, p, last.get(name))


def read_rows(self, names: Sequence[str], lengths: Mapping[str, Mapping[int, int]]) -> list[np.ndarray]:
    """The outputs ``names`` (one per position) as new host arrays, each cut to ``lengths[name]`` (``{axis:
    rows}``; an output not in it comes back whole), read from the fixed buffers as the last replay left them. Call
    it right after this thread's replay, with nothing else replaying the graph (the bucket runner holds its lock).

    Raises:
        GraphReleasedError: after ``release()``.
    """
    out: list = []
    with self._cs.guard:
        if self._released:
            self._raise_released()
        staging = self.staging_now() if self._pin_ok else self._staging
        whole = []
        for i, name in enumerate(names):
            rows = lengths.get(name)
            full = self.outputs[name].shape()
            want = {a: n for a, n in (rows or {}).items() if n != full[a]}
            if not want:
                whole.append(i)
                out.append(None)
                continue
            got = None
            if staging is not None and len(want) == 1:
                ((axis, n),) = want.items()
                got = staging.read_rows(name, axis, n)
            if got is None:
                got = cut(tcopy.to_numpy(self.outputs[name]), want)
            out.append(got)
        if whole:
            if staging is not None and staging.pinned:
                arrs = staging.read_new([names[i] for i in whole])
            else:
                arrs = [tcopy.to_numpy(self.outputs[names[i]]) for i in whole]
            for i, a in zip(whole, arrs):
                out[i] = a
    return out


def cut(a: np.ndarray, lengths: Mapping[int, int]) -> np.ndarray:
    """``a`` cut to ``{axis: length}`` (C-contiguous: a view where it is one, else a copy)."""
    y = a[tuple(slice(0, lengths[ax]) if ax in lengths else slice(None) for ax in range(a.ndim))]
    return y if y.flags.c_contiguous else np.ascontiguousarray(y)


def _repeated_byte(value, dtype) -> int | None:
    """The byte ``value`` (as ``dtype``) repeats, or ``None`` (most non-zero floats)."""
    b = np.asarray(value, dtype).tobytes()
    return b[0] if b == b[:1] * len(b) else None


def _cuda_pointer(v) -> int | None:
    """The device pointer of a C-contiguous CUDA source (CUDA OrtValue, DLPack / CUDA array interface tensor), or
    ``None``."""
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
    """A host numpy copy (or view) of a feed: numpy as is, an OrtValue on any device, a torch/cupy tensor."""
    if isinstance(v, compat.OrtValue):
        return tcopy.to_numpy(v)
    if hasattr(v, "cpu") and hasattr(v, "numpy"):
        return v.detach().cpu().numpy() if hasattr(v, "detach") else v.cpu().numpy()
    if hasattr(v, "get"):
        return v.get()
    return np.asarray(v)


def _device_copyable(buf, v, axes: tuple[int, ...], pad) -> bool:
    """Whether :func:`_device_rows` copies ``v`` into ``buf``: a C-contiguous CUDA source (unified addressing: a
    peer device's too), one axis, a pad value that repeats one byte, cuda-python present."""
    if len(axes) != 1 or compat.cudart() is None or buf.device_name().lower() != "cuda":
        return False
    return _cuda_pointer(v) is not None and _repeated_byte(pad, tcheck.np_dtype_of(buf)) is not None


def _device_rows(buf, name: str, v, axes: tuple[int, ...], pad, last: tuple | None) -> None:
    """A CUDA source's rows into ``buf``'s leading region, device to device (one strided copy on the legacy stream,
    then the rows ``last`` wrote beyond them set to ``pad``'s byte; the caller holds the CUDA gate and checked
    :func:`_device_copyable`)."""
    from ortcapture._ort import cudart
    from ortcapture._ort.values import device_id_of

    full = tuple(buf.shape())
    dtype = tcheck.np_dtype_of(buf)
    axis = axes[0]
    inner = math.prod(full[axis + 1:]) * np.dtype(dtype).itemsize
    n = tcheck.source_spec(v)[0][axis]
    stop = full[axis] if last is None else last[axis]
    cudart.copy_and_zero_2d(buf.data_ptr(), full[axis] * inner, _cuda_pointer(v), n * inner, math.prod(full[:axis]),
                            (stop - n) * inner if stop > n else 0, device=device_id_of(buf),
                            fill=_repeated_byte(pad, dtype))
