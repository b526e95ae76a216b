"""Ray Serve's application builder (issue 44, item 5): ``serve run ortcapture.serving.app:build model=... ``, and a
``serve run``/``serve deploy`` config file, so a served model is deployed the way Ray users deploy."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ortcapture.errors import CaptureError
from tests import tiny


def test_builder_arguments_are_parsed_and_checked(tmp_path):
    from ortcapture.serving.app import options_from_args

    model = tmp_path / "m.onnx"
    model.write_bytes(tiny.bucket_model())
    o = options_from_args({"model": str(model), "buckets": "1,2,4", "replicas": "2", "provider": "cpu",
                           "batch_wait_ms": "5", "max_body_mib": "2", "max_queued": 16})
    assert (o.buckets, o.replicas, o.batch_wait_ms, o.max_body_bytes, o.max_queued, o.name) == (
        (1, 2, 4), 2, 5.0, 2 * 1024 * 1024, 16, "m")
    for args, words in (({"buckets": "1,2"}, "model=PATH"), ({"model": str(model), "nope": "1"}, "unknown"),
                        ({"model": str(model), "replicas": "two"}, "replicas"),
                        ({"model": str(model), "dims": "height"}, "NAME=SIZE"),
                        ({"model": str(tmp_path / "missing.onnx")}, "no such model")):
        with pytest.raises(CaptureError, match=words):
            options_from_args(args)


@pytest.mark.slow
def test_serve_run_of_a_config_file_serves_the_model(tmp_path):
    """``serve run serve.yaml`` (Ray's own CLI; the config names ``ortcapture.serving.app:build`` and its args, and
    Serve's http_options on loopback): the model answers over the protocol, right; SIGINT stops it."""
    if os.environ.get("ORTCAPTURE_REQUIRE_SERVE") == "1":
        import ray  # noqa: F401 - required here: fail, do not skip
        import tritonclient.http as http
    else:
        pytest.importorskip("ray")
        http = pytest.importorskip("tritonclient.http")
    from tests.test_serving_server import _free_port, _get, _listening_beyond_loopback

    model = tmp_path / "tiny.onnx"
    model.write_bytes(tiny.bucket_model())
    port = _free_port()
    config = {"http_options": {"host": "127.0.0.1", "port": port},
              "applications": [{"name": "tiny", "route_prefix": "/", "import_path": "ortcapture.serving.app:build",
                                "args": {"model": str(model), "provider": "cpu", "buckets": "1,2,4"}}]}
    cfg = tmp_path / "serve.json"  # YAML is a superset of JSON: serve run reads it as its config
    cfg.write_text(json.dumps(config))
    serve = Path(sys.executable).with_name("serve")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    before = _listening_beyond_loopback()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(serve), "run", str(cfg)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if _get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        client = http.InferenceServerClient(f"127.0.0.1:{port}")
        x = (np.arange(12, dtype=np.float32).reshape(3, 4) / 7 - 0.5).astype(np.float32)
        inp = http.InferInput("X", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        res = client.infer("tiny", [inp])
        for name, want in tiny.bucket_reference(x).items():
            np.testing.assert_allclose(res.as_numpy(name), want, rtol=1e-4, atol=1e-5)
        assert client.get_model_config("tiny")["max_batch_size"] == 4
        assert not (_listening_beyond_loopback() - before), "serve run listened beyond loopback"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def test_a_refused_start_leaves_the_running_serve_alone(monkeypatch, tmp_path):
    """A process whose Ray runs Serve already (another model served on port 8000 at ``/``): ``serve(port=9000)`` is
    refused — and must leave that Serve, its applications and the process's Ray connection alone (a review found it
    shut them all down)."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    import ray.serve.context as ctx

    from ortcapture.serving import deployment
    from ortcapture.serving.config import ServeOptions

    class Client:  # Ray Serve's running client, as _get_global_client returns it
        class http_config:
            host, port = "127.0.0.1", 8000

        def get_serve_details(self):
            return {"applications": {"other": {"route_prefix": "/"}}}

    monkeypatch.setattr(ctx, "_get_global_client", lambda **kw: Client())
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"gcs_address": "127.0.0.1:6379"})())
    touched = []
    monkeypatch.setattr(deployment, "_stop", lambda o: touched.append("_stop"))
    monkeypatch.setattr(ray, "shutdown", lambda: touched.append("ray.shutdown"))
    monkeypatch.setattr(deployment.ray_serve, "shutdown", lambda: touched.append("serve.shutdown"))
    monkeypatch.setattr(deployment, "_RAY_STARTED_HERE", [False])
    model = tmp_path / "b.onnx"
    model.write_bytes(tiny.bucket_model())
    opts = ServeOptions(str(model), name="b", provider="cpu", port=9000, buckets=(1, 2)).checked()
    with pytest.raises(deployment.ServeRefused, match="listens on 127.0.0.1:8000"):
        deployment.serve(options=opts, on_ready=lambda url: None)
    assert not touched, touched
