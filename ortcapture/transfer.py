"""Strict in-place updates of fixed buffers, and copies between them: the public face of :mod:`ortcapture._transfer`.

ORT's own paths accept silently wrong input: ``OrtValue.update_inplace(numpy)`` checks only the element count
(measured, onnxruntime-gpu 1.31.1: int32 bytes accepted into a float32 OrtValue and reinterpreted), copies the raw
memory of non-contiguous arrays (ORT #13548), and before ORT #32315 a ``copy_tensors`` with an aliased pair or an
undersized destination ended in ``std::terminate``. Every check here runs before any native call.

Backends, chosen by :mod:`ortcapture._ort.compat`: ``OrtValue.update_inplace(OrtValue)`` (ORT >= 1.26; for CUDA it is
``cudaMemcpy`` + ``cudaStreamSynchronize`` on the legacy default stream), ``onnxruntime.copy_tensors`` (WebGPU,
batch copies), and a cuda-python ``cudaMemcpyAsync`` + stream sync for CUDA on ORT versions without the former.
Ordering guarantee: every copy has completed on the device when the call returns, so a replay started afterwards
reads the new values; DLPack sources are ordered after their producer's pending work; and every transfer starts
after the runs an ortcapture session made with ``disable_synchronize_execution_providers=1`` (ORT returns from those
before the device finished them: :func:`ortcapture._ort.sync.settle`).

This module only re-exports: the implementation is :mod:`ortcapture._transfer` (``check``, ``sources``, ``copy``,
``targets``, ``staging``, ``host_copy``, ``pinned_host``, ``arena``). ``COPY_BACKEND`` (the forced device-to-device
backend, set from ``$ORTCAPTURE_COPY_BACKEND`` at import) is :data:`ortcapture._ort.sync.COPY_BACKEND`: set it there.
"""
from __future__ import annotations

from ortcapture._ort.values import ONNX_TO_NP, STORAGE, ValueMeta, meta
from ortcapture._transfer.arena import OutputArena, outputs_into, tap_device_outputs
from ortcapture._transfer.check import (
    CPU, GPU, INT32_RANGE, NONE_VENDOR, InputSpec, can_copy, check_feeds, check_values, input_specs, np_dtype_of,
    source_spec, value_rules,
)
from ortcapture._transfer.copy import (
    check_int64_inputs, check_source, commit, copy, prepare, restore, to_numpy, update_inplace,
)
from ortcapture._transfer.host_copy import host_copy
from ortcapture._transfer.pinned_host import PinnedHostMemory, pin_host_memory, pinning_in_place
from ortcapture._transfer.targets import FeedTargets, copy_feeds

__all__ = ["CPU", "GPU", "INT32_RANGE", "NONE_VENDOR", "ONNX_TO_NP", "STORAGE", "FeedTargets", "InputSpec",
           "OutputArena", "PinnedHostMemory", "ValueMeta", "can_copy", "check_feeds", "check_int64_inputs",
           "check_source", "check_values", "host_copy", "input_specs", "commit", "copy", "copy_feeds", "meta",
           "np_dtype_of", "outputs_into", "pin_host_memory", "pinning_in_place", "prepare", "restore", "source_spec",
           "tap_device_outputs", "to_numpy", "update_inplace", "value_rules"]
