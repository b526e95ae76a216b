#!/usr/bin/env python3
"""Probe: does real WebGPU graph capture work in this environment?

Run with a Python that has onnxruntime (>= 1.24.4) and onnxruntime-ep-webgpu, after sourcing the env file
written by tools/setup_webgpu.sh on GPU-less machines:

    env_file="$(tools/setup_webgpu.sh)" && source "$env_file"
    python tools/probe_webgpu.py

It registers the WebGPU plugin EP, lists the EP devices, builds a tiny Add model, creates a plain WebGPU
session (adapter check), then a session with enableGraphCapture=1 on the WebGPU EP device, binds fixed WebGPU
OrtValues through IOBinding, runs run_with_iobinding several times (first run captures, the rest replay) with
changing input data and checks the results are exact. Right results do not prove capture: onnxruntime 1.24.x
accepts enableGraphCapture for the plugin EP and silently ignores it. So capture counts as active only if
ORT's INFO log shows "Replaying the captured ..." or a new IOBinding after capture is refused / not written.

stdout: one JSON line (ok, versions, devices, timings). Exit 0 when capture works, 1 otherwise (message on
stderr and "ok": false in the JSON).

ORT aborts the whole process (std::terminate) when Dawn finds no adapter, so callers should run this in a
child process and treat death by signal as "not available".
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

SHAPE = (4, 8)
RUNS = 5


def _fail(summary: dict, msg: str) -> int:
    summary["ok"] = False
    summary["error"] = msg
    print(f"probe_webgpu: FAIL: {msg}", file=sys.stderr)
    print(json.dumps(summary, sort_keys=True))
    return 1


def _dist_version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


def _tiny_add_model_bytes() -> bytes:
    import onnx
    from onnx import TensorProto, helper

    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, list(SHAPE))
    b = helper.make_tensor_value_info("B", TensorProto.FLOAT, list(SHAPE))
    c = helper.make_tensor_value_info("C", TensorProto.FLOAT, list(SHAPE))
    graph = helper.make_graph([helper.make_node("Add", ["A", "B"], ["C"])], "probe_add", [a, b], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime the plugin supports
    onnx.checker.check_model(model)
    return model.SerializeToString()


class _StderrLog:
    """Collect what native code writes to fd 2; echo back all but ORT's INFO/VERBOSE lines."""

    def __enter__(self):
        sys.stderr.flush()
        self._tmp = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._tmp.fileno(), 2)
        self.text = ""
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._tmp.seek(0)
        self.text = self._tmp.read().decode("utf-8", "replace")
        self._tmp.close()
        for line in self.text.splitlines():
            if "[I:onnxruntime" not in line and "[V:onnxruntime" not in line:
                print(line, file=sys.stderr)
        return False


def _to_device(ort, host_array, device_value) -> None:
    ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(host_array)], [device_value])


def _to_host(ort, device_value, host_array) -> None:
    ort.copy_tensors([device_value], [ort.OrtValue.ortvalue_from_numpy(host_array)])


def _rebind_check(ort, np, sess) -> str:
    """After capture, run once with a *new* IOBinding on new buffers.

    "refused": ORT raised (1.32 guards this: a replay would ignore the new binding);
    "stale": the new output was not written (replay used the captured buffers);
    "recomputed": the new output is right, i.e. nothing was captured.
    """
    a = np.full(SHAPE, 3.0, np.float32)
    va, vb, vc = (ort.OrtValue.ortvalue_from_shape_and_type(SHAPE, np.float32, "webgpu", 0) for _ in range(3))
    _to_device(ort, a, va)
    _to_device(ort, a, vb)
    _to_device(ort, np.full(SHAPE, -1.0, np.float32), vc)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("A", va)
    binding.bind_ortvalue_input("B", vb)
    binding.bind_ortvalue_output("C", vc)
    try:
        sess.run_with_iobinding(binding)
    except Exception:  # noqa: BLE001
        return "refused"
    out = np.empty(SHAPE, np.float32)
    _to_host(ort, vc, out)
    return "recomputed" if np.array_equal(out, a + a) else "stale"


