"""Ray Serve deployments: model replicas on captured graphs, and an Open Inference Protocol HTTP ingress.

``build_app(options, provider)`` returns a Ray Serve application of two deployments:

* ``Model`` — ``options.replicas`` replicas, each one :class:`ortcapture.serving.replica.ReplicaCore` (one session
  with ``buckets=`` and ``replay_thread=True``, every bucket warmed up in the constructor, one graph per bucket
  asserted). Requests are checked alone (:meth:`BatchRunner.rows`: a bad one is a 400 before it enters the batch
  queue — Serve itself would raise a bare ``RuntimeError``, a 500, for an item past ``max_batch_size``), then
  batched by ``@ray_serve.batch`` with ``max_batch_size`` = the largest bucket and a ``batch_size_fn`` that counts rows;
  ``max_ongoing_requests`` is raised to fit (its default 5 would silently cap batches at 5). A batch runs on a
  worker thread that hands the replay to the session's own thread, so the replica's event loop keeps forming the
  next batch meanwhile. GPUs per replica: 1 for CUDA, 0 otherwise (Ray sets ``CUDA_VISIBLE_DEVICES``).
  ``check_health()`` replays the smallest bucket and checks its answer; shutting down lets requests in flight finish
  (``graceful_shutdown_s``) and releases the graphs. Per-replica metrics go through ``ray.serve.metrics``; every
  second each replica also pushes its counters to the ingress for ``/stats``.
* ``Ingress`` — one replica, no GPU, up before the model replicas are warm: the routes of
  :mod:`ortcapture.serving.routes` (readiness 503 until a model replica runs, 200 after).

The environment the replicas need (the software WebGPU adapter, ortcapture's cache, ...; see
:data:`ortcapture.serving.config.ENV_PASSED`) goes through ``runtime_env``: workers that join a cluster do not
inherit the driver's environment. This module imports Ray; ``import ortcapture.serving`` does not.
"""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import ray
from ray import serve as ray_serve

from ortcapture.serving.batch import RequestError
from ortcapture.serving.config import ServeOptions, check_port, model_layout
from ortcapture.serving.grpc_service import GrpcIngress, grpc_options, proxy_runtime_env
from ortcapture.serving.protocol import ProtocolError
from ortcapture.serving.replica import ReplicaCore
from ortcapture.serving.routes import Refusal, Router
from ortcapture.serving.shm_store import ActorRegistry, ShmStore

MODEL_DEPLOYMENT = "Model"

def _keep_replica_grpc_on_loopback(options: ServeOptions) -> None:
    """On a loopback-only cluster (:meth:`ServeOptions.loopback`), bind this replica's inter-deployment gRPC server
    to 127.0.0.1. Ray Serve 2.60 binds it to ``[::]:0`` whatever the cluster's address
    (``ray/serve/_private/replica.py``, ``_on_initialized``), so every replica otherwise listens on all of the
    machine's interfaces although the cluster, the proxy and ``--host`` are on loopback. Called from the replicas'
    constructors, which run before that server starts; a Ray without that helper is left as it is."""
    if not options.loopback():
        return
    try:
        from ray.serve._private import replica as ray_replica
    except ImportError:  # another Ray layout: nothing to adapt
        return
    real = getattr(ray_replica, "add_port_to_grpc_server", None)
    if real is None or getattr(real, "ortcapture_loopback", False):
        return

    def add_port_to_grpc_server(server, address: str):
        if address.startswith("[::]:") or address.startswith("0.0.0.0:"):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return real(server, address)

    add_port_to_grpc_server.ortcapture_loopback = True
    ray_replica.add_port_to_grpc_server = add_port_to_grpc_server

INGRESS_DEPLOYMENT = "Ingress"
#: seconds between a replica's pushes of its counters to the ingress
REPORT_EVERY_S = 1.0
#: seconds a client is asked to wait (``Retry-After``) after a 503 for a full queue or too many pending bodies
RETRY_AFTER_S = 1


