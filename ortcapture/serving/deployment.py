"""Deploying a served model on Ray Serve: the application, and the process lifecycle (start, serve, stop, replace).

``build_app(options, provider)`` returns a Ray Serve application of three deployments (names in
:mod:`ortcapture.serving.ray_common`):

* ``Model`` — the batching tier (:class:`ortcapture.serving.tier.ModelTier`): ``options.ingress_replicas``
  replicas (default ``min(4, cluster CPUs // 2)``, at least 1; no CPU reserved), each serving the HTTP routes and the
  handle method ``infer``, checking each request once, forming batches and making one call per batch to a session
  replica. Handle users: ``model_handle(app_name).infer.remote({input: array})`` -> ``{"outputs": {...}}``;
* ``ModelSession`` — ``options.replicas`` replicas holding the session
  (:class:`ortcapture.serving.session_replica.ModelSession`); GPUs per replica: 1 for CUDA, 0 otherwise;
* ``ModelStats`` — one replica keeping the reports ``/stats`` shows (:class:`ortcapture.serving.tier.ModelStats`).

:func:`start` deploys the tier (with ``ModelStats``) first, in application ``options.app_name`` on the route ``/``,
so HTTP answers (readiness 503) before the session replicas are warm; then the session replicas in application
``<app_name>-model``. The environment the replicas need (the software WebGPU adapter, ortcapture's cache, ...; see
:data:`ortcapture.serving.config.ENV_PASSED`) goes through ``runtime_env``: workers that join a cluster do not
inherit the driver's environment. This module imports Ray; ``import ortcapture.serving`` does not.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import ray
from ray import serve as ray_serve

from ortcapture.serving.config import ServeOptions, check_port, default_ingress_replicas, model_layout
from ortcapture.serving.grpc_service import grpc_options, proxy_runtime_env
from ortcapture.serving.ray_common import SESSION_DEPLOYMENT, STATS_DEPLOYMENT, TIER_DEPLOYMENT
from ortcapture.serving.session_replica import ModelSession
from ortcapture.serving.tier import ModelStats, ModelTier, api_of

#: the handle users' deployment (the batching tier); kept under its old name for callers
MODEL_DEPLOYMENT = TIER_DEPLOYMENT


#: whether :func:`start` connected this process to Ray (a new local cluster or a joined one), not its caller
_RAY_STARTED_HERE = [False]
#: when (``time.time()``) :func:`start` started Ray here: the batch-slot pools made since are this server's
_STARTED_AT = [0.0]


def model_handle(app_name: str):
    """The ``DeploymentHandle`` of a served model's batching tier (the ``Model`` deployment of application
    ``app_name``, ``ortcapture-<name>`` for ``ortcapture serve``), for Python clients inside the Ray cluster::

        handle = ortcapture.serving.model_handle("ortcapture-320n")
        answer = handle.infer.remote({"images": x}).result()   # {"outputs": {"output0": array}} or {"error", "status"}

    ``x``: a numpy array of the input's dtype with at most ``max_batch_size`` rows along the batch dim; each
    request's answer holds its own rows only. Needs Ray initialised in this process (``ray.init(address=...)``)."""
    return ray_serve.get_deployment_handle(TIER_DEPLOYMENT, app_name)


def build_app(options: ServeOptions, provider: str):
    """The Ray Serve application for checked ``options`` and a resolved ``provider`` (``cuda``, ``webgpu``,
    ``cpu``): ``serve.run(build_app(...))``, or compose it into your own application.

    Raises:
        CaptureError: what :func:`ortcapture.serving.config.model_layout` refuses (checked here, in the driver).
    """
    model_layout(options)  # refuse an unservable layout before any replica starts
    session, tier, stats = _deployments(options, provider)
    return tier.bind(options, provider, session.bind(options, provider), None, stats.bind(options.loopback()))


def ingress_replicas(options: ServeOptions) -> int:
    """The batching tier's replicas: ``options.ingress_replicas``, else from the CPUs of the cluster Ray is
    connected to (:func:`ortcapture.serving.config.default_ingress_replicas`; this machine's when Ray is not
    initialised)."""
    if options.ingress_replicas is not None:
        return int(options.ingress_replicas)
    cpus = ray.cluster_resources().get("CPU") if ray.is_initialized() else os.cpu_count()
    return default_ingress_replicas(cpus)


