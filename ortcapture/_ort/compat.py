"""What the installed onnxruntime can do, and the one module that touches ORT's own internals.

* Features and versions: every other module asks here instead of comparing version strings itself. Probes are
  cached; they never touch a GPU (a WebGPU probe that finds no adapter makes ORT call ``std::terminate``, so
  adapter probes run in a child process: :func:`ortcapture.webgpu.probe`).
* ORT's own classes and functions (:data:`OrtInferenceSession`, :data:`OrtIOBinding`, :data:`OrtValue`, ...), taken
  at import from where ORT defines them (``onnxruntime.capi.onnxruntime_inference_collection``) and never looked up
  through the ``onnxruntime`` module at call time: code that replaces ``onnxruntime.InferenceSession`` (with
  ortcapture's own session, for libraries that build sessions themselves) must not make ortcapture call itself
  (measured before: ``RecursionError`` on the first capture).
* The private attributes of ORT's Python objects (the C session, C OrtValue, C IOBinding) are read only here
  (:func:`c_session`, :func:`c_value`, :func:`c_binding`, :func:`c_device`, :func:`view_fields`), and torch's
  (:func:`torch_capture_query`: its CUDA-initialised flag and C capture query, one frame per replay).
"""
from __future__ import annotations

import contextlib

import functools
import importlib.util
import re

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as _C
from onnxruntime.capi import onnxruntime_inference_collection as _oic

#: ORT's Python classes, as ORT defines them (not whatever ``onnxruntime.<name>`` is bound to later)
OrtInferenceSession = _oic.InferenceSession
OrtIOBinding = _oic.IOBinding
OrtValue = _oic.OrtValue
OrtDevice = _oic.OrtDevice
#: the C-level classes behind them
C_OrtValue = _C.OrtValue
C_OrtDevice = _C.OrtDevice
#: ORT's Python ``run_with_iobinding`` (on ORT >= 1.30 it carries ORT's own WebGPU capture guards, ORT PR #32074):
#: the only way ortcapture's core runs a session (:func:`ortcapture._core.run.run_bound`)
ORT_RUN_WITH_IOBINDING = OrtInferenceSession.run_with_iobinding
#: ``onnxruntime.copy_tensors(src, dst, stream)``, or ``None`` before ORT 1.24
ort_copy_tensors = getattr(_oic, "copy_tensors", None)


def c_session(session: OrtInferenceSession):
    """The C ``InferenceSession`` behind a Python session (ORT's ``_sess``)."""
    return session._sess


def binding_c_session(binding):
    """The C ``InferenceSession`` an IOBinding was made for: ortcapture's ``IOBinding`` records it
    (``_oc_c_session``); ORT >= 1.30's own keeps it as ``_session``; ``None`` when neither says."""
    got = getattr(binding, "_oc_c_session", None)
    return got if got is not None else getattr(binding, "_session", None)


def c_value(value: OrtValue):
    """The C ``OrtValue`` behind a Python OrtValue (ORT's ``_ortvalue``)."""
    return value._ortvalue


def view_fields(attr: str) -> tuple:
    """ORT's own fields of an ``OrtValue`` (``_ortvalue``, ``_session``, ``_numpy_obj``) for a subclass whose instances
    skip ``OrtValue.__init__`` and view another OrtValue held in their attribute ``attr`` (ortcapture's
    ``ReplayOutput``): ``(_ortvalue, _session, _numpy_obj)`` class attributes — the first two read through to that
    value's by C-level getters (no Python frame), the third ``None`` (such an instance keeps no numpy array alive)."""
    from operator import attrgetter

    return property(attrgetter(f"{attr}._ortvalue")), property(attrgetter(f"{attr}._session")), None


def c_binding(binding: OrtIOBinding):
    """The C ``SessionIOBinding`` behind a Python IOBinding (ORT's ``_iobinding``)."""
    return binding._iobinding


