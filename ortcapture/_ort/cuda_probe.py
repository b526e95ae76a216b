"""Whether ORT's CUDA EP really loads here, and why not: one deterministic probe, cached per process.

ORT does not fail when its CUDA EP cannot load. ``get_available_providers()`` lists ``CUDAExecutionProvider``
whenever onnxruntime-gpu is installed; ``InferenceSession(providers=["CUDAExecutionProvider", ...])`` then logs
"Failed to load library libonnxruntime_providers_cuda.so with error: libcublasLt.so.13: cannot open shared object
file" and silently gives a CPU session (measured: onnxruntime-gpu 1.31.1 on a machine without the CUDA libraries).
Parsing that log is not reliable, so :func:`status` asks the dynamic loader and the CUDA runtime itself:

1. ``onnxruntime.preload_dlls()`` (ORT >= 1.21) first, where NVIDIA's pip packages (``nvidia/cu13/lib``,
   ``nvidia/cublas/lib``, ``nvidia/cudnn/lib`` ...) are installed and no other cuBLASLt is loaded yet (ORT got
   there first: the pip copies would only be mapped beside it), as ORT documents for pip-installed CUDA. It prints to
   stdout, which is captured (``--json`` output stays clean). ORT only looks beside its own
   site-packages; when the packages live in another ``sys.path`` entry (ORT installed with ``--target`` or put on
   ``PYTHONPATH``), their CUDA >= 13 folder is passed as ``directory=``;
2. ``ctypes.CDLL`` of ``libonnxruntime_providers_shared.so`` (``RTLD_GLOBAL``, as ORT loads it) and then of ORT's
   ``libonnxruntime_providers_cuda.so``: the loader's error names the first missing library (cuBLAS, cuRAND, the
   CUDA runtime, ``libcuda.so.1`` of the driver);
3. cuDNN 9 (``libcudnn.so.9``), which the provider library loads later rather than at load time;
4. ``cudaDriverGetVersion`` / ``cudaGetDeviceCount`` of the CUDA runtime the provider library links (its
   ``DT_NEEDED`` ``libcudart.so.NN``, already loaded by step 2; called through ``ctypes``, so the answer is the
   runtime ORT uses whatever cuda-python's major is): no device, and a driver too old for the CUDA version ORT was
   built for (``onnxruntime.capi.build_and_package_info.cuda_version``, else that ``libcudart.so.NN``).

Nothing here imports another ortcapture module. Linux only (elsewhere :func:`status` reports the EP as ORT offers it).
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import struct
import sys
import threading
from dataclasses import asdict, dataclass, field

#: ORT's provider library per EP (in ``onnxruntime/capi``)
PROVIDER_LIBRARIES = {
    "CUDAExecutionProvider": "libonnxruntime_providers_cuda.so",
    "TensorrtExecutionProvider": "libonnxruntime_providers_tensorrt.so",
}
SHARED_LIBRARY = "libonnxruntime_providers_shared.so"
CUDNN_LIBRARY = "libcudnn.so.9"
#: the oldest Linux NVIDIA driver per CUDA major (CUDA's minor version compatibility: any 12.x / 13.x runtime runs on
#: the first driver of its major; NVIDIA's CUDA Toolkit release notes, table 2)
MIN_DRIVER = {12: "525.60.13", 13: "580.65.06"}
#: onnxruntime-gpu releases on PyPI per CUDA major (their ``[cuda,cudnn]`` extras install that CUDA's pip packages)
ORT_GPU_RELEASES = {12: "1.24.4 to 1.26.0", 13: "1.27.0 and later"}
#: the ortcapture extra that installs the CUDA libraries of each CUDA major (pyproject.toml, docs/GPU.md)
EXTRA = {12: "cuda12", 13: "cuda"}
_NOT_FOUND = re.compile(r"^(?P<lib>[^\s:]+\.so[.\d]*): cannot open shared object file")
_CUDART = re.compile(r"^libcudart\.so\.(\d+)$")
# CUDA runtime error codes (cudaError_t)
_NO_DEVICE, _INSUFFICIENT_DRIVER, _STUB_LIBRARY = 100, 35, 34


@dataclass(frozen=True)
class EpLoad:
    """What :func:`status` found for one EP. ``loads``: ORT offers the EP, its library loads, and there is a CUDA
    device with a driver new enough; ``cause``: why not, one line in ortcapture's words (``None`` when it loads)."""

    ep: str
    offered: bool  # get_available_providers() lists it (an onnxruntime-gpu build)
    loads: bool
    cause: str | None = None
    missing_library: str | None = None  # the first library the loader could not find, e.g. "libcublasLt.so.13"
    ort_cuda: str | None = None  # CUDA version this onnxruntime was built for, e.g. "13.0" (or "13": from libcudart)
    driver_cuda: str | None = None  # the CUDA version the NVIDIA driver supports, e.g. "13.0"
    devices: int | None = None  # CUDA devices the runtime sees
    preload: str = "not called"  # "called", "called with directory=...", "not called: <why>"
    preload_output: str = ""  # what onnxruntime.preload_dlls() printed (captured)
    loaded_from: dict = field(default_factory=dict)  # soname -> file the process mapped (/proc/self/maps)
    cuda_python: str | None = None  # installed cuda-python (cuda-bindings) version
    note: str | None = None  # a problem that does not stop the EP (cuda-python of another CUDA major)

    @property
    def ort_cuda_major(self) -> int | None:
        """The CUDA major this onnxruntime was built for (13 for ``"13.0"``), or ``None``."""
        return _major(self.ort_cuda)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def refusal(self) -> str | None:
        """``"the CUDA EP does not load (<cause>)"`` when ORT offers the EP and it does not load, else ``None``."""
        if not self.offered or self.loads:
            return None
        return f"the {_short(self.ep)} EP does not load ({self.cause})"


