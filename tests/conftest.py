"""Shared fixtures: the capture backends (WebGPU on the software adapter, CUDA on a GPU) and the reference model.

WebGPU tests skip only where WebGPU cannot run; with ORTCAPTURE_REQUIRE_WEBGPU=1 (set by tools/test.sh, so in CI)
an unusable WebGPU fails them instead. CUDA tests carry ``@pytest.mark.cuda`` and skip without the CUDA EP.
"""
from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest

import ortcapture
from ortcapture._ort import compat

WEBGPU_CAPTURE_SINCE = compat.WEBGPU_PLUGIN_CAPTURE_SINCE


def _webgpu_status() -> tuple[bool, str]:
    from ortcapture import webgpu

    if not webgpu.plugin_installed():
        return False, "onnxruntime-ep-webgpu not installed"
    if not compat.webgpu_plugin_captures():
        return False, f"onnxruntime {ort.__version__} cannot capture with the WebGPU plugin EP (needs >= 1.27.0)"
    result = webgpu.probe()
    return bool(result.get("ok")), str(result.get("error", ""))


_WEBGPU = None


def webgpu_available() -> bool:
    global _WEBGPU
    if _WEBGPU is None:
        _WEBGPU = _webgpu_status()
    ok, why = _WEBGPU
    if not ok:
        if os.environ.get("ORTCAPTURE_REQUIRE_WEBGPU") == "1" and compat.ort_version() >= WEBGPU_CAPTURE_SINCE:
            pytest.fail(f"WebGPU is required here (ORTCAPTURE_REQUIRE_WEBGPU=1) but unusable: {why}")
        pytest.skip(f"WebGPU unavailable: {why}")
    return True


def cuda_available() -> bool:
    """The CUDA EP is offered and really loads (onnxruntime-gpu with its CUDA libraries, a driver and a GPU)."""
    from ortcapture._ort import cuda_probe

    return cuda_probe.cuda_ep_loads()


class Backend:
    """How to make capturing sessions on one EP."""

    def __init__(self, name: str):
        self.name = name
        self.device_type = "cuda" if name == "cuda" else "webgpu"

    def session_args(self, capture: bool = True) -> dict:
        from ortcapture._ort.providers import session_args

        so = ort.SessionOptions()
        so.log_severity_level = 3
        return session_args(self.name, capture, so)

    def session(self, model, capture: bool = True, **kw) -> ortcapture.InferenceSession:
        return ortcapture.InferenceSession(model, **self.session_args(capture), **kw)

    def plain(self, model) -> ort.InferenceSession:
        return ort.InferenceSession(model, **self.session_args(False))

    def __repr__(self):
        return self.name


@pytest.fixture(params=[pytest.param("webgpu", marks=pytest.mark.webgpu), pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request) -> Backend:
    if request.param == "cuda":
        if not cuda_available():
            pytest.skip("CUDA EP unavailable (onnxruntime-gpu on an NVIDIA GPU)")
    else:
        webgpu_available()
    return Backend(request.param)


@pytest.fixture(scope="session")
def reference_model_path() -> str:
    from ortcapture.cli import models

    return str(models.reference_model())


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def no_host_path(monkeypatch):
    """Call it to make any host round trip in ortcapture's transfers (ortcapture._transfer) fail the test from then on."""
    from ortcapture._transfer import copy as tcopy

    def boom(*a, **k):
        raise AssertionError("went through the host")

    def arm():
        monkeypatch.setattr(tcopy, "_copy_host_to", boom)
        monkeypatch.setattr(tcopy.np, "from_dlpack", boom)

    return arm


def _process_state() -> str:
    """What the process holds when a device test fails: live sessions, their captured graphs, threads, memory (the
    first CI failure on ORT 1.27 WebGPU — replays of fresh captures read wrong values in 5 tests of one process — did
    not reproduce locally; this section says next time whether old sessions or threads were still around)."""
    import gc
    import threading

    from ortcapture._session.session import InferenceSession as Captured

    live = [o for o in gc.get_objects() if isinstance(o, ort.InferenceSession)]
    ours = [o for o in live if isinstance(o, Captured)]
    graphs = 0
    for s in ours:
        try:
            graphs += len(s.captured_graphs)
        except Exception:  # noqa: BLE001 - a diagnostic: a session in any state is counted as it can be
            pass
    try:
        rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    except OSError:
        rss = -1
    threads = sorted(t.name for t in threading.enumerate())
    return (f"onnxruntime {ort.__version__}; live InferenceSessions: {len(live)} ({len(ours)} ortcapture, "
            f"{graphs} captured graphs); threads: {threads}; RSS {rss} MiB; gc counts {gc.get_count()}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    device = {"webgpu", "cuda", "backend"} & (set(item.keywords) | set(getattr(item, "fixturenames", ())))
    if report.when == "call" and report.failed and device:
        report.sections.append(("ortcapture process state", _process_state()))
    log = os.environ.get("ORTCAPTURE_DEVICE_ERROR_LOG")  # tools/test.sh: Dawn's device errors, by the test that met them
    if log and "WebGPU device error" in report.capstderr:
        lines = [ln for ln in report.capstderr.splitlines() if "device error" in ln]
        with open(log, "a") as f:
            f.write(f"{item.nodeid} ({report.when}, {report.outcome}): {len(lines)} x {lines[0].strip()[:300]}\n")
