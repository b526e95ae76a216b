"""The WebGPU plugin EP (``onnxruntime-ep-webgpu``): registration, EP device, session options, and a safe probe.

ORT aborts the whole process (``std::terminate``) when Dawn finds no adapter, so whether WebGPU works is asked in a
child process (:func:`probe`; ``python -m ortcapture.webgpu`` is that child). On ORT 1.30 a plugin EP named in
``providers=[...]`` can silently give a CPU-only session, so sessions add it with
``SessionOptions.add_provider_for_devices`` (:func:`session_options`). Never pass ``None`` there: ORT segfaults.

Moved out of :mod:`ortcapture.webgpu` unchanged (which re-exports its public names and is the probe's child:
``python -m ortcapture.webgpu``).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from ortcapture._ort.sync import WEBGPU_LOCK

EP_NAME = "WebGpuExecutionProvider"
_registered = False

#: The process-wide WebGPU lock (:data:`ortcapture._ort.sync.WEBGPU_LOCK`): ORT's WebGPU queue is not thread-safe.
LOCK = WEBGPU_LOCK


def _onnxruntime():
    """``onnxruntime``; where none is installed, the ``ModuleNotFoundError`` that names the extras (as every other
    first use of ORT through ``ortcapture`` raises it) instead of a bare one."""
    from ortcapture import _import

    return _import("onnxruntime")


def plugin_installed() -> bool:
    """Whether the ``onnxruntime-ep-webgpu`` package is importable."""
    return importlib.util.find_spec("onnxruntime_ep_webgpu") is not None


def register() -> None:
    """Register the plugin EP library with ORT once per process (idempotent, thread-safe: under
    :data:`~ortcapture._ort.sync.WEBGPU_LOCK`, as two threads registering it at once crashed the process with a
    segfault, ORT 1.32).

    Raises:
        CaptureUnsupportedError: ``onnxruntime-ep-webgpu`` is not installed (``pip install "ortcapture[webgpu]"``), or
            this onnxruntime has no plugin EP API (needs >= 1.24.4).
    """
    if _registered:
        return
    with WEBGPU_LOCK:
        _register()


def _register() -> None:
    global _registered
    if _registered:  # another thread registered it while this one waited for the lock
        return
    ort = _onnxruntime()

    from ortcapture._ort import compat
    from ortcapture.errors import CaptureUnsupportedError

    if not plugin_installed():
        raise CaptureUnsupportedError("the WebGPU plugin EP is not installed: pip install 'ortcapture[webgpu]' "
                                      "(onnxruntime-ep-webgpu)")
    compat.require("the WebGPU plugin EP", compat.has_ep_devices(), "1.24.4")
    import onnxruntime_ep_webgpu as plugin

    try:
        ort.register_execution_provider_library("webgpu", plugin.get_library_path())
    except Exception as exc:  # noqa: BLE001 - already registered under this name
        if "already" not in str(exc).lower():
            raise
    _registered = True


def ep_device():
    """The WebGPU ``OrtEpDevice``: a GPU one when present, else the software-adapter one.

    Returns:
        An ``onnxruntime.OrtEpDevice`` for ``SessionOptions.add_provider_for_devices``.

    Raises:
        CaptureUnsupportedError: the plugin is missing, or ORT offers no WebGPU EP device (without a GPU:
            ``ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1`` and a software Vulkan driver, ``tools/setup_webgpu.sh``).
    """
    ort = _onnxruntime()

    from ortcapture.errors import CaptureUnsupportedError

    register()
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        raise CaptureUnsupportedError(
            "no WebGPU EP device: on a machine without a GPU set ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1 and a "
            "software Vulkan driver (tools/setup_webgpu.sh) before the first session — after the README's commands: "
            "source \"${ORTCAPTURE_CACHE:-$HOME/.cache/ortcapture}/webgpu.env\" (it sets both, and VK_ICD_FILENAMES)"
        )
    devices.sort(key=lambda d: 0 if "GPU" in str(d.device.type) else 1)
    return devices[0]


def session_options(capture: bool = True, sess_options=None, ep_options=None):
    """``SessionOptions`` with the WebGPU plugin EP added through ``add_provider_for_devices``.

    On ORT 1.30 naming a plugin EP in ``providers=[...]`` can silently give a CPU-only session, so the EP is added to
    the options instead; memory patterns are switched off (capture needs ``enable_mem_pattern=False``).

    Args:
        capture: sets the EP option ``enableGraphCapture``.
        sess_options: a fresh ``onnxruntime.SessionOptions`` to add the EP to (default: a new one).
        ep_options: further WebGPU EP options, ``{key: str}`` (the EP ignores unknown keys).

    Returns:
        The ``SessionOptions`` (``sess_options`` itself when given).

    Raises:
        TypeError: ``capture`` is not a bool (e.g. ``"yes"`` or ``1``).
        CaptureError: ``sess_options`` already holds the WebGPU EP (ORT refuses to register it twice).
        CaptureUnsupportedError: no WebGPU EP device (see :func:`ep_device`).
        ModuleNotFoundError: no onnxruntime installed (the message names the extras that install it).
    """
    if not isinstance(capture, bool):  # "yes", 0, None...: a truthy or falsy value of another type is a mistake
        raise TypeError(f"capture must be True or False, got {capture!r}")
    ort = _onnxruntime()

    from ortcapture.errors import CaptureError

    so = sess_options if sess_options is not None else ort.SessionOptions()
    try:
        present = so.get_session_config_entry("ep.webgpuexecutionprovider.enableGraphCapture")
    except RuntimeError:
        present = None
    if present:
        raise CaptureError("these SessionOptions already have the WebGPU EP (session_options() was called on them "
                           "before): ORT refuses to register it twice; pass a fresh onnxruntime.SessionOptions()")
    so.enable_mem_pattern = False
    so.add_provider_for_devices([ep_device()], {**dict(ep_options or {}),
                                                "enableGraphCapture": "1" if capture else "0"})
    return so


def probe(timeout: float = 180.0) -> dict:
    """Whether WebGPU capture works here, asked in a child process (ORT calls ``std::terminate`` when Dawn finds no
    adapter, which would end this process).

    Args:
        timeout: seconds the child may take.

    Returns:
        The child's JSON: ``{"ok": True, "device_type", "vendor_id", "providers"}``, or ``{"ok": False, "error": why}``
        when the child failed, died or timed out. Never raises for a failed probe.
    """
    try:
        proc = subprocess.run([sys.executable, "-m", "ortcapture.webgpu"], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"WebGPU probe timed out after {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    why = f"exit code {proc.returncode}" if proc.returncode >= 0 else f"killed by signal {-proc.returncode}"
    tail = proc.stderr.strip().splitlines()[-3:]
    return {"ok": False, "error": f"WebGPU probe {why}: {' | '.join(tail)}"}


def _probe_main() -> int:
    """Capture a tiny Add model on WebGPU and replay it twice; print one JSON line."""
    import numpy as np
    from onnx import TensorProto, helper

    import ortcapture

    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in "ABC"]
    graph = helper.make_graph([helper.make_node("Add", ["A", "B"], ["C"])], "probe", vi[:2], vi[2:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    dev = ep_device()
    sess = ortcapture.InferenceSession(model.SerializeToString(), session_options(True))
    a, b = np.arange(8, dtype=np.float32).reshape(2, 4), np.ones((2, 4), np.float32)
    with sess.capture({"A": a, "B": b}) as g:
        ok = all(np.array_equal(g.run({"A": a * k})[0], a * k + b) for k in (2.0, 3.0))
    print(json.dumps({"ok": bool(ok), "device_type": str(dev.device.type), "vendor_id": int(dev.device.vendor_id),
                      "providers": sess.get_providers()}))
    return 0 if ok else 1

