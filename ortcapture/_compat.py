"""What the installed onnxruntime can do — the one place that probes versions and features.

Every other module asks here instead of comparing version strings itself. Probes are cached; they never touch a
GPU (a WebGPU probe that finds no adapter makes ORT call ``std::terminate``, so adapter probes run in a child
process: see :mod:`ortcapture.probe`).
"""
from __future__ import annotations

import functools
import importlib.util
import re

import numpy as np
import onnxruntime as ort

_C = ort.capi._pybind_state


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


_FORWARD_NAMES = frozenset({"_sess", "run_with_iobinding", "_iobinding"})
#: what onnxruntime 1.30-1.32's wrapper adds: the IOBinding/session identity check and the WebGPU capture guards
#: of ORT PR #32074 (``is_webgpu_graph_capture_enabled``: nothing else happens for any other EP)
_WEBGPU_GUARD_NAMES = _FORWARD_NAMES | {
    "_session", "ValueError", "_graph_annotation_id", "is_webgpu_graph_capture_enabled", "_GRAPH_ANNOTATION_SKIP",
    "_validate_capture_bindings", "_capture_signature", "_captured_graph_bindings", "get", "weakref", "ref",
    "_pinned_graph_ids", "add"}


@functools.cache
def iobinding_run_wrapper() -> str:
    """What ``onnxruntime.InferenceSession.run_with_iobinding`` (Python) does besides calling the C session's
    ``run_with_iobinding(iobinding._iobinding, run_options)``, read from the names its code uses: ``"nothing"``
    (onnxruntime 1.24.4-1.29), ``"webgpu guards"`` (1.30-1.32: an IOBinding/session identity check and, for a
    WebGPU capturing session only, ORT PR #32074's capture guards), or ``"more"`` (anything else: a future
    release). Where it is nothing, or WebGPU-only work on a session that is not WebGPU, ortcapture's replay hot
    path makes the C call itself, a Python frame and a few calls less per replay."""
    code = getattr(ort.InferenceSession.run_with_iobinding, "__code__", None)
    names = set(code.co_names) if code is not None else None
    if names is not None and names <= _FORWARD_NAMES:
        return "nothing"
    if names is not None and names <= _WEBGPU_GUARD_NAMES and "is_webgpu_graph_capture_enabled" in names:
        return "webgpu guards"
    return "more"


def device_name_is_reliable() -> bool:
    """``OrtValue.device_name()`` names WebGPU buffers "webgpu" (ORT >= 1.30); older releases say "cuda"."""
    return ort_version() >= (1, 30, 0)


def has_native_webgpu_guards() -> bool:
    """ORT >= 1.30 pins IOBindings per ``gpu_graph_id`` itself — for WebGPU capture only (ORT PR #32074)."""
    return hasattr(ort.IOBinding, "_reject_if_pinned")


def has_release_captured_graph() -> bool:
    """``InferenceSession.release_captured_graph`` exists (WebGPU releases natively; CUDA/TensorRT: no-op)."""
    return hasattr(_C.InferenceSession, "release_captured_graph")


def has_webgpu_capture_query() -> bool:
    """The C session answers ``is_webgpu_graph_capture_enabled()``."""
    return hasattr(_C.InferenceSession, "is_webgpu_graph_capture_enabled")


def has_session_ortvalues() -> bool:
    """``InferenceSession.create_ortvalue_from_shape_and_type`` (session-scoped allocator) exists."""
    return hasattr(ort.InferenceSession, "create_ortvalue_from_shape_and_type")


def has_copy_tensors() -> bool:
    """``onnxruntime.copy_tensors(src_list, dst_list)`` exists (uses the environment's data transfers)."""
    return hasattr(ort, "copy_tensors")


def has_ep_devices() -> bool:
    """Plugin EP API: ``get_ep_devices`` / ``SessionOptions.add_provider_for_devices``."""
    return hasattr(ort, "get_ep_devices") and hasattr(ort.SessionOptions, "add_provider_for_devices")


def has_dlpack() -> bool:
    """``OrtValue.from_dlpack`` / ``OrtValue.__dlpack__`` exist."""
    return hasattr(_C.OrtValue, "from_dlpack")


@functools.lru_cache(maxsize=None)
def has_update_inplace_ortvalue() -> bool:
    """``OrtValue.update_inplace(OrtValue)`` (device-to-device, ORT >= 1.26) works.

    Probed on two tiny CPU values rather than by version, since builds differ.
    """
    dst = ort.OrtValue.ortvalue_from_numpy(np.zeros(2, np.float32))
    src = ort.OrtValue.ortvalue_from_numpy(np.ones(2, np.float32))
    try:
        dst.update_inplace(src)
    except (TypeError, RuntimeError, ValueError):
        return False
    return bool(dst.numpy()[0] == 1.0)


@functools.lru_cache(maxsize=None)
def has_cuda_python() -> bool:
    """cuda-python's runtime bindings (``cuda.bindings.runtime`` or the older ``cuda.cudart``) import."""
    return cudart() is not None


@functools.lru_cache(maxsize=None)
def cudart():
    """The cuda-python runtime module, or ``None`` when cuda-python is not installed."""
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            if importlib.util.find_spec(name.rsplit(".", 1)[0]) is None:
                continue
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def require(feature: str, available: bool, since: str) -> None:
    """Raise :class:`~ortcapture.errors.CaptureUnsupportedError` naming the ORT version that adds ``feature``."""
    if not available:
        from ortcapture.errors import CaptureUnsupportedError

        raise CaptureUnsupportedError(
            f"{feature} needs onnxruntime >= {since}; this is onnxruntime {ort.__version__}. "
            "Upgrade onnxruntime (or onnxruntime-gpu)."
        )
