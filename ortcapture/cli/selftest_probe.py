"""One ``ortcapture selftest`` case, run in a child process: ``python -m ortcapture.cli.selftest_probe CASE``.

Prints JSON lines: ``{"stage": ...}`` as it gets past each risky step, then ``{"result": "present" | "missing" |
"not testable", "evidence": ...}``. A case that may corrupt memory prints its result and leaves with
``os._exit`` before the corruption can kill it. When the child dies instead (ORT aborts when Dawn finds no
adapter; before ORT #32315 an aliased copy ends in ``std::terminate``), the parent reads the last stage it
reached. Imports onnxruntime (the parent, :mod:`ortcapture.cli.selftest`, does not).
"""
from __future__ import annotations

import json
import os
import sys


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def done(result: str, evidence: str) -> None:
    say(result=result, evidence=evidence)
    sys.stdout.flush()
    os._exit(0)  # leave before a corrupted heap can abort the process


def webgpu_value(np, ort, elements: int):
    """A float32 WebGPU OrtValue of ``elements`` values (default context); ``done('not testable')`` if none."""
    from ortcapture import webgpu

    if not webgpu.plugin_installed():
        done("not testable", "the WebGPU plugin EP (onnxruntime-ep-webgpu) is not installed")
    try:
        webgpu.ep_device()
    except Exception as exc:  # noqa: BLE001 - any failure means: no WebGPU here
        done("not testable", f"no WebGPU EP device: {exc}")
    say(stage="adapter")  # dying after this line (ORT aborts without an adapter) reads as "no WebGPU adapter"
    try:
        value = ort.OrtValue.ortvalue_from_shape_and_type([elements], np.float32, "webgpu", 0)
    except Exception as exc:  # noqa: BLE001
        done("not testable", f"this ORT cannot allocate a WebGPU OrtValue from Python: {exc}")
    say(stage="webgpu value")
    return value


def case_copy_size_check(np, ort) -> None:
    if not hasattr(ort, "copy_tensors"):
        done("not testable", "onnxruntime.copy_tensors does not exist in this build")
    src = webgpu_value(np, ort, 8)
    dst = ort.OrtValue.ortvalue_from_numpy(np.zeros(2, np.float32))
    say(stage="copy")
    try:
        ort.copy_tensors([src], [dst])
    except Exception as exc:  # noqa: BLE001
        done("present", f"copy_tensors(WebGPU float32[8] -> CPU float32[2]) refused: {str(exc)[:160]}")
    done("missing", "copy_tensors(WebGPU float32[8] -> CPU float32[2]) was accepted: it wrote 24 bytes past the "
                    "destination (ortcapture patch 0003)")


def case_aliased_copy(np, ort) -> None:
    if not hasattr(ort, "copy_tensors"):
        done("not testable", "onnxruntime.copy_tensors does not exist in this build")
    value = webgpu_value(np, ort, 4)
    say(stage="copy")
    try:
        ort.copy_tensors([value], [value])
    except Exception as exc:  # noqa: BLE001
        done("present", f"copy_tensors(v, v) on WebGPU returned an error: ...{str(exc).splitlines()[0][-120:]}")
    done("present", "copy_tensors(v, v) on WebGPU returned (no abort)")


def case_update_inplace(np, ort) -> None:
    dst = ort.OrtValue.ortvalue_from_numpy(np.zeros(2, np.float32))
    src = ort.OrtValue.ortvalue_from_numpy(np.ones(2, np.float32))
    try:
        dst.update_inplace(src)
    except (TypeError, RuntimeError, ValueError) as exc:
        done("missing", f"OrtValue.update_inplace(OrtValue) refused: {str(exc).splitlines()[0][:160]}")
    if dst.numpy().tolist() != [1.0, 1.0]:
        done("missing", f"OrtValue.update_inplace(OrtValue) left {dst.numpy().tolist()}")
    done("present", "OrtValue.update_inplace(OrtValue) copied [1.0, 1.0] into a CPU value")


def case_webgpu_io_guards(np, ort) -> None:
    names = [n for n in ("_reject_if_pinned",) if hasattr(ort.IOBinding, n)]
    from onnxruntime.capi import _pybind_state as C

    query = hasattr(C.InferenceSession, "is_webgpu_graph_capture_enabled")
    if names and query:
        done("present", "IOBinding._reject_if_pinned and InferenceSession.is_webgpu_graph_capture_enabled exist")
    done("missing", "ORT's Python layer has no WebGPU I/O guards (IOBinding._reject_if_pinned: "
                    f"{bool(names)}, is_webgpu_graph_capture_enabled: {query})")


def case_cancopy_vendor_guard(np, ort) -> None:
    from ortcapture._ort import cuda_probe

    cuda = cuda_probe.status()
    if not cuda.offered:
        done("not testable", "needs one build holding both the CUDA and the WebGPU EP; this build has no CUDA EP")
    if not cuda.loads:  # ORT would log the failed load and fail the CUDA OrtValue below
        done("not testable", f"CUDA EP does not load ({cuda.cause})")
    if not hasattr(ort, "copy_tensors"):
        done("not testable", "onnxruntime.copy_tensors does not exist in this build")
    from ortcapture import webgpu

    if webgpu.plugin_installed():
        try:
            webgpu.register()
        except Exception as exc:  # noqa: BLE001
            done("not testable", f"WebGPU plugin EP not registered: {exc}")
    src = ort.OrtValue.ortvalue_from_numpy(np.arange(4, dtype=np.float32), "cuda", 0)
    dst = ort.OrtValue.ortvalue_from_shape_and_type([4], np.float32, "cuda", 0)
    say(stage="copy")
    try:
        ort.copy_tensors([src], [dst])
    except Exception as exc:  # noqa: BLE001
        done("not testable", f"a CUDA->CUDA copy_tensors reaches no data transfer here: {str(exc)[:160]}")
    if dst.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]:
        done("present", "CUDA->CUDA copy_tensors copied correctly with the WebGPU EP registered")
    done("missing", f"CUDA->CUDA copy_tensors with the WebGPU EP registered gave {dst.numpy().tolist()}")


CASES = {
    "copy-size-check": case_copy_size_check,
    "aliased-copy": case_aliased_copy,
    "update-inplace": case_update_inplace,
    "webgpu-io-guards": case_webgpu_io_guards,
    "cancopy-vendor-guard": case_cancopy_vendor_guard,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CASES:
        print(f"usage: python -m ortcapture.cli.selftest_probe {{{','.join(CASES)}}}", file=sys.stderr)
        return 2
    import numpy as np
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    say(stage="start", ort=ort.__version__)
    CASES[argv[0]](np, ort)
    return 2  # every case ends in done()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