def _batch_rows(items) -> int:
    """``batch_size_fn``: a batch's rows (each item is ``(rows, enqueued_ns, feeds)``)."""
    return sum(item[0] for item in items)


class ModelReplica:
    """The ``Model`` deployment's class (see the module docstring). Args: checked ``options`` and the resolved
    ``provider``."""

    def __init__(self, options: ServeOptions, provider: str, ingress_app: str | None = None):
        _keep_replica_grpc_on_loopback(options)
        self.options = options
        self.core = ReplicaCore(options, provider)
        self._pool = ThreadPoolExecutor(options.max_concurrent_batches, "ortcapture-batch")
        self._batched = ray_serve.batch(max_batch_size=options.max_batch_size,
                                    batch_wait_timeout_s=options.batch_wait_ms / 1000.0,
                                    max_concurrent_batches=options.max_concurrent_batches,
                                    batch_size_fn=_batch_rows)(self._run_batch)
        ctx = ray_serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self._app = ingress_app or ctx.app_name  # where the ingress runs
        self._reporter: asyncio.Task | None = None
        self._ingress = None
        self._metrics = _Metrics(options.name)
        self._metrics.graphs(self.core)

    # -- requests -----------------------------------------------------------------------------------------------
    async def infer(self, feeds: dict) -> dict:
        """One request: ``{"outputs": {name: array}}`` or ``{"error": message, "status": 400}`` (a bad request,
        refused before it enters the batch queue) / ``500`` (the run failed)."""
        self._start_reporter()
        try:
            rows = self.core.rows(feeds)
        except RequestError as exc:
            self._metrics.requests("bad")
            return {"error": str(exc), "status": 400}
        return await self._batched((rows, time.perf_counter_ns(), feeds))

    async def _run_batch(self, items: list) -> list:
        now = time.perf_counter_ns()
        feeds = [f for _, _, f in items]
        queued = [now - t for _, t, _ in items]
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self._pool, self.core.run, feeds, queued)
        self._metrics.batch(_batch_rows(items), results)
        if not any(isinstance(r, Exception) for r in results):
            return [{"outputs": r} for r in results]
        # who is at fault (a health replay at most): on the worker thread, not the event loop
        return await loop.run_in_executor(self._pool, self.core.answers, results)

    async def stats(self) -> dict:
        """This replica's report (:meth:`ReplicaCore.report`) with its replica id."""
        return {"replica": self.replica_id, **self.core.report()}

    async def check_health(self) -> None:
        """Replay the smallest bucket and check its answer (Ray Serve calls this periodically; raising marks the
        replica unhealthy and Ray replaces it)."""
        self._start_reporter()
        await asyncio.get_running_loop().run_in_executor(None, self.core.check_health)

    # -- reports ------------------------------------------------------------------------------------------------
    def _start_reporter(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            try:
                if self._ingress is None:
                    self._ingress = ray_serve.get_deployment_handle(INGRESS_DEPLOYMENT, self._app)
                await self._ingress.report.remote(self.replica_id, self.core.report())
                self._metrics.graphs(self.core)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the ingress restarts or is not up yet: push again later
                pass
            await asyncio.sleep(REPORT_EVERY_S)

    def __del__(self):
        """Graceful shutdown (Serve calls this after requests in flight finished): release the graphs."""
        task = getattr(self, "_reporter", None)
        if task is not None:
            task.cancel()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        core = getattr(self, "core", None)
        if core is not None:
            core.close()


class _Metrics:
    """Per-replica metrics through ``ray.serve.metrics`` (Ray adds the deployment, replica and application tags)."""

    def __init__(self, model: str):
        from ray.serve import metrics

        self.tags = {"model": model}
        self._requests = metrics.Counter("ortcapture_requests", "requests by outcome (ok, bad, failed)",
                                         tag_keys=("model", "outcome"))
        self._rows = metrics.Histogram("ortcapture_batch_rows", "rows per batch run",
                                       boundaries=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64], tag_keys=("model",))
        self._graphs = metrics.Gauge("ortcapture_graphs_captured", "graphs captured on this replica",
                                     tag_keys=("model",))
        self._uncaptured = metrics.Gauge("ortcapture_uncaptured_runs", "runs not served by a captured graph",
                                         tag_keys=("model",))
        self._waste = metrics.Gauge("ortcapture_padding_waste", "padded rows / rows replayed", tag_keys=("model",))

    def requests(self, outcome: str, n: int = 1) -> None:
        self._requests.inc(n, tags={**self.tags, "outcome": outcome})

    def batch(self, rows: int, results) -> None:
        self._rows.observe(rows, tags=self.tags)
        bad = sum(isinstance(r, Exception) for r in results)
        if len(results) - bad:
            self.requests("ok", len(results) - bad)
        if bad:
            self.requests("failed", bad)

    def graphs(self, core: ReplicaCore) -> None:
        if core.session is None:
            return
        s = core.bucket_stats()
        self._graphs.set(s["captured"], tags=self.tags)
        self._uncaptured.set(s["uncaptured"], tags=self.tags)
        self._waste.set(s["padding_waste"], tags=self.tags)


