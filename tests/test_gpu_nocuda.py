"""A GPU user's set-up on a machine without CUDA (issue 31): onnxruntime-gpu installed without its CUDA libraries, no
NVIDIA driver, no GPU. ORT lists the CUDA EP, cannot load it, logs that and runs on the CPU; every ortcapture command
must say the cause in its own words (checked in ortcapture's own lines, never in ORT's log lines):

* the probe (:mod:`ortcapture._ort.cuda_probe`) names the first library the loader misses;
* ``demo`` falls back to WebGPU with one line naming it (exit 0), or exits 2 naming both causes without WebGPU;
* ``doctor`` exits 2 naming it, without the placement findings a CPU-only session would produce;
* ``bench`` refuses with it (``auto`` and ``--provider cuda``); ``serve`` too, once it exists;
* ``selftest`` reports the CUDA case "not testable" with the cause in full;
* the library: ``pick_provider("auto")`` and ``patched("auto")`` skip the CUDA EP, ``pick_provider("cuda")`` and a
  capture-enabled CUDA ``InferenceSession`` refuse naming the cause (not the plugin-EP hint).

The venv (``.venv-gpu-nocuda``) is made by ``tools/bootstrap.sh --gpu-nocuda``; tools/test.sh makes it once and
passes it as ``ORTCAPTURE_NOCUDA_VENV`` (the tests skip without it). The commands run on tiny models.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests import tiny

VENV = os.environ.get("ORTCAPTURE_NOCUDA_VENV")
pytestmark = pytest.mark.skipif(not VENV, reason="ORTCAPTURE_NOCUDA_VENV not set (tools/test.sh sets it in the first "
                                                 "ORT version's run only: the venv of tools/bootstrap.sh --gpu-nocuda)")
# ORT's own log lines ("2026-... [E:onnxruntime:Default, provider_bridge_ort.cc:...] ... Failed to load library")
ORT_LOG = ("[E:onnxruntime", "[W:onnxruntime", "[I:onnxruntime")
WEBGPU_ENV = ("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "VK_ICD_FILENAMES", "VK_DRIVER_FILES")


def run(*argv: str, cwd: Path, webgpu: bool = True, timeout: float = 120, path: str | None = None
        ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and (webgpu or k not in WEBGPU_ENV)}
    if path:
        env["PYTHONPATH"] = path
    return subprocess.run([str(Path(VENV) / "bin" / "python"), *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)


def own_lines(text: str) -> list[str]:
    """ortcapture's lines of a command's output (ORT's log lines and the Vulkan adapter's warnings left out)."""
    return [ln for ln in text.splitlines() if ln.strip() and not any(m in ln for m in ORT_LOG)
            and not ln.startswith("Warning: maxDynamic")]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("nocuda")
    (d / "add.onnx").write_bytes(tiny.add_model())
    return d


@pytest.fixture(scope="module")
def probe(work) -> dict:
    proc = run("-c", "import json; from ortcapture._ort import cuda_probe; s = cuda_probe.status(); "
                     "print(json.dumps({**s.as_dict(), 'refusal': s.refusal}))", cwd=work)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    if got["loads"]:
        pytest.skip("the CUDA EP loads on this machine: not the no-CUDA situation")
    return got


def test_probe_names_the_missing_library(probe):
    assert probe["offered"] is True  # onnxruntime-gpu lists the EP it cannot load
    assert probe["ort_cuda"] and probe["ort_cuda"].startswith("13")  # onnxruntime-gpu 1.31.1: CUDA 13.0
    lib = probe["missing_library"]
    assert lib and lib.startswith("lib") and ".so." in lib, probe
    assert probe["cause"].startswith(f"{lib} not found"), probe["cause"]
    assert probe["refusal"] == f"the CUDA EP does not load ({probe['cause']})"
    assert "docs/GPU.md" in probe["cause"]
    assert probe["preload"].startswith("not called")  # no NVIDIA pip packages in this venv


def test_preload_dlls_prints_are_captured_and_json_stays_clean(probe, work):
    """NVIDIA's pip package folder on ``sys.path`` (here outside ORT's site-packages, so ortcapture passes it as
    ``directory=``) holding a library that cannot load: ORT's ``preload_dlls()`` prints "Failed to load ...", which
    ortcapture keeps out of ``doctor --json``'s stdout and records in the probe."""
    lib = work / "site" / "nvidia" / "cu13" / "lib" / "libcublasLt.so.13"
    lib.parent.mkdir(parents=True, exist_ok=True)
    lib.write_bytes(b"not a shared library")
    proc = run("-m", "ortcapture", "doctor", str(work / "add.onnx"), "--json", cwd=work, path=str(work / "site"))
    assert proc.returncode == 2, proc.stderr
    report = json.loads(proc.stdout)  # nothing but the JSON object on stdout
    cuda = report["findings"][0]["details"]["cuda_ep"]
    assert cuda["preload"] == f"called with directory={lib.parent}"
    assert f"Failed to load {lib}" in cuda["preload_output"]
    assert cuda["missing_library"] == probe["missing_library"]


