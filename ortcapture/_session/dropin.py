"""The drop-in's implementation: ``AutoCaptureSession`` and the patch of ``onnxruntime.InferenceSession``.

Moved out of :mod:`ortcapture.dropin` unchanged (which re-exports its public names and describes the drop-in).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator, Mapping, Sequence

import numpy as np

from ortcapture._buckets.feeds import from_list, requested_outputs
from ortcapture._buckets.feeds import specs as input_specs
from ortcapture._core.dispatch import GraphDispatcher, Refused
from ortcapture._core.run import replay_cannot_honour
from ortcapture._ort.specialize import host_read_inputs
from ortcapture._transfer.check import check_feed_values
from ortcapture._core.run import explicit_graph_id as _explicit_graph_id
from ortcapture._core.run import uncaptured as _uncaptured
from ortcapture.errors import CaptureError, GraphReleasedError
from ortcapture._session.session import InferenceSession

class AutoCaptureSession(InferenceSession):
    """The session :func:`patch_onnxruntime` installs. Takes ``onnxruntime.InferenceSession``'s arguments.

    ``stats`` counts the plain runs: ``{"replayed", "captured", "uncaptured"}``.
    """

    #: set on the subclass that patch_onnxruntime installs: {"provider", "provider_options", "max_graphs", "buckets"}
    _oc_defaults: dict = {"provider": None, "provider_options": None, "max_graphs": 8, "buckets": None}

    def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
        caller = (sess_options, providers, provider_options)
        args = _with_capture(self._oc_defaults, sess_options, providers, provider_options)
        bucket_kwargs = _bucket_kwargs(_buckets_for(self._oc_defaults.get("buckets"), path_or_bytes))
        if bucket_kwargs and not _requests_capture(args):
            # e.g. a library that names providers=["CPUExecutionProvider"] itself: ORT's session as asked
            warnings.warn(f"ortcapture: the buckets given for this model are not applied: its session was created "
                          f"with providers {args[1]!r}, which do not capture (patched()'s provider applies only "
                          "when the caller names none)", RuntimeWarning, stacklevel=2)
            bucket_kwargs = {}
        buckets = bucket_kwargs.get("buckets")
        #: feed key -> CapturedGraph, or Refused (run uncaptured): the one key -> graph map (ortcapture._core.dispatch);
        #: made first: ORT's constructor may call set_providers (its fallback providers)
        self._oc_graphs = GraphDispatcher(self._oc_defaults["max_graphs"], full="refuse")
        try:
            super().__init__(path_or_bytes, *args, **bucket_kwargs, **kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever the capture request broke
            if args == caller and buckets is None:
                raise  # the caller asked for exactly this: ORT's (or ortcapture's) error is theirs
            # ORT would have built the caller's session (e.g. onnxruntime-gpu lists TensorRT without its runtime
            # and falls back): build that, without the capture switch, and say so once
            warnings.warn(f"ortcapture: the session runs as the caller asked, without graph capture: switching "
                          f"capture on failed ({type(exc).__name__}: {str(exc)[:300]})", RuntimeWarning,
                          stacklevel=2)
            super().__init__(path_or_bytes, *caller, **kwargs)
        self._oc_warned: set[str] = set()
        self.stats = {"replayed": 0, "captured": 0, "uncaptured": 0}
        self._oc_host_inputs = host_read_inputs(self)
        self._oc_output_names = [o.name for o in self.get_outputs()]
        #: read once: while compact() or set_providers() rebuilds the C session, get_inputs() returns None
        self._oc_input_names = [i.name for i in self.get_inputs()]
        self._oc_input_specs = input_specs(self)

    # -- plain run: replayed where it can be --------------------------------------------------------------------
    def run(self, output_names, input_feed, run_options=None):
        """ORT's ``run``; served from a captured graph where it can be (see the module docstring). Returns what ORT
        returns: one numpy array per requested output. Raises what ORT raises, and :class:`CaptureError` (``kind``
        ``"fork"``) for a device session used in an ``os.fork()`` child of the process that made it (ORT would hang
        there without a word; never served uncaptured instead)."""
        self._oc_check_fork("run()")
        if self._oc_buckets is not None and not _explicit_graph_id(run_options):
            try:
                return super().run(output_names, input_feed, run_options)  # the bucket graphs
            except CaptureError as exc:  # a refused bucket: ORT would have run it
                self._oc_warn(f"bucket:{type(exc).__name__}", f"a bucket runs uncaptured: {exc}")
                self.stats["uncaptured"] += 1
                self._oc_buckets.note_uncaptured()
                return super().run(output_names, input_feed, _uncaptured(run_options))
        if _explicit_graph_id(run_options) or not (self.capture_enabled or self.capture_deferred):
            return super().run(output_names, input_feed, run_options)
        names = requested_outputs(output_names, self._oc_output_names)
        feeds = None
        if names is not None and not replay_cannot_honour(run_options):
            feeds = self._oc_array_feeds(input_feed)
        graph = self._oc_graph_for(feeds, run_options) if feeds is not None else None
        if graph is None:  # ORT's own run: its result, or its own error for what it refuses
            self.stats["uncaptured"] += 1
            return super().run(output_names, input_feed, _uncaptured(run_options))
        try:
            outs = graph.run(feeds)
        except GraphReleasedError:  # released by another thread since the look-up: this run as ORT runs it
            self.stats["uncaptured"] += 1
            return super().run(output_names, input_feed, _uncaptured(run_options))
        except CaptureError as exc:  # a host-read input's value changed under the key (not with today's keys)
            if getattr(exc, "kind", None) != "host_read_input":
                raise
            self._oc_warn("host_read", f"run uncaptured: {exc}")
            self.stats["uncaptured"] += 1
            return super().run(output_names, input_feed, _uncaptured(run_options))
        self.stats["replayed"] += 1
        return _select(self._oc_output_names, outs, names)

    def _oc_array_feeds(self, input_feed) -> dict | None:
        """``{input: ndarray}`` a graph can serve: numpy arrays as given (0-d ones included), Python lists converted
        as ORT converts them (to the input's element type); ``None`` for anything else (numpy scalars, Python
        numbers, OrtValues, strings, ``None``...), which then goes to ORT's own run, so ORT's own result or error
        comes back (measured, ORT 1.32: ``np.float32(0.5)`` for a 0-d input raises ``RuntimeError: Unable to handle
        object of type <class 'numpy.float32'>``)."""
        if not isinstance(input_feed, Mapping):
            return None
        out = {}
        for name, v in input_feed.items():
            if type(v) is not np.ndarray:
                spec = self._oc_input_specs.get(name)
                v = from_list(spec, v) if isinstance(v, list) and spec is not None else None
                if v is None:
                    return None
            out[name] = v
        return out

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):
        """ORT's ``run_with_ort_values``. OrtValue feeds are not served from graphs: without an explicit
        ``gpu_graph_id`` the run is uncaptured (one ``RuntimeWarning`` per session); with one, ortcapture's rules
        apply (:meth:`ortcapture.InferenceSession.run_with_ort_values`)."""
        if _explicit_graph_id(run_options) or not (self.capture_enabled or self.capture_deferred):
            return super().run_with_ort_values(output_names, input_dict_ort_values, run_options)
        self._oc_warn("run_with_ort_values", "OrtValue feeds run uncaptured under patch_onnxruntime")
        return super().run_with_ort_values(output_names, input_dict_ort_values, _uncaptured(run_options))

    def run_with_ortvaluevector(self, run_options, feed_names, feeds, fetch_names, fetches, fetch_devices):
        """ORT's ``run_with_ortvaluevector``: without an explicit ``gpu_graph_id`` uncaptured (one
        ``RuntimeWarning`` per session), as ORT runs it, never a ``CaptureError``."""
        if _explicit_graph_id(run_options) or not (self.capture_enabled or self.capture_deferred):
            return super().run_with_ortvaluevector(run_options, feed_names, feeds, fetch_names, fetches,
                                                   fetch_devices)
        self._oc_warn("run_with_ortvaluevector", "run_with_ortvaluevector runs uncaptured under patch_onnxruntime")
        return super().run_with_ortvaluevector(_uncaptured(run_options), feed_names, feeds, fetch_names, fetches,
                                               fetch_devices)

    def run_async(self, output_names, input_feed, callback, user_data, run_options=None):
        """ORT's ``run_async``. It returns before the run, so it is never captured: without an explicit
        ``gpu_graph_id`` the run is uncaptured (one ``RuntimeWarning`` per session); with one, ortcapture's rules
        apply (:meth:`ortcapture.InferenceSession.run_async`)."""
        if _explicit_graph_id(run_options) or not (self.capture_enabled or self.capture_deferred):
            return super().run_async(output_names, input_feed, callback, user_data, run_options)
        self._oc_warn("run_async", "run_async runs uncaptured under patch_onnxruntime")
        return super().run_async(output_names, input_feed, callback, user_data, _uncaptured(run_options))

    def run_with_iobinding(self, iobinding, run_options=None):
        """Without an explicit ``gpu_graph_id`` (ORT's default id 0), a library's IOBinding run is uncaptured: it
        may rebind between runs, which a captured graph would refuse. With one, ortcapture's capture rules apply."""
        if _explicit_graph_id(run_options) or not self.capture_enabled:
            return super().run_with_iobinding(iobinding, run_options)
        return super().run_with_iobinding(iobinding, _uncaptured(run_options))

    # -- the graphs -----------------------------------------------------------------------------------------------
    def _oc_graph_for(self, feeds: dict, run_options):
        names = self._oc_input_names
        if set(feeds) != set(names):
            self._oc_warn("inputs", "a run that does not feed every input runs uncaptured")
            return None
        key = tuple((n, feeds[n].shape, feeds[n].dtype.str,
                     feeds[n].tobytes() if n in self._oc_host_inputs else None) for n in names)
        graphs = self._oc_graphs
        with graphs.lock:
            known = graphs.get(key)
            if known is not None and not isinstance(known, Refused) and known.released:
                # released from outside (release_captured_graph, set_providers): captured again, as ORT would run
                graphs.discard(key, known)
                known = None
            if known is not None:
                return None if isinstance(known, Refused) else known
            graphs.prune(_released)  # released from outside: no place held under max_graphs
            specs = self._oc_input_specs
            if any(n in specs and specs[n].problem(feeds[n].shape, feeds[n].dtype) for n in names):
                return None  # a feed ORT's run refuses (another element type, rank or fixed dim): ORT's own error,
                # with no capture tried, no "runs uncaptured" warning before it and no refused key left behind
            device = self._oc_state.device  # a value the copy refuses: this call's TransferError, as the plain run
            # raises it, not a refused key (its shapes would run uncaptured from then on)
            check_feed_values(device.device_type if device is not None else None, feeds, self._oc_host_inputs)
            if not graphs.admits():
                self._oc_warn("max_graphs", f"more than max_graphs={self._oc_defaults['max_graphs']} distinct input "
                                            "shapes: the others run uncaptured")
                return None
            graph = None
            mark = self._oc_state.release_mark()
            try:
                graph = self.capture(feeds, verify=self._oc_defaults.get("verify", "full"))  # ortcapture._verify.compare
                self.stats["captured"] += 1
            except Exception as exc:  # noqa: BLE001 - whatever refused the capture: run uncaptured instead
                passing = isinstance(exc, GraphReleasedError) or self._oc_state.released_elsewhere(mark)
                if graph is not None:
                    graph.release()
                if passing:  # a graph released by another thread meanwhile: this run uncaptured, the next captures
                    return None
                self._oc_warn(f"capture:{type(exc).__name__}", f"inputs of shapes "
                              f"{ {n: s for n, s, _, _ in key} } run uncaptured: {exc}")
                graphs.refuse(key, exc)
                return None
            graphs.add(key, graph)
            return graph

    def set_providers(self, providers=None, provider_options=None) -> None:
        """ORT's ``set_providers`` (:meth:`ortcapture.InferenceSession.set_providers`); the shapes refused under the old
        providers are tried again under the new ones."""
        try:
            super().set_providers(providers, provider_options)
        finally:
            self._oc_graphs.forget_refused()
            self._oc_graphs.prune(_released)

    def _oc_warn(self, kind: str, message: str) -> None:
        if kind not in self._oc_warned:
            self._oc_warned.add(kind)
            warnings.warn(f"ortcapture: {message}", RuntimeWarning, stacklevel=3)


#: the session keywords a ``patched(buckets=...)`` entry may give besides the buckets themselves
_BUCKET_KEYWORDS = frozenset({"buckets", "pad_values", "output_axes", "oversize", "max_graphs", "replay_thread"})


def _bucket_kwargs(value) -> dict:
    """A ``patched(buckets=...)`` entry as session keywords: ``{"batch": [...]}`` (the buckets) or
    ``{"buckets": {...}, "pad_values": {...}, "output_axes": {...}, ...}`` (with the other bucket keywords).
    Raises :class:`CaptureError` for unknown keywords in the second form."""
    if value is None:
        return {}
    if isinstance(value, Mapping) and isinstance(value.get("buckets"), Mapping):
        unknown = sorted(set(value) - _BUCKET_KEYWORDS)
        if unknown:
            raise CaptureError(f"patched(buckets=...): unknown keyword(s) {unknown}; an entry gives "
                               f"{sorted(_BUCKET_KEYWORDS)}")
        return dict(value)
    return {"buckets": value}


def _buckets_for(spec, path_or_bytes):
    """The ``buckets=`` for a session of ``path_or_bytes``: ``spec`` is None, a dict keyed by model path (matched
    by ``os.path.realpath``), or a callable ``f(path_or_bytes) -> buckets or None``."""
    import os

    if spec is None:
        return None
    if callable(spec):
        return spec(path_or_bytes)
    if isinstance(path_or_bytes, (str, os.PathLike)):
        want = os.path.realpath(os.fspath(path_or_bytes))
        for key, value in spec.items():
            if os.path.realpath(os.fspath(key)) == want:
                return value
    return None


def _released(graph) -> bool:
    return graph.released


def _select(all_names: list, outs: list, names: list) -> list:
    """The replay's outputs (one per ``all_names`` entry) for the requested ``names`` (checked before the replay:
    :func:`ortcapture._buckets.feeds.requested_outputs`); a name asked for twice gets separate arrays, as from ORT."""
    if names == all_names:
        return outs
    picked, seen = [], set()
    for n in names:
        out = outs[all_names.index(n)]
        picked.append(out.copy() if n in seen else out)
        seen.add(n)
    return picked


def _with_capture(defaults: dict, sess_options, providers, provider_options):
    """The session arguments with capture requested: the default provider when the caller names none (and added no
    plugin EP to ``sess_options``), and ``enable_cuda_graph``/``trt_cuda_graph_enable`` for a CUDA/TensorRT EP the
    caller names without it."""
    from ortcapture._ort.providers import CAPTURE_EPS, requested_capture, session_args

    if providers:
        if requested_capture(providers, provider_options, sess_options) is not None:
            return sess_options, providers, provider_options
        out = []
        for i, p in enumerate(providers):
            name, opts = (p[0], dict(p[1])) if isinstance(p, (tuple, list)) else (
                p, dict(provider_options[i]) if provider_options and i < len(provider_options) else {})
            ep = CAPTURE_EPS.get(name)
            if ep is not None and ep.device_type == "cuda":
                opts[ep.option] = "1"
            out.append((name, opts))
        return sess_options, out, None
    if defaults.get("provider") is None or requested_capture(None, None, sess_options) is not None:
        return sess_options, providers, provider_options
    if sess_options is not None and _has_plugin_ep(sess_options):
        return sess_options, providers, provider_options
    if sess_options is not None and defaults["provider"] == "webgpu":
        # the plugin EP is added to a SessionOptions object, which ORT cannot copy: adding it to the caller's own
        # would change their object for every later session (after unpatch too) — their session runs as they asked
        if not _WARNED_OPTIONS:
            _WARNED_OPTIONS.append(True)
            warnings.warn("ortcapture: patched(provider='webgpu') leaves sessions made with the caller's own "
                          "SessionOptions as asked, without capture (the WebGPU EP would have to be added to that "
                          "object, changing it for the caller's later sessions too); create the session without "
                          "sess_options, or add the EP yourself: ortcapture.webgpu.session_options(True, so). "
                          "Warned once per process.", RuntimeWarning, stacklevel=3)
        return sess_options, providers, provider_options
    args = session_args(defaults["provider"], True, sess_options, ep_options=defaults.get("provider_options"))
    return args["sess_options"], args.get("providers"), None


_WARNED_OPTIONS: list = []  # the warning above, once per process


def _requests_capture(args) -> bool:
    """Whether session arguments ``(sess_options, providers, provider_options)`` request graph capture."""
    from ortcapture._ort.providers import requested_capture

    sess_options, providers, provider_options = args
    return requested_capture(providers, provider_options, sess_options) is not None


def _has_plugin_ep(sess_options) -> bool:
    try:
        return bool(sess_options.get_session_config_entry("ep.webgpuexecutionprovider.enableGraphCapture"))
    except RuntimeError:
        return False


_PATCH_LOCK = threading.Lock()
_ORIGINAL: list = []  # the onnxruntime.InferenceSession that patch_onnxruntime replaced (one level)


def patch_onnxruntime(provider: str | None = "auto", provider_options: Mapping[str, str] | None = None, *,
                      max_graphs: int = 8, buckets=None) -> type:
    """Install :class:`AutoCaptureSession` as ``onnxruntime.InferenceSession`` (see the module docstring).

    Args:
        provider: the capture provider for sessions whose caller names none (with ``"webgpu"``, nor passes its own
            ``SessionOptions``, which would have to be changed: such sessions run as asked, one warning):
            ``"cuda"``, ``"webgpu"``, ``"auto"``
            (CUDA where onnxruntime-gpu's CUDA EP really loads — its CUDA libraries, a driver and a GPU:
            ``ortcapture._ort.cuda_probe`` — else WebGPU where a child-process probe captures), or ``None`` (leave
            such sessions as the caller made them).
        provider_options: further EP options for that provider, ``{key: str}`` (e.g. ``{"device_id": "1"}``).
        max_graphs: distinct input-shape sets captured per session; runs beyond it are uncaptured.
        buckets: batch buckets for some models (``InferenceSession(buckets=...)``, docs/BUCKETS.md): a dict
            ``{model path: buckets}`` or a callable ``f(path_or_bytes) -> buckets or None``; an entry may also be
            ``{"buckets": ..., "pad_values": ..., "output_axes": ..., "oversize": ..., "max_graphs": ...,
            "replay_thread": ...}`` (the session's bucket keywords). Their plain ``run()``
            pads to the bucket; a bucket that cannot be served runs uncaptured with one warning.

    Returns:
        The installed class (a subclass of :class:`AutoCaptureSession` holding these defaults).

    Raises:
        CaptureError: already patched (call :func:`unpatch_onnxruntime` first), or a bad argument.
        CaptureUnsupportedError: ``provider="auto"`` and no capture-capable provider here.
    """
    import onnxruntime as ort

    from ortcapture._ort.providers import check_provider_options, pick_provider

    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise CaptureError(f"max_graphs must be an int >= 1, got {max_graphs!r}")
    if buckets is not None and not callable(buckets) and not isinstance(buckets, Mapping):
        raise CaptureError(f"buckets must be a dict {{model path: buckets}} or a callable, got {buckets!r}")
    for entry in (buckets.values() if isinstance(buckets, Mapping) else ()):
        _bucket_kwargs(entry)  # unknown keywords named now, not at a library's session creation
    if provider not in (None, "auto", "cuda", "webgpu"):
        raise CaptureError(f"provider must be 'cuda', 'webgpu', 'auto' or None, got {provider!r}")
    options = check_provider_options(provider_options)
    with _PATCH_LOCK:
        if _ORIGINAL:
            raise CaptureError("onnxruntime is already patched by ortcapture; call unpatch_onnxruntime() first")
        chosen = pick_provider("auto") if provider == "auto" else provider
        cls = type("InferenceSession", (AutoCaptureSession,), {
            "_oc_defaults": {"provider": chosen, "provider_options": options, "max_graphs": max_graphs,
                            "buckets": buckets},
            "__module__": __name__, "__doc__": AutoCaptureSession.__doc__})
        _ORIGINAL.append(ort.InferenceSession)
        ort.InferenceSession = cls
        return cls


def unpatch_onnxruntime() -> None:
    """Restore the ``onnxruntime.InferenceSession`` that :func:`patch_onnxruntime` replaced (no-op if not patched).
    Sessions made while patched keep working."""
    import onnxruntime as ort

    with _PATCH_LOCK:
        if _ORIGINAL:
            ort.InferenceSession = _ORIGINAL.pop()


@contextlib.contextmanager
def patched(provider: str | None = "auto", provider_options: Mapping[str, str] | None = None, *,
            max_graphs: int = 8, buckets=None) -> Iterator[type]:
    """``with ortcapture.patched(...) as cls:`` — :func:`patch_onnxruntime` for the block, restored on exit (also on
    an exception). Same arguments and exceptions."""
    cls = patch_onnxruntime(provider, provider_options, max_graphs=max_graphs, buckets=buckets)
    try:
        yield cls
    finally:
        unpatch_onnxruntime()


def is_patched() -> bool:
    """Whether ``onnxruntime.InferenceSession`` is ortcapture's now."""
    return bool(_ORIGINAL)


__all__: Sequence[str] = ["AutoCaptureSession", "patch_onnxruntime", "unpatch_onnxruntime", "patched", "is_patched"]