class IngressReplica(GrpcIngress):  # hook: the gRPC methods (ortcapture.serving.grpc_service)
    """The ``Ingress`` deployment's class: the Open Inference Protocol over HTTP in front of ``model`` (a handle
    to the ``Model`` deployment), or, with ``model=None``, of the ``Model`` deployment of application
    ``model_app`` (looked up once it runs)."""

    def __init__(self, options: ServeOptions, model=None, model_app: str | None = None):
        import ortcapture

        _keep_replica_grpc_on_loopback(options)
        self.spec = model_layout(options).spec
        self.model = model
        self._app = model_app or ray_serve.get_replica_context().app_name  # where the model runs
        self._ready_at = 0.0
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._draining = False  # set by drain(): new requests get a 503, the ones in flight finish
        self._in_flight = 0
        self._pending_bodies = 0  # requests whose body is still arriving
        self._queued = 0  # requests waiting for a model replica's answer
        self._refused = {"queue_full": 0, "bodies_pending": 0, "body_timeout": 0, "request_timeout": 0,
                         "client_gone": 0}
        self.options = options
        # hook: system shared memory, its registry one named actor per application (ortcapture.serving.shm_store)
        self.shm = ShmStore(ActorRegistry(f"{options.app_name}-shm"), allow_remote=options.allow_remote_shared_memory)
        self.router = Router(self.spec, self.ready, self.infer, server_version=ortcapture.__version__,
                             token=options.token, ingress_stats=self._stats, shm=self.shm)

    async def __call__(self, request):
        from starlette.responses import Response

        if self._draining:
            return Response(b'{"error": "the server is shutting down"}', status_code=503,
                            headers={"content-type": "application/json"})
        self._in_flight += 1
        try:
            return await self._handle(request)
        finally:
            self._in_flight -= 1

    async def drain(self, timeout_s: float) -> int:
        """Graceful shutdown, first step: answer new requests with a 503 and wait (at most ``timeout_s`` seconds)
        until the requests in flight have their answers; returns how many were still in flight then (0 normally).
        Serve's own shutdown closes the HTTP proxy's connections, requests in flight included."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self.shm.shutdown()  # hook: every shared memory region unregistered and unmapped
        return self._in_flight

    async def _handle(self, request):
        from starlette.responses import Response

        headers = {k.lower(): v for k, v in request.headers.items()}

        async def read_body(cap: int) -> bytes:
            return await self._read_body(request, cap)

        client = request.client.host if request.client else None  # hook: shared memory registration is loopback's
        res = await self.router.handle(request.method, request.url.path, headers, read_body, client)
        return Response(res.body, status_code=res.status, headers=res.headers)

    async def _read_body(self, request, cap: int) -> bytes:
        """The request body, bounded three ways: at most ``cap`` bytes (413); at most
        ``options.max_pending_bodies`` bodies arriving at once (503 at once, ``Connection: close``); and a body that
        makes no progress for ``options.body_timeout_s`` seconds is refused (408, ``Connection: close``). Ray Serve's
        proxy hands the request over after its headers and streams the body on demand, so without these a
        thousand connections that send headers and stall hold every slot of the ingress."""
        o = self.options
        if self._pending_bodies >= o.max_pending_bodies:
            self._refused["bodies_pending"] += 1
            raise Refusal(f"{self._pending_bodies} requests are sending their bodies already; try again",
                          503, {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        self._pending_bodies += 1
        try:
            chunks, n = [], 0
            stream = request.stream().__aiter__()
            while True:
                try:
                    chunk = await asyncio.wait_for(stream.__anext__(), o.body_timeout_s)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    self._refused["body_timeout"] += 1
                    raise Refusal(f"the request body made no progress for {o.body_timeout_s:g} s", 408,
                                  {"Connection": "close"}) from None
                except Exception as exc:  # noqa: BLE001 - starlette's ClientDisconnect: the client went away
                    self._refused["client_gone"] += 1
                    raise Refusal(f"the client closed the connection before its body arrived "
                                  f"({type(exc).__name__})", 400, {"Connection": "close"}) from None
                n += len(chunk)
                if n > cap:
                    raise ProtocolError(f"request body is past the cap of {cap} bytes", 413)
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            self._pending_bodies -= 1

    def _stats(self) -> dict:
        """The ingress's own counters for ``/stats``: bodies arriving and requests queued now, their caps, and
        the requests refused by each bound since start."""
        o = self.options
        return {"pending_bodies": self._pending_bodies, "max_pending_bodies": o.max_pending_bodies,
                "queued": self._queued, "max_queued": o.max_queued, "refused": dict(self._refused)}

    async def layout(self) -> dict:
        """What clients see of the served model (:func:`replace_model` checks a replacement against it)."""
        return _api_of(self.spec)

    async def report(self, replica: str, data: dict) -> None:
        """A model replica's counters, shown under ``/stats``."""
        self.router.report(replica, data)

    async def ready(self) -> bool:
        """Whether a ``Model`` replica is running (warm), asked of the Serve controller: a yes is trusted for 0.5 s,
        a no is asked again (at most every 50 ms)."""
        if self._draining:
            return False
        asked = self._ready_at
        if self._ready and time.monotonic() - asked < 0.5:
            return True
        async with self._ready_lock:
            if self._ready_at == asked or time.monotonic() - self._ready_at > 0.05:
                try:
                    self._ready = await asyncio.get_running_loop().run_in_executor(None, _model_running, self._app)
                except Exception:  # noqa: BLE001 - the controller is busy: keep the last answer
                    pass
                self._ready_at = time.monotonic()
        return self._ready

    async def infer(self, feeds: dict) -> dict:
        """Run one request's checked ``feeds`` on a model replica: its answer, or ``{"error", "status": 503,
        "retry_after"}`` when ``options.max_queued`` requests wait for an answer already (refused at once), no
        replica answers within ``options.request_timeout_s`` seconds, or none could run it."""
        o = self.options
        if self._queued >= o.max_queued:
            self._refused["queue_full"] += 1
            return {"error": f"{self._queued} requests are queued already; try again", "status": 503,
                    "retry_after": RETRY_AFTER_S}
        if self.model is None:
            self.model = ray_serve.get_deployment_handle(MODEL_DEPLOYMENT, self._app)
        self._queued += 1
        try:
            return await asyncio.wait_for(self.model.infer.remote(feeds), o.request_timeout_s)
        except asyncio.TimeoutError:
            self._refused["request_timeout"] += 1
            return {"error": f"no model replica answered within {o.request_timeout_s:g} s", "status": 503,
                    "retry_after": RETRY_AFTER_S}
        except (ray.exceptions.RayError, RuntimeError) as exc:  # a replica died, was removed, or is overloaded
            return {"error": f"no model replica could run the request: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:300] if str(exc) else ''}", "status": 503,
                    "retry_after": RETRY_AFTER_S}
        finally:
            self._queued -= 1


