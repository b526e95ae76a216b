"""Host staging of a captured graph: its own host buffers for host (numpy) feeds and host outputs (issue 32).

:class:`HostStaging` holds a graph's :attr:`~ortcapture.CapturedGraph.host_inputs` / ``host_outputs``: page-locked
(``cudaHostAlloc`` through cuda-python) on CUDA, with ``cudaMemcpyAsync`` on a copy stream of the graph's own; ordinary
numpy arrays elsewhere (WebGPU, CPU, no cuda-python, ``ORTCAPTURE_PINNED=0``). :func:`host_copy` is the threaded host
memcpy the staging fills use. Moved out of :mod:`ortcapture.transfer` unchanged (which keeps the one copy and
validation path, :func:`~ortcapture.transfer.update_inplace`, that the pageable staging calls).
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Mapping

import numpy as np

from ortcapture._ort import compat
from ortcapture._ort.compat import OrtValue
from ortcapture._ort.sync import CUDA_GATE, UNSETTLED, settle
from ortcapture._ort.values import STORAGE
from ortcapture.transfer import _dst_meta, copy, to_numpy, update_inplace


# ---------------------------------------------------------------------------------------------------------------
# host staging: a graph's own host buffers for host feeds and host outputs
# ---------------------------------------------------------------------------------------------------------------
def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one: a container's cpuset, ``taskset``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


#: Host memcpy threads of a pinned staging fill (a big numpy feed is copied into the page-locked buffer in chunks,
#: each chunk's host-to-device copy starting as soon as it is in; the calling thread copies chunks too):
#: $ORTCAPTURE_STAGING_THREADS, default half the usable cores, at most 4 (1: the calling thread alone; on the H200
#: the 9.8 MB YOLOv8n b8 fill took 732 / 462 / 344 / 457 µs at 1 / 2 / 4 / 8 threads). numpy
#: releases the GIL for the copies. ``benchmarks/profile_replay.py`` times the fill at 1, 2, 4 and 8 threads.
STAGING_THREADS = int(os.environ.get("ORTCAPTURE_STAGING_THREADS") or 0) or min(4, max(1, _usable_cpus() // 2))
#: Chunk of a pipelined fill (bytes); feeds up to twice this go in one piece
STAGING_CHUNK = 1 << 20
#: $ORTCAPTURE_PINNED=0 turns page-locked staging off (graphs then stage in ordinary host memory, as on WebGPU)
PINNED = os.environ.get("ORTCAPTURE_PINNED", "1") != "0"
#: A graph whose inputs and outputs hold at least this many bytes ($ORTCAPTURE_PINNED_MIN) stages plain numpy feeds
#: and ``copy_outputs=True`` outputs through page-locked memory unasked. Default ``None``: never unasked, only once a
#: graph's host buffers are asked for (``host_inputs``, ``copy_outputs="pinned"``, ``out=``, ``run_many``). Measured
#: on the H200 (YOLOv8n b8, onnxruntime-gpu 1.31.1): ``g.run(numpy)`` staged unasked took 2522-2799 µs against
#: 2450-2492 µs for ORT's own pageable ``update_inplace`` path — the host copy into the staging buffer (344-732 µs)
#: costs what the faster page-locked upload saves — so plain numpy keeps ORT's path unless a user opts in.
PINNED_AUTO_MIN = int(os.environ["ORTCAPTURE_PINNED_MIN"]) if os.environ.get("ORTCAPTURE_PINNED_MIN") else None
_POOL: list = []
_POOL_LOCK = threading.Lock()


#: $ORTCAPTURE_STAGING_PIN=1: each staging worker thread runs on one CPU of its own (spread over the process's
#: affinity mask) instead of wherever the scheduler wakes it. Off by default; the profile measures both. A burst of
#: copies shorter than the scheduler's load balancing can otherwise land a woken worker on its waker's busy CPU.
STAGING_PIN = os.environ.get("ORTCAPTURE_STAGING_PIN", "0") == "1"


def _pinning_initializer(threads: int):
    """A ThreadPoolExecutor initializer putting worker i (1 .. threads-1) on CPU ``cpus[i * len(cpus) // threads]``
    of the process's affinity mask at the time (nothing where the OS has no affinity call or refuses it)."""
    import itertools

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    counter = itertools.count(1)

    def init() -> None:
        i = next(counter)
        try:
            os.sched_setaffinity(0, {cpus[(i * len(cpus) // threads) % len(cpus)]})
        except OSError:
            pass
    return init


def _pool(threads: int | None = None, pin: bool | None = None):
    """The process's staging copy threads (``None`` with :data:`STAGING_THREADS` 1); ``threads``/``pin``: a pool of
    that many (pinned or not: :data:`STAGING_PIN`) instead (the profile's scaling runs), made once per choice. The
    pool holds ``threads - 1`` workers: the calling thread copies a share itself."""
    threads = STAGING_THREADS if threads is None else int(threads)
    pin = STAGING_PIN if pin is None else bool(pin)
    if threads <= 1:
        return None
    key = (threads, pin)
    for k, pool in _POOL:
        if k == key:
            return pool
    from concurrent.futures import ThreadPoolExecutor

    with _POOL_LOCK:
        for k, pool in _POOL:
            if k == key:
                return pool
        pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="ortcapture-staging",
                                  initializer=_pinning_initializer(threads) if pin else None)
        _POOL.append((key, pool))
    return pool


class _PinnedBlock:
    """One page-locked host block; numpy arrays made from it (``np.asarray(block)``) keep it alive, and its free is
    queued for a safe point (:func:`ortcapture._ort.cudart.release_later`) once the last of them is gone."""

    def __init__(self, nbytes: int) -> None:
        from ortcapture._ort import cudart

        self.ptr = cudart.host_alloc(nbytes)
        self.nbytes = int(nbytes)
        self.__array_interface__ = {"data": (self.ptr, False), "shape": (max(self.nbytes, 1),), "typestr": "|u1",
                                    "version": 3}
        weakref.finalize(self, cudart.release_later, "host", self.ptr)


def _host_array(shape: tuple, dtype: np.dtype, pinned: bool) -> tuple[np.ndarray, np.ndarray]:
    """(array of ``shape``/``dtype``, its bytes as a flat uint8 view) in page-locked or ordinary host memory."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if pinned:
        flat = np.asarray(_PinnedBlock(nbytes))[:nbytes]
    else:
        flat = np.empty(nbytes, np.uint8)
    return flat.view(dtype).reshape(shape), flat


class HostStaging:
    """A graph's own host buffers: :attr:`host_inputs` and :attr:`host_outputs`, one array per fixed buffer, of its
    shape and dtype; made by ``CapturedGraph`` the first time host data goes in or out.

    ``pinned`` (CUDA with cuda-python; ``kind == "pinned"``): page-locked memory (``cudaHostAlloc``), a
    non-blocking copy stream of the graph's own and ``cudaMemcpyAsync`` both ways. A numpy feed is copied into its
    page-locked buffer in chunks (by :data:`STAGING_THREADS` threads), each chunk's host-to-device copy queued as
    soon as it is in; a feed that *is* the graph's host input buffer is sent without the host copy. Before a buffer
    is refilled, its previous copy is waited for (an event per input); every upload and readback has completed when
    it returns (the transfer module's ordering guarantee), except :meth:`upload_async`, whose caller waits.
    Otherwise (``kind == "pageable"``: WebGPU, CPU, CUDA without cuda-python, bfloat16 buffers, or
    ``ORTCAPTURE_PINNED=0``): ordinary numpy arrays; uploads go through :func:`update_inplace`'s checked path, and
    readbacks are written straight into :attr:`host_outputs` (one ``copy_tensors`` call on WebGPU) instead of into
    a new host value per output.

    Every method is called with the graph's guard held (CUDA: ``CUDA_GATE.shared``; allocation and frees of pinned
    memory, streams and events happen only there, never from a finalizer: frees are queued).
    """

    def __init__(self, inputs: Mapping[str, OrtValue], outputs: Mapping[str, OrtValue], pinned: bool) -> None:
        metas = {**{("in", n): _dst_meta(v) for n, v in inputs.items()},
                 **{("out", n): _dst_meta(v) for n, v in outputs.items()}}
        kinds = {m.kind for m in metas.values()}
        devices = {m.device_id for m in metas.values()}
        pinned = bool(pinned and PINNED and kinds == {"cuda"} and len(devices) == 1 and compat.has_cuda_python()
                      and not any(m.dtype in STORAGE for m in metas.values()))
        self._stream = None
        self._events: dict[str, Any] = {}
        self._busy: set[str] = set()  # inputs whose host-to-device copy may still be running
        self.device_id = devices.pop() if len(devices) == 1 else 0
        if pinned:
            try:
                self._make(inputs, outputs, metas, True)
            except Exception as exc:  # noqa: BLE001 - out of page-locked memory, a cuda-python that differs: pageable
                pinned = False
                self._stream, self._events = None, {}
                _warn_pinned_once(exc)
        if not pinned:
            self._make(inputs, outputs, metas, False)
        self.pinned = pinned
        #: ``"pinned"`` (page-locked, asynchronous copies) or ``"pageable"``
        self.kind = "pinned" if pinned else "pageable"

    def _make(self, inputs, outputs, metas, pinned: bool) -> None:
        from ortcapture._ort import cudart

        if pinned:
            cudart.free_pending(CUDA_GATE.capturing)
        self.inputs, self.outputs = dict(inputs), dict(outputs)
        self.host_inputs: dict[str, np.ndarray] = {}
        self.host_outputs: dict[str, np.ndarray] = {}
        self._flat: dict[tuple, np.ndarray] = {}
        self._ptr: dict[tuple, tuple[int, int, int]] = {}  # (host ptr, device ptr, nbytes)
        for (role, name), m in metas.items():
            arr, flat = _host_array(m.shape, m.dtype, pinned)
            (self.host_inputs if role == "in" else self.host_outputs)[name] = arr
            self._flat[(role, name)] = flat
            if pinned:
                self._ptr[(role, name)] = (int(flat.ctypes.data), m.span[0] if m.span else 0, m.nbytes)
        self._wrappers = None  # pageable readback: CPU OrtValues over host_outputs (made on first use)
        if pinned:
            handles = []
            self._stream = cudart.new_stream(self.device_id)
            handles.append(("stream", self._stream))
            for name in inputs:
                self._events[name] = cudart.new_event(self.device_id)
                handles.append(("event", self._events[name]))
            weakref.finalize(self, _release_handles, handles)
            for event in self._events.values():  # every call the copies make, once: a failure shows here
                cudart.record(event, self._stream)
                cudart.wait_event(event)
        # the host inputs start as the graph's inputs are now (feeding all of them after filling one changes one)
        if pinned:
            if UNSETTLED:
                settle()
            for name in inputs:
                hptr, dptr, nbytes = self._ptr[("in", name)]
                if nbytes:
                    cudart.copy_async(hptr, dptr, nbytes, self._stream)
            cudart.sync_stream(self._stream)
        else:
            for name, buf in inputs.items():
                np.copyto(self.host_inputs[name], to_numpy(buf))

    # -- uploads ----------------------------------------------------------------------------------------------
    def takes(self, name: str, arr: np.ndarray) -> bool:
        """Whether :meth:`upload` takes numpy ``arr`` for input ``name`` as it is: pinned staging takes every
        C-contiguous array of the input's exact shape and dtype; pageable staging only the graph's own host input
        array (others go through :func:`update_inplace`, which also casts nothing and copies non-contiguous arrays
        the same way)."""
        own = self.host_inputs.get(name)
        if own is None:
            return False
        if not self.pinned and arr is not own:
            return False
        return arr.shape == own.shape and arr.dtype == own.dtype and arr.flags.c_contiguous

    def upload(self, host: Mapping[str, np.ndarray]) -> None:
        """Copy each array into its input's device buffer (through the page-locked buffer where pinned); done when
        this returns. The arrays were accepted by :meth:`takes`."""
        if not self.pinned:
            for name, arr in host.items():
                update_inplace(self.inputs[name], arr)
            return
        self.upload_async(host)
        self.wait()

    def upload_async(self, host: Mapping[str, np.ndarray], *, settle_first: bool = True) -> None:
        """:meth:`upload` without the final wait (pinned only): the copies are queued on the copy stream; call
        :meth:`wait` before the device buffers are read. ``settle_first=False``: the caller settled unsynchronised
        runs (a helper thread must not: settling takes the CUDA gate, which its waiting caller holds)."""
        from ortcapture._ort import cudart

        if settle_first and UNSETTLED:
            settle()
        stream = self._stream
        for name, arr in host.items():
            if name in self._busy:  # its previous copy must be done before the buffer is refilled
                cudart.wait_event(self._events[name])
                self._busy.discard(name)
            hptr, dptr, n = self._ptr[("in", name)]
            if n:
                if arr is self.host_inputs[name]:
                    cudart.copy_async(dptr, hptr, n, stream)
                else:
                    _fill_and_send(self._flat[("in", name)], arr, hptr, dptr, n, stream)
            cudart.record(self._events[name], stream)
            self._busy.add(name)

    def fill(self, host: Mapping[str, np.ndarray]) -> None:
        """Copy each array into its page-locked host input buffer only (pinned; no device copy), once the buffer's
        previous host-to-device copy is done; :meth:`upload_async` of :attr:`host_inputs` sends them later."""
        from ortcapture._ort import cudart

        for name, arr in host.items():
            if name in self._busy:
                cudart.wait_event(self._events[name])
                self._busy.discard(name)
            if arr is not self.host_inputs[name]:
                _fill(self._flat[("in", name)], arr)

    def wait(self) -> None:
        """Wait for every queued copy of this staging (pinned; a no-op otherwise)."""
        if self.pinned:
            from ortcapture._ort import cudart

            cudart.sync_stream(self._stream)
            self._busy.clear()

    # -- readbacks ----------------------------------------------------------------------------------------------
    def read_async(self, names) -> None:
        """Queue device-to-host copies of outputs ``names`` into :attr:`host_outputs` (pinned; pageable: done at
        once). The device work that wrote them must be finished (ORT's synchronised run)."""
        if UNSETTLED:
            settle()
        if not self.pinned:
            names = list(names)
            if self._wrappers is None:  # CPU OrtValues over the host arrays (ORT's CPU tensors alias numpy memory)
                self._wrappers = False if any(a.dtype in STORAGE for a in self.host_outputs.values()) else {
                    n: OrtValue.ortvalue_from_numpy(a) for n, a in self.host_outputs.items()}
            if self._wrappers is False:  # bfloat16: ORT's numpy bridge refuses it; through to_numpy's byte path
                for n in names:
                    np.copyto(self.host_outputs[n], to_numpy(self.outputs[n]))
                return
            copy([self.outputs[n] for n in names], [self._wrappers[n] for n in names])
            return
        from ortcapture._ort import cudart

        stream = self._stream
        for n in names:
            hptr, dptr, nbytes = self._ptr[("out", n)]
            if nbytes:
                cudart.copy_async(hptr, dptr, nbytes, stream)

    def read(self, names) -> None:
        """:meth:`read_async` and the wait: :attr:`host_outputs` hold the outputs ``names`` when this returns."""
        self.read_async(names)
        self.wait()

    def profile(self, name: str, arr: np.ndarray) -> dict:
        """Callables timing the staging's parts on input ``name`` (``benchmarks/profile_replay.py``): the host copy
        into the staging buffer, the upload from it, a full upload of ``arr``, the readback of every output."""
        out = {"host copy into the staging buffer": lambda: np.copyto(self.host_inputs[name], arr)}
        own = self.host_inputs[name]
        out["upload of the staging buffer (host -> device)"] = lambda: self.upload({name: own})
        if self.takes(name, arr):
            out["upload of a numpy feed (host copy + host -> device)"] = lambda: self.upload({name: arr})
        names = list(self.outputs)
        out["readback of every output (device -> host buffers)"] = lambda: self.read(names)
        if self.pinned and self.takes(name, arr):  # the threads' effect: fill alone, fill pipelined with the DMA
            flat = self._flat[("in", name)]
            hptr, dptr, n = self._ptr[("in", name)]
            for t, pin in [(t, False) for t in sorted({1, 2, 4, 8, STAGING_THREADS})] + [(8, True)]:
                tag = f"{t} threads{', pinned' if pin else ''}"
                out[f"fill, {tag} (host copy only)"] = lambda t=t, pin=pin: _fill(flat, arr, t, pin)

                def send(t=t, pin=pin):
                    _fill_and_send(flat, arr, hptr, dptr, n, self._stream, t, pin)
                    self.wait()
                out[f"fill + upload, {tag} (pipelined)"] = send
        return out


def free_released_staging() -> None:
    """Free the page-locked blocks, streams and events of staging that is gone (queued by finalizers), now: under
    ``CUDA_GATE.shared`` and not inside a capture (``CapturedGraph.release`` calls it; new staging does too)."""
    from ortcapture._ort import cudart

    if cudart.has_pending():
        with CUDA_GATE.shared:
            cudart.free_pending(CUDA_GATE.capturing)


_WARNED: list = []


def _warn_pinned_once(exc: BaseException) -> None:
    """One RuntimeWarning per process when page-locked staging could not be set up (the graph stages in ordinary
    host memory instead, as without cuda-python)."""
    if not _WARNED:
        _WARNED.append(exc)
        import warnings

        warnings.warn(f"ortcapture: page-locked host staging is unavailable ({type(exc).__name__}: {exc}); graphs "
                      "stage host data in ordinary memory (slower host <-> device copies)", RuntimeWarning,
                      stacklevel=4)


def _release_handles(handles) -> None:
    from ortcapture._ort import cudart

    for kind, h in handles:
        cudart.release_later(kind, h)


#: Host copies bigger than four times this are split over the staging threads (the calling thread takes a part)
PARALLEL_MIN = 256 << 10


def host_copy(src: np.ndarray, dst: np.ndarray | None = None, *, threads: int | None = None,
              pin: bool | None = None) -> np.ndarray:
    """``src`` (a host array) copied into ``dst`` (same shape and dtype; default a new array), split over the staging
    threads (``threads``, default :data:`STAGING_THREADS`) where it is big and both are C-contiguous (numpy releases
    the GIL for the copies; the calling thread copies the first part); returns ``dst``."""
    if dst is None:
        dst = np.empty_like(src)
    n = src.nbytes
    pool = _pool(threads, pin) if n > 4 * PARALLEL_MIN else None
    if pool is None or not (src.flags.c_contiguous and dst.flags.c_contiguous):
        np.copyto(dst, src)
        return dst
    s, d = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    step = max(PARALLEL_MIN, -(-n // (STAGING_THREADS if threads is None else threads)))
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
    host_copy(arr.reshape(-1).view(np.uint8), flat, threads=threads, pin=pin)


def _fill_and_send(flat: np.ndarray, arr: np.ndarray, hptr: int, dptr: int, n: int, stream,
                   threads: int | None = None, pin: bool | None = None) -> None:
    """Copy ``arr``'s bytes into the page-locked ``flat`` and queue their host-to-device copy to ``dptr``: in
    chunks of :data:`STAGING_CHUNK`, each sent as soon as it is in (the DMA of one overlaps the host copy of the
    next), the host copies spread over the staging threads where there are several (the calling thread copies the
    first chunk and every chunk no worker has started when its turn to be sent comes). The DMAs are queued by the
    calling thread alone, in order."""
    from ortcapture._ort import cudart

    src = arr.reshape(-1).view(np.uint8)
    if n <= 2 * STAGING_CHUNK:
        np.copyto(flat, src)
        cudart.copy_async(dptr, hptr, n, stream)
        return
    bounds = [(a, min(a + STAGING_CHUNK, n)) for a in range(0, n, STAGING_CHUNK)]
    pool = _pool(threads, pin)
    if pool is None:
        for a, b in bounds:
            np.copyto(flat[a:b], src[a:b])
            cudart.copy_async(dptr + a, hptr + a, b - a, stream)
        return
    a, b = bounds[0]
    futures = [pool.submit(np.copyto, flat[a:b], src[a:b]) for a, b in bounds[1:]]
    try:
        np.copyto(flat[a:b], src[a:b])
        cudart.copy_async(dptr + a, hptr + a, b - a, stream)
        for (a, b), fut in zip(bounds[1:], futures):
            if fut.cancel():  # no worker took it yet: copied here rather than waited for
                np.copyto(flat[a:b], src[a:b])
            else:
                fut.result()
            cudart.copy_async(dptr + a, hptr + a, b - a, stream)
    finally:
        for fut in futures:  # nothing may still write the buffer once this returns (an error above included)
            fut.cancel() or fut.exception()
