"""GPU check of issue 31: after ortcapture's probe (``onnxruntime.preload_dlls()``) and a CUDA session, the CUDA libraries
ORT uses come from NVIDIA's pip packages, not from the system CUDA in the loader cache.

    PYTHONPATH=/tmp/site /opt/torch/.venv/bin/python tools/h200_cuda_probe_check.py   # writes $OUT/h200_cuda_probe.json

The system libraries sit in the loader cache, so an empty ``LD_LIBRARY_PATH`` proves nothing: this reads the files the
process really mapped (``/proc/self/maps``). Steps: :func:`ortcapture._ort.cuda_probe.status` (preloads, probes the
provider library, the driver, the devices), then an ``ortcapture.InferenceSession`` with CUDA graphs on a tiny model
(capture, replay, compare), then the maps. For contrast, a child process makes a raw ORT CUDA session without any
preload and reports where its libcublasLt came from. torch is never imported (it would load the pip libraries itself).

Prints one JSON object; exit 0 when the EP loads, the session captures and replays exactly, preload_dlls was called,
and libcublasLt (and libcudart) are mapped once each, from a ``site-packages/nvidia/`` folder; else exit 1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RAW_CHILD = """
import json, sys, onnxruntime as ort
sess = ort.InferenceSession(sys.argv[1], providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcublasLt.so" in l})
print(json.dumps({"providers": sess.get_providers(), "libcublasLt": maps}))
"""


def mapped(prefix: str) -> list[str]:
    """Distinct files mapped into this process whose name starts with ``prefix`` (e.g. ``libcublasLt.so``)."""
    with open("/proc/self/maps") as f:
        paths = {ln.split()[-1] for ln in f if "/" in ln and os.path.basename(ln.split()[-1]).startswith(prefix)}
    return sorted(paths)


def from_pip(path: str) -> bool:
    real = os.path.realpath(path)
    return "/site-packages/nvidia/" in real or "/dist-packages/nvidia/" in real


def main() -> int:
    import numpy as np

    from ortcapture._ort import cuda_probe
    from tests import tiny

    out_dir = Path(os.environ.get("OUT") or ".")
    model = out_dir / "h200_cuda_probe_add.onnx"
    model.write_bytes(tiny.add_model())
    status = cuda_probe.status()
    after_probe = {"libcublasLt": mapped("libcublasLt.so"), "libcudart": mapped("libcudart.so")}
    result: dict = {"python": sys.executable, "probe": status.as_dict(), "after_probe": after_probe}
    problems = []
    if not status.loads:
        problems.append(f"the CUDA EP does not load: {status.cause}")
    else:
        import onnxruntime as ort

        import ortcapture

        sess = ortcapture.InferenceSession(str(model), providers=[
            ("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"])
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        b = np.full((2, 4), 0.5, np.float32)
        graph = sess.capture({"A": a, "B": b})
        replay = graph.run({"A": b, "B": a})[0]  # host numpy copies of the outputs
        result["session"] = {"providers": sess.get_providers(), "capture_enabled": sess.capture_enabled,
                             "replay_exact": bool(np.array_equal(replay, a + b)), "onnxruntime": ort.__version__}
        if not (sess.capture_enabled and result["session"]["replay_exact"]):
            problems.append("the CUDA session did not capture and replay exactly")
    maps = {"libcublasLt": mapped("libcublasLt.so"), "libcudart": mapped("libcudart.so"),
            "libcudnn": mapped("libcudnn.so"), "libcublas": [p for p in mapped("libcublas.so") if "Lt" not in p]}
    result["mapped"] = maps
    result["torch_imported"] = "torch" in sys.modules
    if not status.preload.startswith("called"):
        problems.append(f"preload_dlls was not called: {status.preload}")
    for lib in ("libcublasLt", "libcudart"):
        if len(maps[lib]) != 1:
            problems.append(f"{lib} is mapped {len(maps[lib])} times: {maps[lib]}")
        elif not from_pip(maps[lib][0]):
            problems.append(f"{lib} came from {maps[lib][0]}, not from NVIDIA's pip packages")
    if result["torch_imported"]:
        problems.append("torch was imported (it loads the pip libraries itself)")
    try:  # contrast: raw ORT without any preload
        child = subprocess.run([sys.executable, "-c", RAW_CHILD, str(model)], capture_output=True, text=True,
                               timeout=300)
        result["raw_ort_without_preload"] = (json.loads(child.stdout.splitlines()[-1]) if child.returncode == 0
                                             else {"error": child.stderr[-500:]})
    except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        result["raw_ort_without_preload"] = {"error": repr(exc)}
    result["problems"] = problems
    result["ok"] = not problems
    text = json.dumps(result, indent=2)
    print(text)
    (out_dir / "h200_cuda_probe.json").write_text(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
