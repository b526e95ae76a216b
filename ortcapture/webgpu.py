"""The WebGPU plugin EP (``onnxruntime-ep-webgpu``): registration, EP device, session options, and a safe probe.

ORT aborts the whole process (``std::terminate``) when Dawn finds no adapter, so whether WebGPU works is asked in a
child process (:func:`probe`; ``python -m ortcapture.webgpu`` is that child). On ORT 1.30 a plugin EP named in
``providers=[...]`` can silently give a CPU-only session, so sessions add it with
``SessionOptions.add_provider_for_devices`` (:func:`session_options`). Never pass ``None`` there: ORT segfaults.

This module only re-exports: the implementation is :mod:`ortcapture._ort.webgpu`.
"""
from __future__ import annotations

import sys

from ortcapture._ort import webgpu as _webgpu
from ortcapture._ort.webgpu import EP_NAME  # noqa: F401 - public, not documented (as before)
from ortcapture._ort.webgpu import _probe_main, ep_device, plugin_installed, probe, register, session_options

#: The process-wide WebGPU lock (:data:`ortcapture._ort.sync.WEBGPU_LOCK`): ORT's WebGPU queue is not thread-safe.
LOCK = _webgpu.LOCK

__all__ = ["LOCK", "plugin_installed", "register", "ep_device", "session_options", "probe"]  # in the order of the source

if __name__ == "__main__":
    sys.exit(_probe_main())
