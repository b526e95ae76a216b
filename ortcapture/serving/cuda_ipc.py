"""Triton's CUDA shared memory extension, the device half: a session replica opens clients' CUDA IPC handles.

The batching tier checks registrations and references (:mod:`ortcapture.serving.cuda_shm`) and sends a run's rows
as :class:`~ortcapture.serving.cuda_shm.DeviceRows`. :class:`IpcMemory` lives in the session replica (the process
with the CUDA context): it opens each region's handle once per registration (``cudaIpcOpenMemHandle``), checks that
the region lies inside the allocation the handle names (``cuMemGetAddressRange``: a client that claims more bytes
than it allocated gets a 400, never a read past its allocation), gathers a run's rows into one CUDA ``OrtValue``
device to device (that value then goes through the feed path's device copy into the graph's input buffer, no host
round trip), and writes outputs into regions — device to device from the graph's own output buffers as the run's
outputs are read (:class:`RegionTap`, through :func:`ortcapture.transfer.tap_device_outputs`), from the host
answer where that cannot be (:meth:`IpcMemory.write`: a pageable staging, an output batched on another axis or cut
along two, an uncaptured run, an oversize split, a request run alone after its batch failed). Handles are closed
(``cudaIpcCloseMemHandle``) when a name is registered again, unregistered, or the replica stops.

Uses cuda-python (``cuda.bindings``) and onnxruntime's ``OrtValue``; imported only where CUDA shared memory is used.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ortcapture.serving.cuda_shm import DeviceRows
from ortcapture.serving.requests import HostRows
from ortcapture.serving.shm import Ref, Region, ShmError


def _rt():
    from cuda.bindings import runtime

    return runtime


class DeviceCopyError(RuntimeError):
    """A CUDA runtime call of this replica failed while it reached a client's region (``cudaSetDevice``, a copy, a
    synchronize): the device's fault, not the request's — e.g. a sticky error left by the model's own kernel
    (``cudaErrorIllegalAddress``) shows up here first. Not a :class:`~ortcapture.serving.shm.ShmError`, so
    ``ortcapture.serving.replica.ReplicaCore.answers``' health rule decides 400 or 500, as for ORT's errors."""


def _check(err, what: str, client: bool = False) -> None:
    """Raise for a CUDA error: :class:`ShmError` (the client's 400) where ``client`` (the handle it registered does
    not open here), else :class:`DeviceCopyError`."""
    if int(err) != 0:
        rt = _rt()
        name = rt.cudaGetErrorName(err)[1]
        raise (ShmError if client else DeviceCopyError)(f"{what}: {name.decode() if isinstance(name, bytes) else name}")


class IpcMemory:
    """The CUDA regions one session replica has opened (see the module docstring). Thread-safe.

    Args:
        device: the CUDA device this replica's graphs run on (the handles are opened there; with unified addressing
            a region on a peer GPU is reached through it).
    """

    def __init__(self, device: int = 0):
        self.device = int(device)
        self._open: dict[tuple[str, int], int] = {}  # (name, generation) -> device pointer
        self._scratch: dict[tuple, Any] = {}  # (input, shape, dtype) -> CUDA OrtValue the rows are gathered into
        self._lock = threading.Lock()
        #: outputs copied device to device into a region (:meth:`copy_from_device`), and from the host (:meth:`write`)
        self.device_writes = self.host_writes = 0
        #: inputs gathered from host parts (:class:`~ortcapture.serving.requests.HostRows`, :meth:`gather`)
        self.host_gathers = 0

    def open(self, region: Region) -> int:
        """The device pointer of ``region`` (opened on first use of each registration; a handle of an earlier
        registration of the name stays open until :meth:`forget`, so a copy in flight never loses its memory).

        Raises:
            ShmError: the handle does not open here (another machine, a freed allocation, a handle of this very
                process), or ``byte_size`` is past the end of the allocation.
            DeviceCopyError: ``cudaSetDevice`` failed.
        """
        key = (region.name, region.generation)
        with self._lock:
            ptr = self._open.get(key)
            if ptr is not None:
                return ptr
            rt = _rt()
            (err,) = rt.cudaSetDevice(self.device)
            _check(err, "cudaSetDevice")
            handle = rt.cudaIpcMemHandle_t()
            import ctypes

            ctypes.memmove(handle.getPtr(), region.raw_handle, len(region.raw_handle))
            err, ptr = rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
            _check(err, f"region {region.name!r}: cudaIpcOpenMemHandle", client=True)
            ptr = int(ptr)
            try:
                self._check_size(region, ptr)
            except BaseException:
                rt.cudaIpcCloseMemHandle(ptr)
                raise
            self._open[key] = ptr
            return ptr

    @staticmethod
    def _check_size(region: Region, ptr: int) -> None:
        from cuda.bindings import driver

        err, base, size = driver.cuMemGetAddressRange(ptr)
        if int(err) != 0:
            raise ShmError(f"region {region.name!r}: cuMemGetAddressRange failed ({int(err)})")
        left = int(base) + int(size) - ptr
        if region.byte_size > left:
            raise ShmError(f"region {region.name!r}: byte_size {region.byte_size} is past the end of the CUDA "
                           f"allocation its handle names ({left} bytes)")

    def names(self) -> list[str]:
        """The regions open here."""
        with self._lock:
            return sorted({name for name, _ in self._open})

    def forget(self, live: dict[str, Region] | None = None) -> None:
        """Close every handle (``live`` ``None``), or those of registrations ``live`` (the registered regions by
        name) no longer holds. Call it where no copy from them is in flight (the replay thread, between runs)."""
        rt = _rt() if self._open else None
        with self._lock:
            for (name, gen), ptr in list(self._open.items()):
                if live is None or name not in live or live[name].generation != gen:
                    del self._open[(name, gen)]
                    rt.cudaIpcCloseMemHandle(ptr)

    def gather(self, name: str, rows: DeviceRows | HostRows):
        """Input ``name``'s ``rows`` joined into one CUDA ``OrtValue`` of ``rows.shape``: device to device from CUDA
        regions (:class:`~ortcapture.serving.cuda_shm.DeviceRows`), host to device from host parts
        (:class:`~ortcapture.serving.requests.HostRows`: one DMA each where they are page-locked, as a batch slot is
        in a CUDA session replica); ordered on the legacy default stream and finished before it returns. The value
        is reused for the next run of that input and shape: feed it before gathering again. Raises
        :class:`ShmError` for a region that does not open (:meth:`open`), :class:`DeviceCopyError` for a copy that
        fails."""
        import onnxruntime as ort

        rt = _rt()
        if isinstance(rows, HostRows):
            (err,) = rt.cudaSetDevice(self.device)  # the calling thread's device (the replay thread's already)
            _check(err, "cudaSetDevice")
        key = (name, rows.shape, rows.dtype.str)
        with self._lock:
            dst = self._scratch.get(key)
        if dst is None:
            dst = ort.OrtValue.ortvalue_from_shape_and_type(list(rows.shape), rows.dtype.type, "cuda", self.device)
            with self._lock:
                self._scratch[key] = dst
        base = dst.data_ptr()
        if isinstance(rows, HostRows):
            at = 0
            for part in rows.parts:  # C-contiguous (HostRows.of)
                (err,) = rt.cudaMemcpyAsync(base + at, part.__array_interface__["data"][0], part.nbytes,
                                            rt.cudaMemcpyKind.cudaMemcpyHostToDevice, 0)
                _check(err, f"input {name!r}: cudaMemcpyAsync host to device")
                at += part.nbytes
            (err,) = rt.cudaStreamSynchronize(0)
            _check(err, "cudaStreamSynchronize")
            with self._lock:
                self.host_gathers += 1
            return dst
        row_bytes = int(np.prod(rows.shape[1:], dtype=np.int64)) * rows.dtype.itemsize
        at = 0
        for t, start, stop in rows.parts:
            src = self.open(t.ref.region) + t.ref.offset + start * row_bytes
            n = (stop - start) * row_bytes
            (err,) = rt.cudaMemcpyAsync(base + at, src, n, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, 0)
            _check(err, f"region {t.ref.region.name!r}: cudaMemcpyAsync")
            at += n
        (err,) = rt.cudaStreamSynchronize(0)
        _check(err, "cudaStreamSynchronize")
        return dst

    def write(self, ref: Ref, a: np.ndarray, where: str) -> None:
        """Copy host array ``a`` (C order) to where ``ref`` points, finished before it returns. Raises
        :class:`ShmError` when it is larger than ``ref.byte_size`` (nothing is written) or the region does not
        open, :class:`DeviceCopyError` for a copy that fails."""
        a = np.ascontiguousarray(a)
        if a.nbytes > ref.byte_size:
            raise ShmError(f"{where}: {a.nbytes} bytes do not fit its shared_memory_byte_size of {ref.byte_size}")
        rt = _rt()
        dst = self.open(ref.region) + ref.offset
        (err,) = rt.cudaMemcpy(dst, a.ctypes.data, a.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice)
        _check(err, f"{where}: cudaMemcpy")
        (err,) = rt.cudaStreamSynchronize(0)
        _check(err, "cudaStreamSynchronize")
        with self._lock:
            self.host_writes += 1

    def copy_from_device(self, ref: Ref, src: int, nbytes: int, stream, where: str) -> None:
        """Queue a device-to-device copy of ``nbytes`` bytes at device pointer ``src`` to where ``ref`` points, on
        CUDA stream ``stream`` (finished when the caller synchronizes it). Raises :class:`ShmError` when they do not
        fit ``ref.byte_size`` (nothing is copied) or the region does not open, :class:`DeviceCopyError` for a copy
        that cannot be queued."""
        if nbytes > ref.byte_size:
            raise ShmError(f"{where}: {nbytes} bytes do not fit its shared_memory_byte_size of {ref.byte_size}")
        dst = self.open(ref.region) + ref.offset
        rt = _rt()
        (err,) = rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream)
        _check(err, f"{where}: cudaMemcpyAsync")
        with self._lock:
            self.device_writes += 1

    def close(self) -> None:
        """Close every handle and drop the gather buffers."""
        self.forget()
        with self._lock:
            self._scratch.clear()


class RegionTap:
    """The ``copy`` of :func:`ortcapture.transfer.tap_device_outputs` for one session run: each request's rows of the
    outputs it names into CUDA regions (``wants``: per request ``{output name: Ref}`` or ``None``; ``rows``: per
    request, in the run's order), copied device to device from the graph's output buffer as the staging reads it —
    no host round trip (issue 45). Only an output batched on axis 0 whose read holds the whole run's rows is copied
    (a run alone per request after a failed batch reads fewer: left to :meth:`IpcMemory.write`); a request whose
    copy raises (a region too small or gone, a copy that cannot be queued) is left out too, so the host write after
    the run answers its error as before. ``done`` holds, per request, the set of output names copied here.

    Args:
        ipc: the replica's :class:`IpcMemory` (or anything with its ``copy_from_device``).
        rows, wants: as above, one entry per request of the run.
        axes: ``{output name: batched axis}`` of the session's outputs.
        inputs: the :class:`~ortcapture.serving.shm.Ref` s the run's inputs were gathered from: an output region
            overlapping one (the same IPC handle, or region name, and bytes) is left to the host write — copied
            during the read it would change the inputs that the run's requests are gathered from again, one at a
            time, should the run fail after it.
    """

    def __init__(self, ipc, rows, wants, axes, inputs=()):
        spans = [_span(r) for r in inputs]
        wants = [None if not w else {n: r for n, r in w.items() if not any(_overlap(_span(r), x) for x in spans)}
                 for w in wants]
        self.ipc, self.rows, self.wants, self.axes = ipc, [int(r) for r in rows], wants, axes
        self.total = sum(self.rows)
        self.done: list[set] = [set() for _ in self.rows]

    def __call__(self, name: str, dptr: int, shape, dtype, stream) -> None:
        if self.axes.get(name) != 0:
            return
        if not shape or shape[0] != self.total:  # another run's read (a request run alone): what was copied of
            for done in self.done:  # this output before is not what the answer holds now
                done.discard(name)
            return
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
        at = 0
        for k, n in enumerate(self.rows):
            ref = (self.wants[k] or {}).get(name)
            if ref is not None:
                try:
                    self.ipc.copy_from_device(ref, dptr + at, n * row_bytes, stream, f"output {name!r}")
                    self.done[k].add(name)
                except Exception:  # noqa: BLE001 - this request's own fault: IpcMemory.write after the run says it
                    self.done[k].discard(name)
            at += n * row_bytes

    def member(self, start: int, stop: int) -> list[set]:
        """``done`` of requests ``[start, stop)`` (one member of a merged run)."""
        return self.done[start:stop]


def _span(ref: Ref) -> tuple:
    """Where ``ref``'s bytes are: (the allocation's IPC handle, else the region's name; first byte; end)."""
    start = ref.region.offset + ref.offset
    return ref.region.raw_handle or ref.region.name, start, start + ref.byte_size


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]
