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
import threading
from typing import Iterator

import numpy as np

_LOCAL = threading.local()


class OutputArena:
    """The room ``[start, stop)`` of a writable byte buffer that :func:`outputs_into` hands out in order.

    Args:
        buffer: a writable, C-contiguous buffer (``memoryview``, ``mmap``, ``SharedMemory.buf``, a numpy array):
            page-locked memory (``ortcapture.transfer.pin_host_memory``) for the DMA to run at full speed.
        start, stop: the byte range handed out (``stop`` ``None``: the buffer's end).
        align: every array starts at a multiple of ``align`` bytes past ``start`` (a power of two).

    Raises:
        TypeError: ``buffer`` is not a writable C-contiguous buffer.
        ValueError: the range is outside the buffer, or ``align`` is not a power of two.
    """

    def __init__(self, buffer, start: int = 0, stop: int | None = None, align: int = 4096):
        try:
            view = memoryview(buffer)
        except TypeError:
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
    return getattr(_LOCAL, "arena", None)


@contextlib.contextmanager
def outputs_into(buffer, start: int = 0, stop: int | None = None, align: int = 4096) -> Iterator[OutputArena]:
    """Place the host outputs this thread reads inside the block in ``buffer[start:stop]`` (see the module
    docstring): ``CapturedGraph.run`` with ``copy_outputs=True`` and a session's bucket runs, on a page-locked
    (CUDA) staging. Yields the :class:`OutputArena` (``offset``: where the next one would go; ``taken``: how many
    landed there). Blocks nest (the innermost wins) and are per thread. Raises what :class:`OutputArena` raises.

    The arrays returned inside the block are views of ``buffer``: they change when it is written, and keep it
    exported (a ``SharedMemory`` cannot close while one is alive)."""
    arena = buffer if isinstance(buffer, OutputArena) else OutputArena(buffer, start, stop, align)
    prev = current()
    _LOCAL.arena = arena
    try:
        yield arena
    finally:
        _LOCAL.arena = prev
