"""ortcapture: safe, fast GPU graph capture (CUDA graphs, TensorRT, WebGPU) for ONNX Runtime.

Public names only; see each module for details.
"""
from ortcapture.errors import (
    BindingError,
    CaptureError,
    CaptureUnsupportedError,
    GraphReleasedError,
    PatchError,
    TransferError,
)
from ortcapture.graph import CapturedGraph, ReplayOutput, StaleOutputError
from ortcapture.session import InferenceSession
from ortcapture.transfer import can_copy, copy, to_numpy, update_inplace

__version__ = "0.1.0"

__all__ = [
    "BindingError", "CaptureError", "CaptureUnsupportedError", "CapturedGraph", "GraphReleasedError",
    "InferenceSession", "PatchError", "ReplayOutput", "StaleOutputError", "TransferError", "__version__",
    "can_copy", "copy", "to_numpy", "update_inplace",
]