def _short(ep: str) -> str:
    return {"CUDAExecutionProvider": "CUDA", "TensorrtExecutionProvider": "TensorRT"}.get(ep, ep)


_LOCK = threading.Lock()
_CACHE: dict[str, EpLoad] = {}


def status(ep: str = "CUDAExecutionProvider") -> EpLoad:
    """Whether ``ep`` (``"CUDAExecutionProvider"`` or ``"TensorrtExecutionProvider"``) really loads here, and why not.

    Probed once per process (see the module docstring); later calls return the same :class:`EpLoad`. The first call
    loads the CUDA libraries into the process, as ORT's first CUDA session would, and may initialise the CUDA
    driver (``cudaGetDeviceCount``); it creates no CUDA context on any device. Never raises for a failed load.
    """
    with _LOCK:
        got = _CACHE.get(ep)
        if got is None:
            got = _CACHE[ep] = _probe(ep)
        return got


def refusal(ep: str = "CUDAExecutionProvider") -> str | None:
    """``"the CUDA EP does not load (<cause>)"`` when onnxruntime offers ``ep`` and it does not load, else ``None``."""
    return status(ep).refusal


def cuda_ep_loads() -> bool:
    """Whether the CUDA EP is offered and really loads (:func:`status`)."""
    return status().loads


# ---------------------------------------------------------------------------------------------------------------
def _probe(ep: str) -> EpLoad:
    import onnxruntime as ort

    offered = ep in ort.get_available_providers()
    cuda_python = _cuda_python_version()
    if not offered:
        return EpLoad(ep, False, False, f"onnxruntime {ort.__version__} has no {ep} (it is not an onnxruntime-gpu "
                      "build)", cuda_python=cuda_python)
    capi = os.path.join(os.path.dirname(ort.__file__), "capi")
    library = os.path.join(capi, PROVIDER_LIBRARIES.get(ep, PROVIDER_LIBRARIES["CUDAExecutionProvider"]))
    needed = _needed(library)
    ort_cuda = _ort_cuda_version(needed)
    major = _major(ort_cuda)
    note = _cuda_python_note(cuda_python, major)
    base = dict(ep=ep, offered=True, ort_cuda=ort_cuda, cuda_python=cuda_python, note=note)
    if not sys.platform.startswith("linux"):
        return EpLoad(loads=True, preload="not called: not Linux", **base)
    preload, printed = _preload(ort, major)
    base.update(preload=preload, preload_output=printed)
    built = f"onnxruntime-gpu {ort.__version__} is built for CUDA {ort_cuda or '?'}"
    try:
        ctypes.CDLL(os.path.join(capi, SHARED_LIBRARY), mode=os.RTLD_GLOBAL)
        ctypes.CDLL(library)
    except OSError as exc:
        text = str(exc)
        found = _NOT_FOUND.match(text)
        lib = found.group("lib") if found else None
        return EpLoad(loads=False, cause=_missing_cause(lib, text, built, major), missing_library=lib,
                      loaded_from=_maps(), **base)
    try:
        ctypes.CDLL(CUDNN_LIBRARY)
    except OSError:
        return EpLoad(loads=False, missing_library=CUDNN_LIBRARY, loaded_from=_maps(), cause=(
            f"{CUDNN_LIBRARY} not found: the CUDA EP needs cuDNN 9 for CUDA {major or '?'}; {_install(major)}"),
            **base)
    cudart = next((n for n in needed if _CUDART.match(n)), None)
    driver, devices, cause = _device_check(cudart, built, major)
    return EpLoad(loads=cause is None, cause=cause, driver_cuda=driver, devices=devices, loaded_from=_maps(), **base)


