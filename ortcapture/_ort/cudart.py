"""Thin cuda-python helpers (all optional: each returns ``None``/``False`` where cuda-python is absent).

Used where ORT's Python API has no answer: which device a pointer lives on, whether a stream is being captured
(ORT PR #32081: a capturing session called during a foreign stream capture ends in ``std::terminate``), and
device-to-device copies on ORT versions without ``OrtValue.update_inplace(OrtValue)``.
"""
from __future__ import annotations

import contextlib

from ortcapture._ort import compat


def _ok(err) -> bool:
    return int(err) == 0


def pointer_device(ptr: int) -> int | None:
    """CUDA device ordinal that owns device pointer ``ptr``, or ``None`` (not CUDA memory / no cuda-python)."""
    rt = compat.cudart()
    if rt is None or not ptr:
        return None
    try:
        err, attrs = rt.cudaPointerGetAttributes(ptr)
    except Exception:  # noqa: BLE001
        return None
    if not _ok(err):
        return None
    mem_type = int(getattr(attrs, "type", 0))
    if mem_type not in (2, 3):  # cudaMemoryTypeDevice, cudaMemoryTypeManaged
        return None
    return int(attrs.device)


@contextlib.contextmanager
def current_device(device: int):
    """Make CUDA ``device`` the calling thread's current device inside the block, then restore the previous one.

    For exporting DLPack tensors: a producer (torch) refuses ``__dlpack__(stream=...)`` unless its tensor's device
    is current ("Can't export tensors on a different CUDA device index"), and ORT's CUDA EP leaves the device of
    its last run current (``cudaSetDevice`` in ``OnRunStart``). A no-op without cuda-python.
    """
    rt = compat.cudart()
    prev = None
    if rt is not None:
        err, cur = rt.cudaGetDevice()
        if _ok(err) and int(cur) != int(device):
            (err,) = rt.cudaSetDevice(int(device))
            prev = int(cur) if _ok(err) else None
    try:
        yield
    finally:
        if prev is not None:
            rt.cudaSetDevice(prev)


_PEER: dict[tuple[int, int], bool] = {}
_PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled


def ensure_peer_access(a: int, b: int) -> bool:
    """Enable CUDA peer access between devices ``a`` and ``b`` (both directions, once per process); True when it is
    on. Without it a device-to-device ``cudaMemcpy`` between two GPUs is staged through host memory by the driver
    (measured on two H200s: 15 GB/s for a 1.2 MB copy, against the host path's 9 GB/s). False (and the copy still
    works, staged) where the GPUs cannot reach each other or cuda-python is absent."""
    key = (a, b) if a < b else (b, a)
    known = _PEER.get(key)
    if known is not None:
        return known
    rt = compat.cudart()
    ok = rt is not None and a != b
    if ok:
        for x, y in ((a, b), (b, a)):
            err, can = rt.cudaDeviceCanAccessPeer(x, y)
            if not _ok(err) or not int(can):
                ok = False
                break
            with current_device(x):
                (err,) = rt.cudaDeviceEnablePeerAccess(y, 0)
                if int(err) == _PEER_ALREADY_ENABLED:
                    rt.cudaGetLastError()  # clear it: ORT checks cudaGetLastError() after its kernel launches
                elif not _ok(err):
                    rt.cudaGetLastError()
                    ok = False
                    break
    _PEER[key] = ok
    return ok


def mem_get_info(device: int) -> tuple[int, int] | None:
    """``(free, total)`` bytes of CUDA ``device`` (``cudaMemGetInfo``: device-wide, every process and allocator
    counted), or ``None`` without cuda-python or on failure."""
    rt = compat.cudart()
    if rt is None:
        return None
    with current_device(device):
        err, free, total = rt.cudaMemGetInfo()
    return (int(free), int(total)) if _ok(err) else None


def memcpy_d2d(dst_ptr: int, src_ptr: int, nbytes: int) -> None:
    """Synchronous device-to-device (or peer) copy of ``nbytes`` bytes; raises :class:`RuntimeError` on failure."""
    rt = compat.cudart()
    if rt is None:
        raise RuntimeError("cuda-python is not installed")
    # cudaMemcpy does not wait for a device-to-device copy to finish; copy on the legacy stream and wait for it,
    # so the copy is complete before the next replay on ORT's (non-blocking) stream reads the buffer.
    (err,) = rt.cudaMemcpyAsync(dst_ptr, src_ptr, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault, 0)
    if _ok(err):
        (err,) = rt.cudaStreamSynchronize(0)
    if not _ok(err):
        raise RuntimeError(f"cudaMemcpyAsync device-to-device copy failed: {err}")


