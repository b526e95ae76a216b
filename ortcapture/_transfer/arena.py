"""Host outputs read straight into memory the caller chose: :func:`outputs_into` (one DMA per output, no host copy).

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

import contextlib
import contextvars
from typing import Iterator

import numpy as np

# a context variable, not a thread-local: per thread, and per asyncio task too (a coroutine's block must not catch
# the outputs of another coroutine that runs on the same thread while it awaits)
_ARENA: contextvars.ContextVar = contextvars.ContextVar("ortcapture_output_arena", default=None)


class OutputArena:
    """The room ``[start, stop)`` of a writable byte buffer that :func:`outputs_into` hands out in order.

    Args:
        buffer: a writable, C-contiguous buffer (``memoryview``, ``mmap``, ``SharedMemory.buf``, a numpy array):
            page-locked memory (``ortcapture.transfer.pin_host_memory``) for the DMA to run at full speed.
        start, stop: the byte range handed out (``stop`` ``None``: the buffer's end).
        align: every array starts at a multiple of ``align`` bytes past ``start`` (a power of two).

    Raises:
        TypeError: ``buffer`` is not a writable C-contiguous buffer (or one Python cannot export, e.g. datetime64).
        ValueError: the range is outside the buffer, or ``align`` is not a power of two.

    Not thread-safe: :meth:`take` moves :attr:`offset` without a lock, so give each thread its own arena.
    """

    def __init__(self, buffer, start: int = 0, stop: int | None = None, align: int = 4096):
        try:
            view = memoryview(buffer)
        except (TypeError, ValueError):
            raise TypeError(f"outputs_into() needs a buffer (memoryview, mmap, numpy array), got "
                            f"{type(buffer).__name__}") from None
        if view.readonly or not view.c_contiguous:
            raise TypeError("outputs_into() needs a writable, C-contiguous buffer")
        size = view.nbytes
        stop = size if stop is None else int(stop)
        start = int(start)
        if not 0 <= start <= stop <= size:
            raise ValueError(f"outputs_into(): the range [{start}, {stop}) is outside the buffer of {size} bytes")
        align = int(align)
        if align < 1 or align & (align - 1):
            raise ValueError(f"outputs_into(): align must be a power of two, got {align}")
        self._bytes = np.frombuffer(view.cast("B"), np.uint8)
        self.start, self.stop, self.align = start, stop, align
        #: where the next array goes (bytes from the buffer's start)
        self.offset = start
        #: arrays handed out
        self.taken = 0

    def take(self, shape, dtype) -> np.ndarray | None:
        """A C-contiguous array of ``shape`` and ``dtype`` at :attr:`offset` (which then moves past it, rounded up to
        ``align``), or ``None`` when it does not fit what is left (nothing moves)."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if self.offset + n > self.stop:
            return None
        a = self._bytes[self.offset:self.offset + n].view(dt).reshape(tuple(shape))
        self.offset += -(-n // self.align) * self.align
        self.taken += 1
        return a


def current() -> OutputArena | None:
    """The arena of the innermost :func:`outputs_into` block of this thread, or ``None``."""
    return _ARENA.get()


@contextlib.contextmanager
def outputs_into(buffer, start: int = 0, stop: int | None = None, align: int = 4096) -> Iterator[OutputArena]:
    """Place the host outputs read inside the block in ``buffer[start:stop]`` (see the module docstring), on a
    page-locked (CUDA) staging: ``CapturedGraph.run`` with ``copy_outputs=True`` (no ``out=``), and a session's
    bucket runs made on this thread (not those a ``replay_thread=True`` session hands to its replay thread, nor
    ``run_many``'s, read on a helper thread). Each array starts ``align`` bytes (or a multiple) past ``start``; one
    that does not fit what is left, and every output of a pageable staging (WebGPU, CPU), comes back as without the
    block. Yields the :class:`OutputArena` (``offset``: where the next one would go; ``taken``: how many landed
    there). Blocks nest (the innermost wins) and belong to the thread and the asyncio task that entered them.

    ``buffer`` may be an :class:`OutputArena` already (then ``start``, ``stop`` and ``align`` must be left out).
    The arrays returned inside the block are views of ``buffer``: they change when it is written, and keep it
    exported (a ``SharedMemory`` cannot close while one is alive).

    Raises:
        TypeError, ValueError: what :class:`OutputArena` raises; ``ValueError`` for an :class:`OutputArena` given
            with ``start``, ``stop`` or ``align``.
    """
    if isinstance(buffer, OutputArena):
        if (start, stop, align) != (0, None, 4096):
            raise ValueError("outputs_into(arena): start, stop and align belong to the OutputArena already")
        arena = buffer
    else:
        arena = OutputArena(buffer, start, stop, align)
    token = _ARENA.set(arena)
    try:
        yield arena
    finally:
        _ARENA.reset(token)