def c_device(device: OrtDevice):
    """The C ``OrtDevice`` behind a Python ``onnxruntime.OrtDevice``."""
    return device._get_c_device()


def ort_version() -> tuple[int, int, int]:
    """The installed onnxruntime version as ``(major, minor, patch)`` (dev/rc suffixes dropped)."""
    nums = [int(x) for x in re.findall(r"\d+", ort.__version__)[:3]]
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


#: Oldest onnxruntime ortcapture supports (the WebGPU plugin EP's floor).
MIN_ORT = (1, 24, 4)
#: First onnxruntime whose WebGPU plugin EP (onnxruntime-ep-webgpu 0.4.0) really captures. Measured: 1.24.4 and
#: 1.25.1 accept enableGraphCapture and silently never capture; 1.26.0 cannot load plugin 0.4.0; 1.27.0+ capture.
WEBGPU_PLUGIN_CAPTURE_SINCE = (1, 27, 0)


def webgpu_plugin_captures() -> bool:
    """Whether this onnxruntime really captures graphs with the WebGPU plugin EP (see WEBGPU_PLUGIN_CAPTURE_SINCE)."""
    return ort_version() >= WEBGPU_PLUGIN_CAPTURE_SINCE


def device_name_is_reliable() -> bool:
    """``OrtValue.device_name()`` names WebGPU buffers "webgpu" (ORT >= 1.30); older releases say "cuda"."""
    return ort_version() >= (1, 30, 0)


def has_native_webgpu_guards() -> bool:
    """ORT >= 1.30 pins IOBindings per ``gpu_graph_id`` itself — for WebGPU capture only (ORT PR #32074)."""
    return hasattr(OrtIOBinding, "_reject_if_pinned")


def has_release_captured_graph() -> bool:
    """``InferenceSession.release_captured_graph`` exists (WebGPU releases natively; CUDA/TensorRT: no-op)."""
    return hasattr(_C.InferenceSession, "release_captured_graph")


def has_webgpu_capture_query() -> bool:
    """The C session answers ``is_webgpu_graph_capture_enabled()``."""
    return hasattr(_C.InferenceSession, "is_webgpu_graph_capture_enabled")


def has_session_ortvalues() -> bool:
    """``InferenceSession.create_ortvalue_from_shape_and_type`` (session-scoped allocator) exists."""
    return hasattr(OrtInferenceSession, "create_ortvalue_from_shape_and_type")


def has_copy_tensors() -> bool:
    """``onnxruntime.copy_tensors(src_list, dst_list)`` exists (uses the environment's data transfers)."""
    return ort_copy_tensors is not None


def has_ep_devices() -> bool:
    """Plugin EP API: ``get_ep_devices`` / ``SessionOptions.add_provider_for_devices``."""
    return hasattr(ort, "get_ep_devices") and hasattr(ort.SessionOptions, "add_provider_for_devices")


def has_dlpack() -> bool:
    """``OrtValue.from_dlpack`` / ``OrtValue.__dlpack__`` exist."""
    return hasattr(_C.OrtValue, "from_dlpack")


@functools.lru_cache(maxsize=None)
def dlpack_takes_bool_flag() -> bool:
    """``OrtValue.from_dlpack(capsule, is_bool_tensor)`` (ORT <= 1.31) rather than ``from_dlpack(capsule)`` (1.32).

    Those older converters refuse DLPack's own bool type (kDLBool: "Unsupported code 6", measured on 1.24.4, 1.27.0
    and onnxruntime-gpu 1.31.1) and read a uint8 tensor as bool when the flag is set; 1.32 reads kDLBool itself.
    Probed once on a one-byte CPU array (no device touched).
    """
    try:
        C_OrtValue.from_dlpack(np.zeros(1, np.uint8).__dlpack__(), False)
    except TypeError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def has_update_inplace_ortvalue() -> bool:
    """``OrtValue.update_inplace(OrtValue)`` (device-to-device, ORT >= 1.26) works.

    Probed on two tiny CPU values rather than by version, since builds differ.
    """
    dst = OrtValue.ortvalue_from_numpy(np.zeros(2, np.float32))
    src = OrtValue.ortvalue_from_numpy(np.ones(2, np.float32))
    try:
        dst.update_inplace(src)
    except (TypeError, RuntimeError, ValueError):
        return False
    return bool(dst.numpy()[0] == 1.0)


