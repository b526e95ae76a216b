"""The CUDA extras resolve to what ORT's CUDA EP loads, at both ends of the supported onnxruntime-gpu range (issue 31).

``ortcapture[cuda]`` is for the onnxruntime-gpu releases built for CUDA 13 (1.27.0 and later), ``ortcapture[cuda12]``
for those built for CUDA 12 (1.24.4 to 1.26.0): each brings ``onnxruntime-gpu[cuda,cudnn]`` (ORT's own extras: the
CUDA runtime, NVRTC, cuFFT, cuRAND, cuDNN 9 and through it cuBLAS) and a cuda-python of the same CUDA major. Checked
with ``pip install --dry-run --ignore-installed --report -`` (a full resolution, nothing installed; pip's cache keeps
the metadata). Needs the package index: tools/test.sh runs it once (``ORTCAPTURE_PIP_RESOLVE=1``).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(os.environ.get("ORTCAPTURE_PIP_RESOLVE") != "1",
                                reason="resolves against the package index: ORTCAPTURE_PIP_RESOLVE=1 (tools/test.sh)")


def resolve(*requirements: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--disable-pip-version-check", "--report", "-", *requirements],
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


def installed(*requirements: str) -> dict[str, str]:
    proc = resolve(*requirements)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    return {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"]
            for i in report["install"]}


def major(version: str) -> int:
    return int(version.split(".")[0])


@pytest.mark.parametrize("ort_gpu, extra, cuda", [("1.31.1", "cuda", 13), ("1.24.4", "cuda12", 12)])
def test_extra_resolves_one_cuda_major(ort_gpu, extra, cuda):
    got = installed(f"onnxruntime-gpu=={ort_gpu}", f"{ROOT}[{extra}]")
    assert got["onnxruntime-gpu"] == ort_gpu
    assert major(got["cuda-python"]) == cuda and major(got["cuda-bindings"]) == cuda, got
    # what libonnxruntime_providers_cuda.so loads: the CUDA runtime, cuBLAS(Lt), cuRAND, cuFFT, NVRTC, cuDNN 9
    suffix = "" if cuda >= 13 else "-cu12"
    for lib in ("nvidia-cuda-runtime", "nvidia-cublas", "nvidia-curand", "nvidia-cufft", "nvidia-cuda-nvrtc"):
        assert lib + suffix in got, (lib, got)
    assert major(got["nvidia-cuda-runtime" + suffix]) == cuda and major(got["nvidia-cublas" + suffix]) == cuda
    assert major(got[f"nvidia-cudnn-cu{cuda}"]) == 9
    other = [n for n in got if n.startswith("nvidia-") and (n.endswith("-cu12") if cuda >= 13 else
                                                             not n.endswith("-cu12"))]
    assert other == [], f"CUDA packages of another major: {other}"  # one CUDA in the venv
    assert "onnxruntime" not in got  # the CPU distribution would overwrite onnxruntime-gpu's files


def test_cuda_extra_refuses_a_cuda12_onnxruntime_gpu():
    """``[cuda]`` with an onnxruntime-gpu built for CUDA 12 does not resolve (rather than pairing it with a
    cuda-python for CUDA 13); ``[cuda12]`` is the extra for it."""
    proc = resolve("onnxruntime-gpu==1.24.4", f"{ROOT}[cuda]")
    assert proc.returncode != 0
    assert "ResolutionImpossible" in proc.stderr or "conflict" in proc.stderr, proc.stderr[-2000:]
