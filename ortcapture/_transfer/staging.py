"""Host staging of a captured graph: its own host buffers for host (numpy) feeds and host outputs (issue 32).

:class:`HostStaging` holds a graph's :attr:`~ortcapture.CapturedGraph.host_inputs` / ``host_outputs``: page-locked
(``cudaHostAlloc`` through cuda-python) on CUDA, with ``cudaMemcpyAsync`` on a copy stream of the graph's own; ordinary
numpy arrays elsewhere (WebGPU, CPU, no cuda-python, ``ORTCAPTURE_PINNED=0``). The threaded host memcpy the staging
fills use is :mod:`ortcapture._transfer.host_copy`; the ``ORTCAPTURE_PINNED*`` / ``ORTCAPTURE_REGISTER*`` settings are
:mod:`ortcapture._ort.sync`'s. Moved out of ``ortcapture._staging`` unchanged (which had moved
out of :mod:`ortcapture.transfer`, whose one copy and validation path, :func:`~ortcapture.transfer.update_inplace`, the
pageable staging calls).
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Mapping

import numpy as np

from ortcapture._ort import compat, sync
from ortcapture._ort.compat import OrtValue
from ortcapture._ort.sync import CUDA_GATE, UNSETTLED, settle
from ortcapture._ort.values import STORAGE
from ortcapture._transfer.arena import current as current_arena
from ortcapture._transfer.arena import current_tap
from ortcapture._transfer.check import _dst_meta
from ortcapture._transfer.copy import copy, to_numpy, update_inplace
from ortcapture._transfer.host_copy import _fill, _fill_and_send, host_copy


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


class _Lease:
    """One page-locked block lent out as a numpy array's memory (``np.asarray(lease)``); when the array and every
    view of it are gone, ``__del__`` puts the block back on its pool's free list (an append: safe from any thread
    and from the garbage collector; no CUDA call — the block itself is freed only when its pool is gone, through
    :class:`_PinnedBlock`'s deferred free)."""

    __slots__ = ("block", "free", "__array_interface__")

    def __init__(self, block: _PinnedBlock, free) -> None:
        self.block = block
        self.free = free
        self.__array_interface__ = block.__array_interface__

    def __del__(self) -> None:
        self.free.append(self.block)


class _OutputPool:
    """Page-locked blocks per output for :meth:`HostStaging.read_new`, recycled: an output's new array is a block
    off its free list, or a newly allocated one while the pool holds less than :data:`OUTPUT_POOL_BYTES` plus two
    sets of outputs; ``take`` answers ``None`` beyond (the caller keeps that many arrays alive). Called with the
    graph's guard held (``cudaHostAlloc`` under ``CUDA_GATE.shared``)."""

    def __init__(self, specs: Mapping[str, tuple]) -> None:
        import collections

        self.specs = {n: (tuple(shape), np.dtype(dtype)) for n, (shape, dtype) in specs.items()}
        self.nbytes = {n: int(np.prod(shape, dtype=np.int64)) * dt.itemsize for n, (shape, dt) in self.specs.items()}
        self.free = {n: collections.deque() for n in self.specs}
        self.held = 0
        self.cap = sync.OUTPUT_POOL_BYTES + 2 * sum(self.nbytes.values())

    def take(self, name: str) -> np.ndarray | None:
        free = self.free[name]
        try:
            block = free.pop()
        except IndexError:
            nbytes = self.nbytes[name]
            if self.held + nbytes > self.cap:
                return None
            block = _PinnedBlock(nbytes)
            self.held += nbytes
        shape, dtype = self.specs[name]
        flat = np.asarray(_Lease(block, free))[:self.nbytes[name]]
        return flat.view(dtype).reshape(shape)


#: Feeds smaller than this (bytes) are always copied into the staging buffer: their copy costs less than a page pinned
REGISTER_MIN = 256 << 10


#: Arrays kept page-locked per input (a rotation of a few request buffers is common), most recently fed first
REGISTER_KEEP = 4

#: In-place registrations by ``(ptr, nbytes)``: ``[array, stagings using it]``. The driver locks a range once
#: (a second ``cudaHostRegister`` is refused), so one array fed to two graphs — a bucket's and a ``CapturedGraph``'s
#: of the same size — shares the first staging's registration; the last staging to drop it unregisters it.
_SHARED: dict[tuple[int, int], list] = {}
_SHARED_LOCK = threading.RLock()  # reentrant: a staging's finalizer may run while this thread holds it


