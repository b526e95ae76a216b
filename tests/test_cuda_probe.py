"""The CUDA EP probe (:mod:`ortcapture._ort.cuda_probe`, issue 31) in this venv, and on a GPU (``@pytest.mark.cuda``).

The no-CUDA situation with onnxruntime-gpu (the loader's missing library in every command's words) is
tests/test_gpu_nocuda.py; the extras' resolution is tests/test_gpu_extras.py.
"""
from __future__ import annotations

import ctypes
import glob
import os

import onnxruntime as ort
import pytest

from ortcapture._ort import cuda_probe
from ortcapture._ort.providers import pick_provider
from ortcapture.errors import CaptureUnsupportedError


def test_status_is_probed_once_per_process():
    assert cuda_probe.status() is cuda_probe.status()
    assert cuda_probe.status("TensorrtExecutionProvider") is cuda_probe.status("TensorrtExecutionProvider")


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="an onnxruntime-gpu venv")
def test_a_cpu_onnxruntime_offers_no_cuda_ep():
    s = cuda_probe.status()
    assert (s.offered, s.loads, s.refusal) == (False, False, None)
    assert ort.__version__ in s.cause
    with pytest.raises(CaptureUnsupportedError, match="the CUDA EP is not available"):
        pick_provider("cuda")


def test_needed_reads_the_dt_needed_entries_of_a_real_library(tmp_path):
    pybind = glob.glob(os.path.join(os.path.dirname(ort.__file__), "capi", "onnxruntime_pybind11_state*.so"))[0]
    needed = cuda_probe._needed(pybind)
    assert "libc.so.6" in needed and "libstdc++.so.6" in needed
    not_elf = tmp_path / "x.so"
    not_elf.write_bytes(b"not an ELF file at all" * 8)
    assert cuda_probe._needed(str(not_elf)) == [] and cuda_probe._needed(str(tmp_path / "missing.so")) == []


def _system_cudart() -> str:
    for name in ("libcudart.so.13", "libcudart.so.12"):
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return name
    pytest.skip("no CUDA runtime library on the loader path")


def test_device_check_without_a_driver_says_so():
    """A CUDA runtime without ``libcuda.so.1`` (a toolkit without a driver): cudaDriverGetVersion reports 0."""
    cudart = _system_cudart()
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("an NVIDIA driver is installed here")
    except OSError:
        pass
    driver, devices, cause = cuda_probe._device_check(cudart, "onnxruntime-gpu X is built for CUDA 13.0", 13)
    assert (driver, devices) == (None, None)
    assert cause.startswith("no NVIDIA driver") and cuda_probe.MIN_DRIVER[13] in cause


def test_missing_library_causes_name_the_fix():
    built = "onnxruntime-gpu 1.31.1 is built for CUDA 13.0"
    cause = cuda_probe._missing_cause("libcublasLt.so.13", "libcublasLt.so.13: cannot open shared object file",
                                      built, 13)
    assert cause.startswith("libcublasLt.so.13 not found: " + built) and "[cuda] extra" in cause
    assert "[cuda12] extra" in cuda_probe._missing_cause("libcublas.so.12", "", built.replace("13", "12"), 12)
    assert "no NVIDIA driver" in cuda_probe._missing_cause("libcuda.so.1", "", built, 13)
    assert "cuDNN 9" in cuda_probe._missing_cause("libcudnn.so.9", "", built, 13)
    odd = "libonnxruntime_providers_cuda.so: undefined symbol: Provider_GetHost"
    assert cuda_probe._missing_cause(None, odd, built, 13).endswith(odd)


def test_cuda_python_of_another_major_is_noted():
    note = cuda_probe._cuda_python_note("12.9.4", 13)
    assert "cuda-python 12.9.4 is for CUDA 12" in note and "cuda-python 13.x" in note
    assert cuda_probe._cuda_python_note("13.0.1", 13) is None and cuda_probe._cuda_python_note(None, 13) is None


# -- on a GPU -------------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_on_a_gpu_the_ep_loads_with_a_driver_and_a_device():
    s = cuda_probe.status()
    if not s.offered:
        pytest.skip("not an onnxruntime-gpu venv")
    assert s.loads, s.cause
    assert s.devices and s.devices >= 1
    assert int(s.driver_cuda.split(".")[0]) >= s.ort_cuda_major
    assert any(name.startswith("libcublasLt.so.") for name in s.loaded_from), s.loaded_from
    assert pick_provider("auto") == "cuda" and cuda_probe.refusal() is None


@pytest.mark.cuda
def test_on_a_gpu_the_pip_libraries_are_the_ones_mapped():
    """Where NVIDIA's pip packages are on sys.path, the preloaded copies are the ones the process maps (once)."""
    s = cuda_probe.status()
    if not s.loads or not s.preload.startswith("called"):
        pytest.skip(f"the CUDA EP does not load or nothing was preloaded: {s.cause or s.preload}")
    lt = s.loaded_from.get(f"libcublasLt.so.{s.ort_cuda_major}")
    assert lt and "/nvidia/" in os.path.realpath(lt), s.loaded_from