#: cudaMemcpy2D / cudaMemset2D refuse pitches beyond the device's cudaDevAttrMaxPitch (2**31 - 1 on NVIDIA GPUs up to
#: the H200): such copies go row by row with 1-D calls
MAX_PITCH = 2**31 - 1


def copy_and_zero_2d(dst_ptr: int, dpitch: int, src_ptr: int, width: int, height: int, zero_bytes: int,
                     spitch: int | None = None, device: int | None = None, fill: int = 0) -> None:
    """Synchronous strided copy between any of host (pageable or pinned) and device memory (``cudaMemcpyDefault``,
    unified addressing): ``height`` rows of ``width`` bytes, destination rows ``dpitch`` and source rows ``spitch``
    (default ``width``) bytes apart; then ``zero_bytes`` after each destination row's copied part set to the byte
    ``fill`` (default 0: a bucket's padding); then one wait. One row (``height`` 1, e.g. a batch on axis 0) uses
    1-D ``cudaMemcpyAsync``/``cudaMemsetAsync`` (no pitch limit); pitches beyond :data:`MAX_PITCH` go row by row.
    ``device``: the CUDA device made current for the calls (the buffer's; a thread's current device is otherwise
    whatever it last used). Raises :class:`RuntimeError` on failure."""
    rt = compat.cudart()
    if rt is None:
        raise RuntimeError("cuda-python is not installed")
    spitch = width if spitch is None else spitch
    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    with current_device(device) if device is not None else contextlib.nullcontext():
        err = 0
        if not height:
            return
        if height == 1 or max(dpitch, spitch) > MAX_PITCH:
            for row in range(height):
                if width and _ok(err):
                    (err,) = rt.cudaMemcpyAsync(dst_ptr + row * dpitch, src_ptr + row * spitch, width, kind, 0)
                if zero_bytes and _ok(err):
                    (err,) = rt.cudaMemsetAsync(dst_ptr + row * dpitch + width, fill, zero_bytes, 0)
        else:
            if width:
                (err,) = rt.cudaMemcpy2DAsync(dst_ptr, dpitch, src_ptr, spitch, width, height, kind, 0)
            if _ok(err) and zero_bytes:
                (err,) = rt.cudaMemset2DAsync(dst_ptr + width, dpitch, fill, zero_bytes, height, 0)
        if _ok(err):
            (err,) = rt.cudaStreamSynchronize(0)
    if not _ok(err):
        raise RuntimeError(f"cudaMemcpy2DAsync/cudaMemset2DAsync failed: {err}")


def make_capture_probe():
    """A cheap callable answering: is a CUDA graph being captured that a replay from the calling thread would break
    or be recorded into? Built once per session; no synchronisation; one driver query per call (and torch's once
    torch's CUDA is initialised; the runtime's too where the driver has no answer). Without torch and cuda-python it
    always answers False.

    First the legacy default stream of the calling thread's current CUDA context (the device it used last), through
    the driver API (``cuStreamIsCapturing(CU_STREAM_LEGACY)``: the runtime's ``cudaStreamIsCapturing(
    cudaStreamLegacy)`` asks the driver the same, and the driver does not leave the runtime's sticky last error that
    ORT checks after its launches): it answers ``CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`` (906) while any blocking stream
    of that context is being captured, in any capture mode and from any thread, without invalidating that capture
    (any of 900-908 counts as capturing; a status other than none, e.g. an invalidated capture, too). Where the
    driver has no answer (a thread with no current CUDA context yet, 201; an older cuda-python without the driver
    module; any other driver error) the runtime's query of ``cudaStreamLegacy`` instead, which makes the current
    device's primary context current. Then torch's current stream, where torch's CUDA is initialised:
    ``torch.cuda.graph()`` captures a non-blocking side stream that the legacy stream query cannot see. A capture
    error raised by torch's query (``cudaErrorStreamCaptureImplicit`` while its current stream is the legacy one)
    counts as capturing; other torch errors propagate. ``benchmarks/bench_capture_probe.py`` shows every form's
    answer in each situation (non-blocking streams other than torch's current one are seen by none of them).
    """
    import sys

    rt = compat.cudart()
    drv = compat.cudadrv()
    query = getattr(rt, "cudaStreamIsCapturing", None) if rt is not None else None
    dquery = getattr(drv, "cuStreamIsCapturing", None) if drv is not None and query is not None else None
    modules = sys.modules
    # the legacy default stream (cudaStreamLegacy, 1: 0 would be the per-thread stream where cuda-python is set to
    # it); as cuda-python's own handle type where it takes one (no conversion per call)
    legacy = int(getattr(rt, "cudaStreamLegacy", 1)) if rt is not None else 1
    dlegacy = None
    if query is not None:
        from ortcapture._ort.sync import CUDA_GATE

        with CUDA_GATE.shared:  # never beside another thread's capture
            try:
                handle = rt.cudaStream_t(legacy)
                query(handle)
                rt.cudaGetLastError()
                legacy = handle
            except Exception:  # noqa: BLE001 - an older cuda-python: the int works everywhere
                pass
            if dquery is not None:
                try:
                    dlegacy = drv.CUstream(int(drv.CU_STREAM_LEGACY))
                    dquery(dlegacy)
                except Exception:  # noqa: BLE001 - a cuda-python whose driver module cannot load libcuda
                    dquery = None
    torch_query = None  # torch's check, bound once torch is imported

    def probe() -> bool:
        nonlocal torch_query
        if dquery is not None:
            err, status = dquery(dlegacy)
            if not err:  # CUDA_SUCCESS is 0 (IntEnum or int alike)
                if status:  # CU_STREAM_CAPTURE_STATUS_NONE is 0
                    return True
            elif int(err) in _CAPTURE_ERRORS:
                return True
            else:
                err = None  # no driver answer (no current context on this thread, ...): the runtime's
        else:
            err = None
        if err is None and query is not None:
            err, status = query(legacy)
            if err:
                rt.cudaGetLastError()  # not left sticky for ORT's launch checks
                if int(err) in _CAPTURE_ERRORS:
                    return True
            elif status:
                return True
        if torch_query is None:
            torch = modules.get("torch")
            if torch is None or getattr(torch, "cuda", None) is None:  # (or torch half imported: not yet bound)
                return False
            torch_query = compat.torch_capture_query(torch)
        return torch_query()

    return probe


