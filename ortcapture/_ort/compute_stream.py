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
still known (:func:`stream_of`). A CUDA EP added through ``SessionOptions.add_provider_for_devices`` (a plugin EP
device, no ``providers=``) keeps ORT's own stream.
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping

from ortcapture._ort import compat, sync
from ortcapture._ort.providers import _truthy, device_ordinal

_CUDA = "CUDAExecutionProvider"
#: EPs that may share a session with the CUDA EP whose stream is known: a CPU EP (no stream of its own)
_NO_STREAM_EPS = frozenset({"CPUExecutionProvider"})
#: options with which ORT refuses a user stream
_EXTERNAL = ("gpu_external_alloc", "gpu_external_free", "gpu_external_empty_cache")
#: queued copies that fell back to ORT's synchronous copy (a failing CUDA call; see async_copier), process-wide
FALLBACKS = [0]


def _pointer(value: Any) -> int:
    """A pointer-valued provider option as ORT parses it (decimal); 0 for none or anything unparsable."""
    try:
        return int(str(value).strip() or "0")
    except ValueError:
        return 0


def wants_stream(name: str, options: Mapping[str, Any]) -> bool:
    """Whether ortcapture gives this provider entry a compute stream: the CUDA EP with ``enable_cuda_graph`` on
    and neither a stream (a nonzero ``user_compute_stream``; ORT derives ``has_user_compute_stream`` from it) nor an
    external allocator named."""
    if name != _CUDA or not _truthy(options.get("enable_cuda_graph", "0")):
        return False
    if _pointer(options.get("user_compute_stream", "0")):
        return False
    return not any(_pointer(options.get(k, "0")) for k in _EXTERNAL)


def _device(options: Mapping[str, Any]) -> int | None:
    try:
        return device_ordinal(options.get("device_id"))
    except Exception:  # noqa: BLE001 - a malformed device_id: ORT says what is wrong with it
        return None


def with_streams(names: list[str], options: list[dict], streams: dict[int, Any]) -> int | None:
    """Give every provider (``names[i]`` with ``options[i]``, ORT's normalised form; the dicts changed in place)
    that :func:`wants_stream` a ``user_compute_stream``: ``streams[device_id]`` (a cuda-python ``cudaStream_t``),
    created where missing (a non-blocking stream on that device; normally under the CUDA gate: ORT's builds of CUDA
    sessions hold it). Returns the CUDA EP's stream (an int), or ``None`` where none was given (disabled, no
    cuda-python, a malformed ``device_id``, creation failed: ORT's own stream then, as without ortcapture)."""
    if not sync.COMPUTE_STREAM or compat.cudart() is None:
        return None
    given = None
    for name, opts in zip(names, options):
        if not wants_stream(name, opts):
            continue
        device = _device(opts)
        if device is None:
            return None
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


def single_cuda_ep(providers) -> bool:
    """Whether the CUDA EP is the only EP with a stream among ``providers`` (``get_providers()``): where a TensorRT
    (or any other GPU) EP runs beside it, the graph does not run on the CUDA EP's stream alone."""
    return _CUDA in providers and not set(providers) - _NO_STREAM_EPS - {_CUDA}


def stream_of(provider_options: Mapping[str, Mapping[str, Any]] | None) -> int | None:
    """The CUDA EP's compute stream as ORT reports it (``get_provider_options()``; ``None`` while a session has no
    C session), or ``None`` (ORT's own)."""
    opts = (provider_options or {}).get(_CUDA) or {}
    return _pointer(opts.get("user_compute_stream", "0")) or None


def hide(provider_options, ours: int | None):
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
    bytes from ``sptr`` (``src``'s buffer) to ``dptr`` (the graph's fixed input), both on the compute stream's own
    CUDA device, queued on the session's compute ``stream`` with no host wait, ordered after the work queued on the
    calling thread's legacy stream (``cudaEventRecord(event, cudaStreamLegacy)`` + ``cudaStreamWaitEvent(stream,
    event)``: the ordering ``update_inplace``'s legacy-stream ``cudaMemcpy`` has, e.g. against torch's default
    stream) and before the replay ORT then launches on that stream (ORT synchronises it before its run returns, so
    ``src`` may be reused as soon as the replay returns; a caller whose replay fails settles it:
    :func:`settle`). Where a call fails — the calling thread's current device is not the stream's (an event cannot
    be recorded on another device's legacy stream), a stream or event gone — the error is cleared (ORT checks
    ``cudaGetLastError()`` after its launches), :data:`FALLBACKS` counts it, and ``fallback(src)`` (ORT's
    synchronous copy) runs instead. ``event``: a cuda-python ``cudaEvent_t`` of the stream's device. Call under
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
        FALLBACKS[0] += 1
        fallback(src)

    return copy