def _capture_checks(ort, np, model: bytes, dev, ep_name: str, summary: dict) -> str | None:
    """Capture + replays on fixed WebGPU buffers; fills summary, returns an error message or None."""
    so = ort.SessionOptions()
    so.enable_mem_pattern = False
    so.log_severity_level = 1
    so.add_provider_for_devices([dev], {"enableGraphCapture": "1"})
    t0 = time.perf_counter()
    try:
        sess = ort.InferenceSession(model, sess_options=so)
    except Exception as e:  # noqa: BLE001
        return f"capture session creation failed: {e}"
    summary["session_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    summary["providers"] = sess.get_providers()
    if summary["providers"][0] != ep_name:
        return f"session is not on {ep_name}: {summary['providers']}"
    # 1.24.x reports {} here for plugin EPs even when the option was given
    summary["provider_options_enableGraphCapture"] = (sess.get_provider_options().get(ep_name) or {}).get(
        "enableGraphCapture"
    )
    try:
        gpu = {n: ort.OrtValue.ortvalue_from_shape_and_type(SHAPE, np.float32, "webgpu", 0) for n in "ABC"}
        binding = sess.io_binding()
        for n in "AB":
            binding.bind_ortvalue_input(n, gpu[n])
        binding.bind_ortvalue_output("C", gpu["C"])

        rng = np.random.default_rng(0)
        times = []
        host_out = np.empty(SHAPE, np.float32)
        for i in range(RUNS):
            a = rng.standard_normal(SHAPE).astype(np.float32)
            b = rng.standard_normal(SHAPE).astype(np.float32)
            # same device buffers every run (a captured graph replays against fixed buffers)
            _to_device(ort, a, gpu["A"])
            _to_device(ort, b, gpu["B"])
            t0 = time.perf_counter()
            sess.run_with_iobinding(binding)
            times.append(round((time.perf_counter() - t0) * 1e3, 3))
            _to_host(ort, gpu["C"], host_out)
            if not np.array_equal(host_out, a + b):
                err = float(np.max(np.abs(host_out - (a + b))))
                return f"run {i}: result differs from numpy (max abs err {err})"
        # [capture, replay, ...]: time to submit (async); results are read back after each run
        summary["run_ms"] = times
        summary["runs"] = RUNS
        summary["exact"] = True

        summary["rebind_check"] = _rebind_check(ort, np, sess)
        # the session must still work with the original binding afterwards
        a = rng.standard_normal(SHAPE).astype(np.float32)
        _to_device(ort, a, gpu["A"])
        _to_device(ort, a, gpu["B"])
        sess.run_with_iobinding(binding)
        _to_host(ort, gpu["C"], host_out)
        if not np.array_equal(host_out, a + a):
            return "original binding gives wrong results after the rebind check"
    except Exception as e:  # noqa: BLE001
        return f"capture/replay failed: {type(e).__name__}: {e}"
    return None


def main() -> int:
    summary: dict = {
        "ok": False,
        "env": {
            "VK_ICD_FILENAMES": os.environ.get("VK_ICD_FILENAMES"),
            "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER": os.environ.get("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER"),
        },
    }
    try:
        import numpy as np
        import onnxruntime as ort
        import onnxruntime_ep_webgpu as ortwg
    except ImportError as e:
        return _fail(summary, f"import failed: {e}")

    summary["onnxruntime"] = ort.__version__
    summary["onnxruntime_ep_webgpu"] = _dist_version("onnxruntime-ep-webgpu")
    ep_name = ortwg.get_ep_name()
    summary["ep_name"] = ep_name

    try:
        ort.register_execution_provider_library("webgpu", ortwg.get_library_path())
    except Exception as e:  # noqa: BLE001 - report whatever ORT raises
        return _fail(summary, f"register_execution_provider_library failed: {e}")

    devices = []
    for d in ort.get_ep_devices():
        hw = d.device
        devices.append(
            {
                "ep_name": d.ep_name,
                "type": str(hw.type).rsplit(".", 1)[-1],
                "vendor": hw.vendor,
                "vendor_id": hw.vendor_id,
                "device_id": hw.device_id,
            }
        )
    summary["ep_devices"] = devices
    webgpu = [d for d in ort.get_ep_devices() if d.ep_name == ep_name]
    if not webgpu:
        hint = ""
        if os.environ.get("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER") != "1":
            hint = " (no GPU? set ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1, see tools/setup_webgpu.sh)"
        return _fail(summary, f"no EP device for {ep_name}{hint}")
    dev = webgpu[0]

    model = _tiny_add_model_bytes()
    # 1) plain session: brings up the Dawn device; any adapter failure shows up here, loudly
    t0 = time.perf_counter()
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_provider_for_devices([dev], {})
        plain = ort.InferenceSession(model, sess_options=so)
        a = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
        if not np.array_equal(plain.run(None, {"A": a, "B": a})[0], a + a):
            return _fail(summary, "plain WebGPU session gives wrong results")
    except Exception as e:  # noqa: BLE001
        return _fail(summary, f"WebGPU session failed: {e}")
    summary["first_session_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    if plain.get_providers()[0] != ep_name:
        return _fail(summary, f"session is not on {ep_name}: {plain.get_providers()}")
    del plain

    # 2) capture session, INFO log: ORT logs "Replaying the captured ..." through the session logger.
    #    Native stderr is collected meanwhile; everything but INFO/VERBOSE lines is echoed afterwards.
    with _StderrLog() as log:
        err = _capture_checks(ort, np, model, dev, ep_name, summary)
    summary["replays_logged"] = log.text.count("Replaying the captured")
    if err:
        return _fail(summary, err)
    summary["capture_active"] = summary["replays_logged"] > 0 or summary["rebind_check"] != "recomputed"
    if not summary["capture_active"]:
        return _fail(
            summary,
            "results are right but graph capture is not active (no replay logged, a new IOBinding was simply "
            "recomputed); this onnxruntime ignores enableGraphCapture for the plugin EP (seen with 1.24.x)",
        )
    summary["ok"] = True
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