def _install(major: int | None) -> str:
    cuda = f"CUDA {major}" if major else "CUDA"
    return (f"install its {cuda} libraries (ortcapture's [{EXTRA.get(major or 0, 'cuda')}] extra) or a system {cuda} "
            "with cuDNN 9 (docs/GPU.md)")


def _missing_cause(lib: str | None, text: str, built: str, major: int | None) -> str:
    if lib is None:  # not a missing file: a wrong architecture, an undefined symbol, an old libstdc++ ...
        return f"the loader refused ORT's CUDA provider library: {text}"
    if lib == "libcuda.so.1":
        return ("libcuda.so.1 not found: no NVIDIA driver is installed (the CUDA EP needs an NVIDIA GPU and its "
                f"driver{', >= ' + MIN_DRIVER[major] if major in MIN_DRIVER else ''})")
    if lib.startswith("libcudnn"):
        return f"{lib} not found: the CUDA EP needs cuDNN 9; {_install(major)}"
    if lib.startswith(("libnvinfer", "libnvonnxparser")):
        return f"{lib} not found: the TensorRT EP needs TensorRT (NVIDIA's tensorrt pip package, or a system install)"
    return f"{lib} not found: {built}; {_install(major)}"


def _device_check(cudart: str | None, built: str, major: int | None) -> tuple[str | None, int | None, str | None]:
    """``(driver CUDA version, device count, cause or None)`` from the CUDA runtime ORT links."""
    if cudart is None:
        return None, None, None  # cannot tell; ORT's own session creation will
    try:
        rt = ctypes.CDLL(cudart)  # loaded already with the provider library: the same handle
    except OSError:
        return None, None, None
    version = ctypes.c_int(0)
    rt.cudaDriverGetVersion(ctypes.byref(version))
    driver = f"{version.value // 1000}.{version.value % 1000 // 10}" if version.value else None
    need = MIN_DRIVER.get(major or 0)
    if version.value == 0:
        return None, None, ("no NVIDIA driver: the CUDA runtime finds none (the CUDA EP needs an NVIDIA GPU and its "
                            f"driver{', >= ' + need if need else ''})")
    if major is not None and version.value // 1000 < major:
        return driver, None, (f"the NVIDIA driver supports CUDA {driver}, but {built}, which needs a driver >= "
                              f"{need or '?'}: update the driver, or install an onnxruntime-gpu built for CUDA "
                              f"{version.value // 1000} ({ORT_GPU_RELEASES.get(version.value // 1000, 'none')})")
    count = ctypes.c_int(0)
    err = rt.cudaGetDeviceCount(ctypes.byref(count))
    if err == _NO_DEVICE or (err == 0 and count.value == 0):
        return driver, 0, "no CUDA device: the NVIDIA driver is installed but sees no GPU"
    if err == _INSUFFICIENT_DRIVER:
        return driver, None, (f"the NVIDIA driver (CUDA {driver}) is too old for {built} (needs >= {need or '?'})")
    if err == _STUB_LIBRARY:
        return driver, None, "libcuda.so.1 is the CUDA toolkit's stub library, not an NVIDIA driver"
    if err != 0:
        return driver, None, f"cudaGetDeviceCount failed with CUDA error {err}"
    return driver, count.value, None


