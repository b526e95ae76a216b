"""Host memory its owner page-locks for feeds: :func:`pin_host_memory` (issue 44: the serving batch slots).

A numpy feed that lies inside such memory is sent to a captured graph's device buffer with one DMA from where it is
(``cudaMemcpyAsync`` on the graph's copy stream, waited for before ``run`` returns) instead of being copied into the
graph's page-locked staging first. The staging's own in-place registration (:class:`ortcapture._transfer.staging.
_InPlace`) never locks memory numpy does not own — a view of ``SharedMemory`` or ``mmap`` can be unmapped while the
array lives, and a range left registered over an address a later mapping reuses is undefined behaviour in the
driver — so memory like that is pinned by whoever maps it, for as long as it stays mapped: this module.
"""
from __future__ import annotations

import os
import threading
import weakref

import numpy as np

from ortcapture._ort import sync
from ortcapture._ort.sync import CUDA_GATE

_LOCK = threading.Lock()  # changes of sync.HOST_RANGES; released through _release() only
#: ``(ptr, nbytes, view, pid)`` of pins collected while ``_LOCK`` was held (a finalizer may run on the very thread
#: that holds it, in the middle of rebuilding the list): undone by whoever holds the lock, before it lets go
_DROPPED: list = []


class PinnedHostMemory:
    """Host memory page-locked in place (``cudaHostRegister``, portable) until :meth:`close`; made by
    :func:`pin_host_memory`. Holds a ``memoryview`` of the buffer, so the buffer cannot be released meanwhile (a
    ``SharedMemory.close()`` raises ``BufferError`` until this is closed). Dropped without :meth:`close`, its range
    stops being used at once and the page-locking is undone at the next safe point (the memoryview, which keeps the
    memory mapped, is held until then). Attributes: ``ptr`` (the first byte's address, int) and ``nbytes`` (int)."""

    def __init__(self, view: memoryview, ptr: int, nbytes: int) -> None:
        self._view: memoryview | None = view
        self.ptr = ptr
        self.nbytes = nbytes
        self._pid = os.getpid()  # a forked child undoes nothing on the device
        self._finalizer = weakref.finalize(self, _dropped, view, ptr, nbytes, self._pid)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._view is None

    def close(self) -> None:
        """Stop feeding from this memory and undo the page-locking now (``cudaHostUnregister``), under the CUDA
        capture gate (never while another thread captures). Call it when no run that feeds from this memory is in
        progress and before the memory is unmapped or freed. Idempotent and safe from several threads at once; in a
        process forked after pinning, nothing is undone on the device (the page-locking is the parent's)."""
        from ortcapture._ort import cudart

        _LOCK.acquire()
        try:
            view, self._view = self._view, None
            if view is None:
                return
            self._finalizer.detach()
            _forget(self.ptr, self.nbytes)
        finally:
            _release()
        try:
            if self._pid == os.getpid():
                with CUDA_GATE.shared:
                    cudart.host_unregister(self.ptr)
        except BaseException:  # not undone: still open (its range no longer fed from), so a later close() tries again
            _LOCK.acquire()
            try:
                self._view = view
                self._finalizer = weakref.finalize(self, _dropped, view, self.ptr, self.nbytes, self._pid)
            finally:
                _release()
            raise
        view.release()

    def __enter__(self) -> "PinnedHostMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"PinnedHostMemory(ptr=0x{self.ptr:x}, nbytes={self.nbytes}, {state})"


def _forget(ptr: int, nbytes: int) -> None:
    """Take ``[ptr, ptr + nbytes)`` out of :data:`ortcapture._ort.sync.HOST_RANGES` (the caller holds ``_LOCK``)."""
    sync.HOST_RANGES = [r for r in sync.HOST_RANGES if r != (ptr, ptr + nbytes)]


def _dropped(view: memoryview, ptr: int, nbytes: int, pid: int) -> None:
    """A :class:`PinnedHostMemory` collected without :meth:`~PinnedHostMemory.close` (a finalizer, which may run
    anywhere, a capture included, and never waits for a lock): its range is no longer used — now, or, where
    ``_LOCK`` is held (maybe by this very thread, mid-update), by the holder before it lets go — and then its
    ``cudaHostUnregister`` is queued with the memoryview (the memory stays mapped until then) for the next safe point
    (``cudart.free_pending``)."""
    _DROPPED.append((ptr, nbytes, view, pid))
    if _LOCK.acquire(blocking=False):
        _release()


