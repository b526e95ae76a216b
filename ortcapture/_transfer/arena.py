"""Outputs into memory the caller chose, as the staging reads them: ``outputs_into`` (host) and ``tap_device_outputs``.

:func:`tap_device_outputs` offers the graph's device output buffers to the caller's own device copies as the staging
reads them (a CUDA IPC region written device to device, no host round trip); the rest of this docstring is
:func:`outputs_into`'s.

Host outputs read straight into memory the caller chose: :func:`outputs_into` (one DMA per output, no host copy).

A page-locked staging (CUDA) reads each host output with one ``cudaMemcpyAsync`` into a block of its recycling pool
(:meth:`ortcapture._transfer.staging.HostStaging.read_new` / ``read_rows``), and a caller that wants those outputs in
memory of its own — a serving batch slot shared with another process, a ring of pinned buffers — copied them again
on the host (measured on the H100, eighth session: 5.6 MB of YOLOv8n batch-8 outputs, ~0.6 ms of the replay thread).
Inside ``with outputs_into(buffer):`` every host output that this thread's replays read is instead placed in
``buffer``, one after another in the order they are read, each at an ``align``-byte boundary; an output that does
not fit what is left goes to the pool as before. Where it landed is the returned array's own memory: check
``np.shares_memory`` or the data pointer, never assume (pageable stagings, WebGPU and CPU never use the arena).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import operator
import threading

import numpy as np

# a context variable, not a thread-local: per thread, and per asyncio task too (a coroutine's block must not catch
# the outputs of another coroutine that runs on the same thread while it awaits); it holds the entering thread's id
# as well, since asyncio.to_thread and loop.run_in_executor copy the context into worker threads
_ARENA: contextvars.ContextVar = contextvars.ContextVar("ortcapture_output_arena", default=None)
# the device-output tap: as _ARENA, (block, thread id, task) of the innermost tap_device_outputs block
_TAP: contextvars.ContextVar = contextvars.ContextVar("ortcapture_device_output_tap", default=None)


def _index(value, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"outputs_into(): {what} must be an int, got {type(value).__name__}") from None


class OutputArena:
    """The room ``[start, stop)`` of a writable byte buffer that :func:`outputs_into` hands out in order.

    Args:
        buffer: a writable, C-contiguous buffer (``memoryview``, ``mmap``, ``SharedMemory.buf``, a numpy array):
            page-locked memory (``ortcapture.transfer.pin_host_memory``) for the DMA to run at full speed.
        start, stop: the byte range handed out (ints; ``stop`` ``None``: the buffer's end).
        align: every array starts at a multiple of ``align`` bytes past ``start`` (a power of two).

    Raises:
        TypeError: ``buffer`` has no buffer interface Python can export (an int; a numpy datetime64 array), or
            ``start``, ``stop`` or ``align`` is not an int.
        ValueError: ``buffer`` is read-only or not C-contiguous, the range is outside it, or ``align`` is not a
            power of two.

    The arena holds an export of ``buffer`` until it is dropped (a ``SharedMemory`` cannot close while it lives; an
    arena made by :func:`outputs_into` is dropped when its block ends), and every array it handed out holds one
    while it lives. Not thread-safe: :meth:`take` moves :attr:`offset` without a lock, so give each thread its own.
    """

    def __init__(self, buffer, start: int = 0, stop: int | None = None, align: int = 4096):
        start = _index(start, "start")
        stop = None if stop is None else _index(stop, "stop")
        align = _index(align, "align")
        try:
            view = memoryview(buffer)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"outputs_into() needs a buffer (memoryview, mmap, SharedMemory.buf, numpy array); "
                            f"{type(buffer).__name__} gives none ({exc})") from None
        if view.readonly or not view.c_contiguous:
            raise ValueError("outputs_into() needs a writable, C-contiguous buffer")
        size = view.nbytes
        stop = size if stop is None else stop
        if not 0 <= start <= stop <= size:
            raise ValueError(f"outputs_into(): the range [{start}, {stop}) is outside the buffer of {size} bytes")
        if align < 1 or align & (align - 1):
            raise ValueError(f"outputs_into(): align must be a power of two, got {align}")
        self._bytes: np.ndarray | None = np.frombuffer(view.cast("B"), np.uint8)
        self.start, self.stop, self.align = start, stop, align
        #: where the next array goes (bytes from the buffer's start)
        self.offset = start
        #: arrays handed out
        self.taken = 0

    def take(self, shape, dtype) -> np.ndarray | None:
        """A C-contiguous array of ``shape`` and ``dtype`` at :attr:`offset` (which then moves past it, rounded up to
        ``align``), or ``None`` when it does not fit what is left (nothing moves) or after :meth:`release`."""
        if self._bytes is None:
            return None
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if self.offset + n > self.stop:
            return None
        a = self._bytes[self.offset:self.offset + n].view(dt).reshape(tuple(shape))
        self.offset += -(-n // self.align) * self.align
        self.taken += 1
        return a


    def release(self) -> None:
        """Let go of the buffer (this arena's export of it): :meth:`take` hands nothing out from now on; the arrays
        handed out keep their own hold on it. :func:`outputs_into` does this when the block of an arena it made
        ends."""
        self._bytes = None


def current() -> OutputArena | None:
    """The arena of the innermost :func:`outputs_into` block this thread and task entered that has not ended, or
    ``None``."""
    block = _innermost(_ARENA)
    return None if block is None else block.arena


def _innermost(var: contextvars.ContextVar):
    """The innermost block of ``var`` this thread and task entered that has not ended, or ``None``."""
    held = var.get()
    while held is not None and held[0].token is None:  # ended (out of order, or in another context): its parent
        held = held[0].parent
    if held is None or held[1] != threading.get_ident() or held[2] is not _task():
        return None
    return held[0]


def _task():
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


class _Block:
    """What :func:`outputs_into` returns: a context manager over one :class:`OutputArena` (``arena``); and, over
    ``var`` ``_TAP``, what :func:`tap_device_outputs` returns (``arena`` its callable, never released)."""

    def __init__(self, arena, own: bool, var: contextvars.ContextVar = _ARENA, what: str = "outputs_into()"):
        self.arena, self._own, self.token, self.parent = arena, own, None, None
        self._var, self._what = var, what

    def __enter__(self):
        if self.token is not None:
            raise RuntimeError(f"{self._what}: this block is entered already")
        self.parent = self._var.get()  # what current() falls back to once this block ended
        self.token = self._var.set((self, threading.get_ident(), _task()))
        return self.arena

    def __exit__(self, *exc) -> None:
        token, self.token = self.token, None
        try:
            held = self._var.get()
            if held is not None and held[0] is self:  # the innermost block: the variable back as it was
                self._var.reset(token)
            # else a block entered inside this one is still open (a generator's block ended out of order, or this
            # is another context): the variable keeps it, and current() passes over this ended block to its parent
        except ValueError:  # the token belongs to another context (an async generator closed by the event loop)
            pass
        finally:
            if self._own:
                self.arena.release()


def outputs_into(buffer, start: int | None = None, stop: int | None = None, align: int | None = None) -> _Block:
    """A context manager: the host outputs read inside the ``with`` block go into ``buffer[start:stop]`` (see the
    module docstring), on a page-locked (CUDA) staging: ``CapturedGraph.run`` with ``copy_outputs=True`` (no
    ``out=``), and a session's bucket runs made on this thread (not those a ``replay_thread=True`` session hands to
    its replay thread, nor ``run_many``'s, read on a helper thread). Each array starts ``align`` bytes (default
    4096), or a multiple, past ``start`` (default 0); one that does not fit what is left, and every output of a
    pageable staging (WebGPU, CPU: nothing goes into ``buffer`` there), comes back as without the block. ``with``
    yields the :class:`OutputArena` (``offset``: where the next one would go; ``taken``: how many landed there).
    Blocks nest (the innermost wins) and belong to the thread and the asyncio task that entered them (a worker
    thread that copied the context, e.g. through ``asyncio.to_thread``, and a task created inside the block do not
    use it). Do not ``yield`` inside the block of a generator: while it is suspended there its block is still the
    caller's (context variables are not per generator, PEP 568 was never adopted), so the caller's outputs would go
    into ``buffer`` too. A block that ends out of order, or in another context (an async generator closed by the
    event loop), counts as ended from then on.

    ``buffer`` may be an :class:`OutputArena` already (then ``start``, ``stop`` and ``align`` must be left out; the
    arena stays usable after the block). The arrays returned inside the block are views of ``buffer``: they change
    when it is written, and keep it exported while they live (a ``SharedMemory`` cannot close until they are gone).

    Raises (here, before the block):
        TypeError, ValueError: what :class:`OutputArena` raises; ``ValueError`` for an :class:`OutputArena` given
            with ``start``, ``stop`` or ``align``.
    """
    if isinstance(buffer, OutputArena):
        if start is not None or stop is not None or align is not None:
            raise ValueError("outputs_into(arena): start, stop and align belong to the OutputArena already")
        return _Block(buffer, own=False)
    return _Block(OutputArena(buffer, 0 if start is None else start, stop, 4096 if align is None else align),
                  own=True)


def tap_device_outputs(copy) -> _Block:
    """A context manager: inside the ``with`` block, each output that a page-locked (CUDA) staging reads into a new
    host array on this thread and asyncio task — ``CapturedGraph.run`` with ``copy_outputs=True`` and no ``out=``, a
    session's bucket runs made on this thread (their answer's read: a bucket's capture and verification reads are
    not offered) — is first offered to ``copy(name, device_ptr, shape, dtype, stream)``:
    ``device_ptr`` (int) is the graph's own fixed device buffer of output ``name`` and ``shape`` (tuple of ints,
    C order, numpy ``dtype``) what is read from it — the whole output, or its first rows along the batched axis
    (a bucket's padding cut off, nothing before that axis) — and ``stream`` the CUDA stream (cuda-python
    ``cudaStream_t``) the read is queued on. What ``copy`` queues on ``stream`` (e.g. a device-to-device
    ``cudaMemcpyAsync`` of some rows into memory of the caller's: a CUDA IPC region) runs after the replay and is
    finished when the read returns; the buffer is the graph's, overwritten by its next replay, so copy from it only
    there. Pageable stagings (WebGPU, CPU, a CUDA staging that could not page-lock), and outputs read otherwise
    (``out=``, ``copy_outputs="pinned"``, ``run_many``, cut along more than one axis), never call it: the caller
    checks what it got. A small CUDA graph (one that reads its outputs with ORT's own copy) makes its page-locked
    staging on its first run inside a block, and keeps it. What ``copy`` raises fails the
    read (and the run) — catch a request's own faults inside it. ``with`` gives ``copy`` back. Blocks nest (the
    innermost wins) and belong to the thread and task that entered them, as :func:`outputs_into`'s: a
    ``replay_thread=True`` session reads on its replay thread, so enter the block there (``run_on_replay_thread``).

    Raises:
        TypeError: ``copy`` is not callable (here, before the block).
    """
    if not callable(copy):
        raise TypeError(f"tap_device_outputs() needs a callable, got {type(copy).__name__}")
    return _Block(copy, own=False, var=_TAP, what="tap_device_outputs()")


def current_tap():
    """The callable of the innermost :func:`tap_device_outputs` block this thread and task entered that has not
    ended, or ``None``."""
    block = _innermost(_TAP)
    return None if block is None else block.arena


def suspend_tap():
    """A context manager in which no :func:`tap_device_outputs` block is current on this thread and task (captures,
    their verification replays and a bucket runner's probes: their reads are not the answer's, so a tap must not copy
    them). With no tap open (``_TAP`` unset: every caller that never tapped) a shared no-op context, ~12 ns."""
    return _NO_OP if _TAP.get() is None else _Block(None, own=False, var=_TAP, what="suspend_tap()")


_NO_OP = contextlib.nullcontext()
