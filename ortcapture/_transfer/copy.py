"""The copies into fixed buffers and between them: ``update_inplace``, ``copy``, ``to_numpy`` and their backends.

Moved out of :mod:`ortcapture.transfer` unchanged; the public module re-exports the public names.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ortcapture._ort import compat, sync
from ortcapture._ort.compat import OrtValue
from ortcapture._ort.sync import CUDA_GATE, UNSETTLED, WEBGPU_LOCK, settle
from ortcapture._ort.values import STORAGE, ValueMeta, check_webgpu_bytes, meta
from ortcapture._transfer.check import (
    _alias, _check_int32_range, _check_match, _dst_meta, _host_int64_rule, _name_it, _require_copyable,
)
from ortcapture._transfer.sources import _WRAPPED, _as_numpy, _as_source
from ortcapture.errors import CaptureUnsupportedError, TransferError


#: ORT's own device-to-device ``OrtValue.update_inplace(OrtValue)`` works (ORT >= 1.26; probed once at import on two
#: tiny CPU values)
_ORT_D2D = compat.has_update_inplace_ortvalue()


def update_inplace(dst: OrtValue, src: Any, *, cast: bool = False) -> OrtValue:
    """Copy ``src`` into the fixed buffer ``dst`` in place; the copy has completed when this returns.

    Guards against ORT's own ``OrtValue.update_inplace(numpy)``, which checks only the element count (measured on
    onnxruntime-gpu 1.31.1: int32 bytes accepted into a float32 OrtValue and reinterpreted) and copies the raw memory
    of non-contiguous arrays (ORT #13548).

    Args:
        dst: a tensor OrtValue on any device (CPU, ``cuda:N``, WebGPU), any shape and numpy-representable dtype.
        src: a numpy array (made C-contiguous; 0-d for a scalar input — a numpy scalar such as ``np.float32(0.5)``
            is refused, as ORT's ``run()`` refuses it), an OrtValue on any device, or a DLPack producer (``torch.Tensor``,
            ``cupy.ndarray``: wrapped zero-copy; CUDA sources go device to device, peer to peer across GPUs, never
            through the host; non-contiguous device sources are refused). Exactly ``dst``'s shape and dtype;
            ``src`` that is ``dst`` itself is a no-op.
        cast: convert a numpy source of another dtype on the host first — refused when a value would not survive
            (wrap-around, a sign flip or a truncated fraction into an integer buffer, NaN into an integer, a finite
            value overflowing to infinity, a dropped imaginary part; numpy's ``astype`` does all of these silently)
            or is not a number (object, string, datetime); rounding to the nearest float is accepted.

    int64 into a WebGPU buffer: ORT's WebGPU EP under graph capture keeps only the low 32 bits, so every host
    source (numpy array, CPU OrtValue, CPU DLPack tensor) is range-checked here on every call; a WebGPU OrtValue
    source is checked once, when a capture takes it as an example feed (``check_int64_inputs``) — afterwards
    (device to device, no readback) its values staying within int32 is the caller's promise.

    Returns:
        ``dst``.

    Raises:
        TransferError: (a ``ValueError``) shape, dtype or device mismatch, overlapping buffers, an unsupported source
            type, a ``cast=True`` value the buffer's dtype cannot hold, int64 host data outside the int32 range for
            a WebGPU buffer — always before any native call.
        StaleOutputError: ``src`` is a ``ReplayOutput`` overwritten by a later replay.
        CaptureUnsupportedError: the installed ORT lacks the needed copy path (device to device needs ORT >= 1.26
            or cuda-python).
        CaptureError: (``kind`` ``"fork"``) a CUDA or WebGPU buffer in an ``os.fork()`` child of a process that had
            used that device: ORT's device state does not survive fork (the copy would hang or crash without a word).
    """
    if UNSETTLED:  # a run returned before its device work finished (disable_synchronize_execution_providers=1)
        settle()
    dm = _dst_meta(dst)
    if not isinstance(src, OrtValue):
        cached = _WRAPPED.get(id(src))  # a CUDA DLPack producer wrapped before (torch/cupy on the hot path)
        if cached is not None and cached[0]() is src and cached[1](src):
            src = cached[2]
        else:
            src = _as_source(src)
            if isinstance(src, np.ndarray):
                _copy_host_to(dst, dm, _as_numpy(src, dm, cast))
                return dst
    sm = getattr(src, "_ortcapture_meta", None)
    if _fast_pair(sm, dm, src):  # hot path: a CUDA OrtValue seen before, checked in one expression
        with _CUDA_SHARED:
            if sm.device_id != dm.device_id:
                _peer(sm.device_id, dm.device_id)
            dst.update_inplace(src)
        return dst
    sm = _checked_value_source(src, dst, dm)
    if sm is not None:
        _copy_value(src, sm, dst, dm)
        _recheck(src)
    return dst


def _fast_pair(sm: ValueMeta | None, dm: ValueMeta, src: Any) -> bool:
    """The one test of :func:`update_inplace`'s hot path: ``src`` an exact ``onnxruntime.OrtValue`` (not a
    ``ReplayOutput``: those need a staleness check) whose metadata is cached, CUDA to CUDA, same shape and dtype,
    disjoint buffers (or different GPUs), ORT's own ``OrtValue.update_inplace(OrtValue)`` as the copy backend —
    everything the full checks below it would establish."""
    return (sm is not None and type(src) is _ORTVALUE and sm.kind == "cuda" == dm.kind and sm.dtype == dm.dtype
            and sm.shape == dm.shape and bool(sm.span) and bool(dm.span) and sync.COPY_BACKEND is None and _ORT_D2D
            and (sm.span[1] <= dm.span[0] or dm.span[1] <= sm.span[0] or sm.device_id != dm.device_id))


def prepare(dst: OrtValue, src: Any, *, cast: bool = False):
    """Validate ``src`` for ``dst`` exactly as :func:`update_inplace` does, without copying; return a token for
    :func:`commit`. Lets a caller check every feed before touching any buffer."""
    dm = _dst_meta(dst)
    if not isinstance(src, OrtValue):
        src = _as_source(src)
        if isinstance(src, np.ndarray):
            return (dst, dm, _as_numpy(src, dm, cast), None)
    return (dst, dm, src, _checked_value_source(src, dst, dm))


def check_source(dst: OrtValue, src: Any) -> None:
    """Raise exactly what :func:`update_inplace` would raise for ``src`` into ``dst``, without copying anything (a
    request checked in full before any of it is staged: ``CapturedGraph.run_many``)."""
    prepare(dst, src)


def commit(token) -> None:
    """Perform a copy validated by :func:`prepare`."""
    dst, dm, src, sm = token
    if UNSETTLED:
        settle()
    if isinstance(src, np.ndarray):
        _copy_host_to(dst, dm, src)
    elif sm is not None:
        _recheck(src)  # a ReplayOutput may have gone stale since prepare()
        _copy_value(src, sm, dst, dm)
        _recheck(src)


def _recheck(src) -> None:
    """A ReplayOutput source read while another thread replayed its graph raises StaleOutputError (seqlock)."""
    check = getattr(src, "_check", None)
    if check is not None:
        check()


def _checked_value_source(src: OrtValue, dst: OrtValue, dm: ValueMeta) -> ValueMeta | None:
    """Validate an OrtValue source against the destination; ``None`` when it is the destination itself."""
    check = getattr(src, "_check", None)  # a ReplayOutput: refuse reading it once a later replay overwrote it
    if check is not None:
        check()
    sm = _dst_meta(src, "source")
    _check_match(dm, sm.shape, sm.dtype, f"source ({sm.kind})")
    _require_copyable(sm, dm)
    alias = _alias(src, sm, dst, dm)
    if alias == "same":
        return None
    if alias == "overlap":
        raise TransferError("source and destination buffers overlap; an in-place copy between them is undefined")
    _host_int64_rule(src, sm, dm)
    return sm


def check_int64_inputs(buffers: Mapping[str, OrtValue], names: Sequence[str] | None = None) -> None:
    """Read back the int64 WebGPU buffers in ``buffers`` (those in ``names``; ``None``: all) and apply the int32-range
    rule (:func:`_check_int32_range`) to what they hold — for sources no host check saw: WebGPU OrtValues (another
    graph's outputs, the caller's own buffers) copied device to device. Called once at capture (the example feeds);
    later device-to-device feeds are not read back (it would cost a readback on every run): keeping their int64
    values within int32 is the caller's promise.

    Raises:
        TransferError: naming the input whose value is outside the int32 range.
    """
    for name, buf in buffers.items():
        if names is not None and name not in names:
            continue
        m = _dst_meta(buf)
        if m.kind == "webgpu" and m.dtype == np.int64 and m.nbytes:
            try:
                _check_int32_range(to_numpy(buf))
            except TransferError as exc:
                _name_it(exc, name)
                raise


def restore(buffers: Mapping[str, OrtValue], values: Mapping[str, Any]) -> None:
    """Write host copies of values ORT itself produced back into their buffers (outputs after the capture-time
    verification, outputs around a compaction): shape and dtype checked as :func:`update_inplace` checks them, but
    no input rule — an int64 output a float computation produced may lie beyond int32 (the WebGPU EP wrote it; the
    range rule is about what a WebGPU EP can read as an input).

    Raises:
        TransferError: an unknown name, a value that is no numpy array or does not match its buffer.
    """
    if UNSETTLED:
        settle()
    for name, value in values.items():
        dst = buffers.get(name)
        if dst is None:
            raise TransferError(f"unknown buffer {name!r}; the buffers are {list(buffers)}")
        if not isinstance(value, np.ndarray):
            raise TransferError(f"{name!r}: restore takes numpy arrays, got {type(value).__name__}")
        dm = _dst_meta(dst)
        _check_match(dm, tuple(value.shape), value.dtype, f"{name!r}")
        _copy_host_to(dst, dm, np.require(value, requirements="C"))


def copy(src: Sequence[OrtValue], dst: Sequence[OrtValue]) -> None:
    """Copy ``src[i]`` into ``dst[i]`` for every i, as ``onnxruntime.copy_tensors`` does, after checking every pair.

    Guards against ``copy_tensors`` with an aliased pair (``std::terminate`` before ORT #32315) and with an undersized
    destination (accepted and written past its end by released ORT: ortcapture patch 0003).

    Args:
        src: tensor OrtValues on any device.
        dst: tensor OrtValues, each exactly the shape and dtype of its source.

    Raises:
        TransferError: before any copy starts, for a length mismatch, non-OrtValues, a shape or dtype mismatch
            (an undersized destination included), a device pair ORT cannot copy (:func:`can_copy`), a pair whose
            source is its destination, overlapping pairs, or one destination written twice.
        StaleOutputError: a source is a ``ReplayOutput`` overwritten by a later replay.
        CaptureError: (``kind`` ``"fork"``) a CUDA or WebGPU buffer in an ``os.fork()`` child of a process that had
            used that device: ORT's device state does not survive fork (the copy would hang or crash without a word).
    """
    if UNSETTLED:
        settle()
    for what, seq in (("src", src), ("dst", dst)):
        if isinstance(seq, (OrtValue, str, bytes)) or not hasattr(seq, "__iter__"):
            raise TransferError(f"copy takes sequences of OrtValues ({what}=[value], as onnxruntime.copy_tensors), "
                                f"got {type(seq).__name__}")
    src, dst = list(src), list(dst)
    if len(src) != len(dst):
        raise TransferError(f"copy needs as many sources as destinations ({len(src)} != {len(dst)})")
    for s in src:
        _recheck(s)
    sms = [_dst_meta(s, f"source #{i}") for i, s in enumerate(src)]
    dms = [_dst_meta(d, f"destination #{i}") for i, d in enumerate(dst)]
    for i in range(len(src)):
        _check_match(dms[i], sms[i].shape, sms[i].dtype, f"source #{i}")
        _require_copyable(sms[i], dms[i])
        if sms[i].kind == "cpu" and dms[i].kind == "webgpu":  # state carries (device to device) skip the call
            _host_int64_rule(src[i], sms[i], dms[i])
        if _alias(src[i], sms[i], dst[i], dms[i]):
            raise TransferError(f"pair #{i}: source and destination are the same or overlapping buffers")
    for i in range(len(dst)):
        for j in range(i + 1, len(dst)):
            if _alias(dst[i], dms[i], dst[j], dms[j]):
                raise TransferError(f"destinations #{i} and #{j} are the same or overlapping buffers")
            if _alias(dst[i], dms[i], src[j], sms[j]) or _alias(dst[j], dms[j], src[i], sms[i]):
                raise TransferError(f"pairs #{i} and #{j}: one's destination overlaps the other's source")
    if not src:
        return
    if compat.has_copy_tensors() and any(m.kind == "webgpu" for m in (*sms, *dms)):
        _webgpu_bytes(*sms, *dms)
        with WEBGPU_LOCK:
            compat.ort_copy_tensors(src, dst, None)  # one call for the batch; ORT's environment transfers know WebGPU
    else:
        for s, sm, d, dm in zip(src, sms, dst, dms):
            _copy_value(s, sm, d, dm)
    for s in src:
        _recheck(s)


def to_numpy(value: OrtValue) -> np.ndarray:
    """A new host copy of a tensor OrtValue.

    Args:
        value: a tensor OrtValue on any device (WebGPU is read back through ``copy_tensors``; a ``ReplayOutput`` is
            checked for staleness before and after the read).

    Returns:
        A C-contiguous numpy array of ``value``'s shape and dtype.

    Raises:
        TransferError: not a tensor OrtValue, or an element type numpy cannot hold.
        StaleOutputError: a ``ReplayOutput`` overwritten by a later replay (also when one begins during the read).
        CaptureError: (``kind`` ``"fork"``) a CUDA or WebGPU buffer in an ``os.fork()`` child of a process that had
            used that device: ORT's device state does not survive fork (the copy would hang or crash without a word).
    """
    if getattr(value, "_check", None) is not None:  # a ReplayOutput: checked for staleness before and after
        return value.numpy()
    if UNSETTLED:
        settle()
    m = _dst_meta(value, "value")
    if m.dtype in STORAGE:
        return _storage_to_numpy(value, m)
    if m.kind == "webgpu":
        _webgpu_bytes(m)
        host = OrtValue.ortvalue_from_shape_and_type(list(m.shape), m.dtype.type)
        with WEBGPU_LOCK:
            compat.ort_copy_tensors([value], [host], None)
        return host.numpy()
    if m.kind == "cuda":
        with _CUDA_SHARED:
            return value.numpy()
    # a host value: ORT's numpy() is a view of the OrtValue's memory (a later update_inplace would show through it)
    return np.array(value.numpy(), copy=True)


def _webgpu_bytes(*metas: ValueMeta) -> None:
    """Refuse a WebGPU copy ORT would crash on (:func:`ortcapture._ort.values.check_webgpu_bytes`)."""
    for m in metas:
        if m.kind == "webgpu":
            check_webgpu_bytes(m.nbytes, f"a WebGPU buffer of shape {list(m.shape)}")


_ORTVALUE = OrtValue  # the hot path takes exact OrtValues only (a ReplayOutput must be checked for staleness)


def _peer(a: int, b: int) -> None:
    """GPU-to-GPU copies go peer to peer, not staged through the host (:func:`ortcapture._ort.cudart.ensure_peer_access`)."""
    from ortcapture._ort.cudart import ensure_peer_access

    ensure_peer_access(a, b)


#: CUDA copies are "readers" of the process-wide capture gate: see :mod:`ortcapture._ort.sync`.
_CUDA_SHARED = CUDA_GATE.shared


def _storage_to_numpy(value: OrtValue, m: ValueMeta) -> np.ndarray:
    """A host copy of a value whose dtype ORT's numpy bridge does not know (bfloat16): its bytes, read from a CPU
    OrtValue of the same element type (``value`` itself, or a copy of it), viewed as ``m.dtype``."""
    import ctypes

    storage, code = STORAGE[m.dtype]
    host = value
    if m.kind != "cpu":
        host = OrtValue.ortvalue_from_shape_and_type(list(m.shape), code)
        _copy_value(value, m, host, meta(host))
    raw = bytes((ctypes.c_char * m.nbytes).from_address(host.data_ptr())) if m.nbytes else b""
    return np.frombuffer(raw, dtype=storage).view(m.dtype).reshape(m.shape).copy()


def _copy_host_to(dst: OrtValue, dm: ValueMeta, arr: np.ndarray) -> None:
    storage = STORAGE.get(arr.dtype)
    if storage is not None:  # ORT's numpy bridge copies the bytes of the same-size storage type unchanged
        arr = arr.view(storage[0])
    if dm.kind == "webgpu":
        _webgpu_bytes(dm)
        with WEBGPU_LOCK:
            compat.ort_copy_tensors([OrtValue.ortvalue_from_numpy(arr)], [dst], None)
    elif dm.kind == "cuda":
        with _CUDA_SHARED:
            dst.update_inplace(arr)
    else:
        dst.update_inplace(arr)


def _copy_value(src: OrtValue, sm: ValueMeta, dst: OrtValue, dm: ValueMeta) -> None:
    if sm.kind == "cuda" or dm.kind == "cuda":
        with _CUDA_SHARED:  # never while another thread captures a CUDA graph (ortcapture._ort.sync)
            _copy_value_unguarded(src, sm, dst, dm)
    else:
        _copy_value_unguarded(src, sm, dst, dm)


def _copy_value_unguarded(src: OrtValue, sm: ValueMeta, dst: OrtValue, dm: ValueMeta) -> None:
    both_cuda = sm.kind == "cuda" and dm.kind == "cuda"
    if both_cuda and sm.device_id != dm.device_id:
        _peer(sm.device_id, dm.device_id)
    if sync.COPY_BACKEND == "cuda-python" and both_cuda:
        from ortcapture._ort.cudart import memcpy_d2d

        memcpy_d2d(dm.span[0], sm.span[0], sm.nbytes)
    elif "webgpu" in (sm.kind, dm.kind):
        _webgpu_bytes(sm, dm)
        with WEBGPU_LOCK:
            compat.ort_copy_tensors([src], [dst], None)
    elif _ORT_D2D:
        dst.update_inplace(src)
    elif both_cuda and compat.has_cuda_python():
        from ortcapture._ort.cudart import memcpy_d2d

        memcpy_d2d(dm.span[0], sm.span[0], sm.nbytes)
    elif sm.kind == "cpu":
        _copy_host_to(dst, dm, np.require(to_numpy(src), requirements="C"))
    elif "cuda" in (sm.kind, dm.kind) and sm.span and dm.span and compat.has_cuda_python():
        from ortcapture._ort.cudart import memcpy_d2d  # cudaMemcpyDefault: device to host as well

        memcpy_d2d(dm.span[0], sm.span[0], sm.nbytes)
    else:
        raise CaptureUnsupportedError(
            f"device-to-device update_inplace needs onnxruntime >= 1.26 (OrtValue.update_inplace(OrtValue)) or "
            f"cuda-python for CUDA; this is onnxruntime {compat.ort_version_string()}"
        )