def _deployments(options: ServeOptions, provider: str):
    """``(ModelSession, Model, ModelStats)`` deployments for ``options``."""
    env = options.replica_env()
    runtime_env = {"env_vars": env} if env else {}
    tiers = ingress_replicas(options)
    session = ray_serve.deployment(
        ModelSession, name=SESSION_DEPLOYMENT, num_replicas=options.replicas,
        ray_actor_options={"num_gpus": options.gpus(provider), "num_cpus": options.cpus_per_replica,
                           "runtime_env": runtime_env},
        # every tier replica's batches in flight, and room for Serve's own calls
        max_ongoing_requests=max(16, 2 * tiers * options.max_concurrent_batches),
        graceful_shutdown_timeout_s=options.graceful_shutdown_s, graceful_shutdown_wait_loop_s=0.2,
        health_check_period_s=5.0, health_check_timeout_s=60.0)
    tier = ray_serve.deployment(
        ModelTier, name=TIER_DEPLOYMENT, num_replicas=tiers,
        ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env},
        max_ongoing_requests=max(1024, options.max_queued + options.max_pending_bodies + 64),
        graceful_shutdown_timeout_s=options.graceful_shutdown_s, graceful_shutdown_wait_loop_s=0.2)
    stats = ray_serve.deployment(ModelStats, name=STATS_DEPLOYMENT, num_replicas=1,
                                 ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
    return session, tier, stats


def model_app_name(options: ServeOptions) -> str:
    """The application :func:`start` runs the model replicas in (the ingress runs in ``options.app_name``)."""
    return f"{options.app_name}-model"


class ServeFailed(RuntimeError):
    """The model's deployment failed (its replicas could not start): the message is Serve's reason."""


class ServeStopped(ServeFailed):
    """A stop (SIGINT, SIGTERM, ``stop_event``) came while the replicas were warming up: :func:`serve` shuts down
    and returns 0."""


class ServeRefused(ServeFailed):
    """Nothing was deployed: the joined cluster's Serve listens elsewhere, or serves this name or route already
    (stopping must then leave that cluster's applications alone)."""


def start(options: ServeOptions, provider: str, *, ray_init: dict | None = None,
          on_status: Callable[[str], None] | None = None, startup_timeout_s: float = 900.0, stop_event=None) -> str:
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
        if options.grpc_port:  # the gRPC port too
            check_port(options.host, options.grpc_port, "--grpc-port")
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
            if proxy_runtime_env(options):  # Ray's gRPC proxy binds --host, not every interface
                kwargs["runtime_env"] = proxy_runtime_env(options)
        kwargs.update(ray_init or {})
        say("starting Ray" if not options.address else f"joining the Ray cluster at {options.address}")
        import signal
        import threading

        main = threading.current_thread() is threading.main_thread()
        term = signal.getsignal(signal.SIGTERM) if main else None
        _STARTED_AT[0] = time.time()
        ray.init(**{k: v for k, v in kwargs.items() if v is not None})
        _RAY_STARTED_HERE[0] = True
        if callable(term):  # ray.init replaces a Python SIGTERM handler with its own (it aborts the process)
            signal.signal(signal.SIGTERM, term)
        if not options.address:  # what --address takes to join it (ortcapture serve --replace, ray status)
            say(f"Ray cluster at {ray.get_runtime_context().gcs_address}")
    http = {"host": options.host, "port": options.port}
    if options.ssl_certfile:
        http.update(ssl_certfile=options.ssl_certfile, ssl_keyfile=options.ssl_keyfile)
    _check_joined_serve(options)  # a Serve already running (joined, or started earlier in this process)
    grpc = {"grpc_options": grpc_options(options)} if options.grpc_port else {}
    ray_serve.start(http_options=http, proxy_location="HeadOnly", **grpc)
    if options.address:
        _check_joined_serve(options)
    model_layout(options)
    session, tier, stats = _deployments(options, provider)
    model_app = model_app_name(options)
    # the tier first, in its own application: HTTP answers (readiness 503) before the session replicas are warm
    ray_serve.run_many([ray_serve.RunTarget(tier.bind(options, provider, None, model_app, stats.bind(options.loopback())),
                                            name=options.app_name, route_prefix="/")],
                       wait_for_applications_running=True)
    _check_listening(options.host, options.port)
    if options.grpc_port:
        _check_listening(options.host, options.grpc_port)
    ray_serve.run_many([ray_serve.RunTarget(session.bind(options, provider, options.app_name), name=model_app,
                                            route_prefix=None)],
                       wait_for_ingress_deployment_creation=True, wait_for_applications_running=False)
    scheme = "https" if options.ssl_certfile else "http"
    say(f"HTTP up at {scheme}://{options.authority()} (ready: 503 until warm); warming up {options.replicas} "
        + (f"replica(s): one graph per bucket {list(options.buckets)}" if provider != "cpu"
           else "replica(s) without capture (the CPU provider): each batch runs at its own size"))
    _wait_running(model_app, startup_timeout_s, stop_event)
    return f"{scheme}://{options.authority()}"


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


def _wait_running(app: str, timeout_s: float, stop=None) -> None:
    """Wait until Serve says application ``app`` is RUNNING; :class:`ServeFailed` if it failed or took too long,
    :class:`ServeStopped` as soon as ``stop`` (a ``threading.Event``: a signal) is set — a server whose replicas
    cannot start (a GPU asked for where there is none) otherwise ignored Ctrl-C for the whole ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if stop is not None and stop.is_set():
            raise ServeStopped(f"stopped while application {app!r} was warming up")
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
    running = ray_serve.get_deployment_handle(TIER_DEPLOYMENT, options.app_name).layout.remote().result(
        timeout_s=60)
    new = api_of(model_layout(options).spec)
    if running != new:
        raise ServeRefused(f"the new model's API differs from the one served (served {running}, new {new}): "
                           "serve it under another --name")
    session, _, _ = _deployments(options, provider)
    say(f"replacing {options.name!r} in place: {options.replicas} new replica(s) warm up, the old ones finish their "
        "requests and stop")
    try:  # Serve marks the application DEPLOYING when it takes the new version, RUNNING once it runs
        ray_serve.run_many([ray_serve.RunTarget(session.bind(options, provider, options.app_name), name=model_app,
                                                route_prefix=None)], wait_for_applications_running=True)
    except RuntimeError:  # Serve's DEPLOY_FAILED: its reason, one line
        pass
    _wait_running(model_app, timeout_s)


def _check_joined_serve(options: ServeOptions) -> None:
    """On a joined cluster, or where this process runs Serve already: refuse to deploy where it would share
    silently — Serve running there on another host or port than asked (Serve keeps its first HTTP options and
    would ignore ours with a log line), or an application that already has this model's application names or
    serves the route ``/``. Replacing a model on purpose is Ray Serve's in-place update (docs/SERVING.md), not
    this path."""
    try:
        from ray.serve.context import _get_global_client  # Ray's own accessor of the running Serve's client
        client = _get_global_client(raise_if_no_controller_running=False)
    except Exception:  # noqa: BLE001 - no Serve there yet, or another Ray layout: nothing to compare
        client = None
    if client is None:
        return
    cfg = client.http_config
    where = options.address or ray.get_runtime_context().gcs_address
    if int(cfg.port) != int(options.port) or str(cfg.host) != str(options.host):
        raise ServeRefused(f"Serve on the cluster at {where} listens on {cfg.host}:{cfg.port}, not "
                          f"--host {options.host} --port {options.port}: pass those (one Serve, one HTTP port per "
                          "cluster)")
    taken = []
    for name, app in (client.get_serve_details().get("applications") or {}).items():
        if name in (options.app_name, model_app_name(options)):
            taken.append(f"application {name!r} exists already")
        elif (app or {}).get("route_prefix") == "/":
            taken.append(f"application {name!r} serves the route '/' already")
    if taken:
        raise ServeRefused(f"the cluster at {where} is serving: {'; '.join(taken)} (use another --name, or "
                          "stop that one first; to replace a model in place see docs/SERVING.md)")


def _failure(app_status) -> str:
    """Serve's reason a deployment failed, reduced to its last exception line."""
    texts = [app_status.message or ""] + [d.message or "" for d in app_status.deployments.values()]
    text = "\n".join(t for t in texts if t)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        # ORT's own exception types are named Fail, InvalidGraph, InvalidArgument, NoSuchFile, ... (pybind11)
        if "Error" in head or "Exception" in head or (".onnxruntime_pybind11_state." in head and " " not in head):
            return ln
    return lines[-1] if lines else "the model deployment failed"


def stop(options: ServeOptions, deployed: bool = True, watch_cluster: bool = False) -> None:
    """Shut the application down gracefully (requests in flight finish, graphs are released), then Serve and Ray
    when :func:`start` started them; where Ray was joined (``address``) or already running in this process, only this
    application is deleted and the connection closed only if :func:`start` opened it. ``deployed=False`` (a refused
    start deployed nothing of its own): nothing else is touched — not the Serve that refused it, nor its
    applications. ``watch_cluster``: see :func:`serve`'s ``exit_when_cluster_gone`` (a new local cluster only)."""
    if not ray.is_initialized():  # refused before Ray started (a port in use): nothing to stop
        return
    if not deployed:
        if _RAY_STARTED_HERE[0]:
            _RAY_STARTED_HERE[0] = False
            ray.shutdown()
        return
    import contextlib
    import sys

    watch = None
    if watch_cluster and _RAY_STARTED_HERE[0] and not options.address:  # the local cluster started here: SIGTERM
        # to the whole process group kills its GCS too (serve(exit_when_cluster_gone=True), ortcapture serve only)
        done = threading.Event()
        thread = threading.Thread(target=_exit_when_cluster_gone, args=(done, _STARTED_AT[0]), daemon=True,
                                  name="ortcapture-cluster-watch")
        thread.start()
        watch = (done, thread)
    # Ray's driver prints the raylet's "Task ServeController... killed by ray.kill" lines of a shutdown to stdout,
    # which carries only the URL: they go to stderr with the rest of the log, less those lines (Serve's controller
    # stopped while its own tasks were pending: noise that reads as a failure)
    out = _ShutdownNoiseFilter(sys.stderr)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            _stop(options, watch)
        finally:
            out.flush()


class _ShutdownNoiseFilter:
    """A text stream that passes whole lines to ``target`` except Ray's harmless shutdown notices: a raylet line
    about a ``ServeController`` task that failed because ``ray.kill`` stopped the controller. Thread-safe (Ray's log
    thread, the cluster watch and the main thread write through it); bytes and every other stream attribute
    (``isatty``, ``fileno``, ``encoding``, ...) go to ``target`` as they are."""

    def __init__(self, target) -> None:
        self.target, self._part, self._lock = target, "", threading.Lock()

    @staticmethod
    def noise(line: str) -> bool:
        return "ServeController." in line and "killed by `ray.kill`" in line

    def write(self, text) -> int:
        if not isinstance(text, str):  # bytes: not lines of Ray's log
            return getattr(self.target, "buffer", self.target).write(text)
        with self._lock:
            *lines, self._part = (self._part + text).split("\n")
            kept = "".join(line + "\n" for line in lines if not self.noise(line))
            if kept:
                self.target.write(kept)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            if self._part and not self.noise(self._part):
                self.target.write(self._part)
            self._part = ""
        self.target.flush()

    def __getattr__(self, name):
        return getattr(self.target, name)


def _cluster_gone(address: str) -> bool:
    """Whether the GCS at ``address`` (``host:port``) refuses connections: its process is gone (one TCP connect;
    a timeout or any other error is not taken for that)."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return False


def _exit_when_cluster_gone(done, since: float = 0.0, period_s: float = 0.25) -> None:
    """While :func:`stop` runs on a cluster this process started: exit the process at once (status 0) if its GCS
    goes away. SIGTERM to the whole process group (a container stop, ``kill -- -PGID``) kills Ray's GCS with the
    server; every Serve call of the graceful stop then waited 60 s for the GCS and Ray aborted the process (exit 1
    after 61 s). Nothing is left to drain then: the replicas died with it. ``since``: when this server started
    (``time.time()``): its replicas' batch-slot pools, made after it, are unlinked once their processes are gone."""
    import os
    import sys
    import time

    try:
        address = str(ray.get_runtime_context().gcs_address)
    except Exception:  # noqa: BLE001 - not connected: nothing to watch
        return
    while not done.wait(period_s):
        if _cluster_gone(address):
            print(f"ortcapture serve: the Ray cluster is gone (its GCS at {address} refuses connections): "
                  "nothing left to drain; exiting", file=sys.stderr, flush=True)
            # the tier replicas die with it, their batch-slot pools left in /dev/shm (32 MiB each, found by a
            # tester): unlinked once their processes are gone (pools made since this server started; 3 s at most: a
            # replica that outlives its raylet longer leaves its pool to the next server's start, which sweeps it)
            from ortcapture.serving.shm_version import PREFIX as REGISTRY_PREFIX
            from ortcapture.serving.slots import pool_owners, sweep_stale_pools

            deadline = time.monotonic() + 3.0
            while pool_owners(since) and time.monotonic() < deadline:
                time.sleep(0.1)
            sweep_stale_pools()
            sweep_stale_pools(REGISTRY_PREFIX)  # the shared memory registry's count of changes (shm_version)
            sys.stdout.flush()
            os._exit(0)  # Ray's own exit hooks would wait for the GCS too


def _stop(options: ServeOptions, watch=None) -> None:
    """The graceful stop; ``watch``: ``(event, thread)`` of :func:`_exit_when_cluster_gone`, ended before this
    process shuts its own cluster down (whose GCS then refuses connections as it should)."""
    try:
        try:  # requests in flight finish first: Serve's own shutdown closes the proxy's connections with them
            _drain(options)
        except Exception:  # noqa: BLE001 - best effort: the tier may be gone already
            pass
        if options.address or not _RAY_STARTED_HERE[0]:  # a Serve this process did not start: ours only
            ray_serve.delete(model_app_name(options))
            ray_serve.delete(options.app_name)
        else:
            ray_serve.shutdown()
    finally:
        if watch is not None:
            watch[0].set()
            watch[1].join(5)
        if _RAY_STARTED_HERE[0] and ray.is_initialized():
            ray.shutdown()
        _RAY_STARTED_HERE[0] = False


def _drain(options: ServeOptions) -> None:
    """Drain every tier replica (:meth:`ModelTier.drain`): a handle reaches one replica per call, so calls go out
    in rounds of ``2 * replicas + 2`` at once (Serve's router spreads calls in flight) until every running replica
    answered, three rounds at most."""
    tier = ray_serve.get_deployment_handle(TIER_DEPLOYMENT, options.app_name)
    status = ray_serve.status().applications.get(options.app_name)
    dep = status.deployments.get(TIER_DEPLOYMENT) if status is not None else None
    want = sum(n for k, n in dep.replica_states.items() if str(getattr(k, "value", k)) == "RUNNING") if dep else 1
    seen: set[str] = set()
    for _ in range(3):
        calls = [tier.drain.remote(options.graceful_shutdown_s) for _ in range(2 * want + 2)]
        for call in calls:
            seen.add(call.result(timeout_s=options.graceful_shutdown_s + 5)["replica"])
        if len(seen) >= want:
            return


def serve(model: str | None = None, *, options: ServeOptions | None = None, stop_event=None,
          on_ready: Callable[[str], None] | None = None, on_status: Callable[[str], None] | None = None,
          ray_init: dict | None = None, exit_when_cluster_gone: bool = False, **kwargs) -> int:
    """Serve ``model`` until SIGINT/SIGTERM (or ``stop_event`` is set), then shut down gracefully; returns 0.

    Args:
        model: the ONNX model path; the other :class:`~ortcapture.serving.config.ServeOptions` fields as keywords
            (``buckets=``, ``provider=``, ``replicas=``, ``port=``, ...), or a whole ``options=``.
        stop_event: a ``threading.Event`` that stops the server when set (signals still work in the main thread).
        on_ready: called with the base URL once the replicas are warm (default: print it).
        on_status: progress lines (default: none).
        ray_init: extra ``ray.init`` keywords for the new local cluster (e.g. ``{"num_cpus": 2}``).
        exit_when_cluster_gone: ``ortcapture serve``'s own process only: while the graceful stop runs on a new
            local cluster (no ``address``), exit the process at once with status 0 if that cluster's GCS refuses
            connections — SIGTERM to the whole process group killed it too, and every Serve call of the stop would
            wait 60 s for it before Ray aborts the process (exit 1). Off by default: it ends the calling process.

    Raises:
        CaptureError: bad options, an unservable model layout, no usable provider (``ortcapture.pick_provider``).
        ServeFailed: the model replicas could not start (e.g. the model does not capture), or not in time.
    """
    import signal

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
            url = start(options, provider, ray_init=ray_init, on_status=on_status, stop_event=stop_event)
        except ServeRefused:
            deployed = False
            raise
        except ServeStopped:  # a signal while warming up: shut down as after serving
            if on_status:
                on_status("stopping while warming up")
            return 0
        if main:  # ray.init installs its own SIGTERM handler (it aborts the process): ours again
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, on_signal)
        (on_ready or print)(url)
        while not stop_event.wait(0.5):
            pass
        if on_status:
            on_status("stopping: requests in flight finish" + (", graphs are released" if provider != "cpu" else ""))
        return 0
    finally:
        try:
            stop(options, deployed, watch_cluster=exit_when_cluster_gone and not options.address)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
