"""ortcapture: safe, fast GPU graph capture (CUDA graphs, TensorRT, WebGPU) for ONNX Runtime.

Public names only; see each module for details. Names are imported on first use (PEP 562), so tools that need
no onnxruntime (``ortcapture patch``) never load it.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "BindingError": "ortcapture.errors", "CaptureError": "ortcapture.errors",
    "CaptureUnsupportedError": "ortcapture.errors", "GraphReleasedError": "ortcapture.errors",
    "PatchError": "ortcapture.errors", "TransferError": "ortcapture.errors", "StaleOutputError": "ortcapture.errors",
    "CapturedGraph": "ortcapture.graph", "ReplayOutput": "ortcapture.graph",
    "InferenceSession": "ortcapture.session", "run_options_for": "ortcapture.session",
    "can_copy": "ortcapture.transfer", "copy": "ortcapture.transfer", "to_numpy": "ortcapture.transfer",
    "update_inplace": "ortcapture.transfer",
}
__all__ = sorted([*_EXPORTS, "__version__"])


_SUBMODULES = {"binding", "buffers", "capture", "compat", "cudart", "errors", "graph", "models", "providers",
               "registry", "session", "shapes", "timing", "transfer", "values", "webgpu"}


def __getattr__(name: str):
    if name in _SUBMODULES:  # ortcapture.webgpu etc. work after a plain `import ortcapture`
        return importlib.import_module(f"ortcapture.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ortcapture' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