def _release() -> None:
    """Undo the dropped pins (:data:`_DROPPED`) and release ``_LOCK``; again if more were dropped meanwhile and the
    lock is free (a drop whose own try found it taken is undone here, never left behind)."""
    from ortcapture._ort import cudart

    while True:
        while _DROPPED:
            ptr, nbytes, view, pid = _DROPPED.pop()
            _forget(ptr, nbytes)
            if pid == os.getpid():  # a forked child undoes nothing on the device
                cudart.release_later("registered", (ptr, view))
        _LOCK.release()
        if not _DROPPED or not _LOCK.acquire(blocking=False):
            return


def _address(view: memoryview) -> int:
    """The first byte's address of C-contiguous ``view`` (the temporary views made for it are gone on return)."""
    arr = np.frombuffer(view, np.uint8) if view.ndim <= 1 and view.itemsize == 1 else \
        np.frombuffer(view.cast("B"), np.uint8)
    try:
        return int(arr.ctypes.data)
    finally:
        del arr


def _explained(exc: RuntimeError) -> RuntimeError:
    """``cudaHostRegister``'s failure, said plainly where the cause is the machine (no cuda-python, no driver)."""
    text = str(exc)
    if "cuda-python is not installed" in text:
        return RuntimeError('pin_host_memory needs CUDA: cuda-python is not installed (pip install "ortcapture[cuda]"); '
                            "CPU and WebGPU sessions have no page-locked memory to feed from")
    if "InsufficientDriver" in text or "NoDevice" in text:
        return RuntimeError(f"pin_host_memory needs an NVIDIA GPU and its driver; none is usable here ({text})")
    return exc


def pinning_in_place() -> bool:
    """Whether ortcapture page-locks host memory in place (``cudaHostRegister``): ``False`` under
    ``ORTCAPTURE_REGISTER=0``, read at import. :func:`pin_host_memory` itself always pins; callers that pin on their
    own initiative (``ortcapture serve``'s batch slots) ask this first."""
    return sync.REGISTER


def pin_host_memory(buffer) -> PinnedHostMemory:
    """Page-lock ``buffer``'s memory in place so that numpy feeds inside it reach a captured graph's device buffers
    with one DMA (no host copy into the graph's staging; CUDA graphs with page-locked staging only, i.e.
    ``host_staging == "pinned"``; ``ORTCAPTURE_REGISTER=0`` turns the use off).

    What it is for: memory an owner keeps mapped for a long time and fills with feeds — a ``SharedMemory`` ring that
    another process writes images into (``ortcapture serve``'s batch slots), an ``mmap``. A feed is used from there
    only when the whole array lies inside the pinned range; the copy is waited for before ``run`` returns, so the
    owner may rewrite the memory as soon as ``run`` returns (never *during* a run that feeds from it).

    Args:
        buffer: an object with the buffer protocol (``SharedMemory.buf``, ``mmap.mmap``, a numpy array, ``bytearray``),
            C-contiguous, at least one byte. It stays referenced until :meth:`PinnedHostMemory.close`.

    Returns:
        :class:`PinnedHostMemory` (a context manager): close it before unmapping or freeing the memory.

    Raises:
        TypeError: ``buffer`` has no buffer protocol.
        ValueError: not C-contiguous, empty, or overlapping memory pinned here already.
        RuntimeError: no cuda-python, no NVIDIA driver or GPU, or the driver refused (``cudaHostRegister``: memory
            already page-locked by someone else, a mapping it cannot lock).
    """
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise TypeError(f"pin_host_memory: {exc}") from None
    try:
        if not view.c_contiguous:
            raise ValueError("pin_host_memory: the buffer must be C-contiguous")
        if view.nbytes < 1:
            raise ValueError("pin_host_memory: the buffer is empty")
        ptr, nbytes = _address(view), int(view.nbytes)
        with CUDA_GATE.shared:  # the gate first, then _LOCK, as everywhere
            _LOCK.acquire()
            try:
                pinned = _register(view, ptr, nbytes)
            finally:
                _release()
    except BaseException:
        view.release()
        raise
    return pinned


def _register(view: memoryview, ptr: int, nbytes: int) -> PinnedHostMemory:
    """:func:`pin_host_memory`'s registration, with the CUDA gate and ``_LOCK`` held."""
    from ortcapture._ort import cudart

    if any(a < ptr + nbytes and ptr < b for a, b in sync.HOST_RANGES):
        raise ValueError(f"pin_host_memory: [0x{ptr:x}, +{nbytes}) overlaps memory pinned already")
    # read-only memory (a PROT_READ mapping, bytes) needs cudaHostRegisterReadOnly: feeds only read it
    try:
        cudart.host_register(ptr, nbytes, portable=True, read_only=view.readonly)
    except RuntimeError as exc:
        raise _explained(exc) from None
    pinned = PinnedHostMemory(view, ptr, nbytes)
    sync.HOST_RANGES = [*sync.HOST_RANGES, (ptr, ptr + nbytes)]
    return pinned
