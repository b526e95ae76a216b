"""``ortcapture.InferenceSession``: a drop-in ``onnxruntime.InferenceSession`` whose every run path is capture-safe.

Capture is on when the user enabled it the ORT way (``enable_cuda_graph``, ``trt_cuda_graph_enable``,
``enableGraphCapture``; see :mod:`ortcapture._ort.providers`). With capture off this class behaves exactly like ORT.
With capture on, what ORT >= 1.30 guarantees for WebGPU only (ORT PR #32074) holds for every capture-capable EP:

* ``run``/``run_async``/``run_with_ort_values``/``run_with_ortvaluevector`` raise unless the run options set
  ``gpu_graph_id=-1`` (measured on CUDA: ``run()`` after a capture is accepted and replays stale buffers; after a
  release it fails with ``IndexError``);
* ``run_with_iobinding`` pins the IOBinding per ``gpu_graph_id`` (:mod:`ortcapture._core.registry`), refuses CPU-bound,
  ORT-allocated, foreign-device and input/output-aliased bindings, and serialises runs (ORT does not support
  concurrent ``Run`` under capture and does not enforce it);
* ``release_captured_graph`` retires CUDA/TensorRT ids (ORT's release is a no-op there; :meth:`InferenceSession.compact`
  frees them by rebuilding the C session) and ``set_providers`` forgets every graph.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Mapping, Sequence

import onnxruntime as ort

from ortcapture._ort import compat, compute_stream, cuda_probe
from ortcapture._ort.compute_stream import SessionStreams
from ortcapture._verify import inspect as _inspect
from ortcapture._ort import specialize as shapes
from ortcapture._core.binding import IOBinding
from ortcapture._ort.compat import OrtInferenceSession
from ortcapture._ort.model import ModelSource, external_folder
from ortcapture._session import buckets as _buckets_api
from ortcapture._session import capture as _capture
from ortcapture._session import memory as _memory_api
from ortcapture._ort.providers import CaptureInfo, detect_capture, device_kind, names_cuda_ep, normalize, requested_capture
from ortcapture._session.setup import (
    build_without_capture, check_version, constant_outputs_of, refuse_int64_arithmetic, refusal_text,
    trt_bucket_profiles, without_capture)
from ortcapture._core.run import GRAPH_ID_KEY, SKIP_GRAPH_ID, graph_id_of, run_bound, unsynchronised
from ortcapture._core.state import CaptureState
from ortcapture._ort.sync import (
    CUDA_GATE, FORKED_DEVICES, WEBGPU_LOCK, Origin, defer_sync, device_origin, hold, run_async_guarded)
from ortcapture._verify.compare import level_of
from ortcapture._session import plain as _plain
from ortcapture.errors import BindingError, CaptureError, CaptureUnsupportedError

_NULL = contextlib.nullcontext()


class InferenceSession(OrtInferenceSession):
    """Drop-in ``onnxruntime.InferenceSession`` with capture guards for CUDA, TensorRT and WebGPU graph capture.

    Takes exactly ``onnxruntime.InferenceSession``'s arguments, plus:

    Args:
        static_shapes: ``{input name: shape}`` — specialise the session to these input shapes up front (fixes the
            dims in the model), so the raw IOBinding path can capture models with dynamic dims.
        buckets: ``{dim_param or (input name, axis): [ascending sizes]}`` — plain :meth:`run` (and
            ``run_with_ort_values``) then replays captured graphs: the smallest bucket >= the request's dim, feeds
            padded with zeros (or ``pad_values``), outputs sliced back (see docs/BUCKETS.md). Needs capture
            requested. Plain runs carry no device state: a recurrent state or cache is an ordinary input, fed every
            call and padded like any input carrying a bucketed dim.
        pad_values: ``{input name: scalar}`` — what padded rows of that input hold (default 0), e.g. the pad token
            id, or 0 for an ``attention_mask``; cast to the input's dtype (a value that does not fit is refused).
            The output-axis probes and the verification replay pad with it too.
        output_axes: ``{output: {axis: dim or size function} or None}`` for outputs whose relation to a bucketed dim
            cannot be measured (otherwise decided by running the model uncaptured at two sizes).
        oversize: ``"uncaptured"`` (default: a request beyond the largest bucket runs uncaptured) or ``"split"``
            (chunks of the largest bucket).
        verify: ``True``/``"full"`` (default: example and a varied input set), ``"example"``, ``False``/``"off"``
            (see ortcapture._verify.compare): the default of :meth:`capture`'s ``verify=``, and the check of every new
            bucket graph against the uncaptured run of the unpadded feeds.
        max_graphs: at most this many bucket graphs, the least recently used released first (WebGPU frees it at
            once; ORT keeps a released CUDA graph's memory until the automatic :meth:`compact` rebuilds the session).
        replay_thread: one session-owned thread captures and replays for every caller (CUDA graphs are per thread).
        allow_int64_as_int32: WebGPU only. ORT's WebGPU EP runs int64 tensors as 32-bit in a session with
            ``enableGraphCapture=1`` (captured and ``gpu_graph_id=-1`` runs alike; measured, onnxruntime 1.32 +
            WebGPU plugin 0.4.0), so a model with nodes that *produce* int64 from int64 arithmetic (Add, Sub, Mul,
            CumSum, ReduceSum, Range, ... on values that are not shape arithmetic; see
            :mod:`ortcapture._verify.model_checks`) is refused, naming them, and so is one whose int64 constants
            (initializers, ``Constant`` nodes) beyond int32 are read as data by such nodes (``Where``, ``Max``,
            ``Gather`` indices; not ``Slice`` ends or ``Reshape`` shapes, which ORT reads on the host). ``True``
            accepts it: you promise every int64 value stays within int32. int64 host feeds for WebGPU buffers are
            range-checked either way.

    Raises:
        CaptureUnsupportedError: capture was requested but the session ended up without a capturing EP (measured:
            on ORT 1.30, ``providers=[("WebGpuExecutionProvider", ...)]`` silently yields a CPU-only session; add
            the plugin EP with ``SessionOptions.add_provider_for_devices``), or the installed ORT cannot capture on
            the requested EP; or, on WebGPU, the model produces int64 from int64 arithmetic or reads int64
            constants beyond int32 as data (``kind`` is ``"int64_as_int32"``, ``nodes`` names them) and
            ``allow_int64_as_int32`` is not set.
        CaptureError: bad ``buckets``/``output_axes``/``oversize``/``max_graphs``/``verify``/``pad_values``, or
            buckets without capture; or (``kind`` ``"fork"``) a session on a device (CUDA/TensorRT, WebGPU) made in a
            process that ``os.fork()`` made from one that had already used that device: ORT's device state is per
            process and does not survive fork, so its first run would hang (measured on WebGPU, ORT 1.32).

    Processes: a session with a device EP (anything but ORT's CPU EP) made before ``os.fork()`` cannot be used in
    the child — ORT and Dawn hang there on the first run, without a word (measured on WebGPU; CUDA does not support
    fork either). Every entry that would reach native code (runs, ``capture()``, graph replays, IOBinding copies,
    ``allocate()``, ``set_providers()``, ``compact()``, ``ortcapture.transfer`` copies of its device buffers)
    raises :class:`CaptureError` (``kind`` ``"fork"``) in the child instead, before any native call; releases there
    do nothing, and the session is never destroyed in the child (its destruction would hang too). Sessions on ORT's
    CPU EP keep working in the child. Use the ``spawn`` (or ``forkserver``) start method (docs/USAGE.md).

    When ORT refuses capture for the model's dynamic shapes (or inputs without shape information), the session is
    created without capture instead (``capture_deferred`` is then True) and :meth:`capture` specialises a sibling
    session to the example shapes. When it refuses otherwise, :class:`CaptureUnsupportedError` names the nodes ORT
    placed off the EP and the dtypes or non-tensor inputs/outputs it cannot take. On WebGPU, graph outputs that
    are views (Reshape, Flatten, Squeeze, Unsqueeze, Identity) are computed inside the graph by an added ``Cast``
    to their own type (ORT copies view outputs once at capture and never on replay); names, shapes, types and
    values of the outputs are unchanged.
    All capture bookkeeping lives in one per-session object (:class:`ortcapture._core.state.CaptureState`).
    """

    def __init__(
        self,
        path_or_bytes,
        sess_options: ort.SessionOptions | None = None,
        providers: Sequence[Any] | None = None,
        provider_options: Sequence[Mapping[str, Any]] | None = None,
        *,
        static_shapes: Mapping[str, Sequence[int]] | None = None,
        buckets: Mapping[Any, Sequence[int]] | None = None,
        output_axes: Mapping[str, Any] | None = None,
        oversize: str = "uncaptured",
        verify: Any = True,
        max_graphs: int | None = None,
        replay_thread: bool = False,
        pad_values: Mapping[str, Any] | None = None,
        allow_int64_as_int32: bool = False,
        _oc_family: CaptureState | None = None,
        **kwargs,
    ) -> None:
        self._oc_verify = level_of(verify)
        self._oc_allow_int64 = bool(allow_int64_as_int32)
        self._oc_ref_cache: dict = {}  # the EP-accuracy check's CPU EP session, once (ortcapture._core.reference)
        self._oc_lock = threading.RLock()
        self._oc_refusal: str | None = None
        self._oc_providers = (providers, provider_options)  # what the C session was last built with
        self._oc_streams = SessionStreams(self)  # the CUDA EP's compute stream, ortcapture's own (see there)
        requested = requested_capture(providers, provider_options, sess_options)
        if FORKED_DEVICES:  # an os.fork() child of a device user: refused before ORT builds anything (see Origin)
            self._oc_refuse_forked(providers, requested)
        # the model as it is now: every later build (siblings, references, rebuilds) starts from it (ortcapture._ort.model)
        source = path_or_bytes if isinstance(path_or_bytes, ModelSource) else \
            ModelSource(path_or_bytes, keep=requested is not None)
        self._oc_args = (source, sess_options, providers, provider_options, dict(kwargs))
        if (requested is not None or static_shapes or buckets is not None) and not source.readable():
            # a model ortcapture cannot read or parse: ORT's own constructor says why, with ORT's exception and
            # message (NoSuchFile, InvalidProtobuf, ...), as a raw onnxruntime.InferenceSession would
            OrtInferenceSession(source.given, sess_options, providers, provider_options, **kwargs)
        check_version(requested)
        if buckets is not None and requested is not None and requested.ep.name == "TensorrtExecutionProvider":
            providers, provider_options = trt_bucket_profiles(source, buckets, providers, provider_options)
        model = shapes.fix_input_shapes(source, static_shapes) if static_shapes else source
        if requested is not None and requested.device_type == "webgpu":
            model = _inspect.rewrite_view_outputs(model)  # view outputs computed inside the graph (_inspect)
        static_sig = shapes.shape_signature(static_shapes) if static_shapes else None
        if requested is not None and requested.device_type == "webgpu" and not self._oc_allow_int64:
            refuse_int64_arithmetic(model)
        # ORT gets what the caller gave, unless ortcapture rewrote it: then the graph's bytes, with the folder of
        # the model's external data (the rewrite keeps the weights on disk)
        rewritten = model is not source
        model = model if rewritten else source.given
        self._oc_folder = source.build_kwargs()["folder"]
        with external_folder(sess_options, self._oc_folder if rewritten else None) as build_options:
            deferred = self._oc_build(model, build_options, providers, provider_options, kwargs, requested,
                                      static_shapes, static_sig, source)
        self._oc_setup(requested, deferred, static_sig, _oc_family)
        self._oc_origin.check("InferenceSession()")  # made in an os.fork() child on a device its parent used
        self._oc_bucket_args = dict(output_axes=output_axes, oversize=oversize, verify=verify,
                                    max_graphs=max_graphs, replay_thread=replay_thread, pad_values=pad_values)
        self._oc_buckets = None
        if buckets is not None:
            self._oc_buckets = self._oc_new_buckets(buckets)
        elif (output_axes is not None or oversize != "uncaptured" or max_graphs is not None or replay_thread
              or pad_values is not None):
            raise CaptureError("output_axes=, oversize=, max_graphs=, replay_thread= and pad_values= go with buckets=")
        self._oc_buckets_spec = buckets

    def _oc_build(self, model, sess_options, providers, provider_options, kwargs, requested, static_shapes,
                  static_sig, source) -> bool:
        """ORT's constructor (capture deferred where ORT refuses it for dynamic dims); True when deferred."""
        deferred = False
        if requested is not None:
            # ORT silently falls back to the CPU EP when a session fails to build; under capture that fallback
            # hides the failure, so it is off unless the caller asked for it.
            kwargs.setdefault("enable_fallback", 0)
        # building a CUDA session allocates and initialises on the device: never while another thread captures
        cuda = (requested is not None and requested.device_type == "cuda") or names_cuda_ep(providers)
        if cuda:  # once per process: onnxruntime.preload_dlls() where NVIDIA's pip packages are installed, and why
            cuda_probe.status()  # the CUDA EP would not load (told if the session then runs without capture)
        with CUDA_GATE.exclusive if cuda else _NULL:
            try:
                self._oc_create(model, sess_options, providers, provider_options, kwargs, requested, static_sig)
            except Exception as exc:  # noqa: BLE001 - ORT raises its own Fail/EPFail types, not RuntimeError
                if requested is None or not shapes.is_capture_refusal(exc):
                    raise
                if static_shapes or not shapes.specializable_inputs(_inspect.load_structure(source)):
                    why = "" if static_shapes else " (it has no dynamic input dims to specialise)"
                    raise CaptureUnsupportedError(
                        refusal_text(model, sess_options, providers, provider_options, kwargs, requested,
                                     static_shapes) + f" ORT said{why}: {exc}"
                    ) from exc
                self._oc_init_deferred(model, sess_options, providers, provider_options, kwargs, requested)
                deferred = True
                self._oc_refusal = str(exc)
        return deferred

    # -- construction helpers -------------------------------------------------------------------------------
    @staticmethod
    def _oc_refuse_forked(providers, requested: CaptureInfo | None) -> None:
        """In an ``os.fork()`` child of a process that had sessions on a device: raise :class:`CaptureError`
        (``kind`` ``"fork"``) for a session asking for that device, where it is known before ORT builds (the
        requested capture EP, an EP named in ``providers=``); a device EP added through the session options is
        refused once built (``_oc_setup``'s origin)."""
        names = {n for n, _ in normalize(providers, None)} | ({requested.ep.name} if requested is not None else set())
        eps = sorted(n for n in names if device_kind(n) in FORKED_DEVICES)
        if eps:
            Origin(eps, sorted({device_kind(n) for n in eps}), inherited=False).check("InferenceSession()")

    def _oc_create(self, model, sess_options, providers, provider_options, kwargs, requested, static_sig) -> None:
        """ORT's constructor. A WebGPU capture request for a model with dynamic input dims is first tried quietly:
        ORT refuses it at creation with an ``[E:onnxruntime...]`` log line ("cannot use the graph capture feature")
        that is expected here (ortcapture then defers, :meth:`_oc_init_deferred`); when ORT accepts, the session is
        built again at the caller's log severity. Which sessions capture or defer does not change."""
        quiet = (requested is not None and requested.device_type == "webgpu" and static_sig is None
                 and sess_options is not None and sess_options.log_severity_level < 4
                 and shapes.specializable_inputs(_inspect.load_structure(model)))
        if quiet:
            level = sess_options.log_severity_level
            sess_options.log_severity_level = 4  # fatal only: hides ORT's refusal line
            try:
                OrtInferenceSession.__init__(self, model, sess_options, providers, provider_options, **kwargs)
            finally:
                sess_options.log_severity_level = level
        OrtInferenceSession.__init__(self, model, sess_options, providers, provider_options, **kwargs)

    def _oc_init_deferred(self, model, sess_options, providers, provider_options, kwargs, requested) -> None:
        """Create this session without capture; :meth:`capture` will specialise siblings that capture."""
        build_without_capture(self, model, sess_options, providers, provider_options, kwargs, requested)

    def _oc_setup(self, requested: CaptureInfo | None, deferred: bool, static_sig, family=None) -> None:
        check_version(requested)
        info = None if deferred else detect_capture(self, requested)
        if requested is not None and info is None and not deferred:
            load = cuda_probe.status(requested.ep.name) if requested.device_type == "cuda" else None
            if load is not None and not load.offered:
                why = (f"this onnxruntime has no {requested.ep.name} (install onnxruntime-gpu, e.g. pip install "
                       "'ortcapture[cuda]', on a machine with an NVIDIA GPU)")
            elif load is not None and not load.loads:
                why = load.refusal  # ORT logged the failed load and made a CPU session
            else:
                why = ("on ORT 1.30 naming a plugin EP in providers=[...] can silently give a CPU-only session: "
                       "register the plugin library and add it with SessionOptions.add_provider_for_devices("
                       "[ep_device], {...}) (ortcapture.webgpu.session_options does); check `ortcapture doctor`")
            raise CaptureUnsupportedError(
                f"graph capture was requested for {requested.ep.name}, but the session runs on "
                f"{self.get_providers()} without capture: {why}."
            )
        eps = [p for p in self.get_providers() if device_kind(p) is not None]
        #: where this C session was made: in an os.fork() child every native entry raises (ortcapture._ort.sync)
        self._oc_origin = device_origin(eps, sorted({device_kind(p) for p in eps}))
        hold(self, self._oc_origin)  # never destroyed in a fork child (its destruction would reach the device)
        old = getattr(self, "_oc_state", None)
        self._oc_state = CaptureState(self, info, requested, deferred, static_sig, self._oc_lock, family,
                                      self._oc_origin)
        self._oc_state.constant_outputs = constant_outputs_of(self._oc_args[0], static_sig)
        self._oc_state.rebuild_session = self._oc_rebuild_c_session
        self._oc_state.check_model = self._oc_check_model
        self._oc_state.compute_stream = self._oc_compute_stream
        if old is not None:  # set_providers: the compaction threshold stays
            self._oc_state.ledger.threshold = old.ledger.threshold

    def _create_inference_session(self, providers, provider_options, *args, **kwargs):
        """ORT's C session build (the constructor, ``set_providers`` and every rebuild call it), with a compute
        stream of ortcapture's own for a CUDA-graph session (:mod:`ortcapture._ort.compute_stream`)."""
        streams = self.__dict__.get("_oc_streams")
        if streams is None:
            return compat.create_inference_session(self, providers, provider_options, *args, **kwargs)
        providers, provider_options, stream = streams.providers_for(providers, provider_options)
        streams.given = None  # until ORT has built it
        result = compat.create_inference_session(self, providers, provider_options, *args, **kwargs)
        streams.built(compat.c_session(self), stream)
        return result

    def get_provider_options(self):
        """ORT's ``get_provider_options()``, as the caller configured the session: where the CUDA EP runs on
        ortcapture's own compute stream, its ``user_compute_stream`` reads ``"0"`` as without ortcapture (see
        :attr:`compute_stream`)."""
        streams = self.__dict__.get("_oc_streams")
        reported = OrtInferenceSession.get_provider_options(self)
        return compute_stream.hide(reported, streams.given) if streams is not None else reported

    @property
    def compute_stream(self) -> int | None:
        """The CUDA stream (``cudaStream_t`` as an int) on which ORT's CUDA EP runs this session, where it is known
        and the CUDA EP is the session's one EP with a stream: ortcapture's own for a CUDA-graph session (created
        through cuda-python, non-blocking, as ORT's own would be; ``ORTCAPTURE_COMPUTE_STREAM=0``: none) or the
        caller's ``user_compute_stream``; ``None`` otherwise (ORT's own stream; TensorRT or another GPU EP beside
        it; no C session). ORT synchronises it at the end of every run. A captured graph queues its
        device-to-device feed copies on it instead of waiting for each (``CapturedGraph.run``)."""
        providers = self.get_providers() or []
        if not compute_stream.single_cuda_ep(providers):
            return None
        return compute_stream.stream_of(OrtInferenceSession.get_provider_options(self))

    def _oc_compute_stream(self):
        """``(stream, event, device)`` for a captured graph's feed copies, or ``None`` (see :attr:`compute_stream`)."""
        if self.compute_stream is None:
            return None
        return self._oc_streams.current(OrtInferenceSession.get_provider_options(self))

    def _oc_rebuild_c_session(self) -> None:
        """ORT's re-creation of the C session (``compact()``), from the model as it was loaded (ORT's
        ``_reset_session`` would read ``_model_path`` again)."""
        source = self._oc_args[0]
        compat.rebuild_c_session(self, *self._oc_providers, model=source.data, folder=self._oc_folder)

    def _oc_check_model(self, what: str = "rebuild the C session") -> None:
        """Raise :class:`CaptureError` when the model's external data files changed or are gone since construction
        (:meth:`ortcapture._ort.model.ModelSource.check_external`)."""
        self._oc_args[0].check_external(what)

    # -- capture state ----------------------------------------------------------------------------------------
    @property
    def capture_enabled(self) -> bool:
        """True when this session's runs capture and replay CUDA/TensorRT/WebGPU graphs."""
        return self._oc_state.info is not None

    @property
    def capture_deferred(self) -> bool:
        """``True`` when capture was requested but ORT refused it for the model's dynamic shapes; :meth:`capture`
        then captures on a sibling session specialised to the example shapes."""
        return self._oc_state.deferred

    @property
    def capture_refusal(self) -> str | None:
        """ORT's message when it refused capture for the model as given (why the session defers), else ``None``."""
        return self._oc_refusal

    @property
    def requested_capture(self) -> CaptureInfo | None:
        """The capture the providers/options asked for (EP and device ordinal), whether or not the session captures
        itself (a capture-deferred session captures on shape-specialised siblings); ``None`` when none was asked."""
        return self._oc_state.requested

    @property
    def static_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """``{input name: shape}`` this session was specialised to (``static_shapes=``, or by :meth:`capture` for a
        shape-specialised sibling); ``None`` when its input dims are the model's own."""
        sig = self._oc_state.static_shapes
        return dict(sig) if sig else None

    @property
    def capture_info(self) -> CaptureInfo | None:
        """The capturing EP and device ordinal, or ``None``."""
        return self._oc_state.info

    @property
    def captured_graphs(self) -> dict[int, dict]:
        """``gpu_graph_id`` -> pinned inputs/outputs (device, shape, type), bytes and replay count, for this session
        and its shape-specialised siblings (ids are unique across them)."""
        return self._oc_state.describe()

    def _oc_require_capture(self, what: str) -> None:
        if self._oc_state.info is None:
            raise CaptureUnsupportedError(
                f"{what} needs a session with graph capture enabled (enable_cuda_graph=1, trt_cuda_graph_enable=1 "
                "or enableGraphCapture=1)" + (
                    "; this session defers capture to shape-specialised siblings: use sess.capture(feeds)"
                    if self._oc_state.deferred else "")
            )

    # -- buffers ----------------------------------------------------------------------------------------------
    allocate = _memory_api.allocate  # defined in ortcapture._session.memory

    def io_binding(self) -> IOBinding:
        """An :class:`ortcapture.IOBinding` (an ``onnxruntime.IOBinding`` that records what it binds).

        Raises:
            CaptureError: (``kind`` ``"fork"``) in an ``os.fork()`` child of the process that made a device session
                (its runs and copies would hang there: ORT's device state does not survive fork).
        """
        return IOBinding(self)

    # -- guarded run paths ------------------------------------------------------------------------------------
    def _oc_check_fork(self, what: str) -> None:
        """Raise :class:`CaptureError` (``kind`` ``"fork"``) when this is an ``os.fork()`` child of the process that
        made this device session (:class:`ortcapture._ort.sync.Origin`); one truth test elsewhere."""
        if FORKED_DEVICES:
            self._oc_origin.check(what)

    def _oc_check_plain_run(self, api: str, run_options) -> bool:
        """Raise unless a plain run is safe here; True when it must hold the session guard (a capture session, or
        any CUDA-based session: its runs must not overlap another thread's capture, see ``ortcapture._ort.sync``).
        In an ``os.fork()`` child of the process that made a device session: :class:`CaptureError` (``kind``
        ``"fork"``; ORT and Dawn would hang on the run)."""
        if FORKED_DEVICES:  # an os.fork() child: refused before any native call (ortcapture._ort.sync.Origin)
            self._oc_origin.check(f"{api}()")
        st = self._oc_state
        if st.info is None:
            return st.deferred or st.gpu_guarded  # deferred: siblings capture under the same lock
        if graph_id_of(run_options) != SKIP_GRAPH_ID:
            raise CaptureError(
                f"{api}() on a session with {st.info.ep.name} graph capture would capture or replay with "
                "transient buffers: replay re-issues the device buffers recorded at capture and ignores new feeds. "
                "Use sess.capture(feeds) (or run_with_iobinding with fixed buffers), or set the run option "
                f"{GRAPH_ID_KEY}=-1 to run this call without capture."
            )
        return True

    # Plain runs (gpu_graph_id=-1) of a capturing or capture-deferred session take the session lock too: ORT does not
    # support them concurrently with capture/replay (measured on WebGPU: SIGSEGV / SIGABRT beside CapturedGraph.run).
    def run(self, output_names, input_feed, run_options=None):
        """ORT's ``run``. With ``buckets=``: served from the bucket's captured graph (padded, replayed, sliced; see
        :meth:`bucket_stats`); ``gpu_graph_id=-1`` runs uncaptured, any other ``gpu_graph_id`` raises
        :class:`CaptureError`. Without buckets on a capturing session only ``gpu_graph_id=-1`` is allowed.

        Raises:
            CaptureError: a ``gpu_graph_id`` other than -1 on a capturing session (ORT would capture or replay the
                transient buffers of this call); or (``kind`` ``"fork"``) a device session (CUDA/TensorRT, WebGPU)
                used in an ``os.fork()`` child of the process that made it — ORT's device state does not survive
                fork, and the raw run would hang without a word (measured on WebGPU, ORT 1.32). Use the ``spawn``
                start method, or make sessions after forking.
        """
        if self._oc_buckets is not None:
            if FORKED_DEVICES:  # before the bucket runner (its replay thread, if any, did not survive the fork)
                self._oc_origin.check("run()")
            return self._oc_buckets.run(output_names, input_feed, run_options)
        return self._oc_plain_run(output_names, input_feed, run_options)

    def _oc_plain_run(self, output_names, input_feed, run_options=None, ort_values: bool = False):
        if ort_values:
            if self._oc_check_plain_run("run_with_ort_values", run_options):
                with self._oc_state.guard:
                    return super().run_with_ort_values(output_names, input_feed, run_options)
            return super().run_with_ort_values(output_names, input_feed, run_options)
        input_feed = self._oc_plain_feeds(input_feed)  # None, byte order, WebGPU's limits
        if self._oc_check_plain_run("run", run_options):
            with self._oc_state.guard:
                return super().run(output_names, input_feed, run_options)
        return super().run(output_names, input_feed, run_options)

    def run_async(self, output_names, input_feed, callback, user_data, run_options=None):
        """ORT's ``run_async``: returns once the run is queued; ``callback(outputs, user_data, err)`` gets ORT's
        outputs (a list of numpy arrays; ``[]`` and ORT's message in ``err`` when the run failed). On a capturing
        session only with ``gpu_graph_id=-1``.

        Serialised like :meth:`run` wherever :meth:`run` takes the session guard (capturing and capture-deferred
        sessions, every CUDA-based session): ORT runs the request on its own threads, outside any Python lock —
        measured on WebGPU (ORT 1.32, software adapter) beside another session's replays: Dawn "Command encoding
        already finished", ``RuntimeError`` s in the other thread and a segfault; on CUDA another thread's capture
        can fail with CUDA error 901. So a helper thread takes the guard (the WebGPU lock, or the CUDA capture gate's
        shared side and the session lock), starts ORT's ``run_async`` and holds the guard until ORT's callback has
        run; then it calls ``callback`` (on that helper thread, not ORT's). This call waits until the run is queued
        (as :meth:`run` waits for the guard), so what ORT raises at once (missing inputs, feeds it cannot convert)
        is raised here, as ORT raises it."""
        input_feed = self._oc_plain_feeds(input_feed)
        if not self._oc_check_plain_run("run_async", run_options):
            return super().run_async(output_names, input_feed, callback, user_data, run_options)

        def start(done):
            OrtInferenceSession.run_async(self, output_names, input_feed, done, None, run_options)

        run_async_guarded(self._oc_state.guard, start, callback, user_data)

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):
        """ORT's ``run_with_ort_values`` (feeds and results are OrtValues). With ``buckets=``: served from the
        bucket's captured graph, as :meth:`run`; otherwise, on a capturing session, only with ``gpu_graph_id=-1``
        (serialised with captures and replays).

        Raises:
            CaptureError: another ``gpu_graph_id`` on a capturing session (ORT would capture or replay on the
                transient buffers of this call and ignore later feeds); (``kind`` ``"fork"``) a device session used
                in an ``os.fork()`` child of the process that made it (as :meth:`run`).
        """
        if self._oc_buckets is not None:
            if FORKED_DEVICES:
                self._oc_origin.check("run_with_ort_values()")
            return self._oc_buckets.run(output_names, input_dict_ort_values, run_options, ort_values=True)
        return self._oc_plain_run(output_names, input_dict_ort_values, run_options, True)

    def run_with_ortvaluevector(self, run_options, feed_names, feeds, fetch_names, fetches, fetch_devices):
        """ORT's ``run_with_ortvaluevector`` (its low-level ``OrtValueVector`` run); on a capturing session only
        with ``gpu_graph_id=-1`` (serialised with captures and replays).

        Raises:
            CaptureError: another ``gpu_graph_id`` on a capturing session (transient buffers, as for :meth:`run`);
                (``kind`` ``"fork"``) a device session used in an ``os.fork()`` child of the process that made it.
        """
        if self._oc_check_plain_run("run_with_ortvaluevector", run_options):
            with self._oc_state.guard:
                return super().run_with_ortvaluevector(run_options, feed_names, feeds, fetch_names, fetches,
                                                       fetch_devices)
        return super().run_with_ortvaluevector(run_options, feed_names, feeds, fetch_names, fetches, fetch_devices)

    def run_with_iobinding(self, iobinding, run_options=None):
        """ORT's ``run_with_iobinding``, with the graph registry's checks when capture is on.

        The first run of a ``gpu_graph_id`` captures (ORT runs the model a few times inside that call) and pins
        the IOBinding; later runs replay it. ``gpu_graph_id=-1`` runs without capture.

        Raises:
            BindingError: another or a changed IOBinding under a captured id, a CPU-bound (``bind_cpu_input``) or
                ORT-allocated output, a buffer on another device, or an input and output sharing one buffer; an
                IOBinding made before :meth:`compact` or :meth:`set_providers` replaced the C session (or made for
                another session).
            GraphReleasedError: a retired id (CUDA/TensorRT release is a no-op in ORT).
            CaptureError: a foreign CUDA graph capture is in progress — torch's current stream (inside
                ``torch.cuda.graph()``) or a blocking stream of the calling thread's current CUDA device, from any
                thread (ORT PR #32081).
            CaptureAbortedError: a capturing run failed inside ORT (e.g. ``RunOptions.terminate``); the id was
                released in ORT (WebGPU, ORT >= 1.30: capture it again) or retired (CUDA/TensorRT).
            CaptureError: (``kind`` ``"fork"``) a device session used in an ``os.fork()`` child of the process that
                made it: ORT's device state does not survive fork (the run would hang or crash without a word).

        With the run option ``disable_synchronize_execution_providers=1`` ORT returns before the device finished the
        run, as ORT documents; ortcapture's own readers and writers (``to_numpy``, ``update_inplace``, ``copy``,
        ``CapturedGraph.run``) then first wait for it (ORT's ``IOBinding.synchronize_outputs()``). ORT's own reads
        (``OrtValue.numpy()``, ``copy_outputs_to_cpu()``) do not: synchronise before them yourself.
        """
        if FORKED_DEVICES:  # an os.fork() child: refused before any native call (ortcapture._ort.sync.Origin)
            self._oc_origin.check("run_with_iobinding()")
        result = self._oc_run_with_iobinding(iobinding, run_options)
        if run_options is not None and unsynchronised(run_options):
            st = self._oc_state
            kind = "webgpu" if st.lock is WEBGPU_LOCK else "cuda" if st.gpu_guarded else None
            if kind is not None:
                defer_sync(iobinding, kind)
        return result

    def _oc_check_binding_session(self, iobinding) -> None:
        """Raise :class:`BindingError` for an IOBinding made for another C session. Not needed before a replay: the
        registry pins a graph's binding per C session (a rebuild starts a new registry), so a pinned binding is
        this C session's."""
        made_for = compat.binding_c_session(iobinding)
        if made_for is not None and made_for is not compat.c_session(self):
            raise BindingError(
                "this IOBinding was made for a C session that sess.compact() or set_providers() replaced since (or "
                "for another session): ORT runs an IOBinding only on the C session it was made from (before ORT 1.30 "
                "it would reach the old one). Make a new one with sess.io_binding() and bind the buffers again."
            )

    def _oc_run_with_iobinding(self, iobinding, run_options):
        st = self._oc_state
        if st.info is None:
            self._oc_check_binding_session(iobinding)
            if not st.deferred:
                if st.gpu_guarded:
                    with st.guard:
                        return run_bound(self, iobinding, run_options)
                return run_bound(self, iobinding, run_options)
            if graph_id_of(run_options) != SKIP_GRAPH_ID:
                raise CaptureUnsupportedError(
                    f"this session cannot capture: {st.requested.ep.name} refused graph capture for the model's "
                    "dynamic input dims, so a raw IOBinding run here would silently run uncaptured and unguarded. "
                    "Create the session with static_shapes={name: shape} to capture through IOBinding, use "
                    f"sess.capture(feeds), or set {GRAPH_ID_KEY}=-1 for an uncaptured run."
                )
            with st.guard:
                return run_bound(self, iobinding, run_options)
        gid = graph_id_of(run_options)
        if gid == SKIP_GRAPH_ID:
            self._oc_check_binding_session(iobinding)
            with st.guard:
                return run_bound(self, iobinding, run_options)
        if not isinstance(iobinding, IOBinding):
            raise BindingError(
                "graph capture needs an IOBinding from sess.io_binding() (ortcapture records what it binds to pin "
                "it per gpu_graph_id); got a plain onnxruntime.IOBinding"
            )
        st.check_foreign_capture()
        if not st.thread_has(gid):
            st.ensure_thread(iobinding, gid, run_options)
        while True:
            exclusive = gid not in st.registry  # a first capture excludes all other CUDA work
            with st.capture_guard if exclusive else st.guard:
                rec = st.registry.check(iobinding, gid)
                if rec is None:
                    if not exclusive:
                        continue  # released and free again (WebGPU) since the look above: capture exclusively
                    self._oc_check_binding_session(iobinding)
                    st.capture(iobinding, gid, run_options)
                    return None
                st.replay(iobinding, run_options, rec)
                return None

    # -- release / reset: graph release and memory, methods defined in ortcapture._session.memory ------------------
    release_captured_graph = _memory_api.release_captured_graph
    compact = _memory_api.compact
    compact_threshold = _memory_api.compact_threshold
    graph_memory = _memory_api.graph_memory

    def set_providers(self, providers=None, provider_options=None) -> None:
        """ORT's ``set_providers`` (recreates the C session); every captured graph is released and forgotten first,
        and the CapturedGraphs made from this session become unusable.

        Raises:
            CaptureUnsupportedError: the new providers request capture but do not give it; the session is then left
                as ORT made it, without capture (``capture_enabled`` False).
            CaptureError: (``kind`` ``"fork"``) in an ``os.fork()`` child of the process that made a device session
                (ORT would destroy the parent's C session: a hang), before anything is touched; or new providers on
                a device the parent process had in use (the session is then left unusable: each use raises so); or
                providers that request no capture for a session with ``buckets=`` (before anything is touched).

        When ORT refuses capture for the model's dynamic dims, the session is made without capture and defers to
        shape-specialised siblings (``capture_deferred``), as the constructor does.
        """
        if FORKED_DEVICES:  # an os.fork() child: refused before any native call (ortcapture._ort.sync.Origin)
            self._oc_origin.check("set_providers()")
        sess_options = self._oc_args[1]
        requested = requested_capture(providers, provider_options, sess_options if not providers else None)
        if FORKED_DEVICES:
            self._oc_refuse_forked(providers, requested)
        self._oc_check_model("rebuild the C session (set_providers)")  # before anything is touched
        if self._oc_buckets_spec is not None and requested is None:  # refused before the C session is replaced
            raise CaptureError("set_providers(): a session made with buckets= needs providers that request graph "
                               "capture; these do not (the session is left as it was)")
        st = self._oc_state
        with st.capture_guard:  # a new C session: no other CUDA work meanwhile
            st.reset()
            self._oc_providers = (providers, provider_options)
            deferred = self._oc_set_providers(providers, provider_options, requested)
            try:
                self._oc_setup(requested, deferred, st.static_shapes)
                if self._oc_buckets_spec is not None:  # the graphs went with the old C session (or none was left)
                    if self._oc_buckets is not None:
                        self._oc_buckets.close()
                    self._oc_buckets = None
                    self._oc_buckets = self._oc_new_buckets(self._oc_buckets_spec)
            except Exception:
                # the C session was already replaced: describe what it really is (no capture), then report
                self._oc_setup(None, False, st.static_shapes)
                raise
        self._oc_origin.check("set_providers()")  # a device EP from the session options, its parent's device

    _oc_plain_feeds = _plain.oc_plain_feeds
    # -- buckets: methods defined in ortcapture._session.buckets --------------------------------------------------
    _oc_bucket_reference = _buckets_api.oc_bucket_reference
    _oc_new_buckets = _buckets_api.oc_new_buckets
    warmup = _buckets_api.warmup
    run_on_replay_thread = _buckets_api.run_on_replay_thread
    bucket_stats = _buckets_api.bucket_stats
    bucket_dims = _buckets_api.bucket_dims
    bucket_output_axes = _buckets_api.bucket_output_axes

    def _oc_set_providers(self, providers, provider_options, requested) -> bool:
        """ORT's ``set_providers``; when ORT refuses capture for the model's dynamic dims, the session is made
        without capture and defers to shape-specialised siblings, as the constructor does. True when deferred."""
        path_or_bytes, sess_options, _, _, kwargs = self._oc_args
        if requested is not None:
            path_or_bytes.keep()  # capture from now on: later builds start from the model as it is now
        model = path_or_bytes.data  # the model as it was loaded (None: a session without capture keeps ORT's way)
        try:
            with compat.built_from(self, model, self._oc_folder):
                OrtInferenceSession.set_providers(self, providers, provider_options)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own Fail type
            if (requested is None or not providers or not shapes.is_capture_refusal(exc)
                    or self._oc_state.static_shapes
                    or not shapes.specializable_inputs(_inspect.load_structure(path_or_bytes))):
                raise
            with compat.built_from(self, model, self._oc_folder):
                OrtInferenceSession.set_providers(self, without_capture(providers, provider_options, requested),
                                                  None)
            self._oc_refusal = str(exc)
            self._oc_args = (path_or_bytes, sess_options, providers, provider_options, kwargs)
            return True
        if providers:  # siblings are made with the session's current providers
            self._oc_args = (path_or_bytes, sess_options, providers, provider_options, kwargs)
        self._oc_refusal = None
        return False

    # -- high level -------------------------------------------------------------------------------------------
    # capture and the uncaptured graph: methods defined in ortcapture._session.capture
    capture = _capture.capture
    uncaptured_graph = _capture.uncaptured_graph

    def _oc_specialized_for(self, feeds: Mapping[str, Any]) -> CaptureState:
        from ortcapture._core.specs import example_specs

        inputs = {m.name for m in self.get_inputs()}  # overridable initializers keep their shapes
        # the feeds are checked as the capture checks them (missing inputs and types named) before a sibling is built
        specs = example_specs(self, feeds)
        sig = shapes.shape_signature({n: shape for n, (shape, _) in specs.items() if n in inputs})
        fam = self._oc_state
        with fam.capture_guard:
            sib = fam.siblings.get(sig)
            if sib is None:
                path_or_bytes, sess_options, providers, provider_options, kwargs = self._oc_args
                self._oc_check_model("build a shape-specialised session for these shapes")
                sess = InferenceSession(path_or_bytes, sess_options, providers, provider_options,
                                        static_shapes=dict(sig), allow_int64_as_int32=self._oc_allow_int64,
                                        _oc_family=fam, **kwargs)
                if sess.capture_info is None:
                    raise CaptureUnsupportedError(
                        f"even with input shapes fixed to {dict(sig)}, {fam.requested.ep.name} does not capture"
                    )
                sib = fam.siblings[sig]  # the sibling's state joined the family (CaptureState)
            return sib