def _model_running(app: str) -> bool:
    status = ray_serve.status().applications.get(app)
    if status is None:
        return False
    dep = status.deployments.get(MODEL_DEPLOYMENT)
    if dep is None:
        return False
    return any(str(getattr(k, "value", k)) == "RUNNING" and n > 0 for k, n in dep.replica_states.items())


def build_app(options: ServeOptions, provider: str):
    """The Ray Serve application for checked ``options`` and a resolved ``provider`` (``cuda``, ``webgpu``,
    ``cpu``): ``serve.run(build_app(...))``, or compose it into your own application.

    Raises:
        CaptureError: what :func:`ortcapture.serving.config.model_layout` refuses (checked here, in the driver).
    """
    model_layout(options)  # refuse an unservable layout before any replica starts
    model, ingress = _deployments(options, provider)
    return ingress.bind(options, model.bind(options, provider))


def _deployments(options: ServeOptions, provider: str):
    env = options.replica_env()
    runtime_env = {"env_vars": env} if env else {}
    model = ray_serve.deployment(
        ModelReplica, name=MODEL_DEPLOYMENT, num_replicas=options.replicas,
        ray_actor_options={"num_gpus": options.gpus(provider), "num_cpus": options.cpus_per_replica,
                           "runtime_env": runtime_env},
        max_ongoing_requests=max(options.max_batch_size * (options.max_concurrent_batches + 1), 16),
        graceful_shutdown_timeout_s=options.graceful_shutdown_s, graceful_shutdown_wait_loop_s=0.2,
        health_check_period_s=5.0, health_check_timeout_s=60.0)
    ingress = ray_serve.deployment(
        IngressReplica, name=INGRESS_DEPLOYMENT, num_replicas=1,
        ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env},
        max_ongoing_requests=max(1024, options.max_queued + options.max_pending_bodies + 64),
        graceful_shutdown_timeout_s=options.graceful_shutdown_s, graceful_shutdown_wait_loop_s=0.2)
    return model, ingress


