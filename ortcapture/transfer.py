"""Strict in-place updates of fixed buffers, and copies between them — all validation lives here.

ORT's own paths accept silently wrong input: ``OrtValue.update_inplace(numpy)`` checks only the element count
(measured, onnxruntime-gpu 1.31.1: int32 bytes accepted into a float32 OrtValue and reinterpreted), copies the raw
memory of non-contiguous arrays (ORT #13548), and before ORT #32315 a ``copy_tensors`` with an aliased pair or an
undersized destination ended in ``std::terminate``. Every check here runs before any native call.

Backends, chosen by :mod:`ortcapture._ort.compat`: ``OrtValue.update_inplace(OrtValue)`` (ORT >= 1.26; for CUDA it is
``cudaMemcpy`` + ``cudaStreamSynchronize`` on the legacy default stream), ``onnxruntime.copy_tensors`` (WebGPU,
batch copies), and a cuda-python ``cudaMemcpyAsync`` + stream sync for CUDA on ORT versions without the former.
Ordering guarantee: every copy has completed on the device when the call returns, so a replay started afterwards
reads the new values; DLPack sources are ordered after their producer's pending work; and every transfer starts
after the runs an ortcapture session made with ``disable_synchronize_execution_providers=1`` (ORT returns from those
before the device finished them: :func:`ortcapture._ort.sync.settle`).
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from ortcapture._ort import compat, compute_stream
from ortcapture._ort.compat import C_OrtDevice, C_OrtValue, OrtDevice, OrtValue
from ortcapture._ort.sync import CUDA_GATE, FORKED_DEVICES, UNSETTLED, WEBGPU_LOCK, check_device, settle
from ortcapture._ort.values import ONNX_TO_NP, STORAGE, ValueMeta, meta  # noqa: F401 - ONNX_TO_NP re-exported
from ortcapture.errors import CaptureUnsupportedError, TransferError

#: Force a device-to-device backend: None (auto), "ort" (OrtValue.update_inplace) or "cuda-python" (cudaMemcpyAsync).
#: Set from $ORTCAPTURE_COPY_BACKEND at import; tests set it directly.
COPY_BACKEND = os.environ.get("ORTCAPTURE_COPY_BACKEND") or None

CPU, GPU = 0, 1  # OrtDevice::Type
NONE_VENDOR = 0x0000
#: OrtValue device kind -> (OrtDevice type, PCI vendor id) — mirrors ORT's get_vendor_id_for_device_type.
_DEVICE_KINDS = {
    "cpu": (CPU, NONE_VENDOR), "cuda": (GPU, 0x10DE), "webgpu": (GPU, NONE_VENDOR), "dml": (GPU, 0x1414),
    "cann": (3, 0x19E5),
}
# DLPack device types (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


# ---------------------------------------------------------------------------------------------------------------
# endpoints and the vendor guard
# ---------------------------------------------------------------------------------------------------------------
def _endpoint(x) -> tuple[int, int, str]:
    """(OrtDevice type, vendor id, kind name) of an OrtValue or OrtDevice."""
    if isinstance(x, C_OrtValue):
        x = OrtValue(x)
    if isinstance(x, OrtValue):
        kind = meta(x).kind
        if kind not in _DEVICE_KINDS:
            raise TransferError(f"unknown OrtValue device {kind!r}")
        return (*_DEVICE_KINDS[kind], kind)
    dev = compat.c_device(x) if isinstance(x, OrtDevice) else x
    if isinstance(dev, C_OrtDevice):
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


def _can_copy_endpoints(s: tuple[int, int, str], d: tuple[int, int, str]) -> bool:
    (st, sv, sk), (dt, dv, dk) = s, d
    if st == CPU and dt == CPU:
        return True
    if "webgpu" in (sk, dk):
        other_t, other_v = (dt, dv) if sk == "webgpu" else (st, sv)
        return other_t == CPU or (other_t == GPU and other_v == NONE_VENDOR)
    if "cuda" in (sk, dk):
        return (dk if sk == "cuda" else sk) in ("cpu", "cuda")
    return False


def can_copy(src, dst) -> bool:
    """Whether ORT can copy from ``src`` to ``dst`` without misreading memory.

    Mirrors WebGPU ``DataTransfer::CanCopy`` with its vendor guard (ORT #32317): WebGPU buffers (GPU memory with
    vendor id NONE) copy only to and from CPU and other WebGPU buffers; a GPU buffer of a named vendor (CUDA's
    0x10DE, AMD, Intel, Microsoft …) is not a ``WGPUBuffer`` and unpatched ORT would hand its pointer to Dawn.
    CUDA copies to and from CPU and CUDA (any ordinal: peer copies). Any other pair of GPU kinds: no.

    Args:
        src: an OrtValue (any shape and dtype) or an ``onnxruntime.OrtDevice``.
        dst: likewise.

    Returns:
        True when the device pair is copyable.

    Raises:
        TransferError: ``src`` or ``dst`` is neither an OrtValue nor an OrtDevice, or an OrtValue of an unknown device.
    """
    return _can_copy_endpoints(_endpoint(src), _endpoint(dst))


_KIND_PAIR_OK: dict[tuple[str, str], bool] = {}
#: ORT's own device-to-device ``OrtValue.update_inplace(OrtValue)`` works (ORT >= 1.26; probed once at import on two
#: tiny CPU values)
_ORT_D2D = compat.has_update_inplace_ortvalue()


def _require_copyable(sm: ValueMeta, dm: ValueMeta) -> None:
    key = (sm.kind, dm.kind)
    ok = _KIND_PAIR_OK.get(key)
    if ok is None:
        if sm.kind not in _DEVICE_KINDS or dm.kind not in _DEVICE_KINDS:
            raise TransferError(f"unknown OrtValue device {sm.kind!r} or {dm.kind!r}")
        ok = _KIND_PAIR_OK[key] = _can_copy_endpoints((*_DEVICE_KINDS[sm.kind], sm.kind),
                                                      (*_DEVICE_KINDS[dm.kind], dm.kind))
    if not ok:
        raise TransferError(
            f"refusing to copy {sm.kind} -> {dm.kind}: no data transfer in ORT handles that pair correctly (a WebGPU "
            "transfer would reinterpret foreign GPU memory as a WGPUBuffer, ORT #32317). Copy through the CPU "
            "explicitly, or allocate the source on the destination's device."
        )


# ---------------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------------
def _dst_meta(value: Any, role: str = "destination") -> ValueMeta:
    """The metadata of a value a transfer reads or writes (every public transfer takes each of its values through
    here before any native call). Raises :class:`TransferError` for what cannot be transferred, and
    :class:`~ortcapture.errors.CaptureError` (``kind`` ``"fork"``) for a buffer on a device the process that
    ``os.fork()`` made this one from had in use (:data:`ortcapture._ort.sync.FORKED_DEVICES`: the copy would hang)."""
    m = getattr(value, "_ortcapture_meta", None)  # fast path: values.meta's cache
    if m is None or m.dtype is None:
        if not isinstance(value, OrtValue):
            raise TransferError(f"{role} must be an onnxruntime.OrtValue, got {type(value).__name__}")
        m = meta(value)
        if m.dtype is None:
            hint = (": bfloat16 needs ml_dtypes (pip install 'ortcapture[bf16]')"
                    if m.element_type == "tensor(bfloat16)" else "")
            raise TransferError(
                f"OrtValue element type {m.element_type} is not supported by ortcapture transfers{hint}")
    if FORKED_DEVICES:  # an os.fork() child of a device user: its buffers are the parent's (sync.Origin)
        check_device(m.kind, role)
    return m


def np_dtype_of(value: OrtValue) -> np.dtype:
    """numpy dtype of a tensor OrtValue; raises :class:`TransferError` for types numpy cannot hold."""
    return _dst_meta(value, "value").dtype


def _check_match(dm: ValueMeta, shape: tuple, dtype: np.dtype, what: str) -> None:
    if dtype != dm.dtype:
        raise TransferError(
            f"dtype mismatch: {what} is {dtype}, destination is {dm.dtype}. ORT would reinterpret the bytes; cast "
            "the source explicitly (update_inplace(..., cast=True) for numpy sources)."
        )
    if shape != dm.shape:
        raise TransferError(
            f"shape mismatch: {what} has shape {shape}, destination has {dm.shape}. Fixed buffers keep the "
            "shape they were captured with."
        )


def _alias(a: OrtValue, am: ValueMeta, b: OrtValue, bm: ValueMeta) -> str | None:
    """``"same"`` when a and b are one buffer, ``"overlap"`` when their bytes overlap, else ``None``."""
    if a is b or compat.c_value(a) is compat.c_value(b):
        return "same"
    if am.kind == bm.kind == "webgpu":  # no byte ranges, but data_ptr() is the buffer handle: equal = same buffer
        try:
            return "same" if a.data_ptr() == b.data_ptr() != 0 else None
        except Exception:  # noqa: BLE001
            return None
    if am.kind != bm.kind or am.span is None or bm.span is None or am.device_id != bm.device_id:
        return None
    if am.span == bm.span:
        return "same"
    if am.span[0] < bm.span[1] and bm.span[0] < am.span[1]:
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
# DLPack sources
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------------------------
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
        cast: convert a numpy source of another dtype on the host first.

    int64 into a WebGPU buffer: ORT's WebGPU EP under graph capture keeps only the low 32 bits, so every host
    source (numpy array, CPU OrtValue, CPU DLPack tensor) is range-checked here on every call; a WebGPU OrtValue
    source is checked once, when a capture takes it as an example feed (``check_int64_inputs``) — afterwards
    (device to device, no readback) its values staying within int32 is the caller's promise.

    Returns:
        ``dst``.

    Raises:
        TransferError: (a ``ValueError``) shape, dtype or device mismatch, overlapping buffers, an unsupported source
            type, int64 host data outside the int32 range for a WebGPU buffer — always before any native call.
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
            and sm.shape == dm.shape and bool(sm.span) and bool(dm.span) and COPY_BACKEND is None and _ORT_D2D
            and (sm.span[1] <= dm.span[0] or dm.span[1] <= sm.span[0] or sm.device_id != dm.device_id))


class FeedTargets:
    """A graph's fixed input buffers as :func:`copy_feeds` takes them on the replay path, with what was decided
    about each source before (built by ``CapturedGraph`` at capture and again whenever its buffers change).

    A source seen before is copied without validating it again only where nothing about it can have changed: an
    exact ``onnxruntime.OrtValue`` (a tensor OrtValue's shape, element type and buffer are fixed for its life; a
    ``ReplayOutput`` is never remembered: it needs its staleness check) copied device to device through ORT
    (CUDA ``OrtValue.update_inplace(OrtValue)``, WebGPU ``copy_tensors``). Everything else — numpy arrays (shape,
    dtype and strides can change in place), DLPack producers (a torch tensor can be resized; their own cache
    re-checks address, shape, dtype and contiguity on every call), CPU values — takes :func:`update_inplace`'s
    full checks on every call. The remembered source is held weakly, and one per input.

    Args:
        buffers: ``{input name: fixed OrtValue}`` (the graph's ``inputs``; not copied: the graph rebuilds its
            targets when it replaces a buffer).
        gate_held: the caller holds ``CUDA_GATE.shared`` around every :meth:`copy` (a CUDA session's guard).
        staging: the graph's :class:`HostStaging` for host (numpy) sources, or ``None``.
    """

    __slots__ = ("buffers", "gate_held", "staging", "make_staging", "stream", "_last", "_prev")

    def __init__(self, buffers: Mapping[str, OrtValue], gate_held: bool = False, staging=None,
                 make_staging=None, stream=None) -> None:
        self.buffers = buffers
        self.gate_held = bool(gate_held)
        #: ``(stream, event, device)``: the session's CUDA compute stream, an event of its device and the device
        #: ordinal (device-to-device copies of remembered sources on that device are then queued on it ahead of
        #: the replay, with no host wait: :func:`ortcapture._ort.compute_stream.async_copier`), or None
        self.stream = stream if self.gate_held else None
        self.staging = staging
        #: ``() -> HostStaging``: makes the staging on the first numpy feed (graphs with pinned staging), or None
        self.make_staging = make_staging
        self._last: dict[str, tuple] = {}  # name -> (weakref to the source, copy(src) into the buffer)
        self._prev: dict[str, tuple] = {}  # name -> the one remembered before (double-buffered feeds alternate)

    def __getitem__(self, name: str) -> OrtValue:
        return self.buffers[name]

    def __iter__(self):
        return iter(self.buffers)

    def __len__(self) -> int:
        return len(self.buffers)

    def copy(self, feeds: Mapping[str, Any]) -> None:
        """:func:`copy_feeds` into these buffers (same checks, same errors; every feed checked before any copy)."""
        if type(feeds) is not dict and not isinstance(feeds, Mapping):
            raise TransferError(f"feeds must be a mapping {{input name: value}}, got {type(feeds).__name__}")
        if len(feeds) == 1:
            for name, value in feeds.items():
                hit = self._hit(name, value)
                if hit is not None:
                    if UNSETTLED:
                        settle()
                    hit[1](value)
                    return
                dst = self.buffers.get(name)
                if dst is None:
                    raise TransferError(f"unknown input {name!r}; the inputs are {list(self.buffers)}")
                if type(value) is np.ndarray:
                    staging = self.staging
                    if staging is None and self.make_staging is not None:
                        staging = self.make_staging()
                    if staging is not None and staging.takes(name, value):
                        staging.upload({name: value})
                        return
                try:
                    update_inplace(dst, value)
                except TransferError as exc:
                    _name_it(exc, name)
                    raise
                self._remember(name, dst, value)
            return
        hits = [self._hit(name, v) for name, v in feeds.items()]
        if all(h is not None for h in hits):
            if UNSETTLED:
                settle()
            for h, v in zip(hits, feeds.values()):
                h[1](v)
            return
        staging = self.staging
        if staging is None and self.make_staging is not None and any(type(v) is np.ndarray for v in feeds.values()):
            staging = self.make_staging()
        host: dict = {}
        tokens = []
        for name, value in feeds.items():
            dst = self.buffers.get(name)
            if dst is None:
                raise TransferError(f"unknown input {name!r}; the inputs are {list(self.buffers)}")
            if staging is not None and type(value) is np.ndarray and staging.takes(name, value):
                host[name] = value  # checked by takes(): exact shape, dtype, C order
                continue
            try:
                tokens.append((name, prepare(dst, value)))
            except TransferError as exc:
                _name_it(exc, name)
                raise
        for name, token in tokens:
            commit(token)
            self._remember(name, token[0], feeds[name])
        if host:
            staging.upload(host)

    def _hit(self, name: str, value: Any) -> tuple | None:
        """The remembered ``(weakref, copy)`` of ``value`` for input ``name`` — the last source or the one before
        (made the last again) — or ``None`` (not seen, or ``COPY_BACKEND`` set: every copy checked)."""
        if COPY_BACKEND is not None:
            return None
        hit = self._last.get(name)
        if hit is not None and hit[0]() is value:
            return hit
        prev = self._prev.get(name)
        if prev is not None and prev[0]() is value:
            self._last[name] = prev
            if hit is None:
                self._prev.pop(name, None)
            else:
                self._prev[name] = hit
            return prev
        return None

    def _remember(self, name: str, dst: OrtValue, src: Any) -> None:
        fn = _direct_copier(dst, src, self.gate_held, self.stream)
        old = self._last.pop(name, None)
        if old is not None and old[0]() is not None:
            self._prev[name] = old
        if fn is None:
            return
        try:
            self._last[name] = (weakref.ref(src), fn)
        except TypeError:
            pass


def _direct_copier(dst: OrtValue, src: Any, gate_held: bool, stream=None):
    """``copy(src)`` into ``dst`` for :class:`FeedTargets` to use next time without checking ``src`` again, or
    ``None`` where it must be checked every time (see there). Called after :func:`update_inplace` accepted the pair.
    The caller holding the CUDA gate: ORT's ``dst.update_inplace`` itself, or — ``stream`` given, both on the
    stream's device — the copy queued on the session's compute stream ahead of the replay (ORT's copy where that
    fails)."""
    if type(src) is not _ORTVALUE:
        return None
    sm = getattr(src, "_ortcapture_meta", None)
    dm = getattr(dst, "_ortcapture_meta", None)
    if sm is None or dm is None or sm.dtype is None or sm.dtype != dm.dtype or sm.shape != dm.shape:
        return None
    if _fast_pair(sm, dm, src):
        if gate_held and stream is not None and sm.device_id == dm.device_id == stream[2] and dm.nbytes:
            return compute_stream.async_copier(dm.span[0], sm.span[0], dm.nbytes, stream[0], stream[1],
                                               dst.update_inplace)
        if gate_held:
            return dst.update_inplace

        def d2d(s, dst=dst):
            with _CUDA_SHARED:
                dst.update_inplace(s)
        return d2d
    if (sm.kind == "webgpu" == dm.kind and COPY_BACKEND is None and compat.has_copy_tensors()
            and _alias(src, sm, dst, dm) is None):
        targets, copy_tensors = [dst], compat.ort_copy_tensors

        def webgpu(s):
            with WEBGPU_LOCK:
                copy_tensors([s], targets, None)
        return webgpu
    return None


def copy_feeds(buffers: Mapping[str, OrtValue], feeds: Mapping[str, Any]) -> None:
    """Copy each feed into the fixed buffer of the same name — the one function that copies feeds into a graph's
    inputs (:meth:`CapturedGraph.run`, capture, ``reset_state``).

    Args:
        buffers: ``{input name: fixed OrtValue}``.
        feeds: ``{input name: source}``, each source as :func:`update_inplace` takes it (numpy array, OrtValue on
            any device, DLPack tensor), exactly the buffer's shape and dtype.

    Raises:
        TransferError: ``feeds`` is not a mapping, names an unknown input, or a source does not match its buffer
            or is no array (a numpy scalar such as ``np.float32(0.5)``: feed a 0-d array); the message names the
            input. Every feed is checked before any buffer is written (a single feed: :func:`update_inplace`'s own checks,
            which also precede its copy), so a refused call changes nothing.
    """
    if type(buffers) is FeedTargets:  # a graph's replay: sources validated before are copied straight away
        if type(feeds) is dict and len(feeds) == 1 and COPY_BACKEND is None:
            for name, value in feeds.items():  # the replay hot path: one remembered source
                hit = buffers._last.get(name)  # noqa: SLF001 - FeedTargets is this module's
                if hit is not None and hit[0]() is value:
                    if UNSETTLED:
                        settle()
                    hit[1](value)
                    return
        buffers.copy(feeds)
        return
    if type(feeds) is not dict and not isinstance(feeds, Mapping):
        raise TransferError(f"feeds must be a mapping {{input name: value}}, got {type(feeds).__name__}")
    if len(feeds) == 1:  # the common case, straight to update_inplace's one fast path
        for name, value in feeds.items():
            dst = buffers.get(name)
            if dst is None:
                raise TransferError(f"unknown input {name!r}; the inputs are {list(buffers)}")
            try:
                update_inplace(dst, value)
            except TransferError as exc:
                _name_it(exc, name)
                raise
        return
    tokens = []
    for name, value in feeds.items():
        dst = buffers.get(name)
        if dst is None:
            raise TransferError(f"unknown input {name!r}; the inputs are {list(buffers)}")
        try:
            tokens.append(prepare(dst, value))
        except TransferError as exc:
            _name_it(exc, name)
            raise
    for token in tokens:
        commit(token)


def _name_it(exc: TransferError, name: str) -> None:
    """Prefix a refusal with the input it concerns (no cost on the path that succeeds)."""
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith("input "):
        exc.args = (f"input {name!r}: {exc.args[0]}", *exc.args[1:])


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


def _host_int64_rule(src: OrtValue, sm: ValueMeta, dm: ValueMeta) -> None:
    """The int32-range rule of WebGPU int64 buffers (:func:`_check_int32_range`) for a CPU OrtValue source, as for a
    numpy one (measured before: an OrtValue of int64 beyond int32 was read silently as 32-bit where the same numpy
    array was refused). Attribute compares unless it applies."""
    if dm.kind == "webgpu" and sm.kind == "cpu" and dm.dtype == np.int64 and sm.nbytes:
        _check_int32_range(src.numpy())


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


def _as_source(src: Any) -> OrtValue | np.ndarray:
    """A non-OrtValue source as an OrtValue (C OrtValue, CUDA DLPack producer) or a host numpy array."""
    if isinstance(src, np.ndarray):
        return src
    if hasattr(src, "__dlpack__"):
        return _from_dlpack(src)
    if isinstance(src, C_OrtValue):
        return OrtValue(src)
    raise TransferError(_unsupported(src))


def _unsupported(src: Any) -> str:
    """Why ``src`` is no source: a numpy scalar (``np.float32(0.5)``: ORT's own ``run`` refuses it too, "Unable to
    handle object of type"), or another type."""
    if isinstance(src, np.generic):
        return (f"a numpy scalar ({type(src).__name__}), not an array: pass a 0-d array (np.asarray(value) or "
                "np.array(0.5, np.float32)) for a scalar input, as ORT's run() needs")
    return f"unsupported source type {type(src).__name__}: pass a numpy array, an OrtValue or a DLPack tensor"


def source_spec(src: Any) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, numpy dtype)`` of a source :func:`update_inplace` takes (numpy array, 0-d included; OrtValue on any
    device; DLPack tensor), without reading it. Raises :class:`TransferError` naming the type for anything else
    (numpy scalars, Python numbers, strings, ``None``)."""
    if isinstance(src, OrtValue):
        return tuple(src.shape()), np_dtype_of(src)
    if isinstance(src, np.ndarray):
        return tuple(src.shape), src.dtype
    if isinstance(src, C_OrtValue):
        return source_spec(OrtValue(src))
    if hasattr(src, "__dlpack__") and hasattr(src, "shape"):
        dt = str(getattr(src, "dtype", "")).replace("torch.", "")
        try:
            return tuple(int(d) for d in src.shape), np.dtype("bool" if dt == "bool" else dt)
        except TypeError:
            pass
    raise TransferError(_unsupported(src))


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
        host = OrtValue.ortvalue_from_shape_and_type(list(m.shape), m.dtype.type)
        with WEBGPU_LOCK:
            compat.ort_copy_tensors([value], [host], None)
        return host.numpy()
    if m.kind == "cuda":
        with _CUDA_SHARED:
            return value.numpy()
    return value.numpy()


# ---------------------------------------------------------------------------------------------------------------
# backends (inputs already validated)
# ---------------------------------------------------------------------------------------------------------------
def _as_numpy(src: np.ndarray, dm: ValueMeta, cast: bool) -> np.ndarray:
    if src.dtype != dm.dtype:
        if not cast:
            _check_match(dm, tuple(src.shape), src.dtype, "numpy source")
        src = src.astype(dm.dtype)
    _check_match(dm, tuple(src.shape), src.dtype, "numpy source")
    if dm.kind == "webgpu" and src.dtype == np.int64 and src.size:
        _check_int32_range(src)
    return np.require(src, requirements="C")  # ascontiguousarray would turn 0-d into (1,)


#: int64 values a WebGPU buffer holds right: ORT's WebGPU EP runs int64 as 32-bit under enableGraphCapture
INT32_RANGE = (-(2**31), 2**31 - 1)


def _check_int32_range(src: np.ndarray) -> None:
    """Refuse int64 host data for a WebGPU buffer with values outside int32 (issue 15: with enableGraphCapture=1
    the WebGPU EP keeps the low 32 bits, in captured and uncaptured runs alike; measured on onnxruntime 1.32 +
    WebGPU plugin 0.4.0)."""
    lo, hi = int(src.min()), int(src.max())
    if lo < INT32_RANGE[0] or hi > INT32_RANGE[1]:
        bad = lo if lo < INT32_RANGE[0] else hi
        raise TransferError(
            f"int64 value {bad} is outside the int32 range: ORT's WebGPU EP under graph capture "
            "(enableGraphCapture=1) runs int64 tensors as 32-bit and would silently use the low 32 bits. Keep "
            "int64 inputs within [-2**31, 2**31) on WebGPU, or run without capture.")


def value_rules(device_type: str) -> dict[np.dtype, Any]:
    """The rules a host feed's *values* (not its shape or dtype) must keep to be copied into a fixed buffer on
    ``device_type`` (``"cuda"``, ``"webgpu"``, ``"cpu"``): ``{numpy dtype: check(array)}``, each check raising
    :class:`~ortcapture.errors.TransferError`. These are the very functions :func:`update_inplace` applies on every
    host copy, so a caller that holds no device and no session (a serving tier checking a request before it joins a
    batch) refuses exactly what the copy would refuse. Today: int64 into a WebGPU buffer must stay within int32
    (ORT's WebGPU EP under ``enableGraphCapture=1`` keeps the low 32 bits: issue 15)."""
    return {np.dtype(np.int64): _check_int32_range} if device_type == "webgpu" else {}


def check_values(rules: Mapping[np.dtype, Any], feeds: Mapping[str, Any]) -> None:
    """Apply :func:`value_rules` to the numpy arrays of ``feeds`` (``{input name: array}``; other sources are
    skipped: their values are checked where they are copied). No device, no native call.

    Raises:
        TransferError: naming the first input whose values a rule refuses (its own values only).
    """
    if not rules:
        return
    for name, v in feeds.items():
        rule = rules.get(v.dtype) if isinstance(v, np.ndarray) else None
        if rule is not None and v.size:
            try:
                rule(v)
            except TransferError as exc:
                _name_it(exc, name)
                raise


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
    if COPY_BACKEND == "cuda-python" and both_cuda:
        from ortcapture._ort.cudart import memcpy_d2d

        memcpy_d2d(dm.span[0], sm.span[0], sm.nbytes)
    elif "webgpu" in (sm.kind, dm.kind):
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
