"""``ortcapture serve`` as a user runs it (issue 29): a subprocess on a tiny dynamic-batch model, WebGPU on the
software adapter inside two Ray Serve replicas, driven by ``tritonclient.http`` from several threads, loopback only.

One server is shared by the module (a real local Ray cluster costs ~15 s to start on 2 cores); the tests run in file
order and the last one stops it with SIGINT. Every loop is bounded in count and time. Ray Serve and tritonclient are
installed for the newest ORT only (tools/bootstrap.sh): elsewhere these tests skip, and with
``ORTCAPTURE_REQUIRE_SERVE=1`` (tools/test.sh, newest ORT) a missing ray fails them instead.
``ORTCAPTURE_SERVE_TEST_PROVIDER=cuda`` runs the same tests on CUDA (the H200: two replicas of 0.5 GPU each).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests import tiny
from tests.conftest import webgpu_available

if os.environ.get("ORTCAPTURE_REQUIRE_SERVE") == "1":
    import ray  # noqa: F401 - required here: fail, do not skip
    import tritonclient.http as http
else:
    pytest.importorskip("ray")
    http = pytest.importorskip("tritonclient.http")

PROVIDER = os.environ.get("ORTCAPTURE_SERVE_TEST_PROVIDER", "webgpu")
pytestmark = [pytest.mark.cuda if PROVIDER == "cuda" else pytest.mark.webgpu, pytest.mark.slow]

MODEL = "tiny"
STARTUP_S = 150  # a fresh Ray cluster, the ingress, two replicas' warm-up on a loaded 2-core machine
RTOL = 1e-4 if PROVIDER == "webgpu" else 3e-3  # CUDA: TF32 matmuls


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports: every socket is held until all are bound, so two calls in a row can
    never hand out the same port (a server's HTTP and gRPC ports once collided that way on the H100)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_port() -> int:
    return _free_ports(1)[0]


def _context(url: str):
    """A TLS context that accepts the test's self-signed certificate, for https URLs."""
    if not url.startswith("https:"):
        return None
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _get(url: str, timeout: float = 5.0, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        req = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(req, timeout=timeout, context=_context(url)) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: bytes, headers: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=_context(url)) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    def __init__(self, tmp: Path, provider: str = PROVIDER, replicas: int = 2, extra: tuple = (),
                 scheme: str = "http", new_session: bool = False, grpc: bool = False):
        self.model = tmp / f"{MODEL}.onnx"
        self.model.write_bytes(tiny.bucket_model())
        self.port, self.grpc_port = _free_ports(2) if grpc else (_free_port(), None)
        self.grpc_url = f"127.0.0.1:{self.grpc_port}" if grpc else None
        if grpc:
            extra = (*extra, "--grpc-port", str(self.grpc_port))
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = tmp / "serve.log"
        cmd = [sys.executable, "-m", "ortcapture", "serve", str(self.model), "--provider", provider,
               "--replicas", str(replicas),
               "--port", str(self.port), "--num-cpus", "2", "--batch-wait-ms", "20", "--graceful-shutdown-s", "5",
               "--max-body-mib", "1", *extra] + (["--gpus-per-replica", "0.5"] if provider == "cuda" else [])
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
        self._log_file = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log_file, env=env,
                                     cwd=Path(__file__).resolve().parents[1], start_new_session=new_session)
        self.ready_codes: list[int] = []  # readiness answers seen while starting
        self.stdout: list[str] = []

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ortcapture serve exited {self.proc.returncode}: {self.tail()}")
            try:
                code, _ = _get(f"{self.url}/v2/health/ready", timeout=2)
            except OSError:
                code = None  # the proxy or the ingress is not up yet
            if code is not None and (not self.ready_codes or self.ready_codes[-1] != code):
                self.ready_codes.append(code)
            if code == 200:
                return
            time.sleep(0.1)
        raise AssertionError(f"not ready within {STARTUP_S} s: {self.tail()}")

    def tail(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-3000:]

    def stats(self) -> dict:
        code, body = _get(f"{self.url}/v2/models/{MODEL}/stats")
        assert code == 200, body
        return json.loads(body)["model_stats"][0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()


def _slot_pools() -> set[str]:
    """The batch-slot pools in /dev/shm (``ortcapture.serving.slots``: ``ortcapture-<pid>-<hex>``)."""
    try:
        return {n for n in os.listdir("/dev/shm") if re.fullmatch(r"ortcapture-\d+-[0-9a-f]{32}", n)}
    except OSError:
        return set()


def _leaked_pools(before: set[str]) -> set[str]:
    """Pools made since ``before`` whose making process is gone: leaked (a pool of a server still running
    elsewhere on the machine is not)."""
    leaked = set()
    for name in _slot_pools() - before:
        pid = name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            leaked.add(name)
    return leaked


def _listening_beyond_loopback() -> set[tuple[str, int]]:
    """``(address hex, port)`` of every TCP socket listening on an address other than loopback (127/8, ::1,
    ::ffff:127/104), from /proc/net/tcp and tcp6 (empty where /proc has no such files)."""
    found = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != "0A":  # 0A: LISTEN
                continue
            addr, port = fields[1].split(":")
            v4 = addr[-8:] if name == "tcp" or addr.startswith("0000000000000000FFFF0000") else None
            if (v4 is not None and v4[6:8] == "7F") or addr == "00000000000000000000000001000000":
                continue
            found.add((addr, int(port, 16)))
    return found


def _provider_usable() -> bool:
    if PROVIDER == "cuda":
        import onnxruntime as ort

        return "CUDAExecutionProvider" in ort.get_available_providers()
    return webgpu_available()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not _provider_usable():
        pytest.skip(f"{PROVIDER} is not usable here")
    before = _listening_beyond_loopback()
    shm_before = _slot_pools()
    srv = Server(tmp_path_factory.mktemp("serve"))
    srv.shm_before = shm_before
    try:
        srv.wait_ready()
        srv.beyond_loopback = _listening_beyond_loopback() - before  # what the server added
        line = srv.proc.stdout.readline().decode().strip()  # the URL, printed once the replicas are warm
        srv.stdout.append(line)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference():
    """The CPU EP's answer for a request (the model run alone, uncaptured)."""
    return tiny.bucket_cpu_answer()


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    scale = max(float(np.max(np.abs(want))), 1e-6)
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=RTOL, atol=RTOL * scale))