# cudaErrorStreamCapture* (900-908): a capture in progress made the legacy stream query illegal
_CAPTURE_ERRORS = frozenset(range(900, 909))


# -- page-locked host staging (CapturedGraph's host feeds and outputs) -------------------------------------------
# cudaHostAlloc and cudaFreeHost (which synchronises the device) are "potentially unsafe" calls: from another
# thread they invalidate a CUDA graph capture in global mode (what ORT's CUDA EP uses). Allocations run under
# CUDA_GATE.shared (no ortcapture capture meanwhile); frees requested by finalizers (which run anywhere, a capture
# included) are queued and done at the next safe point (free_pending), likewise streams and events.
#: cudaHostAllocPortable: the block is page-locked for every CUDA context (any device's copies may use it)
HOST_ALLOC_PORTABLE = 0x01
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads the registered memory
STREAM_NON_BLOCKING = 0x01  # cudaStreamNonBlocking: no implicit ordering against the legacy default stream
EVENT_DISABLE_TIMING = 0x02  # cudaEventDisableTiming
NOT_READY = 600  # cudaErrorNotReady (cudaEventQuery of pending work)

_PENDING: list = []  # [(kind, handle)] freed at the next safe point


def _check(err, what: str) -> None:
    if int(err) != 0:
        rt = compat.cudart()
        rt.cudaGetLastError()  # clear a sticky-free error: ORT checks cudaGetLastError() after its launches
        raise RuntimeError(f"{what} failed: {err}")


def host_alloc(nbytes: int) -> int:
    """A page-locked (pinned, portable) host block of ``nbytes`` bytes (at least 1); its address. Call under
    ``CUDA_GATE.shared``. Raises :class:`RuntimeError` (out of pinned memory, no cuda-python)."""
    rt = compat.cudart()
    if rt is None:
        raise RuntimeError("cuda-python is not installed")
    err, ptr = rt.cudaHostAlloc(max(int(nbytes), 1), HOST_ALLOC_PORTABLE)
    _check(err, f"cudaHostAlloc({nbytes})")
    return int(ptr)


def host_register(ptr: int, nbytes: int, portable: bool = False, read_only: bool = False) -> None:
    """Page-lock ``nbytes`` bytes of existing host memory at ``ptr`` in place (``cudaHostRegister``; ``portable``:
    ``cudaHostRegisterPortable``, for every CUDA context; ``read_only``: ``cudaHostRegisterReadOnly``, which memory
    mapped read-only needs — the device only reads it); undone by :func:`release_later` ``("registered", (ptr,
    owner))`` or :func:`host_unregister`. Call under ``CUDA_GATE.shared``, never inside a capture. Raises
    :class:`RuntimeError` (memory already page-locked, e.g. ``cudaErrorHostMemoryAlreadyRegistered`` for a page
    shared with another registration; a mapping the driver cannot lock; no cuda-python)."""
    rt = compat.cudart()
    if rt is None:
        raise RuntimeError("cuda-python is not installed")
    flags = (HOST_ALLOC_PORTABLE if portable else 0) | (HOST_REGISTER_READ_ONLY if read_only else 0)
    (err,) = rt.cudaHostRegister(int(ptr), int(nbytes), flags)
    _check(err, f"cudaHostRegister({nbytes})")


