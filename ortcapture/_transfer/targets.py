"""A graph's fixed input buffers as the replay path copies feeds into them: ``FeedTargets`` and ``copy_feeds``.

Moved out of :mod:`ortcapture.transfer` unchanged; the public module re-exports the public names. ``COPY_BACKEND``
is read from :mod:`ortcapture._ort.sync`, where it is set.
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping

import numpy as np

from ortcapture._ort import compat, compute_stream, sync
from ortcapture._ort.compat import OrtValue
from ortcapture._ort.sync import UNSETTLED, WEBGPU_LOCK, settle
from ortcapture._ort.values import WEBGPU_MAX_BYTES
from ortcapture._transfer.check import _alias, _name_it
from ortcapture._transfer.copy import _CUDA_SHARED, _ORTVALUE, _fast_pair, commit, prepare, update_inplace
from ortcapture.errors import TransferError



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
        lock: the lock the caller holds around every :meth:`copy` (the session guard's lock), or ``None``. Where it
            is the process's :data:`~ortcapture._ort.sync.WEBGPU_LOCK` (a WebGPU session's guard), remembered WebGPU
            copies call ORT's ``copy_tensors`` without taking that re-entrant lock again (~0.1 µs per feed).
    """

    __slots__ = ("buffers", "gate_held", "staging", "make_staging", "stream", "last", "_prev", "webgpu_locked")

    def __init__(self, buffers: Mapping[str, OrtValue], gate_held: bool = False, staging=None,
                 make_staging=None, stream=None, lock=None) -> None:
        self.buffers = buffers
        self.gate_held = bool(gate_held)
        self.webgpu_locked = lock is WEBGPU_LOCK
        #: ``(stream, event, device)``: the session's CUDA compute stream, an event of its device and the device
        #: ordinal (device-to-device copies of remembered sources on that device are then queued on it ahead of
        #: the replay, with no host wait: :func:`ortcapture._ort.compute_stream.async_copier`), or None
        self.stream = stream if self.gate_held else None
        self.staging = staging
        #: ``() -> HostStaging``: makes the staging on the first numpy feed (graphs with pinned staging), or None
        self.make_staging = make_staging
        self.last: dict[str, tuple] = {}  # name -> (weakref to the source, copy(src) into the buffer)
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
        if sync.COPY_BACKEND is not None:
            return None
        hit = self.last.get(name)
        if hit is not None and hit[0]() is value:
            return hit
        prev = self._prev.get(name)
        if prev is not None and prev[0]() is value:
            self.last[name] = prev
            if hit is None:
                self._prev.pop(name, None)
            else:
                self._prev[name] = hit
            return prev
        return None

    def _remember(self, name: str, dst: OrtValue, src: Any) -> None:
        fn = _direct_copier(dst, src, self.gate_held, self.stream, self.webgpu_locked)
        old = self.last.pop(name, None)
        if old is not None and old[0]() is not None:
            self._prev[name] = old
        if fn is None:
            return
        try:
            self.last[name] = (weakref.ref(src), fn)
        except TypeError:
            pass


def _direct_copier(dst: OrtValue, src: Any, gate_held: bool, stream=None, webgpu_locked: bool = False):
    """``copy(src)`` into ``dst`` for :class:`FeedTargets` to use next time without checking ``src`` again, or
    ``None`` where it must be checked every time (see there). Called after :func:`update_inplace` accepted the pair.
    The caller holding the CUDA gate: ORT's ``dst.update_inplace`` itself, or — ``stream`` given, both on the
    stream's device — the copy queued on the session's compute stream ahead of the replay (ORT's copy where that
    fails). WebGPU: ORT's ``copy_tensors`` under :data:`WEBGPU_LOCK` (taken here unless ``webgpu_locked``: the
    caller holds it)."""
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
    if (sm.kind == "webgpu" == dm.kind and sync.COPY_BACKEND is None and compat.has_copy_tensors()
            and _alias(src, sm, dst, dm) is None and sm.nbytes <= WEBGPU_MAX_BYTES):
        targets, copy_tensors = [dst], compat.ort_copy_tensors
        if webgpu_locked:
            def webgpu_held(s):
                copy_tensors([s], targets, None)
            return webgpu_held

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
        if type(feeds) is dict and len(feeds) == 1 and sync.COPY_BACKEND is None:
            for name, value in feeds.items():  # the replay hot path: one remembered source
                hit = buffers.last.get(name)
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
