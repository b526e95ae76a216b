"""Thin cuda-python helpers (all optional: each returns ``None``/``False`` where cuda-python is absent).

Used where ORT's Python API has no answer: which device a pointer lives on, whether a stream is being captured
(ORT PR #32081: a capturing session called during a foreign stream capture ends in ``std::terminate``), and
device-to-device copies on ORT versions without ``OrtValue.update_inplace(OrtValue)``.
"""
from __future__ import annotations

from ortcapture import compat


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


def stream_is_capturing(stream: int = 0) -> bool:
    """Whether CUDA ``stream`` (0 = legacy default stream) is being captured into a CUDA graph right now."""
    rt = compat.cudart()
    if rt is None:
        return False
    try:
        err, status = rt.cudaStreamIsCapturing(stream)
    except Exception:  # noqa: BLE001
        return False
    if not _ok(err):
        return int(err) in _CAPTURE_ERRORS
    return int(status) != 0


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


def make_capture_probe():
    """A cheap callable answering: is the calling thread's CUDA stream (torch's current stream, else the legacy
    default stream) being captured into a foreign CUDA graph right now? Built once per session; one or two
    queries per call, no synchronisation. Without torch and cuda-python it always answers False."""
    import sys

    rt = compat.cudart()
    query = getattr(rt, "cudaStreamIsCapturing", None) if rt is not None else None
    modules = sys.modules

    def probe() -> bool:
        torch = modules.get("torch")
        if torch is not None:
            cuda = torch.cuda
            if cuda.is_initialized() and cuda.is_current_stream_capturing():
                return True
        if query is not None:
            err, status = query(0)
            if int(err) != 0:
                return int(err) in _CAPTURE_ERRORS
            return int(status) != 0
        return False

    return probe


# cudaErrorStreamCapture* (900-908): a capture in progress made the legacy stream query illegal
_CAPTURE_ERRORS = frozenset(range(900, 909))


def caller_stream_is_capturing() -> bool:
    """One-off form of :func:`make_capture_probe`."""
    return make_capture_probe()()
