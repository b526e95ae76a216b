"""The threaded host memcpy of pinned staging fills (``host_copy``, ``_fill_and_send``) on the staging copy threads.

Moved out of ``ortcapture._staging`` unchanged. The copy threads (process-wide thread pools) and the
``ORTCAPTURE_STAGING_*`` settings are :mod:`ortcapture._ort.sync`'s (:func:`~ortcapture._ort.sync.staging_pool`).
"""
from __future__ import annotations

import threading

import numpy as np

from ortcapture._ort import sync


#: Host copies bigger than four times this are split over the staging threads (the calling thread takes a part)
PARALLEL_MIN = 256 << 10


def host_copy(src: np.ndarray, dst: np.ndarray | None = None, *, threads: int | None = None,
              pin: bool | None = None) -> np.ndarray:
    """``src`` (a host numpy array) copied into ``dst`` (a writable host array of the same shape and dtype; default
    a new array), split over the staging threads (``threads``, default ``ORTCAPTURE_STAGING_THREADS``) where it is
    over 1 MiB and both are C-contiguous (numpy releases the GIL for the copies; the calling thread copies the first
    part and any part no worker has started); done when it returns; returns ``dst``. Raises ``ValueError`` for
    shapes that differ (no broadcasting) and what ``np.copyto`` raises (a read-only ``dst``), before any copy; a
    ``dtype`` that differs is cast by ``np.copyto`` (``same_kind``), and overlapping ``src`` and ``dst`` are copied by
    it too, in this thread."""
    if dst is not None and dst.shape != src.shape:
        raise ValueError(f"host_copy: src of shape {src.shape} into dst of shape {dst.shape}")
    if dst is not None and (dst.dtype != src.dtype or np.may_share_memory(src, dst)):
        np.copyto(dst, src)
        return dst
    if dst is None:
        dst = np.empty_like(src)
    n = src.nbytes
    pool = sync.staging_pool(threads, pin) if n > 4 * PARALLEL_MIN else None
    if pool is None or not (src.flags.c_contiguous and dst.flags.c_contiguous):
        np.copyto(dst, src)
        return dst
    s, d = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    step = max(PARALLEL_MIN, -(-n // (sync.STAGING_THREADS if threads is None else threads)))
    futures = [pool.submit(np.copyto, d[a:a + step], s[a:a + step]) for a in range(step, n, step)]
    try:
        np.copyto(d[:step], s[:step])
        for a, fut in zip(range(step, n, step), futures):  # a part no worker has started yet: copied here
            if fut.cancel():
                np.copyto(d[a:a + step], s[a:a + step])
    finally:
        for fut in futures:
            fut.cancel() or fut.exception()
    return dst


def _fill(flat: np.ndarray, arr: np.ndarray, threads: int | None = None, pin: bool | None = None) -> None:
    """Copy ``arr``'s bytes into ``flat``, in chunks spread over the staging threads where there are several."""
    src = arr.reshape(-1).view(np.uint8)
    host_copy(src, flat[:src.size], threads=threads, pin=pin)


def _fill_and_send(flat: np.ndarray, arr: np.ndarray, hptr: int, dptr: int, n: int, stream,
                   threads: int | None = None, pin: bool | None = None, device: int = 0) -> None:
    """Copy ``arr``'s bytes into the page-locked ``flat`` and queue their host-to-device copy to ``dptr`` on
    ``stream`` (of CUDA ``device``), in chunks of :data:`STAGING_CHUNK`: the calling thread and up to
    ``threads - 1`` staging workers (``threads`` default :data:`STAGING_THREADS`) each claim the next chunk, copy it
    and queue its DMA themselves as soon as it is in, until none is left. The calling thread starts at once, so a
    worker that wakes late (a sleeping core) costs only its share of the parallelism, never a wait; every DMA is
    queued when this returns (the caller records its event after them). Measured on the H200 (9.8 MB,
    ``benchmarks/bench_host_copy.py``): two threads each sending their own 1 MiB chunks 498-613 µs, against
    525-693 µs for chunks handed to a 4-thread pool with the caller queuing every DMA, 563-756 µs for
    ``cudaMemcpyAsync`` from pageable memory (ORT's ``update_inplace(numpy)`` path) and 890-1046 µs for a host copy
    then one DMA; 256 KiB chunks were slower (the calls' cost)."""
    from ortcapture._ort import cudart

    src = arr.reshape(-1).view(np.uint8)
    chunk = sync.STAGING_CHUNK
    pool = sync.staging_pool(threads, pin) if n > 2 * chunk else None
    if pool is None:
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            np.copyto(flat[a:b], src[a:b])
            cudart.copy_async(dptr + a, hptr + a, b - a, stream)
        return
    t = sync.STAGING_THREADS if threads is None else int(threads)
    chunks = iter(range(0, n, chunk))
    lock = threading.Lock()  # the claims (a shared iterator is not thread-safe without the GIL)

    def work(worker: bool) -> None:
        if worker:
            _worker_device(device)
        while True:
            with lock:
                a = next(chunks, None)
            if a is None:
                return
            b = min(n, a + chunk)
            np.copyto(flat[a:b], src[a:b])
            cudart.copy_async(dptr + a, hptr + a, b - a, stream)

    futures = [pool.submit(work, True) for _ in range(t - 1)]
    try:
        work(False)
    finally:  # nothing may still write the buffer once this returns (an error here included)
        errors = [e for e in (None if f.cancel() else f.exception() for f in futures) if e is not None]
    if errors:
        raise errors[0]


_TLS = threading.local()


def _worker_device(device: int) -> None:
    """Make CUDA ``device`` current in a staging worker thread (once per thread and device): its DMAs go on a
    stream of that device."""
    if getattr(_TLS, "device", None) != device:
        from ortcapture._ort import cudart

        cudart.set_device(device)
        _TLS.device = device