def test_demo_falls_back_to_webgpu_with_one_line(probe, work):
    proc = run("-m", "ortcapture", "demo", str(work / "add.onnx"), "--iters", "1", cwd=work)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in own_lines(proc.stderr) if "CUDA" in ln]
    assert lines == [f"ortcapture demo: {probe['refusal']}; falling back to WebGPU"], proc.stderr
    assert probe["missing_library"] in lines[0]
    assert "provider WebGpuExecutionProvider" in proc.stdout


def test_demo_without_webgpu_names_both_causes(probe, work):
    proc = run("-m", "ortcapture", "demo", str(work / "add.onnx"), "--iters", "1", cwd=work, webgpu=False)
    assert proc.returncode == 2, proc.stderr
    last = own_lines(proc.stderr)[-1]
    assert last.startswith(f"ortcapture demo: {probe['refusal']}, and WebGPU is not usable here"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_doctor_exits_2_naming_the_cause_without_cpu_node_findings(probe, work):
    proc = run("-m", "ortcapture", "doctor", str(work / "add.onnx"), "--json", cwd=work)
    assert proc.returncode == 2, proc.stderr
    report = json.loads(proc.stdout)
    assert report["verdict"] == "error" and report["exit_code"] == 2
    kinds = [f["kind"] for f in report["findings"]]
    assert kinds == ["provider"], report["findings"]  # no placement, capture or host-read findings
    assert report["findings"][0]["message"].startswith(probe["refusal"])
    assert report["capture"]["attempted"] is False
    text = run("-m", "ortcapture", "doctor", str(work / "add.onnx"), cwd=work)
    assert text.returncode == 2
    findings = [ln.strip() for ln in text.stdout.splitlines() if ln.startswith("  [")]
    assert findings == [f"[error] provider: {probe['refusal']}: no placement check or capture attempted"], text.stdout
    assert "CPU" not in text.stdout, text.stdout


@pytest.mark.parametrize("provider", ["auto", "cuda"])
def test_bench_refuses_naming_the_cause(probe, work, provider):
    proc = run("-m", "ortcapture", "bench", str(work / "add.onnx"), "--provider", provider, "--procs", "1",
               "--iters", "1", cwd=work)
    assert proc.returncode == 2, proc.stderr
    assert own_lines(proc.stderr)[-1].startswith(f"ortcapture bench: {probe['refusal']}"), proc.stderr
    assert proc.stdout == ""


def test_serve_refuses_naming_the_cause(probe, work):
    proc = run("-m", "ortcapture", "serve", "--help", cwd=work)
    if proc.returncode != 0:
        pytest.skip("no `ortcapture serve` in this checkout")
    (work / "batch.onnx").write_bytes(tiny.round_model(("batch", 4)))  # serve needs a dynamic batch dim
    for provider in ("auto", "cuda"):  # refused before Ray is needed (this venv has none)
        proc = run("-m", "ortcapture", "serve", str(work / "batch.onnx"), "--provider", provider, cwd=work,
                   timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert own_lines(proc.stderr)[-1].startswith(f"ortcapture serve: {probe['refusal']}"), proc.stderr


def test_selftest_says_not_testable_with_the_full_cause(probe, work):
    proc = run("-m", "ortcapture", "selftest", "--case", "cancopy-vendor-guard", "--json", cwd=work)
    assert proc.returncode == 0, proc.stderr
    case = json.loads(proc.stdout)["cases"][0]
    assert case["result"] == "not testable"
    assert case["evidence"] == f"CUDA EP does not load ({probe['cause']})"


LIBRARY = """
import json, ortcapture
from ortcapture._ort.providers import pick_provider
out = {"auto": pick_provider("auto")}
try:
    pick_provider("cuda")
except ortcapture.CaptureUnsupportedError as exc:
    out["cuda"] = str(exc)
try:
    ortcapture.InferenceSession("add.onnx", providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"}),
                                                      "CPUExecutionProvider"])
except ortcapture.CaptureUnsupportedError as exc:
    out["session"] = str(exc)
with ortcapture.patched("auto") as cls:
    out["patched"] = cls._oc_defaults["provider"]
print(json.dumps(out))
"""


def test_library_skips_or_refuses_naming_the_cause(probe, work):
    proc = run("-c", LIBRARY, cwd=work)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["auto"] == "webgpu" and out["patched"] == "webgpu"
    assert out["cuda"] == probe["refusal"]
    assert out["session"].startswith("graph capture was requested for CUDAExecutionProvider, but the session runs "
                                     "on ['CPUExecutionProvider'] without capture: " + probe["refusal"])
    assert "plugin EP" not in out["session"]
