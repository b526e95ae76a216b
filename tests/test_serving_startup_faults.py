"""Faults a tester found in the server's start, errors and handle arguments (no Ray cluster started here)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("ray")


def test_a_signal_while_the_replicas_warm_up_stops_at_once():
    """Ctrl-C during a warm-up that could not finish (a GPU asked for where there is none) was ignored until the
    900 s start timeout: the wait checks the stop event first."""
    from ortcapture.serving import deployment

    stop = threading.Event()
    stop.set()
    t0 = time.monotonic()
    with pytest.raises(deployment.ServeStopped, match="warming up"):
        deployment._wait_running("ortcapture-x", 900.0, stop)
    assert time.monotonic() - t0 < 1.0
    assert issubclass(deployment.ServeStopped, deployment.ServeFailed)


def test_onnxruntimes_own_load_error_is_the_reason_given():
    """ORT's exception types (``...onnxruntime_pybind11_state.Fail``) carry no "Error" in their name: the reason given
    was the traceback's first line (``RuntimeError: Traceback (most recent call last):``)."""
    from ortcapture.serving.deployment import _failure

    class Status:
        deployments: dict = {}
        message = ("RuntimeError: Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "onnxruntime.capi.onnxruntime_pybind11_state.Fail: [ONNXRuntimeError] : 1 : FAIL : Load model "
                   "from m.onnx failed: Type Error: Type (tensor(int64)) of input parameter (b) of operator (Add)")
    assert _failure(Status()).startswith("onnxruntime.capi.onnxruntime_pybind11_state.Fail: [ONNXRuntimeError]")


def test_a_handle_callers_device_outputs_of_another_kind_are_its_400():
    """``handle.infer.remote(feeds, "abc")`` reached the session replica and came back as a 500 from its CUDA
    region writer: anything but ``{output: CUDA region reference}`` is refused with the request."""
    from ortcapture.serving import shm
    from ortcapture.serving.protocol import ModelSpec, TensorSpec
    from ortcapture.serving.requests import RequestError
    from ortcapture.serving.tier import _check_device_outputs

    spec = ModelSpec(name="m", inputs=(TensorSpec("X", np.dtype(np.float32), (-1, 4)),),
                     outputs=(TensorSpec("Y", np.dtype(np.float32), (-1, 4)),), batch_axes={"X": 0}, max_rows=8)
    cuda = shm.Ref(shm.Regions().register_cuda("c", bytes(range(64)), 0, 64), 0, 16)
    system = shm.Ref(shm.Regions().register("s", "/k", 0, 64), 0, 16)
    _check_device_outputs(None, spec)
    _check_device_outputs({"Y": cuda}, spec)
    for bad in ("abc", 5, [1, 2], {"Y": None}, {"Z": cuda}, {"Y": system}):
        with pytest.raises(RequestError, match="device_outputs must be"):
            _check_device_outputs(bad, spec)


@pytest.mark.parametrize("address, watch, started", [(None, True, True), (None, False, False),
                                                     ("10.0.0.9:6379", True, False)])
def test_the_cluster_watch_runs_only_for_a_local_cluster_of_ortcapture_serve(monkeypatch, tmp_path, address, watch,
                                                                              started):
    """The watch that exits the process when the local cluster's GCS goes away (SIGTERM to the process group) runs
    only where ``ortcapture serve`` asked for it (``serve(exit_when_cluster_gone=True)``) on a cluster it started:
    never for a library caller of ``serve()`` (it would end their process) nor on a joined cluster (``--address``:
    a GCS restarting there would have ended a stop in the middle with status 0). Ray stubbed: no cluster here."""
    import ray

    from ortcapture.serving import deployment
    from ortcapture.serving.config import ServeOptions
    from tests import tiny

    model = tmp_path / "m.onnx"
    model.write_bytes(tiny.bucket_model())
    options = ServeOptions(str(model), address=address)
    seen: list = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(deployment, "_RAY_STARTED_HERE", [True])
    monkeypatch.setattr(deployment, "_exit_when_cluster_gone",
                        lambda done, since=0.0: seen.append("watch") or done.wait(5))
    monkeypatch.setattr(deployment, "_stop", lambda o, watch: seen.append(("stop", watch is not None)) or (
        watch and (watch[0].set(), watch[1].join(5))))
    deployment.stop(options, True, watch_cluster=watch)  # stop() itself refuses to watch a joined cluster
    assert seen[-1] == ("stop", started) and ("watch" in seen) == started