def _infer(client, x: np.ndarray, binary: bool = True):
    inp = http.InferInput("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outs = None if binary else [http.InferRequestedOutput(n, binary_data=False) for n in ("scores", "probs", "feat")]
    return client.infer(MODEL, [inp], outputs=outs)


def _distinct(thread: int, i: int, rows: int) -> np.ndarray:
    """Rows no other request has: a cross-talk between requests changes the answer."""
    base = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) / 16
    return (base + thread * 0.37 + i * 0.05 - 1).astype(np.float32)


def test_started_as_a_user_would(server):
    """The URL is printed once the replicas are warm; before that, readiness answered 503, then 200."""
    assert server.stdout == [server.url]
    assert server.ready_codes[-1] == 200
    assert 503 in server.ready_codes, f"readiness went {server.ready_codes} (no 503 while warming up)"
    assert server.ready_codes.index(503) < server.ready_codes.index(200)
    client = http.InferenceServerClient(f"127.0.0.1:{server.port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)


def test_it_listens_on_loopback_only(server):
    """Served on the default --host 127.0.0.1, nothing of the server listens beyond loopback: the proxy, Ray's own
    processes, and each replica's inter-deployment gRPC server (Ray Serve 2.60 binds that one to [::]:0 itself)."""
    assert server.beyond_loopback == set()


def test_metadata_matches_the_model(server):
    client = http.InferenceServerClient(f"127.0.0.1:{server.port}")
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "X", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 3]},
                               {"name": "probs", "datatype": "FP32", "shape": [-1, 3]},
                               {"name": "feat", "datatype": "FP32", "shape": [3, -1]}]
    assert _get(f"{server.url}/v2/models/nope")[0] == 404
    cfg = client.get_model_config(MODEL)  # Triton's model configuration
    assert cfg["max_batch_size"] == 8 and cfg["input"] == [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}]


