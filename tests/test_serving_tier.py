"""The batching tier on a two-node Ray cluster on one machine (issue 44, items 1, 2 and 5), loopback only.

A head node with no CPU and a second node with 2 CPUs (and a custom resource that names it): ``ortcapture serve
--address`` joins the cluster, so every session replica (1 CPU each) runs on the second node; two tier replicas
(``--ingress-replicas 2``, no CPU). Checked: the replicas on the second node answer right (HTTP and handle); a lone
request with ``--batch-wait-ms 500`` is answered in < 250 ms; 16 simultaneous requests share batches (fewer calls
to the session replicas than requests, from ``/stats``); every request gets its own rows back (values unique per
request) under mixed load of handle and HTTP requests of 1-4 rows with bad requests among them.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests import tiny
from tests.test_serving_server import _free_port, _get, _post

if os.environ.get("ORTCAPTURE_REQUIRE_SERVE") == "1":
    import ray  # noqa: F401 - required here: fail, do not skip
else:
    pytest.importorskip("ray")
    pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow
MODEL = "tiny"
APP = f"ortcapture-{MODEL}"
STARTUP_S = 150


def _check(x: np.ndarray, outputs: dict) -> None:
    for name, want in tiny.bucket_reference(x).items():
        np.testing.assert_allclose(outputs[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


def _http_infer(url: str, x: np.ndarray) -> tuple[int, dict]:
    body = json.dumps({"inputs": [{"name": "X", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()
    code, raw = _post(f"{url}/v2/models/{MODEL}/infer", body, {"Content-Type": "application/json"})
    doc = json.loads(raw)
    if code != 200:
        return code, doc
    return code, {o["name"]: np.asarray(o["data"], np.float64).reshape(o["shape"]) for o in doc["outputs"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # the cluster on 127.0.0.1 only (Ray reads this switch at import; this process may have imported Ray already)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    was, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
                                                        "include_dashboard": False})
    c.add_node(num_cpus=2, resources={"second_node": 1}, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    tmp = tmp_path_factory.mktemp("tier")
    model = tmp / f"{MODEL}.onnx"
    model.write_bytes(tiny.bucket_model())
    port = _free_port()
    log = tmp / "serve.log"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ortcapture", "serve", str(model), "--provider", "cpu",
                                 "--address", c.address, "--port", str(port), "--replicas", "2",
                                 "--ingress-replicas", "2", "--buckets", "1,2,4", "--batch-wait-ms", "500",
                                 "--graceful-shutdown-s", "5"], stdout=subprocess.PIPE, stderr=err, env=env,
                                cwd=Path(__file__).resolve().parents[1])
    url = None
    try:
        deadline = time.monotonic() + STARTUP_S
        while url is None:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            line = proc.stdout.readline().decode().strip()
            if line.startswith("http"):
                url = line
        import ray

        ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
        second = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("second_node"))
        yield {"url": url, "second": second, "log": log}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        import ray

        ray.shutdown()
        c.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = was


def _stats(url: str) -> dict:
    code, body = _get(f"{url}/v2/models/{MODEL}/stats")
    assert code == 200, body
    return json.loads(body)["model_stats"][0]["ortcapture"]


def _handle():
    from ortcapture.serving import model_handle

    return model_handle(APP)


def test_replicas_on_the_second_node_answer_right(cluster):
    x = (np.arange(12, dtype=np.float32).reshape(3, 4) / 7 - 0.5).astype(np.float32)
    code, out = _http_infer(cluster["url"], x)
    assert code == 200, out
    _check(x, out)
    answer = _handle().infer.remote({"X": x}).result(timeout_s=60)
    _check(x, answer["outputs"])
    deadline = time.monotonic() + 20  # replicas push their reports every second
    while True:
        reps = _stats(cluster["url"])["replicas"]
        if len(reps) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(reps) == 2, reps
    assert {r["node"] for r in reps} == {cluster["second"]}, "the session replicas are not on the second node"
    from ortcapture.serving.ray_common import SWITCH_INTERVAL_S

    # the replay threads get the GIL back within 0.5 ms under load, not Python's 5 ms (issue 44, item 4)
    assert [r.get("switch_interval_s") for r in reps] == [SWITCH_INTERVAL_S] * 2, reps
    # Ray Serve's throughput-optimised settings reached the replicas through their runtime_env (the default)
    assert [r.get("serve_throughput_optimized") for r in reps] == [True] * 2, reps
    ingress = _stats(cluster["url"])["ingress"]
    assert ingress["replicas"] >= 1 and ingress["refused"]["bad_request"] >= 0


def test_a_lone_request_runs_at_once_though_the_longest_wait_is_500_ms(cluster):
    handle = _handle()
    x = np.full((1, 4), 0.25, np.float32)
    handle.infer.remote({"X": x}).result(timeout_s=60)  # warm: handle resolved, replicas known
    times = []
    for _ in range(3):
        time.sleep(0.3)  # an idle server
        t0 = time.perf_counter()
        answer = handle.infer.remote({"X": x}).result(timeout_s=60)
        times.append(time.perf_counter() - t0)
        _check(x, answer["outputs"])
    assert min(times) < 0.25, f"a lone request took {[round(t * 1000) for t in times]} ms (--batch-wait-ms 500)"


def test_16_simultaneous_requests_share_batches_each_its_own_rows(cluster):
    def counts():  # one snapshot: (session calls, requests sent, slot batches, slot misses)
        ing = _stats(cluster["url"])["ingress"]
        return ing["session_calls"], ing["requests_sent"], ing["slot_batches"], ing["slot_misses"]

    time.sleep(1.5)  # both tier replicas pushed their counters
    c0 = counts()
    handle = _handle()
    xs = [np.full((1 + k % 2, 4), 0.01 * (k + 1), np.float32) for k in range(16)]  # values unique per request
    responses = [handle.infer.remote({"X": x}) for x in xs]
    for x, r in zip(xs, responses):
        _check(x, r.result(timeout_s=60)["outputs"])
    deadline = time.monotonic() + 10
    while True:  # a replica counts a call when it sends it and its slot batch when answered: wait for both reports
        c = counts()
        calls, n, batches, misses = (a - b for a, b in zip(c, c0))
        if (n >= 16 and batches + misses >= calls) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert n == 16, (c, c0)
    assert calls < 16, f"{calls} calls to the session replicas for 16 simultaneous requests"
    # one machine (two Ray nodes): every batch went through the tier's batch slots, none by value
    assert (batches, misses) == (calls, 0), (c, c0)


def test_no_cross_talk_under_mixed_load(cluster):
    """4 threads, handle and HTTP, 1-4 rows, values unique per request, a bad request every fifth: each good one
    gets exactly its own rows, each bad one its own 400 (bounded: 12 requests a thread, 60 s)."""
    handle = _handle()
    errors: list[str] = []
    done = []
    t_end = time.monotonic() + 60

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        for i in range(12):
            if time.monotonic() > t_end:
                errors.append(f"thread {k}: out of time")
                return
            rows = 1 + (i + k) % 4
            x = (rng.standard_normal((rows, 4)) + 100 * k + i).astype(np.float32)
            bad = i % 5 == 4
            try:
                if k % 2 == 0:
                    feeds = {"X": x.astype(np.float64) if bad else x}
                    answer = handle.infer.remote(feeds).result(timeout_s=60)
                    if bad:
                        assert answer.get("status") == 400 and "float64" in answer["error"], answer
                    else:
                        _check(x, answer["outputs"])
                else:
                    code, out = _http_infer(cluster["url"], np.zeros((rows, 5), np.float32) if bad else x)
                    if bad:
                        assert code == 400, out
                    else:
                        assert code == 200, out
                        _check(x, out)
                done.append(1)
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                errors.append(f"thread {k} request {i}: {type(exc).__name__}: {str(exc)[:300]}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors[:3]
    assert len(done) == 48


def test_a_second_start_in_a_process_whose_serve_listens_elsewhere_is_refused(cluster, tmp_path):
    """This process is on a cluster whose Serve listens on another port: Serve keeps its first HTTP options (a second
    ``serve.start`` logs that they are not applied), so ``start`` must refuse at once and deploy nothing, not
    deploy and then fail on "not listening" 30 s later."""
    import ray

    from ortcapture.serving import deployment
    from ortcapture.serving.config import ServeOptions

    assert ray.is_initialized()
    model = tmp_path / "other.onnx"
    model.write_bytes(tiny.bucket_model())
    port = _free_port()
    opts = ServeOptions(str(model), name="other", provider="cpu", port=port, buckets=(1, 2)).checked()
    t0 = time.monotonic()
    with pytest.raises(deployment.ServeRefused, match=f"not --host 127.0.0.1 --port {port}"):
        deployment.start(opts, "cpu")
    assert time.monotonic() - t0 < 20
    from ray import serve

    assert not {opts.app_name, deployment.model_app_name(opts)} & set(serve.status().applications)


def test_replicas_under_the_default_serve_settings_pass_batches_over_4_mib(cluster, tmp_path):
    """The replicas' default environment (``ServeOptions.replica_env``: Ray Serve's throughput-optimised mode, whose
    calls between replicas go over gRPC) carries a 5 MB array each way between two replicas; with the mode alone
    (Ray's 4 MiB gRPC cap) the same call fails — a batch sent by value (no batch slot) of four 1.2 MB images did."""
    from ray import serve

    from ortcapture.serving.config import GRPC_MESSAGE_ENV, THROUGHPUT_ENV, ServeOptions

    model = tmp_path / "m.onnx"
    model.write_bytes(tiny.bucket_model())
    env = ServeOptions(str(model)).checked().replica_env()
    assert env[THROUGHPUT_ENV] == "1"

    def app(name, env_vars):
        opts = {"num_cpus": 0, "runtime_env": {"env_vars": env_vars}}

        @serve.deployment(ray_actor_options=opts)
        class Twice:
            async def run(self, x):
                return x * 2

        @serve.deployment(ray_actor_options=opts)
        class Front:
            def __init__(self, app_name, twice):
                self.app_name = app_name

            async def __call__(self, n):
                # made in the replica, as the tier makes its session handle: the replica's settings apply to it
                twice = serve.get_deployment_handle("Twice", self.app_name)
                x = np.arange(n, dtype=np.float32)
                y = await twice.run.remote(x)
                return float(y[-1]), y.nbytes

        return Front.bind(name, Twice.bind())

    n = 5 * 1024 * 1024 // 4 + 1  # just over 5 MiB of float32
    try:
        handle = serve.run(app("grpc-cap", env), name="grpc-cap", route_prefix=None)
        assert handle.remote(n).result(timeout_s=60) == (2.0 * (n - 1), 4 * n)
        capped = {k: v for k, v in env.items() if k != GRPC_MESSAGE_ENV}
        handle = serve.run(app("grpc-cap-4mib", capped), name="grpc-cap-4mib", route_prefix=None)
        with pytest.raises(Exception, match="(?i)message|RESOURCE_EXHAUSTED|larger"):
            handle.remote(n).result(timeout_s=60)
    finally:
        for name in ("grpc-cap", "grpc-cap-4mib"):
            serve.delete(name, _blocking=True)