def _share(arr: np.ndarray, ptr: int, nbytes: int) -> bool:
    """Count one more staging using ``arr``'s registration if ``arr`` itself is registered at ``ptr`` already."""
    with _SHARED_LOCK:
        e = _SHARED.get((ptr, nbytes))
        if e is not None and e[0] is arr:
            e[1] += 1
            return True
    return False


def _unshare(ptr: int, nbytes: int, arr: np.ndarray) -> None:
    """One staging less uses the registration of ``arr`` at ``ptr``; the last queues its ``cudaHostUnregister``."""
    with _SHARED_LOCK:
        e = _SHARED.get((ptr, nbytes))
        if e is not None and e[0] is arr:
            e[1] -= 1
            if e[1] > 0:
                return
            del _SHARED[(ptr, nbytes)]
    from ortcapture._ort import cudart

    cudart.release_later("registered", (ptr, arr))


class _InPlace:
    """The callers' numpy arrays that one pinned staging has page-locked in place (``cudaHostRegister``).

    A plain numpy feed that :meth:`HostStaging.takes` accepted and that is fed *again* — the same array object, at
    the same address with the same size — is registered on that second call and from then on sent with one DMA from
    the caller's own memory: no host copy into the staging buffer (measured on the H200, YOLOv8n's 9.8 MB input:
    190 µs against 627-747 µs through the staging buffer; registering costs about one staged copy, once). A feed seen
    once is only remembered weakly (an array made per request is never registered; numpy refuses to ``resize`` an
    array in place while a weak reference to it exists, so the graph's last few numpy feeds cannot be resized in place
    until it forgets them). Only arrays whose memory numpy owns are registered (the base chain ends in an array with
    ``OWNDATA``): views of ``SharedMemory``, ``mmap``, ``bytes`` or a torch tensor can be unmapped while the array
    lives, so they are always copied. A registered array is kept alive by the staging (its memory cannot be freed while
    the driver has it locked; ``resize(refcheck=False)`` moving it is caught on the next call, as with any array whose
    memory is pulled away) until it is evicted — :data:`REGISTER_KEEP` per input, least recently fed first; a rotation
    of more arrays than that is never registered (each would evict another) — or the staging is gone
    (``CapturedGraph.release``, or a graph detached by ``set_providers``). A registration that would take the graph
    past :data:`REGISTER_BYTES` is declined (no other array is evicted for it). Unregistrations are queued and done at
    the next safe point — after the upload's wait (a copy from an evicted array may be in flight), at ``release()``,
    or when new staging is made — under ``CUDA_GATE.shared``, never inside a capture, like the staging's own frees.
    An array another graph's staging registered already (one request buffer fed to two graphs) shares that
    registration (:data:`_SHARED`). An array the driver refuses to lock (a page already registered by someone else,
    a mapping it cannot pin) is remembered weakly and copied as before. Only synchronous uploads use it
    (:meth:`HostStaging.upload` waits for the DMA before it returns, so the caller may rewrite the array as soon as
    ``run`` returns); the overlapped ``run_many`` copies each request into the staging buffer, since its iterator
    may reuse an array while the previous copy is in flight."""

    __slots__ = ("regs", "seen", "refused", "nbytes")

    def __init__(self) -> None:
        self.regs: dict[str, list] = {}  # input name -> [[array, ptr, nbytes], ...], most recently fed first
        self.seen: dict[str, list] = {}  # input name -> weakrefs of arrays fed once
        self.refused: list = []  # weakrefs of arrays the driver would not lock
        self.nbytes = 0

    def source(self, name: str, arr: np.ndarray, nbytes: int) -> int:
        """The host address to send input ``name``'s ``nbytes`` from: ``arr``'s own (page-locked in place now or
        earlier), or 0 (copy through the staging buffer). ``arr`` passed :meth:`HostStaging.takes`."""
        regs = self.regs.get(name)
        if regs:
            for i, e in enumerate(regs):
                if e[0] is arr:
                    if arr.ctypes.data == e[1] and arr.nbytes == e[2]:
                        if i:
                            regs.insert(0, regs.pop(i))
                        return e[1]
                    self._drop(name, e)  # moved (ndarray.resize(refcheck=False)): never DMA from the old address
                    break
        if nbytes < REGISTER_MIN or CUDA_GATE.capturing:
            return 0
        seen = self.seen.setdefault(name, [])
        for i, r in enumerate(seen):
            if r() is arr:
                del seen[i]
                return self._register(name, arr, nbytes)
        for r in self.refused:
            if r() is arr:
                return 0
        # as many as may stay registered: a rotation of more arrays than that is never registered (each would evict
        # another and cost a registration per call)
        seen[:] = [r for r in seen if r() is not None][1 - REGISTER_KEEP:] if REGISTER_KEEP > 1 else []
        seen.append(weakref.ref(arr))
        return 0

    def _register(self, name: str, arr: np.ndarray, nbytes: int) -> int:
        from ortcapture._ort import cudart

        regs = self.regs.setdefault(name, [])
        keep = regs[:REGISTER_KEEP - 1]  # what stays of this input's once the new one is in
        if self.nbytes - sum(e[2] for e in regs[len(keep):]) + nbytes > sync.REGISTER_BYTES or not _owns_memory(arr):
            return 0  # over the graph's cap: declined, never another input's evicted for it (no churn)
        ptr = int(arr.ctypes.data)
        if not _share(arr, ptr, nbytes):
            try:
                cudart.host_register(ptr, nbytes)
            except RuntimeError:
                self.refused = [r for r in self.refused if r() is not None][-7:] + [weakref.ref(arr)]
                return 0
            with _SHARED_LOCK:
                _SHARED[(ptr, nbytes)] = [arr, 1]
        while len(regs) > len(keep):  # evicted once the new one is in: a refusal evicts nothing
            self._drop(name, regs[-1])
        regs.insert(0, [arr, ptr, nbytes])
        self.nbytes += nbytes
        return ptr

    def _drop(self, name: str, entry: list) -> None:
        """Forget a registration and queue its ``cudaHostUnregister`` (with the array, kept alive until then; unless
        another staging uses it too): done by :meth:`HostStaging.upload` after its wait, since a copy from the array
        may be in flight now."""
        regs = self.regs[name]
        del regs[next(i for i, e in enumerate(regs) if e is entry)]  # by identity (== would compare the arrays)
        self.nbytes -= entry[2]
        _unshare(entry[1], entry[2], entry[0])

    def registered(self) -> list[np.ndarray]:
        """The arrays page-locked now, most recently fed first per input."""
        return [e[0] for regs in self.regs.values() for e in regs]