def settle(stream: int) -> None:
    """Wait for the copies queued on ``stream`` (after a failed or interrupted replay: a queued copy must not stay
    in flight while its source is reused); errors are cleared, never raised (the caller is already raising)."""
    rt = compat.cudart()
    if rt is None:
        return
    try:
        (err,) = rt.cudaStreamSynchronize(rt.cudaStream_t(int(stream)))
        if err:
            rt.cudaGetLastError()
    except Exception:  # noqa: BLE001 - the original exception matters, not this one
        pass


class SessionStreams:
    """One session's own compute streams (one per CUDA device it was built for, kept across ``set_providers`` and
    rebuilds) and an event per device for :func:`async_copier`. They are queued for
    :func:`ortcapture._ort.cudart.free_pending` (the next safe point) once the session object *and* every C session
    built with one of them are gone (an ``IOBinding`` keeps its C session alive after the session object). Built by
    the session; ``owner`` is the session object."""

    def __init__(self, owner) -> None:
        self._streams: dict[int, Any] = {}  # device -> cuda-python cudaStream_t
        self._events: dict[int, Any] = {}  # device -> cuda-python cudaEvent_t
        self._holders = [1]  # the session object and each C session built with a stream of ours
        #: the stream the C session built last runs on, when it is ortcapture's (an int); else None
        self.given: int | None = None
        weakref.finalize(owner, self._let_go, self._holders, self._streams, self._events)

    def providers_for(self, providers, provider_options):
        """``(providers, provider_options, stream)`` for ORT's constructor: as given with ``None`` where no stream is
        given, or ORT's own normalised form (``check_and_normalize_provider_args``: the same argument checks, which
        raise for what ORT would refuse) with a ``user_compute_stream`` of this session's own for the CUDA EP
        (:func:`wants_stream`) and that stream. :meth:`built` records it once ORT has built the session."""
        if not sync.COMPUTE_STREAM or not providers or compat.cudart() is None:
            return providers, provider_options, None
        names, options = compat.normalized_providers(providers, provider_options)  # raises as ORT would
        options = [dict(o) for o in options]  # never the caller's dicts
        if not any(wants_stream(n, o) for n, o in zip(names, options)):
            return providers, provider_options, None
        stream = with_streams(names, options, self._streams)
        if stream is None:
            return providers, provider_options, None
        return names, options, stream

    def built(self, c_session, stream: int | None) -> None:
        """ORT built ``c_session`` on ``stream`` (ours, from :meth:`providers_for`) or on a stream not ours
        (``None``); the streams live at least as long as it."""
        self.given = stream
        if stream is not None and c_session is not None:
            try:
                weakref.finalize(c_session, self._let_go, self._holders, self._streams, self._events)
            except TypeError:  # a C session without weak references: the session object's life alone
                return
            self._holders[0] += 1

    def current(self, reported: Mapping[str, Mapping[str, Any]] | None):
        """``(stream, event, device)`` for the CUDA EP's compute stream as ORT reports it (``reported``:
        ``get_provider_options()``; this session's own or the caller's), the event made on first use; ``None``
        where ORT runs on a stream of its own or the event cannot be made. Call under ``CUDA_GATE.shared``."""
        stream = stream_of(reported)
        if stream is None:
            return None
        device = _device(reported.get(_CUDA) or {})
        if device is None:
            return None
        event = self._events.get(device)
        if event is None:
            from ortcapture._ort import cudart

            try:
                event = self._events[device] = cudart.new_event(device)
            except Exception:  # noqa: BLE001 - no event: ORT's synchronous copies, as without ortcapture
                return None
        return stream, event, device

    @staticmethod
    def _let_go(holders: list, streams: dict, events: dict) -> None:
        holders[0] -= 1
        if holders[0] > 0:
            return
        from ortcapture._ort import cudart

        for s in streams.values():
            cudart.release_later("stream", s)
        for e in events.values():
            cudart.release_later("event", e)
        streams.clear()
        events.clear()
