"""``ortcapture.InferenceSession``: a drop-in ``onnxruntime.InferenceSession`` whose every run path is capture-safe.

Capture is on when the user enabled it the ORT way (``enable_cuda_graph``, ``trt_cuda_graph_enable``,
``enableGraphCapture``; see :mod:`ortcapture._providers`). With capture off this class behaves exactly like ORT.
With capture on, what ORT >= 1.30 guarantees for WebGPU only (ORT PR #32074) holds for every capture-capable EP:

* ``run``/``run_async``/``run_with_ort_values``/``run_with_ortvaluevector`` raise unless the run options set
  ``gpu_graph_id=-1`` (measured on CUDA: ``run()`` after a capture is accepted and replays stale buffers; after a
  release it fails with ``IndexError``);
* ``run_with_iobinding`` pins the IOBinding per ``gpu_graph_id`` (:mod:`ortcapture._registry`), refuses CPU-bound,
  ORT-allocated, foreign-device and input/output-aliased bindings, and serialises runs (ORT does not support
  concurrent ``Run`` under capture and does not enforce it);
* ``release_captured_graph`` retires CUDA/TensorRT ids (ORT's release is a no-op there) and ``set_providers``
  forgets every graph.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Mapping, Sequence

import onnxruntime as ort

from ortcapture import _compat as compat
from ortcapture import _sync as gate
from ortcapture import _specialize as shapes
from ortcapture._binding import IOBinding
from ortcapture._buffers import BufferPool
from ortcapture.errors import BindingError, CaptureError, CaptureUnsupportedError, GraphReleasedError
from ortcapture._providers import CUDA_EPS, CaptureInfo, detect_capture, names_cuda_ep, requested_capture
from ortcapture._registry import SKIP_GRAPH_ID, GraphRegistry

GRAPH_ID_KEY = "gpu_graph_id"


_NULL = contextlib.nullcontext()


def graph_id_of(run_options: ort.RunOptions | None) -> int:
    """The ``gpu_graph_id`` a run uses: the run config entry, default 0. Raises :class:`CaptureError` if not an int."""
    if run_options is None:
        return 0
    try:
        entry = run_options.get_run_config_entry(GRAPH_ID_KEY)
    except RuntimeError:
        return 0
    if not entry:
        return 0
    try:
        return check_graph_id(int(entry))
    except ValueError:
        raise CaptureError(f"run option {GRAPH_ID_KEY!r} must be an integer, got {entry!r}") from None


#: ORT parses gpu_graph_id as a 32-bit int ("Failed to parse the cuda graph annotation id" beyond that).
MAX_GRAPH_ID = 2**31 - 1


def check_graph_id(graph_id) -> int:
    """``graph_id`` as an int in [-1, 2**31-1]; raises :class:`CaptureError` otherwise (bools and floats too)."""
    import operator

    if isinstance(graph_id, bool):
        raise CaptureError(f"gpu_graph_id must be an int, got {graph_id!r}")
    try:
        gid = operator.index(graph_id)
    except TypeError:
        raise CaptureError(f"gpu_graph_id must be an int, got {graph_id!r}") from None
    if not -1 <= gid <= MAX_GRAPH_ID:
        raise CaptureError(f"gpu_graph_id must be -1 (no capture) or in [0, {MAX_GRAPH_ID}], got {gid}")
    return gid


def run_options_for(graph_id: int, base: ort.RunOptions | None = None) -> ort.RunOptions:
    """``RunOptions`` (``base`` or new) with ``gpu_graph_id`` set to ``graph_id`` (-1: run without capture).
    Raises :class:`CaptureError` for anything but an int in [-1, 2**31-1]."""
    gid = check_graph_id(graph_id)
    ro = base if base is not None else ort.RunOptions()
    ro.add_run_config_entry(GRAPH_ID_KEY, str(gid))
    return ro


def _without_capture(providers, provider_options, requested: CaptureInfo):
    """The provider arguments with the capture switch turned off (for a session that must not capture)."""
    out = []
    for i, p in enumerate(providers or []):
        name, opts = (p[0], dict(p[1])) if isinstance(p, (tuple, list)) else (p, None)
        if opts is None and provider_options and i < len(provider_options):
            opts = dict(provider_options[i])
        if name == requested.ep.name and opts is not None:
            opts[requested.ep.option] = "0"
        out.append((name, opts or {}))
    return out


class InferenceSession(ort.InferenceSession):
    """Drop-in ``onnxruntime.InferenceSession`` with capture guards for CUDA, TensorRT and WebGPU graph capture.

    Takes exactly ``onnxruntime.InferenceSession``'s arguments, plus:

    :param static_shapes: ``{input name: shape}`` — specialise the session to these input shapes up front (fixes
        the dims in the model), so the raw IOBinding path can capture models with dynamic dims.

    Raises :class:`~ortcapture.errors.CaptureUnsupportedError` when capture was requested but the session ended up
    without a capturing EP (measured: on ORT 1.30, ``providers=[("WebGpuExecutionProvider", ...)]`` silently
    yields a CPU-only session; add the plugin EP with ``SessionOptions.add_provider_for_devices``). When ORT
    refuses capture for the model's dynamic shapes, the session is created without capture instead
    (``capture_deferred`` is then True) and :meth:`capture` specialises a sibling session to the example shapes.
    """

    def __init__(
        self,
        path_or_bytes,
        sess_options: ort.SessionOptions | None = None,
        providers: Sequence[Any] | None = None,
        provider_options: Sequence[Mapping[str, Any]] | None = None,
        *,
        static_shapes: Mapping[str, Sequence[int]] | None = None,
        **kwargs,
    ) -> None:
        self._oc_lock = threading.RLock()
        self._oc_args = (path_or_bytes, sess_options, providers, provider_options, dict(kwargs))
        self._oc_siblings: dict[tuple, InferenceSession] = {}
        self._oc_graphs: dict[int, Any] = {}  # gpu_graph_id -> CapturedGraph made by capture()
        self._oc_family: InferenceSession = self  # the session whose id space siblings share
        self._oc_deferred = False
        requested = requested_capture(providers, provider_options, sess_options)
        self._oc_check_version(requested)
        model = shapes.fix_input_shapes(path_or_bytes, static_shapes) if static_shapes else path_or_bytes
        self._oc_static_shapes = shapes.shape_signature(static_shapes) if static_shapes else None
        if requested is not None:
            # ORT silently falls back to the CPU EP when a session fails to build; under capture that fallback
            # hides the failure, so it is off unless the caller asked for it.
            kwargs.setdefault("enable_fallback", 0)
        # building a CUDA session allocates and initialises on the device: never while another thread captures
        cuda = (requested is not None and requested.device_type == "cuda") or names_cuda_ep(providers)
        with gate.CUDA_GATE.exclusive if cuda else _NULL:
            try:
                super().__init__(model, sess_options, providers, provider_options, **kwargs)
            except Exception as exc:  # noqa: BLE001 - ORT raises its own Fail/EPFail types, not RuntimeError
                if requested is None or not shapes.is_capture_refusal(exc) or static_shapes:
                    raise
                dynamic = shapes.dynamic_inputs(shapes.load_model(path_or_bytes))
                if not dynamic:
                    raise CaptureUnsupportedError(
                        f"{requested.ep.name} refused graph capture for this model, which has no dynamic input "
                        f"dims to specialise: {exc}. Run `ortcapture doctor MODEL` to see which nodes fall off "
                        "the EP."
                    ) from exc
                self._oc_init_deferred(model, sess_options, providers, provider_options, kwargs, requested)
        self._oc_requested = requested
        self._oc_setup(requested)

    # -- construction helpers -------------------------------------------------------------------------------
    def _oc_init_deferred(self, model, sess_options, providers, provider_options, kwargs, requested) -> None:
        """Create this session without capture; :meth:`capture` will specialise siblings that capture."""
        self._oc_deferred = True
        if providers:
            super().__init__(model, sess_options, _without_capture(providers, provider_options, requested),
                             None, **kwargs)
            return
        key = f"ep.{requested.ep.name.lower()}.{requested.ep.option}"
        sess_options.add_session_config_entry(key, "0")
        try:
            super().__init__(model, sess_options, providers, provider_options, **kwargs)
        finally:
            sess_options.add_session_config_entry(key, "1")

    @staticmethod
    def _oc_check_version(requested: CaptureInfo | None) -> None:
        if requested is not None and requested.device_type == "webgpu" and not compat.webgpu_plugin_captures():
            raise CaptureUnsupportedError(
                f"onnxruntime {ort.__version__} accepts enableGraphCapture for the WebGPU plugin EP but never "
                "captures (measured on 1.24.4 and 1.25.1: every run recomputes, rebinding is not even ignored); "
                "WebGPU graph capture needs onnxruntime >= 1.27.0"
            )

    def _oc_setup(self, requested: CaptureInfo | None) -> None:
        self._oc_check_version(requested)
        info = None if self._oc_deferred else detect_capture(self, requested)
        if requested is not None and info is None and not self._oc_deferred:
            raise CaptureUnsupportedError(
                f"graph capture was requested for {requested.ep.name}, but the session runs on "
                f"{self.get_providers()} without capture. On ORT 1.30 naming a plugin EP in providers=[...] can "
                "silently give a CPU-only session: register the plugin library and add it with "
                "SessionOptions.add_provider_for_devices([ep_device], {...}); check `ortcapture doctor`."
            )
        self._oc_info = info
        active = self.get_providers()
        webgpu_ep = ((info or requested) is not None and (info or requested).device_type == "webgpu"
                     or any(p == "WebGpuExecutionProvider" for p in active))
        if webgpu_ep:
            from ortcapture import webgpu

            # ORT's WebGPU device is shared by every session and copy in the process: captured or not
            self._oc_lock = webgpu.LOCK
        cuda = ((info or requested) is not None and (info or requested).device_type == "cuda"
                or any(p in CUDA_EPS for p in active))
        # uncaptured GPU runs are guarded too: CUDA ones must not overlap another thread's capture, WebGPU ones
        # must not overlap any other WebGPU work
        self._oc_gpu_guarded = cuda or webgpu_ep
        self._oc_guard = gate.SessionGuard(self._oc_lock, cuda)  # CUDA_GATE.shared, then the session lock
        self._oc_cguard = gate.CaptureGuard(self._oc_lock, cuda)  # CUDA_GATE.exclusive, then the session lock
        # ORT's CUDA/TensorRT EPs keep captured graphs per thread: which graph ids this thread has (see
        # capture.capture_in_this_thread); a fresh threading.local after set_providers (new C session)
        self._oc_per_thread = info is not None and info.device_type == "cuda"
        self._oc_tls = threading.local()
        # the replay may skip ORT's Python run_with_iobinding where it only forwards, or only adds WebGPU capture
        # guards and this is a CUDA/TensorRT capture (its bindings are this session's: set_providers releases graphs)
        wrapper = compat.iobinding_run_wrapper()
        self._oc_c_replay = info is not None and (
            wrapper == "nothing" or wrapper == "webgpu guards" and info.device_type == "cuda")
        self._oc_capture_probe = None
        if info is not None and info.device_type == "cuda":
            from ortcapture._cudart import make_capture_probe

            self._oc_capture_probe = make_capture_probe()
        target = info or (requested if self._oc_deferred else None)
        self._oc_registry = GraphRegistry(info) if info is not None else None
        self._oc_pool = BufferPool(self, target) if target is not None else None

    # -- capture state ----------------------------------------------------------------------------------------
    @property
    def capture_enabled(self) -> bool:
        """True when this session's runs capture and replay CUDA/TensorRT/WebGPU graphs."""
        return self._oc_info is not None

    @property
    def capture_deferred(self) -> bool:
        """True when capture was requested but ORT refused it for the model's dynamic shapes: :meth:`capture`
        then captures on a sibling session specialised to the example shapes."""
        return self._oc_deferred

    @property
    def requested_capture(self) -> CaptureInfo | None:
        """The capture the providers/options asked for (EP and device ordinal), whether or not the session captures
        itself (a capture-deferred session captures on shape-specialised siblings); ``None`` when none was asked."""
        return self._oc_requested

    @property
    def static_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """``{input name: shape}`` this session was specialised to (``static_shapes=``, or by :meth:`capture` for a
        shape-specialised sibling); ``None`` when its input dims are the model's own."""
        return dict(self._oc_static_shapes) if self._oc_static_shapes else None

    @property
    def capture_info(self) -> CaptureInfo | None:
        """The capturing EP and device ordinal, or ``None``."""
        return self._oc_info

    @property
    def captured_graphs(self) -> dict[int, dict]:
        """``gpu_graph_id`` -> pinned inputs/outputs (device, shape, type), bytes and replay count, for this session
        and its shape-specialised siblings (ids are unique across them)."""
        out = {}
        for sess in (self, *self._oc_siblings.values()):
            if sess._oc_registry is not None:
                for gid in sess._oc_registry.graph_ids:
                    rec = sess._oc_registry.get(gid)
                    if rec is None:  # released by another thread meanwhile
                        continue
                    d = rec.describe()
                    d["static_shapes"] = dict(sess._oc_static_shapes) if sess._oc_static_shapes else None
                    out[gid] = d
        return out

    def _oc_require_capture(self, what: str) -> None:
        if self._oc_info is None:
            raise CaptureUnsupportedError(
                f"{what} needs a session with graph capture enabled (enable_cuda_graph=1, trt_cuda_graph_enable=1 "
                "or enableGraphCapture=1)" + (
                    "; this session defers capture to shape-specialised siblings: use sess.capture(feeds)"
                    if self._oc_deferred else "")
            )

    # -- buffers ----------------------------------------------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype) -> ort.OrtValue:
        """A fixed, uninitialised device OrtValue on the capturing EP's device (``cuda:<device_id>`` or ``webgpu``),
        kept alive by this session. ``shape``: concrete ints; ``dtype``: a numpy dtype.

        Raises :class:`~ortcapture.errors.CaptureUnsupportedError` on a session without capture.
        """
        if self._oc_pool is None:
            self._oc_require_capture("allocate()")
        with self._oc_guard:  # a device allocation must not happen while another thread captures (CUDA)
            return self._oc_pool.allocate(shape, dtype)

    def io_binding(self) -> IOBinding:
        """An :class:`ortcapture._binding.IOBinding` (an ``onnxruntime.IOBinding`` that records what it binds)."""
        return IOBinding(self)

    # -- guarded run paths ------------------------------------------------------------------------------------
    def _oc_check_plain_run(self, api: str, run_options) -> bool:
        """Raise unless a plain run is safe here; True when it must hold the session guard (a capture session, or
        any CUDA-based session: its runs must not overlap another thread's capture, see ``ortcapture._sync``)."""
        if self._oc_info is None:
            return self._oc_deferred or self._oc_gpu_guarded  # deferred: siblings capture under the same lock
        if graph_id_of(run_options) != SKIP_GRAPH_ID:
            raise CaptureError(
                f"{api}() on a session with {self._oc_info.ep.name} graph capture would capture or replay with "
                "transient buffers: replay re-issues the device buffers recorded at capture and ignores new feeds. "
                "Use sess.capture(feeds) (or run_with_iobinding with fixed buffers), or set the run option "
                f"{GRAPH_ID_KEY}=-1 to run this call without capture."
            )
        return True

    # Plain runs (gpu_graph_id=-1) of a capturing or capture-deferred session take the session lock too: ORT does not
    # support them concurrently with capture/replay (measured on WebGPU: SIGSEGV / SIGABRT beside CapturedGraph.run).
    def run(self, output_names, input_feed, run_options=None):
        if self._oc_check_plain_run("run", run_options):
            with self._oc_guard:
                return super().run(output_names, input_feed, run_options)
        return super().run(output_names, input_feed, run_options)

    def run_async(self, output_names, input_feed, callback, user_data, run_options=None):
        """ORT's ``run_async``; on a capturing session only with ``gpu_graph_id=-1``. Not serialised with replays
        (it returns before the run): do not mix it with captured replays of the same session."""
        self._oc_check_plain_run("run_async", run_options)
        return super().run_async(output_names, input_feed, callback, user_data, run_options)

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):
        if self._oc_check_plain_run("run_with_ort_values", run_options):
            with self._oc_guard:
                return super().run_with_ort_values(output_names, input_dict_ort_values, run_options)
        return super().run_with_ort_values(output_names, input_dict_ort_values, run_options)

    def run_with_ortvaluevector(self, run_options, feed_names, feeds, fetch_names, fetches, fetch_devices):
        if self._oc_check_plain_run("run_with_ortvaluevector", run_options):
            with self._oc_guard:
                return super().run_with_ortvaluevector(run_options, feed_names, feeds, fetch_names, fetches,
                                                       fetch_devices)
        return super().run_with_ortvaluevector(run_options, feed_names, feeds, fetch_names, fetches, fetch_devices)

    def run_with_iobinding(self, iobinding, run_options=None):
        """ORT's ``run_with_iobinding``, with the graph registry's checks when capture is on.

        The first run of a ``gpu_graph_id`` captures (ORT runs the model a few times inside that call) and pins
        the IOBinding; later runs replay it. Raises :class:`~ortcapture.errors.BindingError` for another or a
        changed IOBinding, a CPU-bound (``bind_cpu_input``) or ORT-allocated output, a buffer on another device,
        or an input and output sharing one buffer; :class:`~ortcapture.errors.GraphReleasedError` for a retired id.
        ``gpu_graph_id=-1`` runs without capture.
        """
        if self._oc_info is None:
            if not self._oc_deferred:
                if self._oc_gpu_guarded:
                    with self._oc_guard:
                        return super().run_with_iobinding(iobinding, run_options)
                return super().run_with_iobinding(iobinding, run_options)
            if graph_id_of(run_options) != SKIP_GRAPH_ID:
                raise CaptureUnsupportedError(
                    f"this session cannot capture: {self._oc_requested.ep.name} refused graph capture for the model's "
                    "dynamic input dims, so a raw IOBinding run here would silently run uncaptured and unguarded. "
                    "Create the session with static_shapes={name: shape} to capture through IOBinding, use "
                    f"sess.capture(feeds), or set {GRAPH_ID_KEY}=-1 for an uncaptured run."
                )
            with self._oc_guard:
                return super().run_with_iobinding(iobinding, run_options)
        gid = graph_id_of(run_options)
        if gid == SKIP_GRAPH_ID:
            with self._oc_guard:
                return super().run_with_iobinding(iobinding, run_options)
        if not isinstance(iobinding, IOBinding):
            raise BindingError(
                "graph capture needs an IOBinding from sess.io_binding() (ortcapture records what it binds to pin "
                "it per gpu_graph_id); got a plain onnxruntime.IOBinding"
            )
        self._oc_check_foreign_capture()
        if not self._oc_thread_has(gid):
            self._oc_prepare_thread(iobinding, gid, run_options)
        while True:
            exclusive = gid not in self._oc_registry  # a first capture excludes all other CUDA work
            with self._oc_cguard if exclusive else self._oc_guard:
                rec = self._oc_registry.check(iobinding, gid)
                if rec is None:
                    if not exclusive:
                        continue  # released and free again (WebGPU) since the look above: capture exclusively
                    self._oc_capture(iobinding, gid, run_options)
                    return None
                super().run_with_iobinding(iobinding, run_options)
                rec.replays += 1
                return None

    def _oc_replay(self, iobinding: IOBinding, run_options: ort.RunOptions, rec) -> None:
        """Hot path for :class:`~ortcapture.graph.CapturedGraph`: replay an already validated, pinned graph.
        The caller holds ``self._oc_guard``, has checked for a foreign capture (``_oc_capture_probe``, else
        :meth:`_oc_check_foreign_capture`) and has called :meth:`_oc_prepare_thread`."""
        if self._oc_c_replay:  # all that ORT's Python wrapper would do here (compat.iobinding_run_wrapper)
            self._sess.run_with_iobinding(iobinding._iobinding, run_options)
        else:
            ort.InferenceSession.run_with_iobinding(self, iobinding, run_options)
        rec.replays += 1

    def _oc_capture(self, iobinding: IOBinding, gid: int, run_options, owner=None):
        """Validate bindings, capture ``gid`` side-effect free, and pin the binding. Caller holds the capture
        guard (:attr:`_oc_cguard`)."""
        from ortcapture._capture import capture_bindings

        rec = capture_bindings(self, iobinding, gid, run_options, owner)
        self._oc_thread_add(gid)
        return rec

    # ORT's CUDA/TensorRT EPs keep captured graphs per thread (CUDAExecutionProvider::PerThreadContext): a captured
    # id run from a new thread would re-run warm-ups and capture again, racing other threads' CUDA work.
    def _oc_thread_has(self, gid: int) -> bool:
        if not self._oc_per_thread:
            return True
        graphs = getattr(self._oc_tls, "graphs", None)
        return graphs is not None and gid in graphs

    def _oc_thread_add(self, gid: int) -> None:
        if self._oc_per_thread:
            graphs = getattr(self._oc_tls, "graphs", None)
            if graphs is None:
                graphs = self._oc_tls.graphs = set()
            graphs.add(gid)

    def _oc_prepare_thread(self, iobinding: IOBinding, gid: int, run_options) -> bool:
        """Before a replay of ``gid`` from this thread: give the thread its own ORT capture if it has none yet
        (:func:`ortcapture._capture.capture_in_this_thread`). True when it did; False when the thread has it, or
        ``gid`` is not captured (the caller's path captures or raises). Raises like the registry's ``check`` for
        another IOBinding. Takes the capture guard itself."""
        if self._oc_thread_has(gid):
            return False
        from ortcapture._capture import capture_in_this_thread

        with self._oc_cguard:
            if self._oc_thread_has(gid) or self._oc_registry is None or gid not in self._oc_registry:
                return False
            if self._oc_registry.check(iobinding, gid) is None:  # pinned binding only
                return False
            capture_in_this_thread(self, iobinding, run_options)
            self._oc_thread_add(gid)
            return True

    def _oc_check_foreign_capture(self) -> None:
        """Raise :class:`CaptureError` when the caller's CUDA stream is being captured (ORT PR #32081)."""
        probe = self._oc_capture_probe
        if probe is not None:
            if probe():
                raise CaptureError(
                    "the calling thread's CUDA stream is being captured into another CUDA graph (e.g. inside "
                    "torch.cuda.graph()); running an ORT CUDA-graph session now ends in std::terminate "
                    "(ORT PR #32081). Run the ORT session outside the foreign capture."
                )

    # -- release / reset --------------------------------------------------------------------------------------
    def release_captured_graph(self, graph_annotation_id: int = 0) -> None:
        """Release a captured graph and unpin its IOBinding.

        WebGPU frees the graph and the id can be captured again. CUDA/TensorRT: ORT's release is a no-op (measured
        on onnxruntime-gpu 1.31.1: a new IOBinding run under the released id writes into the old buffers), so the
        id is retired — reusing it raises :class:`~ortcapture.errors.GraphReleasedError`; capture under a new id.
        """
        gid = check_graph_id(graph_annotation_id)
        with self._oc_guard:  # the family's lock first, then the sibling's (capture() takes them in that order)
            owner = next((s for s in self._oc_siblings.values()
                          if s._oc_registry is not None and gid in s._oc_registry), None)
            if owner is not None:  # captured by capture() on a shape-specialised sibling: release it there
                owner.release_captured_graph(gid)
                graph = self._oc_graphs.pop(gid, None)
                if graph is not None:
                    graph._on_released()
                return
        with self._oc_guard:
            rec = self._oc_registry.release(gid) if self._oc_registry is not None else None
            if compat.has_release_captured_graph():
                super().release_captured_graph(gid)
            graph = self._oc_graphs.pop(gid, None) if self._oc_family is self else None
            if rec is not None and rec.owner is not None:
                rec.owner._on_released()
            elif graph is not None:
                graph._on_released()

    def set_providers(self, providers=None, provider_options=None) -> None:
        """ORT's ``set_providers`` (recreates the C session); every captured graph is released and forgotten first,
        and the CapturedGraphs made from this session become unusable. Raises
        :class:`~ortcapture.errors.CaptureUnsupportedError` if the new providers request capture but do not give it; the
        session is then left as ORT made it, without capture (``capture_enabled`` False).
        """
        sess_options = self._oc_args[1]
        requested = requested_capture(providers, provider_options, sess_options if not providers else None)
        with self._oc_cguard:  # a new C session: no other CUDA work meanwhile
            for sess in (self, *self._oc_siblings.values()):
                if sess._oc_registry is not None:
                    for rec in sess._oc_registry.reset():
                        if rec.owner is not None:
                            rec.owner._on_released()
            for g in list(self._oc_graphs.values()):
                g._on_released()
            self._oc_graphs.clear()
            self._oc_siblings.clear()
            super().set_providers(providers, provider_options)
            self._oc_deferred = False
            try:
                self._oc_setup(requested)
            except Exception:
                # the C session was already replaced: describe what it really is (no capture), then report
                self._oc_requested = None
                self._oc_setup(None)
                raise
            self._oc_requested = requested

    # -- high level -------------------------------------------------------------------------------------------
    def capture(self, example_feeds: Mapping[str, Any], graph_id: int | None = None, *,
                state: Mapping[str, str] | None = None):
        """Capture a graph for ``example_feeds``' shapes and dtypes and return a
        :class:`~ortcapture.graph.CapturedGraph` (see there). ``graph_id``: a free ``gpu_graph_id`` is picked when
        ``None``. ``state``: ``{output name: input name}`` pairs carried from one replay to the next on the device.

        Where the model has dynamic input dims and ORT refused capture for them, the graph is captured on a sibling
        session with the same model, providers and options but those dims fixed (cached per shape signature).
        """
        from ortcapture.graph import CapturedGraph

        target = self._oc_specialized_for(example_feeds) if self._oc_deferred else self
        target._oc_require_capture("capture()")
        target._oc_check_foreign_capture()
        with self._oc_cguard:
            gid = self._oc_free_id() if graph_id is None else check_graph_id(graph_id)
            if gid < 0:
                raise CaptureError(f"gpu_graph_id must be >= 0 to capture, got {gid} (-1 means 'no capture')")
            registries = [s._oc_registry for s in self._oc_members() if s._oc_registry is not None]
            if any(gid in r for r in registries):
                raise CaptureError(f"gpu_graph_id={gid} is already captured; release it or pick another id")
            if any(gid in r.retired_ids for r in registries):
                raise GraphReleasedError(
                    f"gpu_graph_id={gid} was released, and this onnxruntime cannot free a captured "
                    f"{target.capture_info.ep.name} graph: capture under a new id (graph_id=None picks one)")
            graph = CapturedGraph(target, example_feeds, gid, state=state, family=self)
            self._oc_graphs[gid] = graph
            return graph

    def _oc_members(self):
        return (self, *self._oc_siblings.values())

    def _oc_free_id(self) -> int:
        gid = 0
        while True:
            taken = False
            for s in self._oc_members():
                reg = s._oc_registry
                if reg is not None and (gid in reg or gid in reg.retired_ids):
                    taken = True
            if not taken and gid not in self._oc_graphs:
                return gid
            gid += 1

    def _oc_specialized_for(self, feeds: Mapping[str, Any]) -> "InferenceSession":
        sig = shapes.shape_signature(shapes.feed_shapes(feeds))
        with self._oc_cguard:
            sib = self._oc_siblings.get(sig)
            if sib is None:
                path_or_bytes, sess_options, providers, provider_options, kwargs = self._oc_args
                sib = InferenceSession(path_or_bytes, sess_options, providers, provider_options,
                                       static_shapes=dict(sig), **kwargs)
                if sib.capture_info is None:
                    raise CaptureUnsupportedError(
                        f"even with input shapes fixed to {dict(sig)}, {self._oc_requested.ep.name} does not capture"
                    )
                sib._oc_family = self
                self._oc_siblings[sig] = sib
            return sib