def _preload(ort, major: int | None) -> tuple[str, str]:
    """Call ``onnxruntime.preload_dlls()`` where ORT has it and NVIDIA's pip packages are installed; return
    ``(what was done, what it printed)``."""
    if not hasattr(ort, "preload_dlls"):
        return "not called: this onnxruntime has no preload_dlls", ""
    if major is None:
        return "not called: the CUDA version of this onnxruntime is unknown", ""
    own = os.path.dirname(os.path.dirname(os.path.abspath(ort.__file__)))
    roots = [own] + [p for p in sys.path if p and os.path.abspath(p) != own]
    cuda_dir = "nvidia/cu%d/lib" % major if major >= 13 else "nvidia/cublas/lib"
    where = next((r for r in roots if os.path.isfile(os.path.join(r, cuda_dir, f"libcublasLt.so.{major}"))), None)
    cudnn = next((r for r in roots if os.path.isfile(os.path.join(r, "nvidia/cudnn/lib", CUDNN_LIBRARY))), None)
    if where is None and cudnn is None:
        return "not called: no NVIDIA pip packages (nvidia/...) on sys.path", ""
    loaded = _maps().get(f"libcublasLt.so.{major}")
    pip_copy = os.path.join(where, cuda_dir, f"libcublasLt.so.{major}") if where else None
    if loaded and (pip_copy is None or os.path.realpath(loaded) != os.path.realpath(pip_copy)):
        # ORT (or torch) loaded another copy already: preloading the pip ones by path would map a second one beside it
        return f"not called: libcublasLt.so.{major} was loaded already, from {loaded}", ""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if where in (None, own) and cudnn in (None, own):
            ort.preload_dlls()
            done = "called"
        elif major >= 13:  # one folder holds every CUDA library; cuDNN keeps its own
            dirs = []
            if where is not None:
                dirs.append(os.path.join(where, cuda_dir))
                ort.preload_dlls(cuda=True, cudnn=False, directory=dirs[-1])
            if cudnn is not None:
                dirs.append(os.path.join(cudnn, "nvidia/cudnn/lib"))
                ort.preload_dlls(cuda=False, cudnn=True, directory=dirs[-1])
            done = f"called with directory={', '.join(dirs)}"
        else:  # CUDA 12 packages keep one folder per library, and preload_dlls takes one folder: ORT's own search
            ort.preload_dlls()
            done = f"called (the CUDA 12 packages in {where} are not beside onnxruntime: ORT searches its own folder)"
    return done, out.getvalue().strip()


def _ort_cuda_version(needed: list[str]) -> str | None:
    try:
        from onnxruntime.capi import build_and_package_info as info

        version = getattr(info, "cuda_version", None)
    except ImportError:
        version = None
    if version:
        return str(version)
    cudart = next((m.group(1) for m in map(_CUDART.match, needed) if m), None)
    return cudart


def _major(version: str | None) -> int | None:
    m = re.match(r"(\d+)", version or "")
    return int(m.group(1)) if m else None


def _cuda_python_version() -> str | None:
    from importlib import metadata

    for dist in ("cuda-bindings", "cuda-python"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cuda_python_note(version: str | None, major: int | None) -> str | None:
    have = _major(version)
    if have is None or major is None or have == major:
        return None
    return (f"cuda-python {version} is for CUDA {have}, this onnxruntime-gpu for CUDA {major}: ortcapture's "
            f"cuda-python helpers (peer access, pointer lookup, the foreign-capture probe) may load another CUDA "
            f"runtime or none; install cuda-python {major}.x (the ortcapture[{EXTRA.get(major, 'cuda')}] extra)")


def _maps() -> dict:
    """soname -> path of the CUDA libraries mapped into this process (Linux ``/proc/self/maps``)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                name = os.path.basename(path)
                if re.match(r"lib(cublasLt|cublas|cudart|cudnn|curand|cufft|nvrtc|cuda)\.so\.\d+", name):
                    out.setdefault(name, path)
    except OSError:
        pass
    return out


def _needed(path: str) -> list[str]:
    """The ``DT_NEEDED`` entries of an ELF64 little-endian shared library (``[]`` when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return []
            phoff, = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            loads, dynamic = [], None
            for i in range(phnum):
                p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", table, i * phentsize)
                if p_type == 1:  # PT_LOAD
                    loads.append((p_vaddr, p_offset, p_filesz))
                elif p_type == 2:  # PT_DYNAMIC
                    dynamic = (p_offset, p_filesz)
            if dynamic is None:
                return []
            f.seek(dynamic[0])
            raw = f.read(dynamic[1])
            entries = [struct.unpack_from("<qQ", raw, k) for k in range(0, len(raw) - 15, 16)]
            strtab = next((v for t, v in entries if t == 5), None)  # DT_STRTAB (a virtual address)
            if strtab is None:
                return []
            base = next((off + strtab - va for va, off, size in loads if va <= strtab < va + size), None)
            if base is None:
                return []
            names = []
            for tag, value in entries:
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED: an offset into the string table
                    f.seek(base + value)
                    names.append(f.read(256).split(b"\0", 1)[0].decode("ascii", "replace"))
            return names
    except (OSError, struct.error):
        return []