def _owner_pinned(arr: np.ndarray, nbytes: int) -> int:
    """``arr``'s address where its first ``nbytes`` lie in memory its owner page-locked (:data:`ortcapture._ort.sync.
    HOST_RANGES`), else 0 (the two upload paths' one test; callers check the list is not empty first)."""
    ptr = arr.ctypes.data
    return ptr if sync.owner_pinned(ptr, nbytes) else 0


def _owns_memory(arr: np.ndarray) -> bool:
    """Whether ``arr``'s memory belongs to numpy (its base chain ends in an ndarray that owns its data), so that a
    reference to ``arr`` keeps it mapped. Not so for views of ``SharedMemory``, ``mmap``/``np.memmap``, ``bytes``, a
    torch tensor's ``.numpy()`` or a C buffer: their memory can be unmapped while the array lives, and a range left
    registered over an address that a later mapping reuses is undefined behaviour in the driver."""
    root = arr
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root.base is None and bool(root.flags.owndata)


def _unregister_all(inplace: _InPlace) -> None:
    """Queue every registration of a staging that is gone (a finalizer: no CUDA call)."""
    for regs in inplace.regs.values():
        while regs:
            e = regs.pop()
            _unshare(e[1], e[2], e[0])
    inplace.nbytes = 0


class HostStaging:
    """A graph's own host buffers: :attr:`host_inputs` and :attr:`host_outputs`, one array per fixed buffer, of its
    shape and dtype; made by ``CapturedGraph`` the first time host data goes in or out.

    ``pinned`` (CUDA with cuda-python; ``kind == "pinned"``): page-locked memory (``cudaHostAlloc``), a
    non-blocking copy stream of the graph's own and ``cudaMemcpyAsync`` both ways. A numpy feed is copied into its
    page-locked buffer in chunks (by :data:`STAGING_THREADS` threads), each chunk's host-to-device copy queued as
    soon as it is in; a feed that *is* the graph's host input buffer is sent without the host copy, and so is one fed
    again (page-locked in place: :class:`_InPlace`), and one inside memory its owner page-locked
    (:func:`ortcapture.transfer.pin_host_memory`; ``ORTCAPTURE_REGISTER=0`` turns both off). Before a buffer
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
        pinned = bool(pinned and sync.PINNED and kinds == {"cuda"} and len(devices) == 1 and compat.has_cuda_python()
                      and not any(m.dtype in STORAGE for m in metas.values()))
        self._stream = None
        self._events: dict[str, Any] = {}
        self._busy: set[str] = set()  # inputs whose host-to-device copy may still be running
        #: uploads sent by one DMA from memory its owner page-locked (:func:`ortcapture.transfer.pin_host_memory`)
        self.owner_dmas = 0
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
        #: {input: the shape of the region upload_rows last wrote into the host input array}; unknown: all of it
        self._host_rows: dict[str, tuple] = {}
        self._wrappers = None  # pageable readback: CPU OrtValues over host_outputs (made on first use)
        #: recycled page-locked blocks for :meth:`read_new` (pinned only)
        self._out_pool = _OutputPool({n: (m.shape, m.dtype) for (role, n), m in metas.items() if role == "out"}) \
            if pinned else None
        #: callers' arrays page-locked in place (pinned only)
        self._inplace = _InPlace() if pinned else None
        if pinned:
            weakref.finalize(self, _unregister_all, self._inplace)
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

    def unregister_in_place(self) -> None:
        """Queue the unregistration of every array this staging page-locked in place (:class:`_InPlace`); they are
        copied again if fed again. Done at the next :func:`free_released_staging`."""
        if self._inplace is not None:
            _unregister_all(self._inplace)

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
                if self._host_rows and arr is self.host_inputs[name]:  # filled by someone else: record void
                    self._host_rows.pop(name, None)
                update_inplace(self.inputs[name], arr)
            return
        self.upload_async(host, in_place=sync.REGISTER)
        self.wait()
        if self._inplace is not None:  # evicted registrations (queued): their copies are done now
            free_released_staging()

    def upload_async(self, host: Mapping[str, np.ndarray], *, settle_first: bool = True,
                     in_place: bool = False) -> None:
        """:meth:`upload` without the final wait (pinned only): the copies are queued on the copy stream; call
        :meth:`wait` before the device buffers are read. ``settle_first=False``: the caller settled unsynchronised
        runs (a helper thread must not: settling takes the CUDA gate, which its waiting caller holds).
        ``in_place``: an array fed again is sent from its own memory, page-locked in place (:class:`_InPlace`) —
        only for a caller that waits before the array may change (:meth:`upload`)."""
        from ortcapture._ort import cudart

        if settle_first and UNSETTLED:
            settle()
        stream = self._stream
        for name, arr in host.items():
            if self._host_rows:  # the host array is (re)filled below or by the caller: no rows known (buckets only)
                self._host_rows.pop(name, None)
            if name in self._busy:  # its previous copy must be done before the buffer is refilled
                cudart.wait_event(self._events[name])
                self._busy.discard(name)
            hptr, dptr, n = self._ptr[("in", name)]
            if n:
                if arr is self.host_inputs[name]:
                    cudart.copy_async(dptr, hptr, n, stream)
                elif in_place and sync.HOST_RANGES and (src := _owner_pinned(arr, n)):
                    cudart.copy_async(dptr, src, n, stream)  # memory its owner page-locked: one DMA from there
                    self.owner_dmas += 1
                elif in_place and (src := self._inplace.source(name, arr, n)):
                    cudart.copy_async(dptr, src, n, stream)
                else:
                    _fill_and_send(self._flat[("in", name)], arr, hptr, dptr, n, stream, device=self.device_id)
            cudart.record(self._events[name], stream)
            self._busy.add(name)

    def upload_rows(self, name: str, arr: np.ndarray, axes: tuple[int, ...], pad, pad_byte: int | None,
                    last: tuple | None) -> None:
        """Write ``arr`` into the leading region of input ``name``'s device buffer (a bucket's request: fewer rows
        along ``axes`` than the buffer holds) and set the rest of the region ``last`` wrote before (``None``: the
        whole buffer) to ``pad``; done when this returns. ``arr``: C-contiguous, the buffer's dtype and rank, each
        dim at most the buffer's and equal off ``axes`` (the caller checked: :func:`ortcapture._transfer.check.
        check_rows`). ``pad_byte``: the byte ``pad`` repeats, or ``None``.

        Pinned, one axis with nothing before it (a batch on axis 0): the request's rows are a prefix of the buffer,
        copied in chunks by the staging threads, each chunk's DMA queued as soon as it is in (as :meth:`upload`;
        rows in memory their owner page-locked, :func:`ortcapture.transfer.pin_host_memory`: one DMA from there), the
        rows ``last`` wrote beyond them set on the device (``cudaMemsetAsync``) — the rest of the buffer is not
        sent. Otherwise the region is written into :attr:`host_inputs` ``[name]`` with the rest of it set to
        ``pad``, and that whole array is uploaded (pinned: one DMA; pageable: :func:`update_inplace`)."""
        own = self.host_inputs[name]
        full = own.shape
        if self.pinned and len(axes) == 1 and math.prod(full[:axes[0]]) == 1:
            from ortcapture._ort import cudart

            axis = axes[0]
            inner = math.prod(full[axis + 1:]) * own.itemsize
            n = arr.shape[axis]
            stop = full[axis] if last is None else last[axis]
            if UNSETTLED:
                settle()
            self._host_rows.pop(name, None)  # its host array gets this request's rows (and maybe pad) below
            if name in self._busy:
                cudart.wait_event(self._events[name])
                self._busy.discard(name)
            hptr, dptr, _ = self._ptr[("in", name)]
            stream = self._stream
            if n * inner and sync.REGISTER and sync.HOST_RANGES and (src := _owner_pinned(arr, n * inner)):
                cudart.copy_async(dptr, src, n * inner, stream)  # its owner page-locked it: one DMA
                self.owner_dmas += 1
            elif n * inner:
                _fill_and_send(self._flat[("in", name)], arr, hptr, dptr, n * inner, stream, device=self.device_id)
            if stop > n and inner:
                tail = (stop - n) * inner
                if pad_byte is not None:
                    cudart.memset_async(dptr + n * inner, pad_byte, tail, stream)
                else:
                    own[(slice(None),) * axis + (slice(n, stop),)] = pad
                    cudart.copy_async(dptr + n * inner, hptr + n * inner, tail, stream)
            cudart.record(self._events[name], stream)
            self._busy.add(name)
            self.wait()
            return
        if self.pinned and name in self._busy:
            from ortcapture._ort import cudart

            cudart.wait_event(self._events[name])
            self._busy.discard(name)
        # the host array's own extent: rows beyond the region it last held are pad already (the device may differ,
        # but the whole array is sent)
        before = self._host_rows.get(name)
        if before != arr.shape:
            if len(axes) == 1 and before is not None:
                axis = axes[0]
                if before[axis] > arr.shape[axis]:
                    own[(slice(None),) * axis + (slice(arr.shape[axis], before[axis]),)] = pad
            else:
                own.fill(pad)
        own[tuple(slice(0, k) for k in arr.shape)] = arr
        self.upload({name: own})
        self._host_rows[name] = arr.shape  # after upload, which forgets it (a feed through the host array)

    def read_rows(self, name: str, axis: int, n: int) -> np.ndarray | None:
        """Output ``name``'s first ``n`` rows along ``axis`` as a new host array (pinned, nothing before ``axis``:
        one DMA of that prefix into the caller's :func:`ortcapture.transfer.outputs_into` buffer when it has room,
        else into a block of the recycling pool, see :meth:`read_new`); ``None`` where this staging cannot (pageable,
        rows not a prefix, the pool's cap reached): the caller reads the whole output."""
        pool = self._out_pool
        if pool is None:
            return None
        full, dtype = pool.specs[name]
        if math.prod(full[:axis]) != 1:
            return None
        arena = current_arena()
        arr = arena.take(full[:axis] + (n,) + full[axis + 1:], dtype) if arena is not None else None
        if arr is None:
            arr = pool.take(name)
            if arr is None:
                return None
            arr = arr[(slice(None),) * axis + (slice(0, n),)]
        from ortcapture._ort import cudart

        if UNSETTLED:
            settle()
        nbytes = n * math.prod(full[axis + 1:]) * dtype.itemsize
        tap = current_tap()
        if tap is not None:  # ortcapture.transfer.tap_device_outputs: the caller's device copies first
            tap(name, self._ptr[("out", name)][1], arr.shape, dtype, self._stream)
        if nbytes:
            cudart.copy_async(arr.ctypes.data, self._ptr[("out", name)][1], nbytes, self._stream)
        self.wait()
        return arr

    def fill(self, host: Mapping[str, np.ndarray]) -> None:
        """Copy each array into its page-locked host input buffer only (pinned; no device copy), once the buffer's
        previous host-to-device copy is done; :meth:`upload_async` of :attr:`host_inputs` sends them later."""
        from ortcapture._ort import cudart

        for name, arr in host.items():
            if self._host_rows:
                self._host_rows.pop(name, None)
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

    def read_new(self, names) -> list[np.ndarray]:
        """The outputs ``names`` (one per position; a name may repeat) as new host numpy arrays, one per position,
        each of its output's shape and dtype; done when this returns. Pinned: each is read with one DMA straight into
        the caller's :func:`ortcapture.transfer.outputs_into` buffer where one is open and has room, else into
        a page-locked block from this staging's recycling pool (:class:`_OutputPool`), which goes back to the pool
        when the array and every view of it are gone — no host copy, and no page faults of fresh memory (measured on
        the H200, 1.48 MB: 36 µs against 183 µs into the staging buffer and copied out, 202 µs into a new pageable
        array). A position the pool cannot serve (its cap reached while the caller keeps earlier arrays) is read
        into :attr:`host_outputs` and copied out. Pageable: :meth:`read` and copies."""
        names = list(names)
        pool = self._out_pool
        if pool is None:
            self.read(dict.fromkeys(names))
            return [host_copy(self.host_outputs[n]) for n in names]
        from ortcapture._ort import cudart

        if UNSETTLED:
            settle()
        stream = self._stream
        res: list = []
        spill = []
        arena, tap = current_arena(), current_tap()
        for i, n in enumerate(names):
            _hptr, dptr, nbytes = self._ptr[("out", n)]
            if tap is not None:  # ortcapture.transfer.tap_device_outputs: the caller's device copies first
                tap(n, dptr, *pool.specs[n], stream)
            arr = arena.take(*pool.specs[n]) if arena is not None else None
            if arr is None:
                arr = pool.take(n)
            if arr is None:
                spill.append(i)
                res.append(None)
                continue
            if nbytes:
                cudart.copy_async(arr.ctypes.data, dptr, nbytes, stream)
            res.append(arr)
        if spill:
            self.read_async(dict.fromkeys(names[i] for i in spill))
        self.wait()
        for i in spill:
            res[i] = host_copy(self.host_outputs[names[i]])
        return res

    def profile(self, name: str, arr: np.ndarray) -> dict:
        """Callables timing the staging's parts on input ``name`` (``benchmarks/profile_replay.py``): the host copy
        into the staging buffer, the upload from it, a full upload of ``arr``, the readback of every output. They
        write the host input array: :meth:`upload_rows` forgets what it held."""
        self._host_rows.pop(name, None)
        out = {"host copy into the staging buffer": lambda: np.copyto(self.host_inputs[name], arr)}
        own = self.host_inputs[name]
        out["upload of the staging buffer (host -> device)"] = lambda: self.upload({name: own})
        if self.takes(name, arr):  # through the staging buffer, as an array not fed before would go
            out["upload of a numpy feed (host copy + host -> device)"] = lambda: (self.upload_async({name: arr}),
                                                                                   self.wait())
        names = list(self.outputs)
        out["readback of every output (device -> host buffers)"] = lambda: self.read(names)
        if self.pinned and self.takes(name, arr) and sync.REGISTER:
            again = arr.copy()  # an array of the profile's own: page-locked in place from its second call (warm-up)
            out["upload of a numpy feed fed again (page-locked in place, one DMA)"] = \
                lambda: self.upload({name: again})
        if self.pinned and self.takes(name, arr):  # the threads' effect: fill alone, fill pipelined with the DMA
            flat = self._flat[("in", name)]
            hptr, dptr, n = self._ptr[("in", name)]
            for t, pin in [(t, False) for t in sorted({1, 2, 4, 8, sync.STAGING_THREADS})] + [(8, True)]:
                tag = f"{t} threads{', pinned' if pin else ''}"
                out[f"fill, {tag} (host copy only)"] = lambda t=t, pin=pin: _fill(flat, arr, t, pin)

                def send(t=t, pin=pin):
                    _fill_and_send(flat, arr, hptr, dptr, n, self._stream, t, pin, self.device_id)
                    self.wait()
                out[f"fill + upload, {tag} (pipelined)"] = send
        return out


def free_released_staging() -> None:
    """Free the page-locked blocks, streams and events of staging that is gone (queued by finalizers) and undo queued
    in-place registrations, now: under ``CUDA_GATE.shared`` and not inside a capture (``CapturedGraph.release``
    calls it; new staging and every synchronous upload of a pinned staging do too)."""
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
