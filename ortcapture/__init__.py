"""ortcapture: safe, fast GPU graph capture (CUDA graphs, TensorRT, WebGPU) for ONNX Runtime.

The public surface is :data:`__all__`: the session, graph, transfer and error names below, ``DEFAULT_RTOL`` (the
relative tolerance of the verification where reference and replay run different kernels), the :mod:`ortcapture.webgpu`
helpers and :mod:`ortcapture.serving` (batching requests onto a bucketed session). Modules whose names start with
``_`` are private; ``ortcapture.cli`` is the command line. Names are imported on first use (PEP 562), so ``import
ortcapture`` and ``ortcapture patch`` work without onnxruntime installed; the first name that needs it raises
:class:`ModuleNotFoundError` naming the extras that install it.
"""
from __future__ import annotations

import importlib

#: the package version (the one source: pyproject.toml reads it)
__version__ = "0.1.0"

_EXPORTS = {
    "BindingError": "ortcapture.errors", "CaptureError": "ortcapture.errors",
    "CaptureUnsupportedError": "ortcapture.errors", "GraphReleasedError": "ortcapture.errors",
    "PatchError": "ortcapture.errors", "TransferError": "ortcapture.errors", "StaleOutputError": "ortcapture.errors",
    "CaptureAbortedError": "ortcapture.errors", "PointerLifetimeWarning": "ortcapture.errors",
    "EPAccuracyWarning": "ortcapture.errors",
    "VerificationError": "ortcapture._verify.compare",
    "CapturedGraph": "ortcapture.graph", "ReplayOutput": "ortcapture.graph",
    "InferenceSession": "ortcapture.session", "run_options_for": "ortcapture.session",
    "IOBinding": "ortcapture._core.binding",
    "patch_onnxruntime": "ortcapture.dropin", "unpatch_onnxruntime": "ortcapture.dropin",
    "patched": "ortcapture.dropin",
    "can_copy": "ortcapture.transfer", "copy": "ortcapture.transfer", "to_numpy": "ortcapture.transfer",
    "update_inplace": "ortcapture.transfer",
    "DEFAULT_RTOL": "ortcapture._verify.compare",
    "pick_provider": "ortcapture._ort.providers",
}
#: public submodules, importable as attributes after a plain ``import ortcapture``
_PUBLIC_MODULES = {"dropin", "errors", "graph", "session", "transfer", "webgpu", "serving", "cli"}
__all__ = sorted([*_EXPORTS, "webgpu", "serving", "__version__"])

#: the error when no ONNX Runtime is installed (ortcapture depends on none: onnxruntime and onnxruntime-gpu are two
#: distributions of one package, and installing either replaces the other)
_MISSING_ORT = ("ortcapture needs ONNX Runtime, and no onnxruntime is installed: pip install 'ortcapture[cpu]' "
               "(CPU; add webgpu for WebGPU: 'ortcapture[cpu,webgpu]') or 'ortcapture[cuda]' (NVIDIA GPUs: "
               "onnxruntime-gpu)")


def _import(module: str):
    """``importlib.import_module(module)``; a missing onnxruntime becomes one error that names the extras."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != "onnxruntime":
            raise
        raise ModuleNotFoundError(_MISSING_ORT, name="onnxruntime") from exc


def __getattr__(name: str):
    if name in _PUBLIC_MODULES:
        return _import(f"ortcapture.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ortcapture' has no attribute {name!r}")
    value = getattr(_import(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