@functools.lru_cache(maxsize=None)
def has_cuda_python() -> bool:
    """cuda-python's runtime bindings (``cuda.bindings.runtime`` or the older ``cuda.cudart``) import."""
    return cudart() is not None


def _first_module(*names: str):
    """The first of ``names`` that imports (its parent package looked up first, so an absent cuda-python costs no
    ImportError chain), or ``None``."""
    for name in names:
        try:
            if importlib.util.find_spec(name.rsplit(".", 1)[0]) is None:
                continue
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def cudadrv():
    """The cuda-python driver-API module (``cuda.bindings.driver`` or the older ``cuda.cuda``), or ``None``."""
    return _first_module("cuda.bindings.driver", "cuda.cuda")


@functools.lru_cache(maxsize=None)
def cudart():
    """The cuda-python runtime module, or ``None`` when cuda-python is not installed."""
    return _first_module("cuda.bindings.runtime", "cuda.cudart")


def require(feature: str, available: bool, since: str) -> None:
    """Raise :class:`~ortcapture.errors.CaptureUnsupportedError` naming the ORT version that adds ``feature``."""
    if not available:
        from ortcapture.errors import CaptureUnsupportedError

        raise CaptureUnsupportedError(
            f"{feature} needs onnxruntime >= {since}; this is onnxruntime {ort.__version__}. "
            "Upgrade onnxruntime (or onnxruntime-gpu)."
        )


def ort_version_string() -> str:
    """``onnxruntime.__version__``."""
    return ort.__version__


def torch_raw_stream_getter(torch):
    """torch's ``torch._C._cuda_getCurrentRawStream(device) -> int`` (the current CUDA stream's handle, much cheaper
    than ``torch.cuda.current_stream()``), or ``None`` where this torch lacks it."""
    return getattr(torch._C, "_cuda_getCurrentRawStream", None)


class RebuildFailed(Exception):
    """:func:`rebuild_c_session` could not build the new C session: ``cause`` is ORT's exception; ``ort_released``
    whether ORT's own pins had been released first."""

    def __init__(self, cause: BaseException, ort_released: bool) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause, self.ort_released = cause, ort_released


@contextlib.contextmanager
def built_from(session: OrtInferenceSession, model: bytes | None, folder: str | None):
    """For ORT's re-creation of ``session``'s C session in the block (``_reset_session``: ``set_providers``,
    :func:`rebuild_c_session`): build it from ``model`` (the bytes read when the session was built) instead of
    reading ``_model_path`` again, and find external data in ``folder``
    (:func:`ortcapture._ort.model.external_folder` on the session's ``SessionOptions``). ORT's own attributes
    (``_model_path``, ``_model_bytes``) are put back afterwards. ``model=None``: ORT's own model source (a session
    built from bytes keeps them in ``_model_bytes``)."""
    from ortcapture._ort.model import external_folder

    saved = (session._model_path, session._model_bytes, session._sess_options_initial)
    if model is not None and session._model_path:
        session._model_path, session._model_bytes = None, model
    try:
        with external_folder(session._sess_options_initial, folder) as so:
            session._sess_options_initial = so  # a new SessionOptions only where the session had none
            yield
    finally:
        session._model_path, session._model_bytes = saved[0], saved[1]
        if saved[2] is not None:
            session._sess_options_initial = saved[2]