def test_mixed_requests_from_8_threads(server, reference):
    """Requests of 1-4 rows with distinct values, JSON and binary, from 8 threads: each answer equals its own CPU
    EP reference; /stats shows batches of more than one row and one graph per bucket on every replica."""
    errors, done = [], []

    def worker(t: int) -> None:
        client = http.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=60)
        rng = np.random.default_rng(t)
        for i in range(12):
            x = _distinct(t, i, int(rng.integers(1, 5)))
            try:
                res = _infer(client, x, binary=bool((t + i) % 2))
                for name, want in reference(x).items():
                    if not _close(res.as_numpy(name), want):
                        errors.append((t, i, name))
                done.append(1)
            except Exception as exc:  # noqa: BLE001 - collected and reported below
                errors.append((t, i, repr(exc)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors[:5]
    assert len(done) == 96
    deadline = time.monotonic() + 10
    while True:  # replicas push their counters every second
        s = server.stats()
        reps = s["ortcapture"]["replicas"]
        if sum(r.get("requests", 0) for r in reps) >= 96 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(reps) == 2
    assert sum(r["requests"] for r in reps) >= 96
    for r in reps:
        assert r["graphs_per_bucket"] == {"batch=1": 1, "batch=2": 1, "batch=4": 1, "batch=8": 1}, r
        assert r["graphs_captured"] == 4 and r["uncaptured"] == 0 and r["device"].startswith(PROVIDER)
    hist = {}
    for r in reps:
        for k, v in r["batch_size_histogram"].items():
            hist[int(k)] = hist.get(int(k), 0) + v
    assert max(hist) > 4, hist  # several requests (1-4 rows each) shared a batch
    assert s["execution_count"] < s["inference_stats"]["success"]["count"]
    assert any(b["batch_size"] > 4 for b in s["batch_stats"])


def _bad_bodies(server):
    """(name, body, headers, expected status) of the bad requests."""
    good = json.dumps({"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    x = np.ones((2, 4), np.float32).tobytes()
    head = json.dumps({"inputs": [{"name": "X", "shape": [2, 4], "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(x)}}]}).encode()
    return [
        ("wrong datatype", good.replace("FP32", "FP64").encode(), {}, 400),
        ("wrong rank", json.dumps({"inputs": [{"name": "X", "shape": [4], "datatype": "FP32",
                                               "data": [1, 2, 3, 4]}]}).encode(), {}, 400),
        ("missing input", json.dumps({"inputs": [{"name": "Q", "shape": [1, 4], "datatype": "FP32",
                                                  "data": [1, 2, 3, 4]}]}).encode(), {}, 400),
        ("no inputs", b'{"inputs": []}', {}, 400),
        ("malformed binary header", head + x, {"Inference-Header-Content-Length": "abc"}, 400),
        ("header past the body", head + x, {"Inference-Header-Content-Length": str(len(head) + len(x) + 5)}, 400),
        ("claims more bytes than sent", head + x[:-4], {"Inference-Header-Content-Length": str(len(head))}, 400),
        ("too many rows", json.dumps({"inputs": [{"name": "X", "shape": [9, 4], "datatype": "FP32",
                                                  "data": [0.5] * 36}]}).encode(), {}, 400),
        ("body past the cap", b" " * (1024 * 1024 + 10) + good.encode(), {}, 413),
        ("not json", b"\xff\xfe{", {}, 400),
    ]


def test_bad_requests_among_good_ones(server, reference):
    """Each bad request gets its 4xx with {"error": ...}; the good ones around it get their right answers; an
    unknown model is a 404; the server stays up."""
    client = http.InferenceServerClient(f"127.0.0.1:{server.port}")
    infer = f"{server.url}/v2/models/{MODEL}/infer"
    for k, (what, body, headers, status) in enumerate(_bad_bodies(server)):
        x = _distinct(9, k, 1 + k % 4)
        res = _infer(client, x)
        assert all(_close(res.as_numpy(n), w) for n, w in reference(x).items()), what
        code, answer = _post(infer, body, headers)
        assert code == status, (what, code, answer[:300])
        assert set(json.loads(answer)) == {"error"}, what
    code, answer = _post(f"{server.url}/v2/models/other/infer", b'{"inputs": []}')
    assert code == 404 and "unknown model" in json.loads(answer)["error"]
    assert server.proc.poll() is None and client.is_server_ready()


def test_fuzzed_bodies_never_get_a_5xx(server):
    """hypothesis-made bodies at the infer endpoint: never a 5xx, never a crash (bounded examples)."""
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    infer = f"{server.url}/v2/models/{MODEL}/infer"
    numbers = st.lists(st.floats(width=32, allow_nan=False) | st.integers(-5, 5), max_size=12)
    tensor = st.fixed_dictionaries({"name": st.sampled_from(["X", "Y", ""])}, optional={
        "shape": st.lists(st.integers(-1, 5), max_size=3), "datatype": st.sampled_from(["FP32", "FP16", "INT64", "x"]),
        "data": numbers | st.text(max_size=3), "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_size": st.integers(-1, 64)})})
    request = st.fixed_dictionaries({}, optional={"inputs": st.lists(tensor, max_size=2), "id": st.text(max_size=3),
                                                  "outputs": st.lists(st.fixed_dictionaries(
                                                      {"name": st.sampled_from(["scores", "feat", "no"])}),
                                                      max_size=2)})
    seen = []

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(req=request, tail=st.binary(max_size=48), header=st.none() | st.integers(-2, 300))
    def check(req, tail, header):
        body = json.dumps(req).encode() + tail
        headers = {} if header is None else {"Inference-Header-Content-Length": str(header)}
        code, answer = _post(infer, body, headers)
        seen.append(code)
        assert code < 500, (req, code, answer[:300])

    check()
    assert len(seen) == 40 and server.proc.poll() is None


def _serve(args: list, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run([sys.executable, "-m", "ortcapture", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=Path(__file__).resolve().parents[1])


def _one_line_exit_2(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "\x1b[" not in proc.stderr and len(lines[0]) < 400 and all(w in lines[0] for w in words), lines[0]
    assert "://" not in proc.stdout
    return lines[0]


def test_a_second_server_on_the_served_port_exits_2_and_the_first_keeps_its_model(server, reference, tmp_path):
    """Issue 43, item 3: Ray Serve's proxy binds with SO_REUSEPORT, so a second ``ortcapture serve`` on a served
    port (another model under the same name) used to start and take half the clients. Now it exits 2 with one line
    before Ray starts, and the first server answers every request with its own model."""
    other = tmp_path / "other.onnx"
    other.write_bytes(tiny.add_model(shape=("batch", 4)))
    t0 = time.monotonic()
    proc = _serve([str(other), "--name", MODEL, "--port", str(server.port), "--provider", "cpu"])
    print("\n" + _one_line_exit_2(proc, f"--port {server.port}", "in use"), f"({time.monotonic() - t0:.1f} s)")
    client = http.InferenceServerClient(f"127.0.0.1:{server.port}")
    for i in range(24):  # fresh connections: the kernel would have split these between two listeners
        x = _distinct(70, i, 1 + i % 3)
        res = _infer(http.InferenceServerClient(f"127.0.0.1:{server.port}"), x)
        assert all(_close(res.as_numpy(n), w) for n, w in reference(x).items()), i
    assert client.is_server_ready()


def test_a_port_held_by_another_program_is_one_line_exit_2(tmp_path):
    """A port another program listens on: one line and exit 2 before Ray starts (it used to be a 1,189-character
    Ray traceback with ANSI codes)."""
    model = tmp_path / "m.onnx"
    model.write_bytes(tiny.bucket_model())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _serve([str(model), "--port", str(port), "--provider", "cpu"])
    _one_line_exit_2(proc, f"--port {port}", "in use")


def _infer_body(x: np.ndarray) -> tuple[bytes, dict]:
    """A binary infer request for ``x`` (one input X) and its headers."""
    head = json.dumps({"inputs": [{"name": "X", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return head + x.tobytes(), {"Inference-Header-Content-Length": str(len(head)), "Content-Type":
                                "application/octet-stream"}


def _read_answer(sock: socket.socket, deadline: float) -> tuple[int, bytes]:
    """Status and raw bytes of one HTTP/1.1 answer read from ``sock`` (until close or the declared length)."""
    data = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            lengths = [ln.split(b":", 1)[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
            if lengths and len(body) >= int(lengths[0]):
                break
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data


def test_a_slow_honest_client_completes(server, reference):
    """One byte every 20 ms (about 5 s for the body): never cut off by the body timeout (no progress for 10 s)."""
    x = _distinct(71, 0, 2)
    body, headers = _infer_body(x)
    assert len(body) < 300
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        head = f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "Connection: close\r\n\r\n"
        s.sendall(head.encode())
        for i in range(len(body)):
            s.sendall(body[i:i + 1])
            time.sleep(0.02)
        status, data = _read_answer(s, time.monotonic() + 30)
    assert status == 200, data[:500]
    raw = data.partition(b"\r\n\r\n")[2]
    n = int(next(ln.split(b":", 1)[1] for ln in data.split(b"\r\n")
                 if ln.lower().startswith(b"inference-header-content-length:")))
    outs = json.loads(raw[:n])["outputs"]
    scores = outs[0]
    got = np.frombuffer(raw[n:n + scores["parameters"]["binary_data_size"]], np.float32).reshape(scores["shape"])
    assert _close(got, reference(x)[scores["name"]])


def test_stalled_bodies_cannot_lock_out_a_normal_request(server, reference):
    """Issue 43, item 2, and issue 44: 1,100 connections send infer headers with a Content-Length and never the
    body. A normal request is answered (200) within 10 s and 3 tries, taking a 503's Retry-After: it takes the slot
    of a body stalled for longer than EVICT_IDLE_S (it used to wait 60 s, then get a 503 while the stalled ones held
    every slot); once the stalled connections go, requests are answered again; the refusals and evictions are
    counted in /stats."""
    x = _distinct(72, 0, 1)
    body, headers = _infer_body(x)
    head = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
    stalled = []
    try:
        t0 = time.monotonic()
        for _ in range(1100):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(head)  # ... and never the body
            stalled.append(s)
        opened = time.monotonic() - t0
        time.sleep(0.6)  # the stalled bodies are idle for longer than EVICT_IDLE_S (0.5 s)
        t1, tries = time.monotonic(), 0
        while True:  # a client that takes the 503's Retry-After (1 s): on a loaded machine the proxy may still be
            tries += 1  # taking in the last of the 1,100, whose bodies have not been idle for EVICT_IDLE_S yet
            code, answer = _post(f"{server.url}/v2/models/{MODEL}/infer", body, headers, timeout=10)
            if code != 503 or time.monotonic() - t1 > 10:
                break
            assert b"sending their bodies already" in answer, answer[:300]  # the gate's refusal, nothing else
            time.sleep(1.0)
        took = time.monotonic() - t1
        print(f"\n1100 stalled connections opened in {opened:.1f} s; a normal request: {code} in {took:.2f} s "
              f"({tries} tries)")
        assert code == 200 and took < 10 and tries <= 3, (code, tries, answer[:300])
    finally:
        for s in stalled:
            s.close()
    deadline = time.monotonic() + 60
    client = http.InferenceServerClient(f"127.0.0.1:{server.port}")
    while True:  # the stalled requests end (disconnect or body timeout): answered again
        try:
            res = _infer(client, x)
            break
        except Exception:  # noqa: BLE001 - tritonclient's 503
            assert time.monotonic() < deadline, "not answered within 60 s after the stalled connections closed"
            time.sleep(0.5)
    assert all(_close(res.as_numpy(n), w) for n, w in reference(x).items())
    ingress = server.stats()["ortcapture"]["ingress"]
    print(ingress)
    assert ingress["refused"]["bodies_pending"] > 0 and ingress["max_pending_bodies"] == 64
    assert ingress["refused"]["body_evicted"] >= 1
    assert not [c for c in ingress["http_errors"] if c.startswith("5") and c != "503"]  # a gone client is no 5xx


def _negated_model() -> bytes:
    """:func:`tiny.bucket_model` with its weights negated: the same API, other answers."""
    import onnx

    m = onnx.load_from_string(tiny.bucket_model())
    for init in m.graph.initializer:
        if init.name == "W":
            from onnx import numpy_helper

            init.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(init), "W"))
    return m.SerializeToString()


def _cluster_address(server: Server) -> str:
    """The Ray cluster the server started (its log says "Ray cluster at HOST:PORT")."""
    import re

    server.tail()  # flushes the log
    found = re.findall(r"Ray cluster at (\S+)", server.log.read_text(errors="replace"))
    assert found, server.tail()
    return found[0]


def _replace(model: Path, address: str) -> subprocess.CompletedProcess:
    args = [str(model), "--name", MODEL, "--address", address, "--replace", "--provider", PROVIDER, "--replicas", "2",
            "--batch-wait-ms", "20", "--max-body-mib", "1", "--graceful-shutdown-s", "5"]
    return _serve(args + (["--gpus-per-replica", "0.5"] if PROVIDER == "cuda" else []), timeout=STARTUP_S)


def test_a_model_is_replaced_in_place_without_downtime(server, reference, tmp_path):
    """Issue 43, item 3: replacing the served model is Ray Serve's in-place application update
    (``ortcapture serve NEW --name NAME --address ADDRESS --replace``, the address the server printed), not an accident of port sharing: two threads
    send throughout; no request fails; every answer is the old model's or the new one's; afterwards only the new
    one's. Then back to the old model the same way."""
    import onnxruntime as ort

    new = tmp_path / "negated.onnx"
    new.write_bytes(_negated_model())
    neg = ort.InferenceSession(str(new), providers=["CPUExecutionProvider"])
    names = [o.name for o in neg.get_outputs()]

    def new_reference(x):
        return dict(zip(names, neg.run(None, {"X": x})))

    for model, want_after, other in ((new, new_reference, reference), (server.model, reference, new_reference)):
        stop = threading.Event()
        seen = {"old": 0, "new": 0, "failed": []}

        def send(thread: int, stop=stop, seen=seen, want_after=want_after, other=other) -> None:
            client = http.InferenceServerClient(f"127.0.0.1:{server.port}")
            deadline = time.monotonic() + STARTUP_S
            i = 0
            while not stop.is_set() and time.monotonic() < deadline and i < 20000:
                x = _distinct(80 + thread, i, 1 + i % 3)
                i += 1
                try:
                    res = _infer(client, x)
                except Exception as exc:  # noqa: BLE001 - counted: there must be none
                    seen["failed"].append(f"{type(exc).__name__}: {str(exc)[:200]}")
                    continue
                if all(_close(res.as_numpy(n), w) for n, w in want_after(x).items()):
                    seen["new"] += 1
                elif all(_close(res.as_numpy(n), w) for n, w in other(x).items()):
                    seen["old"] += 1
                else:
                    seen["failed"].append("an answer of neither model")

        threads = [threading.Thread(target=send, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            t0 = time.monotonic()
            proc = _replace(model, _cluster_address(server))
            took = time.monotonic() - t0
            time.sleep(1.0)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        print(f"\nreplaced by {model.name} in {took:.1f} s: {seen['old']} answers of the model before, "
              f"{seen['new']} of the new one, {len(seen['failed'])} failed")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "replaced in place" in proc.stderr.strip().splitlines()[-1]
        assert not seen["failed"], seen["failed"][:5]
        assert seen["old"] > 0 and seen["new"] > 0
        client = http.InferenceServerClient(f"127.0.0.1:{server.port}")
        for i in range(6):
            x = _distinct(90, i, 1 + i % 3)
            assert all(_close(_infer(client, x).as_numpy(n), w) for n, w in want_after(x).items())
    other_name = tmp_path / "other.onnx"
    other_name.write_bytes(tiny.add_model(shape=("batch", 4)))
    proc = _replace(other_name, _cluster_address(server))  # another API under the same name: refused, nothing changes
    assert proc.returncode == 2 and "API differs" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    deadline = time.monotonic() + 30  # the replaced replicas' last reports leave /stats (routes.STALE_S)
    while len(server.stats()["ortcapture"]["replicas"]) != 2:
        assert time.monotonic() < deadline, server.stats()["ortcapture"]["replicas"]
        time.sleep(0.5)


def test_replica_killed_under_load_is_replaced(server, reference):
    """One replica's process is killed (SIGKILL) while 4 threads send: Ray starts a new replica; the requests
    that fail meanwhile are counted (printed) and every answer that comes back is right."""
    before = {r["replica"]: r["pid"] for r in server.stats()["ortcapture"]["replicas"]}
    assert len(before) == 2
    victim_id, victim_pid = sorted(before.items())[0]
    stop = threading.Event()
    ok, failed, wrong = [], [], []

    def worker(t: int) -> None:
        client = http.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=30)
        for i in range(400):
            if stop.is_set():
                return
            x = _distinct(20 + t, i, 1 + i % 3)
            try:
                res = _infer(client, x)
            except Exception as exc:  # noqa: BLE001 - counted
                failed.append(f"{type(exc).__name__}: {exc}"[:160])
                time.sleep(0.05)
                continue
            if all(_close(res.as_numpy(n), w) for n, w in reference(x).items()):
                ok.append(1)
            else:
                wrong.append((t, i))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    try:
        time.sleep(1.0)
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = len(ok)
        deadline = time.monotonic() + 90
        replaced = None
        while time.monotonic() < deadline:
            reps = {r["replica"]: r for r in server.stats()["ortcapture"]["replicas"]}
            new = [k for k in reps if k not in before]
            if new and reps[new[0]].get("graphs_per_bucket"):
                replaced = reps[new[0]]
                break
            time.sleep(0.5)
        served_after = len(ok)
        time.sleep(1.0)
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    print(f"\nreplica {victim_id} (pid {victim_pid}) killed: {len(failed)} failed requests, {len(ok)} right "
          f"answers ({served_after - killed_at} while it was replaced); failures: {sorted(set(failed))[:3]}")
    assert not wrong
    assert replaced is not None, "no new replica within 90 s"
    assert replaced["graphs_per_bucket"] == {"batch=1": 1, "batch=2": 1, "batch=4": 1, "batch=8": 1}
    assert len(ok) > killed_at  # the survivor (and the new replica) kept answering
    assert len(failed) <= 40, failed[:5]
    client = http.InferenceServerClient(f"127.0.0.1:{server.port}")
    assert client.is_server_ready()


def test_sigint_while_clients_send(server, reference):
    """SIGINT to ``ortcapture serve`` while 4 threads send: every request gets its right answer or is refused (a
    refused or reset connection, or a 503 while stopping) — never a wrong answer or a hang; exit 0 in time."""
    stop = threading.Event()
    ok, refused, wrong, other = [], [], [], []

    def worker(t: int) -> None:
        client = http.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=30)
        for i in range(300):
            if stop.is_set():
                return
            x = _distinct(40 + t, i, 1 + i % 4)
            try:
                res = _infer(client, x)
            except http.InferenceServerException as exc:
                (refused if exc.status() in ("503", None) else other).append(str(exc)[:120])
                time.sleep(0.05)
                continue
            except OSError as exc:  # refused, reset, closed: the server is gone
                refused.append(repr(exc)[:80])
                time.sleep(0.05)
                continue
            except Exception as exc:  # noqa: BLE001 - geventhttpclient's own connection errors
                if "connect" in repr(exc).lower() or "closed" in repr(exc).lower():
                    refused.append(repr(exc)[:80])
                    time.sleep(0.05)
                    continue
                other.append(repr(exc)[:120])
                continue
            if all(_close(res.as_numpy(n), w) for n, w in reference(x).items()):
                ok.append(1)
            else:
                wrong.append((t, i))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    time.sleep(1.0)
    sent_at = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    try:
        code = server.proc.wait(60)
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    took = time.monotonic() - sent_at
    assert not any(th.is_alive() for th in threads), "a client hung"
    assert code == 0, server.tail()
    assert took < 60
    assert not wrong and not other, (wrong[:3], other[:3])
    assert ok
    rest = server.proc.stdout.read().decode()
    assert rest.strip() == "", rest[:500]  # stdout carries only the URL: Ray's shutdown lines go to stderr
    assert not [ln for ln in server.tail().splitlines()  # ... less the controller's harmless "Task ... failed" lines
                if "ServeController." in ln and "killed by `ray.kill`" in ln]
    # the replicas shut down within their grace period, not force-killed past it (then no __del__ runs: graphs not
    # released, batch slots not unlinked): Ray Serve's direct ingress, on in its throughput-optimised mode, held
    # every replica for a 30 s drain
    assert not _leaked_pools(server.shm_before), "batch slots left in /dev/shm: a replica was killed, not stopped"
    killed = [p for p in Path("/tmp/ray/session_latest/logs/serve").glob("controller_*.log")
              if "force-killing" in p.read_text(errors="replace")]
    assert not killed, f"the Serve controller force-killed replicas at shutdown: {killed}"
    print(f"\nSIGINT: exit 0 after {took:.1f} s; {len(ok)} right answers, {len(refused)} refused")


def test_a_model_that_cannot_be_served_is_one_line_exit_2(tmp_path):
    """A model whose replicas cannot start (Round has no WebGPU kernel: capture is refused in the replica's
    constructor): one line naming why, exit 2, Ray stopped."""
    if PROVIDER != "webgpu" or not webgpu_available():
        pytest.skip("needs WebGPU (Round has a CUDA kernel)")
    model = tmp_path / "round.onnx"
    model.write_bytes(tiny.round_model())
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-m", "ortcapture", "serve", str(model), "--provider", "webgpu",
                           "--port", str(_free_port()), "--num-cpus", "1"], capture_output=True, text=True,
                          timeout=STARTUP_S, env=env, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ortcapture serve: cannot serve") and "Capture" in last, last
    print("\n" + last)
    assert "http://" not in proc.stdout  # no URL: it never served


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files), made with cryptography."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = tmp / "cert.pem", tmp / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return certfile, keyfile


@pytest.mark.parametrize("how", ["flag", "env"])
def test_haproxy_with_https_is_refused_before_ray(tmp_path, monkeypatch, capsys, how):
    """Ray 2.60's HAProxy ingress has no TLS: ``--ssl-certfile`` beside ``--haproxy`` (or an inherited
    ``RAY_SERVE_ENABLE_HA_PROXY=1``) is one line and exit 2 before Ray starts — not an https:// URL printed for a
    server that answers in plain HTTP."""
    from ortcapture.cli import main

    certfile, keyfile = _self_signed(tmp_path)
    model = tmp_path / "m.onnx"
    model.write_bytes(tiny.bucket_model())
    with socket.socket() as s:  # a free port: the port check comes first
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setitem(sys.modules, "ray", None)  # importing Ray now fails: the refusal must come first
    args = ["serve", str(model), "--provider", "cpu", "--port", str(port), "--ssl-certfile", str(certfile),
            "--ssl-keyfile", str(keyfile)]
    if how == "flag":
        args.append("--haproxy")
    else:
        monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "plain HTTP" in lines[0] and "--ssl-certfile" in lines[0], lines


def test_sigterm_to_the_process_group_exits_at_once(tmp_path):
    """SIGTERM to the whole process group (a container stop, ``kill -- -PGID``) reaches Ray's GCS and raylet too:
    ``ortcapture serve`` exits 0 at once, saying the cluster is gone, and leaves no process of the group behind (every
    Serve call of the graceful stop used to wait 60 s for the dead GCS, then Ray aborted it: exit 1 after 61 s); the
    killed tier replica's batch-slot pool in /dev/shm is unlinked on the way out or by the next start's sweep."""
    pools_before = _slot_pools()
    srv = Server(tmp_path, provider="cpu", replicas=1, new_session=True)
    try:
        srv.wait_ready()
        assert _slot_pools() - pools_before  # the tier replica's batch slots (a /dev/shm object)
        t = time.monotonic()
        os.killpg(srv.proc.pid, signal.SIGTERM)
        rc = srv.proc.wait(45)
        took = time.monotonic() - t
        assert rc == 0 and took < 20, (rc, took, srv.tail())  # waits up to 3 s for the replicas to die
        deadline = time.monotonic() + 20
        while True:  # the group's other processes (Ray's) end too
            try:
                os.killpg(srv.proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "processes of the group are still running 20 s later"
            time.sleep(0.2)
        # the replica's pool: unlinked on the way out when the replica died within 3 s; else it is its own process
        # group's (Ray's worker), outlives the raylet for a while, and its pool is what the next server's start
        # sweeps — once the replica is gone (a zombie counts as gone) the sweep takes it
        from ortcapture.serving.slots import sweep_stale_pools

        deadline = time.monotonic() + 60
        while _slot_pools() - pools_before:
            assert time.monotonic() < deadline, "the killed replica's pool is still there 60 s later"
            sweep_stale_pools()
            time.sleep(0.5)
    finally:
        try:
            os.killpg(srv.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        srv.stop()


def test_sigterm_stops_it_cleanly_https_and_a_bearer_token(tmp_path, reference):
    """SIGTERM (what a process manager sends) stops ``ortcapture serve`` like SIGINT: exit 0, not Ray's abort on
    SIGTERM. The CPU EP (no capture): requests are still batched and right. Served over HTTPS (Ray Serve's own TLS
    options) with ``--token-file``: every endpoint but health needs the bearer token (401 without)."""
    certfile, keyfile = _self_signed(tmp_path)
    token = "test-token-" + "0123456789abcdef"
    (tmp_path / "token").write_text(token + "\n")
    srv = Server(tmp_path, provider="cpu", replicas=1, scheme="https",
                 extra=("--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile), "--token-file",
                        str(tmp_path / "token")))
    try:
        srv.wait_ready()
        assert srv.proc.stdout.readline().decode().strip() == srv.url  # the printed URL says https
        auth = {"Authorization": f"Bearer {token}"}
        assert _get(f"{srv.url}/v2/health/live")[0] == 200  # health: no token needed
        assert _get(f"{srv.url}/v2/models/{MODEL}")[0] == 401
        code, body = _get(f"{srv.url}/v2/models/{MODEL}", headers={"Authorization": "Bearer nope-nope-nope-nope"})
        assert code == 401 and token.encode() not in body
        assert _get(f"{srv.url}/v2/models/{MODEL}", headers=auth)[0] == 200
        import gevent.ssl

        client = http.InferenceServerClient(f"127.0.0.1:{srv.port}", ssl=True, insecure=True,
                                            ssl_context_factory=gevent.ssl._create_unverified_context)
        x = _distinct(60, 0, 3)
        with pytest.raises(Exception, match="401|Bearer"):
            _infer(client, x)
        inp = http.InferInput("X", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        res = client.infer(MODEL, [inp], headers=auth)
        assert all(_close(res.as_numpy(n), w) for n, w in reference(x).items())
        with pytest.raises(OSError):  # plain HTTP on the TLS port is no way around it
            urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/v2/models/{MODEL}", timeout=5).read()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.tail()
        assert "SIGTERM received" not in srv.tail()
    finally:
        srv.stop()


def test_the_shutdown_filter_drops_only_the_controllers_kill_notices():
    """At shutdown, Ray's raylet lines about Serve's controller tasks killed by ``ray.kill`` read as failures (a
    new user's report); every other line, split across writes or not, reaches the log whole."""
    import io

    from ortcapture.serving.deployment import _ShutdownNoiseFilter

    log = io.StringIO()
    f = _ShutdownNoiseFilter(log)
    f.write("\x1b[33m(raylet)\x1b[0m Task ServeController.listen_for_change failed. There are infinite retries "
            "remaining, so the task will be retried. Error: The actor is dead because it was killed by `ray.kill`.\n")
    f.write("(raylet) Task Model.infer failed: killed by `ray.kill`.\nstopp")
    f.write("ing: requests in flight finish\n(raylet) Task ServeController.graceful_shutdown failed ... killed by ")
    f.write("`ray.kill`.\nlast words")
    f.flush()
    assert log.getvalue() == ("(raylet) Task Model.infer failed: killed by `ray.kill`.\n"
                              "stopping: requests in flight finish\nlast words")
    assert f.isatty() is False and f.getvalue() == log.getvalue()  # any other attribute: the target's


def test_the_shutdown_filter_keeps_every_line_of_threads_writing_at_once():
    """print() writes a line and its newline apart: threads printing through the filter at once (Ray's log thread,
    the cluster watch, the main thread) lose and double no text (their lines may interleave, as on any stream)."""
    import re

    import io
    import threading

    from ortcapture.serving.deployment import _ShutdownNoiseFilter

    log = io.StringIO()
    f = _ShutdownNoiseFilter(log)

    def speak(t):
        for k in range(3000):
            print(f"thread {t} line {k}", file=f)

    threads = [threading.Thread(target=speak, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    f.flush()
    said = re.findall(r"thread \d line \d+", log.getvalue())
    assert sorted(said) == sorted(f"thread {t} line {k}" for t in range(3) for k in range(3000))

