"""The CUDA EP's compute stream, known to ortcapture: a ``user_compute_stream`` of its own for CUDA-graph sessions.

With ``enable_cuda_graph=1`` ORT's CUDA EP runs every request of a session on one EP-level stream that it creates
itself (``cudaStreamCreateWithFlags(cudaStreamNonBlocking)``, "current cuda graph implementation only works with
single stream"), and Python cannot see which. ortcapture creates that stream itself instead — the same kind, made
through cuda-python (:func:`ortcapture._ort.cudart.new_stream`) — and hands it to ORT as ``user_compute_stream``.
ORT treats it exactly as its own unified stream (the same ``use_ep_level_unified_stream_`` path; ``OnRunEnd``
synchronises it at the end of every run, as before) except that it does not destroy it: the session's finalizer
queues it for :func:`ortcapture._ort.cudart.free_pending`.

Knowing the stream, a captured graph's device-to-device feed copy needs no host wait (:func:`async_copier`):
``update_inplace(OrtValue)`` is a synchronous ``cudaMemcpy`` on the legacy stream — on a tiny model about half of a
replay (H200: 20.3 µs per replay -> 15.1 µs, ``benchmarks/bench_compute_stream.py``). A session whose options
already name a stream (``user_compute_stream``), an external allocator (ORT refuses both together), capture off,
no cuda-python, or ``ORTCAPTURE_COMPUTE_STREAM=0`` keeps ORT's own stream; where the caller gave the stream, it is
still known (:func:`stream_of`).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from ortcapture._ort import compat
from ortcapture._ort.providers import _truthy, normalize

#: $ORTCAPTURE_COMPUTE_STREAM=0: leave the CUDA EP's stream to ORT (feed copies then wait, as ORT's own do)
ENABLED = os.environ.get("ORTCAPTURE_COMPUTE_STREAM", "1") != "0"
_CUDA = "CUDAExecutionProvider"
#: options with which ORT refuses a user stream, or which already give one
_EXTERNAL = ("gpu_external_alloc", "gpu_external_free", "gpu_external_empty_cache")


def _nonzero(value: Any) -> bool:
    try:
        return int(str(value).strip() or "0", 0) != 0
    except ValueError:
        return bool(str(value).strip())


def wants_stream(name: str, options: Mapping[str, Any]) -> bool:
    """Whether ortcapture gives this provider entry a compute stream: the CUDA EP with ``enable_cuda_graph`` on
    and neither a stream (``user_compute_stream``/``has_user_compute_stream``) nor an external allocator named."""
    if name != _CUDA or not _truthy(options.get("enable_cuda_graph", "0")):
        return False
    if _nonzero(options.get("user_compute_stream", "0")) or _truthy(options.get("has_user_compute_stream", "0")):
        return False
    return not any(_nonzero(options.get(k, "0")) for k in _EXTERNAL)


def with_streams(entries: list[tuple[str, dict]], streams: dict[int, Any]) -> int | None:
    """Give every entry of ``entries`` (``[(provider name, options)]``, normalised; changed in place) that
    :func:`wants_stream` a ``user_compute_stream``: ``streams[device_id]`` (a cuda-python ``cudaStream_t``), created
    where missing (a non-blocking stream on that device; the caller holds the CUDA gate). Returns the stream of the CUDA EP entry (an int), or
    ``None`` where none was given (disabled, no cuda-python, creation failed: ORT's own stream then, as without
    ortcapture)."""
    if not ENABLED or compat.cudart() is None:
        return None
    given = None
    for name, opts in entries:
        if not wants_stream(name, opts):
            continue
        try:
            device = int(str(opts.get("device_id", "0")).strip() or "0")
        except ValueError:
            return None  # ORT says what is wrong with it
        stream = streams.get(device)
        if stream is None:
            from ortcapture._ort import cudart

            try:
                stream = streams[device] = cudart.new_stream(device)
            except Exception:  # noqa: BLE001 - no such device, out of resources: ORT's own stream, ORT's errors
                return None
        opts["user_compute_stream"] = str(int(stream))
        given = int(stream)
    return given


def stream_of(provider_options: Mapping[str, Mapping[str, Any]]) -> int | None:
    """The CUDA EP's compute stream as ORT reports it (``get_provider_options()``), or ``None`` (ORT's own)."""
    opts = provider_options.get(_CUDA) or {}
    value = opts.get("user_compute_stream", "0")
    try:
        stream = int(str(value).strip() or "0", 0)
    except ValueError:
        return None
    return stream or None


def hide(provider_options: dict, ours: int | None) -> dict:
    """``provider_options`` (ORT's ``get_provider_options()``) as the caller gave them: where the CUDA EP's stream
    is ortcapture's own, ``user_compute_stream``/``has_user_compute_stream`` read ``"0"`` as without ortcapture (a
    caller that builds another session from them must not share a stream that dies with this one)."""
    if ours is None or stream_of(provider_options) != ours:
        return provider_options
    out = dict(provider_options)
    cuda = dict(out[_CUDA])
    cuda["user_compute_stream"] = "0"
    if "has_user_compute_stream" in cuda:
        cuda["has_user_compute_stream"] = "0"
    out[_CUDA] = cuda
    return out


def async_copier(dptr: int, sptr: int, nbytes: int, stream: int, event, fallback):
    """``copy(src)`` for a remembered device-to-device feed (:class:`ortcapture.transfer.FeedTargets`): ``nbytes``
    bytes from ``sptr`` (``src``'s buffer) to ``dptr`` (the graph's fixed input), both on the session's CUDA device,
    queued on the session's compute ``stream`` with no host wait, ordered after the work queued on the calling
    thread's legacy stream (``cudaEventRecord(event, cudaStreamLegacy)`` + ``cudaStreamWaitEvent(stream, event)``:
    the ordering ``update_inplace``'s legacy-stream ``cudaMemcpy`` has, e.g. against torch's default stream) and
    before the replay ORT then launches on that stream (ORT synchronises it before its run returns, so ``src`` may
    be reused as soon as the replay returns). Where a call fails — the calling thread's current device is not the
    session's (an event cannot be recorded on another device's legacy stream), a stream or event gone — the error is
    cleared (ORT checks ``cudaGetLastError()`` after its launches) and ``fallback(src)`` (ORT's synchronous copy)
    runs instead. ``event``: a cuda-python ``cudaEvent_t`` of the session's device. Call under
    ``CUDA_GATE.shared``.
    """
    rt = compat.cudart()
    record, wait, memcpy, clear = rt.cudaEventRecord, rt.cudaStreamWaitEvent, rt.cudaMemcpyAsync, rt.cudaGetLastError
    legacy = rt.cudaStream_t(int(rt.cudaStreamLegacy))
    handle = rt.cudaStream_t(int(stream))
    kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice

    def copy(src) -> None:
        (err,) = record(event, legacy)
        if not err:
            (err,) = wait(handle, event, 0)
            if not err:
                (err,) = memcpy(dptr, sptr, nbytes, kind, handle)
                if not err:
                    return
        clear()
        fallback(src)

    return copy


class SessionStreams:
    """One session's own compute streams (one per CUDA device it was built for, kept across ``set_providers`` and
    rebuilds) and an event per device for :func:`async_copier`. When the session object is gone, they are queued
    for :func:`ortcapture._ort.cudart.free_pending` (the next safe point; the C session that used them is gone by
    then). Built by the session; ``owner`` is the session object."""

    def __init__(self, owner) -> None:
        import weakref

        self._streams: dict[int, Any] = {}  # device -> cuda-python cudaStream_t
        self._events: dict[int, Any] = {}  # device -> cuda-python cudaEvent_t
        #: the stream handed to the C session built last (an int), or None (ORT's own stream, or the caller's)
        self.given: int | None = None
        weakref.finalize(owner, _release, self._streams, self._events)

    def providers_for(self, providers, provider_options):
        """``(providers, provider_options)`` for ORT's constructor: as given, or normalised with a
        ``user_compute_stream`` of this session's own for the CUDA EP (:func:`wants_stream`). Call with the CUDA
        gate held (ORT's session builds hold it exclusively)."""
        self.given = None
        if not ENABLED or not providers:
            return providers, provider_options
        entries = normalize(providers, provider_options)
        if not any(wants_stream(n, o) for n, o in entries) or compat.cudart() is None:
            return providers, provider_options
        self.given = with_streams(entries, self._streams)
        if self.given is None:
            return providers, provider_options
        return [n for n, _ in entries], [o for _, o in entries]

    def current(self, reported: Mapping[str, Mapping[str, Any]]):
        """``(stream, event)`` for the CUDA EP's compute stream as ORT reports it (``reported``:
        ``get_provider_options()``; this session's own or the caller's), the event made on first use; ``None``
        where ORT runs on a stream of its own or the event cannot be made. Call under ``CUDA_GATE.shared``."""
        stream = stream_of(reported)
        if stream is None:
            return None
        try:
            device = int(str((reported.get(_CUDA) or {}).get("device_id", "0")) or "0")
        except ValueError:
            return None
        event = self._events.get(device)
        if event is None:
            from ortcapture._ort import cudart

            try:
                event = self._events[device] = cudart.new_event(device)
            except Exception:  # noqa: BLE001 - no event: ORT's synchronous copies, as without ortcapture
                return None
        return stream, event


def _release(streams: dict, events: dict) -> None:
    from ortcapture._ort import cudart

    for s in streams.values():
        cudart.release_later("stream", s)
    for e in events.values():
        cudart.release_later("event", e)
    streams.clear()
    events.clear()