def normalized_providers(providers, provider_options) -> tuple[list[str], list[dict]]:
    """ORT's own ``check_and_normalize_provider_args`` (what its constructor and ``set_providers`` run first):
    ``(names, options)``; raises ORT's ``ValueError`` for what ORT would refuse. Its warnings (a provider this
    build lacks, a duplicate) are left to ORT's own call, which follows."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _oic.check_and_normalize_provider_args(providers, provider_options, _C.get_available_providers())


def create_inference_session(session: OrtInferenceSession, providers, provider_options, *args, **kwargs):
    """ORT's ``InferenceSession._create_inference_session`` — the one place ORT builds a session's C session (its
    constructor, ``set_providers`` and ``_reset_session`` call it) — on ``session``."""
    return OrtInferenceSession._create_inference_session(session, providers, provider_options, *args, **kwargs)


def rebuild_c_session(session: OrtInferenceSession, providers, provider_options, model: bytes | None = None,
                      folder: str | None = None) -> None:
    """Replace ``session``'s C session with a new one built from the same model, ``SessionOptions`` and the given
    providers — ORT's own re-creation (``_reset_session``, what ``set_providers`` calls; ``model``/``folder``: see
    :func:`built_from`, so a model file replaced or deleted since changes nothing). Graphs captured by the
    old C session die with it. ORT >= 1.30's own WebGPU pins (``_captured_graph_bindings``) are released first
    through ORT's method, not through a subclass's override.

    ORT destroys the old C session before it builds the new one, so the old one's device memory is free for the new
    one (on CUDA the driver keeps what a destroyed session freed and reuses it; a new session built while the old
    one lives would raise the high-water mark by a whole session, ~100 MiB for YOLOv8n). Meanwhile ``get_inputs()``
    and the like return ``None``: compaction holds the capture guard, and ortcapture's readers hold a guard.

    Raises:
        RebuildFailed: ORT could not build the new C session (its exception is the ``cause``); the session then has
            no C session, as after a failed ``set_providers``.
    """
    pinned = sorted(getattr(session, "_captured_graph_bindings", {}) or {})
    for graph_id in pinned:
        OrtInferenceSession.release_captured_graph(session, graph_id)
    try:
        with built_from(session, model, folder):
            OrtInferenceSession._reset_session(session, providers, provider_options)
    except Exception as exc:  # noqa: BLE001 - ORT raises its own types (e.g. NoSuchFile: the model file is gone)
        raise RebuildFailed(exc, bool(pinned)) from exc


# -- torch (optional): its capture query for cudart.make_capture_probe ------------------------------------------
def torch_capture_query(torch):
    """``torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()`` as one frame: torch's own C
    query where this torch has it (its two Python wrappers cost ~0.9 µs per replay on the H200 host), the public
    API elsewhere; a capture error raised by torch's query counts as capturing (:func:`_torch_capture_error`).
    Moved here from ``cudart``: torch's own internals, like ORT's, are read in this module only."""
    cuda = torch.cuda
    c_query = getattr(getattr(torch, "_C", None), "_cuda_isCurrentStreamCapturing", None)
    if c_query is None or not isinstance(getattr(cuda, "_initialized", None), bool):
        def public() -> bool:
            try:
                return bool(cuda.is_initialized() and cuda.is_current_stream_capturing())
            except RuntimeError as exc:
                return _torch_capture_error(exc)
        return public

    def fast() -> bool:
        if not cuda._initialized:  # what is_initialized() reads (False in a forked child too)
            return False
        try:
            return bool(c_query())
        except RuntimeError as exc:
            return _torch_capture_error(exc)

    return fast


def _torch_capture_error(exc: RuntimeError) -> bool:
    """True for torch's error of a capture in progress (``torch.AcceleratorError`` of cudaErrorStreamCapture*:
    "... depend on a capturing blocking stream", "operation not permitted when stream is capturing", "... during
    capture"); any other error (e.g. a sticky illegal memory access) is raised again, as torch's own."""
    if "captur" in str(exc).lower():
        return True
    raise exc