def model_app_name(options: ServeOptions) -> str:
    """The application :func:`start` runs the model replicas in (the ingress runs in ``options.app_name``)."""
    return f"{options.app_name}-model"


class ServeFailed(RuntimeError):
    """The model's deployment failed (its replicas could not start): the message is Serve's reason."""


class ServeRefused(ServeFailed):
    """Nothing was deployed: the joined cluster's Serve listens elsewhere, or serves this name or route already
    (stopping must then leave that cluster's applications alone)."""


def start(options: ServeOptions, provider: str, *, ray_init: dict | None = None,
          on_status: Callable[[str], None] | None = None, startup_timeout_s: float = 900.0) -> str:
    """Start Ray (a new local cluster, or join ``options.address``), Serve's HTTP proxy on ``host:port`` and the
    application; return the base URL once the model replicas are warm.

    Raises:
        ServeFailed: a replica's constructor failed (unservable model: Serve's message, last line first), or the
            replicas were not warm within ``startup_timeout_s``; on a joined cluster (``options.address``), its
            Serve listens on another host or port than ``options`` asks for, or an application of that cluster
            already has this model's application name or serves the route ``/`` (never shared silently).
        CaptureError: (a new local cluster) ``host:port`` is in use already
            (:func:`ortcapture.serving.config.check_port`), checked before Ray starts.
    """
    say = on_status or (lambda msg: None)
    if not options.address and not ray.is_initialized():
        check_port(options.host, options.port)  # Ray's proxy binds with SO_REUSEPORT: it would share the port
        if options.grpc_port:  # hook: the gRPC port too
            check_port(options.host, options.grpc_port)
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if options.address:
            kwargs["address"] = options.address
        else:  # a new local cluster, never RAY_ADDRESS's
            need = options.replicas * options.cpus_per_replica + 1
            kwargs.update(address="local", num_cpus=max(os.cpu_count() or 1, int(need + 0.999)))
            gpus = options.gpus(provider) * options.replicas
            if gpus and provider == "cuda":
                kwargs["num_gpus"] = None  # Ray counts the GPUs itself
            if proxy_runtime_env(options):  # hook: Ray's gRPC proxy binds --host, not every interface
                kwargs["runtime_env"] = proxy_runtime_env(options)
        kwargs.update(ray_init or {})
        say("starting Ray" if not options.address else f"joining the Ray cluster at {options.address}")
        import signal
        import threading

        main = threading.current_thread() is threading.main_thread()
        term = signal.getsignal(signal.SIGTERM) if main else None
        ray.init(**{k: v for k, v in kwargs.items() if v is not None})
        if callable(term):  # ray.init replaces a Python SIGTERM handler with its own (it aborts the process)
            signal.signal(signal.SIGTERM, term)
        if not options.address:  # what --address takes to join it (ortcapture serve --replace, ray status)
            say(f"Ray cluster at {ray.get_runtime_context().gcs_address}")
    http = {"host": options.host, "port": options.port}
    if options.ssl_certfile:
        http.update(ssl_certfile=options.ssl_certfile, ssl_keyfile=options.ssl_keyfile)
    if options.address:
        _check_joined_serve(options)
    grpc = {"grpc_options": grpc_options(options)} if options.grpc_port else {}  # hook: gRPC
    ray_serve.start(http_options=http, proxy_location="HeadOnly", **grpc)
    if options.address:
        _check_joined_serve(options)
    model_layout(options)
    model, ingress = _deployments(options, provider)
    model_app = model_app_name(options)
    # the ingress first, in its own application: HTTP answers (readiness 503) before the model replicas are warm
    ray_serve.run_many([ray_serve.RunTarget(ingress.bind(options, None, model_app), name=options.app_name,
                                            route_prefix="/")], wait_for_applications_running=True)
    _check_listening(options.host, options.port)
    if options.grpc_port:  # hook: gRPC
        _check_listening(options.host, options.grpc_port)
    ray_serve.run_many([ray_serve.RunTarget(model.bind(options, provider, options.app_name), name=model_app,
                                            route_prefix=None)],
                       wait_for_ingress_deployment_creation=True, wait_for_applications_running=False)
    scheme = "https" if options.ssl_certfile else "http"
    say(f"HTTP up at {scheme}://{options.host}:{options.port} (ready: 503 until warm); warming up {options.replicas} "
        + (f"replica(s): one graph per bucket {list(options.buckets)}" if provider != "cpu" and options.arm == "ortcapture"
           else "replica(s) without capture: each batch runs at its own size"))
    _wait_running(model_app, startup_timeout_s)
    return f"{scheme}://{options.host}:{options.port}"