def host_unregister(ptr: int) -> None:
    """Undo :func:`host_register` now (``cudaHostUnregister``), for an owner about to unmap the memory. Call under
    ``CUDA_GATE.shared``, with no copy from or to it in flight. A failure is cleared, not raised."""
    rt = compat.cudart()
    if rt is not None:
        (err,) = rt.cudaHostUnregister(int(ptr))
        if int(err):  # leave no error behind: ORT checks cudaGetLastError() after its launches
            rt.cudaGetLastError()


def release_later(kind: str, handle) -> None:
    """Queue a pinned block (``"host"``), stream (``"stream"``), event (``"event"``) or an in-place registration
    (``"registered"``: ``(ptr, owner)``, the owner — the registered array — kept alive until it is undone) for
    :func:`free_pending`; safe from finalizers (no CUDA call)."""
    _PENDING.append((kind, handle))


def has_pending() -> bool:
    """Whether :func:`release_later` queued anything not freed yet."""
    return bool(_PENDING)


def free_pending(capturing: bool) -> None:
    """Free what :func:`release_later` queued. The caller holds ``CUDA_GATE.shared``; ``capturing``: the calling
    thread itself is capturing (then nothing is freed: a free inside the capture would break it)."""
    if capturing or not _PENDING:
        return
    rt = compat.cudart()
    while _PENDING:
        try:
            kind, handle = _PENDING.pop()
        except IndexError:
            return
        if rt is None:
            continue
        if kind == "host":
            rt.cudaFreeHost(handle)
        elif kind == "stream":
            rt.cudaStreamDestroy(handle)
        elif kind == "event":
            rt.cudaEventDestroy(handle)
        elif kind == "registered":
            (err,) = rt.cudaHostUnregister(handle[0])  # before the owner (handle[1]) may free the memory
            if int(err):  # leave no error behind: ORT checks cudaGetLastError() after its launches
                rt.cudaGetLastError()


def set_device(device: int) -> None:
    """``cudaSetDevice(device)`` for the calling thread (a staging worker's DMAs go on a stream of ``device``).
    Raises :class:`RuntimeError`."""
    (err,) = compat.cudart().cudaSetDevice(int(device))
    _check(err, f"cudaSetDevice({device})")


def new_stream(device: int):
    """A non-blocking CUDA stream on ``device`` (``cudaStreamCreateWithFlags``); call under ``CUDA_GATE.shared``."""
    rt = compat.cudart()
    with current_device(device):
        err, stream = rt.cudaStreamCreateWithFlags(STREAM_NON_BLOCKING)
    _check(err, "cudaStreamCreateWithFlags")
    return stream


def new_event(device: int):
    """A CUDA event without timing on ``device`` (``cudaEventCreateWithFlags``); call under ``CUDA_GATE.shared``."""
    rt = compat.cudart()
    with current_device(device):
        err, event = rt.cudaEventCreateWithFlags(EVENT_DISABLE_TIMING)
    _check(err, "cudaEventCreateWithFlags")
    return event


def copy_async(dst: int, src: int, nbytes: int, stream) -> None:
    """``cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream)`` (unified addressing: host <-> device either
    way); asynchronous only where the host side is page-locked. Raises :class:`RuntimeError`."""
    rt = compat.cudart()
    (err,) = rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault, stream)
    _check(err, "cudaMemcpyAsync")


def memset_async(dst: int, value: int, nbytes: int, stream) -> None:
    """``cudaMemsetAsync(dst, value, nbytes, stream)``: ``nbytes`` device bytes set to the byte ``value``. Raises
    :class:`RuntimeError`."""
    (err,) = compat.cudart().cudaMemsetAsync(dst, int(value), nbytes, stream)
    _check(err, "cudaMemsetAsync")


def record(event, stream) -> None:
    """``cudaEventRecord(event, stream)``."""
    (err,) = compat.cudart().cudaEventRecord(event, stream)
    _check(err, "cudaEventRecord")


def wait_event(event) -> None:
    """Block the host until ``event``'s work is done (``cudaEventSynchronize``)."""
    (err,) = compat.cudart().cudaEventSynchronize(event)
    _check(err, "cudaEventSynchronize")


def sync_stream(stream) -> None:
    """Block the host until ``stream``'s work is done (``cudaStreamSynchronize``)."""
    (err,) = compat.cudart().cudaStreamSynchronize(stream)
    _check(err, "cudaStreamSynchronize")