def _check_listening(host: str, port: int, timeout_s: float = 30.0) -> None:
    """Raise :class:`ServeFailed` unless something accepts TCP connections on ``host:port`` within ``timeout_s``:
    Ray Serve's proxy can fail to listen (a TLS pair uvicorn refuses) while Serve reports the application RUNNING."""
    import socket

    target = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((target, port), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise ServeFailed(f"Ray Serve's HTTP proxy is not listening on {host}:{port} after {timeout_s:.0f} s "
                                  f"({exc.strerror or exc}); the proxy's log under /tmp/ray/session_latest/logs/serve "
                                  "says why") from None
            time.sleep(0.2)


def _wait_running(app: str, timeout_s: float) -> None:
    """Wait until Serve says application ``app`` is RUNNING; :class:`ServeFailed` if it failed or took too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = ray_serve.status().applications.get(app)
        state = str(getattr(st.status, "value", st.status)) if st is not None else "NOT_STARTED"
        if state == "RUNNING":
            return
        if state in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise ServeFailed(_failure(st))
        if time.monotonic() > deadline:
            raise ServeFailed(f"the model replicas were not warm after {timeout_s:.0f} s ({state})")
        time.sleep(0.25)


def replace_model(options: ServeOptions, provider: str, *, on_status: Callable[[str], None] | None = None,
                  timeout_s: float = 900.0) -> None:
    """Replace the model a running ``ortcapture serve`` serves under ``options.name``, in place and without
    downtime: Ray Serve's in-place application update of the model application (new replicas are started with
    ``options`` — a new model file, buckets, replicas — and warmed up; the old ones finish their requests in flight
    and stop; requests meanwhile wait for a replica instead of failing). The HTTP ingress, its port and its
    ``/stats`` stay. Joins ``options.address`` (``"auto"`` on a node of the cluster) unless Ray is initialised (Ray
    2.60's token authentication: see :func:`ortcapture.serving.config.join_auth_env`, called before ``import ray``).

    Raises:
        ServeRefused: no server of that name runs there (nothing is deployed), or the new model's inputs, outputs,
            batch axes or row limit differ from what the running ingress parses (a client would see another API).
        ServeFailed: the new replicas could not start (Serve's reason) or were not warm within ``timeout_s``; the
            running ones keep serving then until Serve replaces them.
    """
    say = on_status or (lambda msg: None)
    if not ray.is_initialized():
        ray.init(address=options.address or "auto", include_dashboard=False, log_to_driver=False)
    apps = ray_serve.status().applications
    model_app = model_app_name(options)
    if options.app_name not in apps or model_app not in apps:
        raise ServeRefused(f"no ortcapture serve of model name {options.name!r} runs on this cluster (applications "
                           f"{sorted(apps)}): start one instead")
    running = ray_serve.get_deployment_handle(INGRESS_DEPLOYMENT, options.app_name).layout.remote().result(
        timeout_s=60)
    new = _api_of(model_layout(options).spec)
    if running != new:
        raise ServeRefused(f"the new model's API differs from the one served (served {running}, new {new}): "
                           "serve it under another --name")
    model, _ = _deployments(options, provider)
    say(f"replacing {options.name!r} in place: {options.replicas} new replica(s) warm up, the old ones finish their "
        "requests and stop")
    try:  # Serve marks the application DEPLOYING when it takes the new version, RUNNING once it runs
        ray_serve.run_many([ray_serve.RunTarget(model.bind(options, provider, options.app_name), name=model_app,
                                                route_prefix=None)], wait_for_applications_running=True)
    except RuntimeError:  # Serve's DEPLOY_FAILED: its reason, one line
        pass
    _wait_running(model_app, timeout_s)


def _api_of(spec) -> dict:
    """What a client of the ingress sees of a model: inputs and outputs (name, datatype, shape), batch axes, the
    row limit — equal for a replacement."""
    return {"inputs": [(t.name, t.datatype, list(t.shape)) for t in spec.inputs],
            "outputs": [(t.name, t.datatype, list(t.shape)) for t in spec.outputs],
            "batch_axes": dict(spec.batch_axes), "max_rows": int(spec.max_rows)}


def _check_joined_serve(options: ServeOptions) -> None:
    """On a joined cluster: refuse to deploy where it would share silently — Serve running there on another host
    or port than asked (Serve keeps its first HTTP options and would ignore ours with a log line), or an
    application that already has this model's application names or serves the route ``/``. Replacing a model
    on purpose is Ray Serve's in-place update (docs/SERVING.md), not this path."""
    try:
        from ray.serve.context import _get_global_client  # Ray's own accessor of the running Serve's client
        client = _get_global_client(raise_if_no_controller_running=False)
    except Exception:  # noqa: BLE001 - no Serve there yet, or another Ray layout: nothing to compare
        client = None
    if client is None:
        return
    cfg = client.http_config
    if int(cfg.port) != int(options.port) or str(cfg.host) != str(options.host):
        raise ServeRefused(f"Serve on the cluster at {options.address} listens on {cfg.host}:{cfg.port}, not "
                          f"--host {options.host} --port {options.port}: pass those (one Serve, one HTTP port per "
                          "cluster)")
    taken = []
    for name, app in (client.get_serve_details().get("applications") or {}).items():
        if name in (options.app_name, model_app_name(options)):
            taken.append(f"application {name!r} exists already")
        elif (app or {}).get("route_prefix") == "/":
            taken.append(f"application {name!r} serves the route '/' already")
    if taken:
        raise ServeRefused(f"the cluster at {options.address} is serving: {'; '.join(taken)} (use another --name, or "
                          "stop that one first; to replace a model in place see docs/SERVING.md)")


def _failure(app_status) -> str:
    """Serve's reason a deployment failed, reduced to its last exception line."""
    texts = [app_status.message or ""] + [d.message or "" for d in app_status.deployments.values()]
    text = "\n".join(t for t in texts if t)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln.split(":", 1)[0] or "Exception" in ln.split(":", 1)[0]:
            return ln
    return lines[-1] if lines else "the model deployment failed"


def stop(options: ServeOptions, deployed: bool = True) -> None:
    """Shut the application down gracefully (requests in flight finish, graphs are released), then Serve and Ray
    when this process started them (a joined cluster keeps running: only this application is deleted, and nothing
    at all with ``deployed=False``: a refused start deployed nothing of its own)."""
    if not ray.is_initialized():  # refused before Ray started (a port in use): nothing to stop
        return
    if not deployed and options.address:
        ray.shutdown()
        return
    import contextlib
    import sys

    # Ray's driver prints the raylet's "Task ServeController... killed by ray.kill" lines of a shutdown to stdout,
    # which carries only the URL: they go to stderr with the rest of the log
    with contextlib.redirect_stdout(sys.stderr):
        _stop(options)


def _stop(options: ServeOptions) -> None:
    try:
        try:  # requests in flight finish first: Serve's own shutdown closes the proxy's connections with them
            ingress = ray_serve.get_deployment_handle(INGRESS_DEPLOYMENT, options.app_name)
            ingress.drain.remote(options.graceful_shutdown_s).result(timeout_s=options.graceful_shutdown_s + 5)
        except Exception:  # noqa: BLE001 - best effort: the ingress may be gone already
            pass
        if options.address:
            ray_serve.delete(model_app_name(options))
            ray_serve.delete(options.app_name)
        else:
            ray_serve.shutdown()
    finally:
        if ray.is_initialized():
            ray.shutdown()


def serve(model: str | None = None, *, options: ServeOptions | None = None, stop_event=None,
          on_ready: Callable[[str], None] | None = None, on_status: Callable[[str], None] | None = None,
          ray_init: dict | None = None, **kwargs) -> int:
    """Serve ``model`` until SIGINT/SIGTERM (or ``stop_event`` is set), then shut down gracefully; returns 0.

    Args:
        model: the ONNX model path; the other :class:`~ortcapture.serving.config.ServeOptions` fields as keywords
            (``buckets=``, ``provider=``, ``replicas=``, ``port=``, ...), or a whole ``options=``.
        stop_event: a ``threading.Event`` that stops the server when set (signals still work in the main thread).
        on_ready: called with the base URL once the replicas are warm (default: print it).
        on_status: progress lines (default: none).
        ray_init: extra ``ray.init`` keywords for the new local cluster (e.g. ``{"num_cpus": 2}``).

    Raises:
        CaptureError: bad options, an unservable model layout, no usable provider (``ortcapture.pick_provider``).
        ServeFailed: the model replicas could not start (e.g. the model does not capture), or not in time.
    """
    import signal
    import threading

    import ortcapture

    if options is None:
        options = ServeOptions(model=model, **kwargs)
    options = options.checked()
    model_layout(options)
    provider = "cpu" if options.provider == "cpu" else ortcapture.pick_provider(options.provider)
    stop_event = stop_event or threading.Event()
    previous = {}
    main = threading.current_thread() is threading.main_thread()

    def on_signal(signum, frame):  # noqa: ARG001 - the signal module's signature
        stop_event.set()

    if main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    deployed = True
    try:
        try:
            url = start(options, provider, ray_init=ray_init, on_status=on_status)
        except ServeRefused:
            deployed = False
            raise
        if main:  # ray.init installs its own SIGTERM handler (it aborts the process): ours again
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, on_signal)
        (on_ready or print)(url)
        while not stop_event.wait(0.5):
            pass
        if on_status:
            on_status("stopping: requests in flight finish, graphs are released")
        return 0
    finally:
        try:
            stop(options, deployed)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
