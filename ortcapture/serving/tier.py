"""The batching tier (the ``Model`` deployment): HTTP and handle requests, checked once, one Ray call per batch.

:class:`ModelTier` runs on ``ingress_replicas`` replicas that hold no session and reserve no CPU of Ray's. Each one
is what clients reach: the Open Inference Protocol's HTTP routes (:mod:`ortcapture.serving.routes`, with the body,
queue and time bounds) and the handle method :meth:`ModelTier.infer`. A request is checked once, here, before it
joins a batch (:class:`~ortcapture.serving.requests.RequestCheck`: the model's inputs and the device's value rules;
a bad one is its own 400). An :class:`~ortcapture.serving.batcher.AdaptiveBatcher` forms batches of at most
``max_batch_size`` rows (a lone request runs at once; a batch waits at most ``batch_wait_ms``, and only while more
requests arrive; at most ``max_concurrent_batches`` batches in flight per tier replica), groups and joins each batch
into runs (:func:`~ortcapture.serving.requests.group_key`, :func:`~ortcapture.serving.requests.pack`,
:func:`~ortcapture.serving.requests.join`) and makes ONE call per batch to a ``ModelSession`` replica
(:meth:`ortcapture.serving.session_replica.ModelSession.run_batch`), whose outputs it slices back per request.

:class:`ModelStats` (one replica, no CPU) keeps the latest report of every session replica and tier replica for
``/stats``. This module imports Ray.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray import serve as ray_serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException

from ortcapture.serving.batcher import AdaptiveBatcher, Item
from ortcapture.serving.bodies import BodyGate, read_body
from ortcapture.serving.config import ServeOptions, client_address_known, model_layout
from ortcapture.serving.grpc_service import GrpcIngress
from ortcapture.serving.ray_common import (SESSION_DEPLOYMENT, STATS_DEPLOYMENT, Reporter,
                                           keep_replica_grpc_on_loopback, quick_gil_handoff)
from ortcapture.serving.requests import (RequestCheck, RequestError, answers_of, group_key, join, on_device, pack,
                                         pieces)
from ortcapture.serving.slots import batch_slots
from ortcapture.serving.routes import RETRY_AFTER_S, STALE_S, Router
from ortcapture.serving.shm import ShmError
from ortcapture.serving.shm_store import ActorRegistry, ShmStore

_log = logging.getLogger("ortcapture.serving")

#: batches in a row that found no session replica on this machine before a tier replica stops using batch slots
SLOT_MISSES = 8
#: how long a "ready" from Serve's controller is trusted (s). Asking costs the tier replica ~40 ms of CPU
#: (``serve.status()`` pickles every deployment's router config), which at 0.5 s was 5-9 % of a busy replica's CPU
#: (py-spy, 32 clients, H100); a batch refused for want of a session replica asks again at the next request.
READY_TRUST_S = 5.0


def _first_line(exc: BaseException) -> str:
    """``Type: the first line of its message`` (at most 300 characters of it), for an answer's error text."""
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


#: the provider's device for the value rules of :func:`ortcapture.transfer.value_rules`
_DEVICE = {"cuda": "cuda", "webgpu": "webgpu", "cpu": "cpu"}


class ModelTier(GrpcIngress):  # the gRPC methods (ortcapture.serving.grpc_service)
    """The ``Model`` deployment's class (see the module docstring).

    Args:
        options: checked :class:`~ortcapture.serving.config.ServeOptions`.
        provider: the resolved provider (its device's value rules apply to every request).
        session: a handle to the ``ModelSession`` deployment, or ``None``: the ``ModelSession`` deployment of
            application ``session_app`` (looked up on first use).
        session_app: where ``ModelSession`` runs (default: this replica's application).
        stats: a handle to the ``ModelStats`` deployment, or ``None``: the one of this replica's application.
    """

    def __init__(self, options: ServeOptions, provider: str, session=None, session_app: str | None = None,
                 stats=None):
        import ortcapture
        from ortcapture.transfer import value_rules

        keep_replica_grpc_on_loopback(options.loopback())
        # Ray's threads deliver the session's answers to this replica's loop: no 5 ms GIL hand-offs
        quick_gil_handoff(options.switch_interval_ms)
        self.options = options
        self.spec = model_layout(options).spec
        self.check = RequestCheck([(t.name, t.dtype, t.shape) for t in self.spec.inputs], self.spec.batch_axes,
                                  options.max_batch_size, value_rules(_DEVICE.get(provider, provider)))
        ctx = ray_serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.session = session
        self._session_app = session_app or ctx.app_name
        self._stats_handle = stats
        self._stats_app = ctx.app_name
        self.batcher = AdaptiveBatcher(self._run_batch, max_rows=options.max_batch_size,
                                       max_wait_s=options.batch_wait_ms / 1000.0,
                                       max_in_flight=options.max_concurrent_batches)
        # the hop to the session replica through node-local shared memory (ortcapture.serving.slots): one slot per
        # batch in flight; None: by value through Ray's object store
        self._slots = batch_slots(self.spec, options.max_batch_size, options.max_concurrent_batches,
                                  options.batch_slots)
        self._misses_in_a_row = 0
        self._ready_at = 0.0
        self._ready = False
        self._ready_lock: asyncio.Lock | None = None
        self._refresh: asyncio.Future | None = None  # a stale yes being asked again in the background (ready())
        self._ready_resets, self._distrusted_at = 0, float("-inf")  # batches that found no session replica
        self._draining = False  # set by drain(): new requests get a 503, the ones in flight finish
        self._in_flight = 0  # HTTP and gRPC requests being answered (GrpcIngress counts its own)
        self._infers = 0  # requests being answered by _infer() (HTTP, gRPC and handle)
        self._bodies = BodyGate(options.max_pending_bodies)  # requests whose body is still arriving
        self._queued = 0  # requests waiting for a session replica's answer
        self._refused = {"queue_full": 0, "bodies_pending": 0, "body_timeout": 0, "body_evicted": 0,
                         "request_timeout": 0, "client_gone": 0, "bad_request": 0, "draining": 0}
        self._sent = {"session_calls": 0, "requests_sent": 0, "session_call_ns": 0, "slot_batches": 0,
                      "slot_misses": 0}
        self._others: dict[str, tuple[float, dict]] = {}
        self._reporter = Reporter(self._push_report)  # this replica's counters to ModelStats, every second
        # system shared memory: its registry one named actor per application (ortcapture.serving.shm_store)
        self.shm = ShmStore(ActorRegistry(f"{options.app_name}-shm"), allow_remote=options.allow_remote_shared_memory,
                            cuda_open=self._cuda_open if provider == "cuda" else None, provider=provider,
                            peers_known=client_address_known(options))
        self.router = Router(self.spec, self.ready, self._infer, server_version=ortcapture.__version__,
                             token=options.token, ingress_stats=self._ingress_stats, shm=self.shm,
                             align_inputs=False)  # each request's rows are copied into its batch (or sent by Ray)

    # -- the handle method and the router's backend -------------------------------------------------------------
    async def infer(self, feeds: dict, device_outputs: dict | None = None) -> dict:
        """The handle's method: one request, as :meth:`_infer` answers it — except while this replica drains, when
        it is refused at once (``{"error": "the server is shutting down", "status": 503, "retry_after": s}``), as
        HTTP (503) and gRPC (``UNAVAILABLE``) requests are: a handle call let in then would hold the drain to its
        timeout and find the batch slots and shared memory closed under it."""
        if self._draining:
            self._refused["draining"] += 1
            return {"error": "the server is shutting down", "status": 503, "retry_after": RETRY_AFTER_S}
        return await self._infer(feeds, device_outputs)

    async def _infer(self, feeds: dict, device_outputs: dict | None = None) -> dict:
        """One request, ``{input name: numpy array}`` (its rows along the batch dim, at most ``max_batch_size``): the
        HTTP and gRPC routes' backend (their requests were let in before any drain, and are answered through it).
        From the HTTP and gRPC routes, an input may be a :class:`~ortcapture.serving.cuda_shm.DeviceTensor` (in a
        CUDA region) and ``device_outputs`` ``{output name: Ref}`` names CUDA regions the session replica writes
        those outputs into (:mod:`ortcapture.serving.cuda_shm`).

        Returns:
            ``{"outputs": {output name: numpy array}}`` (this request's rows only; an output named in
            ``device_outputs`` is a :class:`~ortcapture.serving.cuda_shm.InRegion` instead: its rows are in the
            region), or ``{"error": message,
            "status": code}``: 400 for the request's own fault (checked here before it joins a batch, or its own
            run refused it while the session replica is healthy), 500 when the model failed on a healthy-looking
            request and the replica is not healthy, 503 (with ``"retry_after"``) when ``max_queued`` requests wait
            already, no session replica answered within ``request_timeout_s``, or none could run it.
        """
        self._reporter.start()
        o = self.options
        try:
            rows = self.check.rows(feeds)
            _check_device_outputs(device_outputs, self.spec)
        except RequestError as exc:
            self._refused["bad_request"] += 1
            return {"error": str(exc), "status": 400}
        if self._queued >= o.max_queued:
            self._refused["queue_full"] += 1
            return {"error": f"{self._queued} requests are queued already; try again", "status": 503,
                    "retry_after": RETRY_AFTER_S}
        self._queued += 1
        self._infers += 1
        try:
            return await asyncio.wait_for(self.batcher.submit(rows, (feeds, device_outputs)), o.request_timeout_s)
        except asyncio.TimeoutError:
            self._refused["request_timeout"] += 1
            return {"error": f"no model replica answered within {o.request_timeout_s:g} s", "status": 503,
                    "retry_after": RETRY_AFTER_S}
        finally:
            self._queued -= 1
            self._infers -= 1

    async def _run_batch(self, items: list[Item]) -> list[dict]:
        """The batcher's ``run``: group and join the batch into runs, ONE call to a session replica, rows back."""
        names, axes = self.check.names, self.check.input_axes
        requests = [it.payload[0] for it in items]
        outs = [it.payload[1] for it in items]  # outputs into CUDA regions, per request (mostly None)
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for k, it in enumerate(items):
            groups.setdefault(group_key(requests[k], names, axes), []).append((k, it.rows))
        chunks = [c for members in groups.values() for c in pack(members, self.options.max_batch_size)]
        now = time.perf_counter_ns()
        rows = [[stop for _, _, stop in c] for c in chunks]
        queued = [[now - items[k].queued_ns for k, _, _ in c] for c in chunks]
        if self.session is None:
            self.session = ray_serve.get_deployment_handle(SESSION_DEPLOYMENT, self._session_app)
        self._sent["session_calls"] += 1
        self._sent["requests_sent"] += len(items)
        device = any(outs) or any(on_device(r) for r in requests)  # CUDA regions: references, by value
        slots = None if device else self._slots
        slot = await slots.acquire() if slots is not None else None
        answered = True  # False while the session replica may write into the slot (its call sent, not answered)
        t0 = time.perf_counter_ns()
        try:
            answers = None
            if slot is not None and slot.place([pieces(requests, c, names, axes) for c in chunks]):
                answered = False
                answers = await self.session.run_batch.remote([(None, r) for r in rows], queued, slot.descriptor())
                answered = True
                if isinstance(answers, dict):  # the session replica is on another machine: by value
                    self._slot_missed()
                    answers = None
                else:
                    self._sent["slot_batches"] += 1
                    self._misses_in_a_row = 0
            if answers is None:
                runs = [(join(requests, c, names, axes), r) if not any(outs[k] for k, _, _ in c) else
                        (join(requests, c, names, axes), r, [outs[k] for k, _, _ in c]) for c, r in zip(chunks, rows)]
                answers = await self.session.run_batch.remote(runs, queued)
            self._sent["session_call_ns"] += time.perf_counter_ns() - t0
            return answers_of(len(items), chunks, answers, slot)
        except (ray.exceptions.RayError, RayServeException, RuntimeError) as exc:  # a replica died, was removed,
            # or is overloaded. It raised (it writes no more), or Serve's router refused before sending: slot free
            answered = answered or isinstance(exc, (ray.exceptions.RayTaskError, BackPressureError,
                                                    DeploymentUnavailableError))
            if isinstance(exc, (ray.exceptions.RayActorError, DeploymentUnavailableError)):  # no session replica
                self._distrust_ready()
            return [{"error": f"no model replica could run the request: {_first_line(exc)}",
                     "status": 503, "retry_after": RETRY_AFTER_S}] * len(items)
        except Exception as exc:  # noqa: BLE001 - the call itself failed (e.g. a transport limit): each request
            # gets a 500 that says so, instead of the exception escaping to every caller of this batch
            _log.error("ortcapture serve: a call to the session replica failed: %s: %s", type(exc).__name__, exc)
            return [{"error": f"the call to the model replica failed: {_first_line(exc)}",
                     "status": 500}] * len(items)
        finally:
            if slot is not None:
                if answered:  # free again
                    slots.release(slot)
                else:  # failed or cancelled: the session replica may still write into it
                    slots.retire(slot)

    async def _cuda_open(self, region) -> None:
        """CUDA shared memory registration: a session replica opens ``region``'s handle (and keeps it open);
        :class:`~ortcapture.serving.shm.ShmError` with its reason when it cannot."""
        if self.session is None:
            self.session = ray_serve.get_deployment_handle(SESSION_DEPLOYMENT, self._session_app)
        try:
            problem = await self.session.open_cuda_region.remote(region)
        except (ray.exceptions.RayError, RayServeException) as exc:
            raise ShmError(f"region {region.name!r}: no model replica could open it: {_first_line(exc)}") from None
        if problem:
            raise ShmError(problem)

    def _slot_missed(self) -> None:
        """A session replica found no batch slot of this tier replica (another machine). After
        :data:`SLOT_MISSES` in a row with none found, this replica sends every batch by value."""
        self._sent["slot_misses"] += 1
        self._misses_in_a_row += 1
        if self._misses_in_a_row >= SLOT_MISSES and not self._sent["slot_batches"] and self._slots is not None:
            self._slots.close()
            self._slots = None

    # -- HTTP ---------------------------------------------------------------------------------------------------
    async def __call__(self, request):
        from starlette.responses import Response

        if self._draining:
            return Response(b'{"error": "the server is shutting down"}', status_code=503,
                            headers={"content-type": "application/json"})
        self._reporter.start()
        self._in_flight += 1
        try:
            headers = {k.lower(): v for k, v in request.headers.items()}
            path = request.url.path
            if path.rstrip("/").endswith("/stats"):
                await self._refresh_reports()

            async def read_body(cap: int) -> bytes:
                return await self._read_body(request, cap)

            client = request.client.host if request.client else None  # shared memory registration is loopback's
            res = await self.router.handle(request.method, path, headers, read_body, client)
            return Response(res.body, status_code=res.status, headers=res.headers)
        finally:
            self._in_flight -= 1

    async def _read_body(self, request, cap: int) -> bytes:
        """The request body: :func:`ortcapture.serving.bodies.read_body` through this replica's gate (at most
        ``options.max_pending_bodies`` bodies arriving at once, ``options.body_timeout_s`` without progress)."""
        return await read_body(self._bodies, request.stream(), cap, self.options.body_timeout_s, self._refused)

    # -- lifecycle, readiness, reports ---------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> dict:
        """Graceful shutdown, first step, on this tier replica: answer new HTTP requests with a 503 (gRPC ones with
        ``UNAVAILABLE``, handle calls with a 503 answer) and wait (at most ``timeout_s`` seconds) until the requests
        in flight have their answers. Returns ``{"replica": id, "in_flight": HTTP and gRPC requests still being
        answered then, "infers": requests still in :meth:`_infer` then (those requests' and the handle's)}`` (0 and 0
        normally)."""
        self._draining = True
        self._bodies.close()  # bodies still arriving: 503 now (a stalled one would hold the drain to its end)
        deadline = time.monotonic() + timeout_s
        while (self._in_flight or self._infers) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self.shm.shutdown()  # every shared memory region unregistered and unmapped
        if self._slots is not None:
            self._slots.close()
        return {"replica": self.replica_id, "in_flight": self._in_flight, "infers": self._infers}

    def __del__(self):
        """Serve's graceful shutdown of this replica: its batch slots' shared memory object is unlinked (a replica
        killed outright leaves it in ``/dev/shm`` until the machine restarts)."""
        slots = getattr(self, "_slots", None)
        if slots is not None:
            slots.close()

    async def layout(self) -> dict:
        """What clients see of the served model (:func:`ortcapture.serving.deployment.replace_model` checks a
        replacement against it)."""
        return api_of(self.spec)

    async def ready(self) -> bool:
        """Whether a ``ModelSession`` replica is running (warm), asked of the Serve controller: a yes is trusted for
        :data:`READY_TRUST_S`, then still answered while it is asked again in the background (no request waits for
        the controller: a ``serve.status()`` takes ~40 ms of CPU, and every request behind it waited that long each
        time the trust ran out); a no, or a yes from before a batch found no session replica
        (:meth:`_distrust_ready`), is asked again before answering (at most every 50 ms)."""
        if self._draining:
            return False
        asked = self._ready_at
        if self._ready and time.monotonic() - asked < READY_TRUST_S:
            return True
        if self._ready and asked != float("-inf"):  # a yes gone stale, not distrusted: asked again meanwhile
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.ensure_future(self._ask_ready(asked))
            return True
        await self._ask_ready(asked)
        return self._ready

    async def _ask_ready(self, asked: float) -> None:
        """Ask the controller (one ask at a time; a caller that waited for another's ask takes its answer unless it
        is 50 ms old)."""
        if self._ready_lock is None:
            self._ready_lock = asyncio.Lock()
        async with self._ready_lock:
            if self._ready_at == asked or time.monotonic() - self._ready_at > 0.05:
                resets = self._ready_resets
                try:
                    self._ready = await asyncio.get_running_loop().run_in_executor(None, session_running,
                                                                                   self._session_app)
                except Exception:  # noqa: BLE001 - the controller is busy: keep the last answer
                    pass
                # an answer asked before a batch found no session replica is not trusted: asked again next time
                self._ready_at = time.monotonic() if self._ready_resets == resets else float("-inf")

    def _distrust_ready(self) -> None:
        """A batch found no session replica (it died, or none is available): the next request asks the controller
        again — at most once a second (an overloaded replica, ``BackPressureError``, is not this) — and an answer
        being asked meanwhile is not trusted."""
        now = time.monotonic()
        if now - self._distrusted_at >= 1.0:
            self._distrusted_at = now
            self._ready_resets += 1
            self._ready_at = float("-inf")

    async def check_health(self) -> None:
        """Serve's periodic health check: starts this replica's report loop (nothing to check: no session)."""
        self._reporter.start()

    def _stats_target(self):
        if self._stats_handle is None:
            self._stats_handle = ray_serve.get_deployment_handle(STATS_DEPLOYMENT, self._stats_app)
        return self._stats_handle

    def _own(self) -> dict:
        o = self.options
        return {"pending_bodies": self._bodies.held, "waiting_bodies": self._bodies.waiting,
                "max_pending_bodies": o.max_pending_bodies,
                "queued": self._queued, "max_queued": o.max_queued, "refused": dict(self._refused), **self._sent,
                "shm_lookups": self.shm.registry.lookups, "shm_registry_calls": self.shm.registry.calls,
                "http_errors": {str(k): v for k, v in self.router.http_errors.items()}}

    def _ingress_stats(self) -> dict:
        """``/stats``' ``ortcapture.ingress``: the counters of every tier replica heard from (this one live, the
        others as last pushed), summed; ``replicas`` tier replicas. Per-replica caps (``max_queued``,
        ``max_pending_bodies``) are this replica's."""
        total = self._own()
        n = 1
        for rid, (t, other) in self._others.items():
            if rid == self.replica_id or time.monotonic() - t > STALE_S:
                continue
            n += 1
            for key in ("pending_bodies", "waiting_bodies", "queued", "session_calls", "requests_sent", "session_call_ns",
                        "slot_batches", "slot_misses", "shm_lookups", "shm_registry_calls"):
                total[key] += other.get(key, 0)
            for part in ("refused", "http_errors"):
                for k, v in (other.get(part) or {}).items():
                    total[part][k] = total[part].get(k, 0) + v
        total["http_errors"] = dict(sorted(total["http_errors"].items()))
        total["replicas"] = n
        return total

    async def _refresh_reports(self) -> None:
        """Fetch ``ModelStats``' reports now (``/stats`` shows the session replicas' last pushes: at most ~1 s
        old)."""
        try:
            snap = await asyncio.wait_for(self._stats_target().snapshot.remote(), 5.0)
        except Exception:  # noqa: BLE001 - ModelStats restarting: show what is known
            return
        now = time.monotonic()
        for rid, (age, data) in snap["replicas"].items():
            self.router.report(rid, data, now=now - age)
        self._others = {rid: (now - age, data) for rid, (age, data) in snap["tiers"].items()}

    async def _push_report(self) -> None:
        """Every second (:class:`~ortcapture.serving.ray_common.Reporter`): this replica's counters to ModelStats,
        and the shared memory objects of regions unregistered meanwhile closed (``ShmStore.sweep``)."""
        try:
            await self.shm.sweep()
        except Exception:  # noqa: BLE001 - the registry restarting: the next round sweeps
            pass
        await self._stats_target().tier.remote(self.replica_id, self._own())

class ModelStats:
    """The ``ModelStats`` deployment's class (one replica): the latest report of each session replica
    (:meth:`report`) and tier replica (:meth:`tier`), dropped :data:`~ortcapture.serving.routes.STALE_S` seconds
    after its last push. ``loopback``: bind its inter-deployment gRPC server to 127.0.0.1
    (:func:`~ortcapture.serving.ray_common.keep_replica_grpc_on_loopback`)."""

    def __init__(self, loopback: bool = False):
        keep_replica_grpc_on_loopback(loopback)
        self._replicas: dict[str, tuple[float, dict]] = {}
        self._tiers: dict[str, tuple[float, dict]] = {}

    async def report(self, replica: str, data: dict) -> None:
        """A session replica's counters (:meth:`ortcapture.serving.replica.ReplicaCore.report`)."""
        self._replicas[str(replica)] = (time.monotonic(), dict(data))

    async def tier(self, replica: str, data: dict) -> None:
        """A tier replica's own counters (its bounds, refusals, calls to the session replicas)."""
        self._tiers[str(replica)] = (time.monotonic(), dict(data))

    async def snapshot(self) -> dict:
        """``{"replicas": {id: (age_s, report)}, "tiers": {id: (age_s, counters)}}``, fresh ones only."""
        now = time.monotonic()
        out = {}
        for key, store in (("replicas", self._replicas), ("tiers", self._tiers)):
            for k in [k for k, (t, _) in store.items() if now - t > STALE_S]:
                del store[k]
            out[key] = {k: (now - t, d) for k, (t, d) in store.items()}
        return out


def session_running(app: str) -> bool:
    """Whether application ``app``'s ``ModelSession`` deployment has a RUNNING replica (asks Serve's controller)."""
    status = ray_serve.status().applications.get(app)
    if status is None:
        return False
    dep = status.deployments.get(SESSION_DEPLOYMENT)
    if dep is None:
        return False
    return any(str(getattr(k, "value", k)) == "RUNNING" and n > 0 for k, n in dep.replica_states.items())


def api_of(spec) -> dict:
    """What a client of the tier sees of a model: inputs and outputs (name, datatype, shape), batch axes, the row
    limit — equal for a replacement."""
    return {"inputs": [(t.name, t.datatype, list(t.shape)) for t in spec.inputs],
            "outputs": [(t.name, t.datatype, list(t.shape)) for t in spec.outputs],
            "batch_axes": dict(spec.batch_axes), "max_rows": int(spec.max_rows)}


def _check_device_outputs(device_outputs, spec) -> None:
    """Raise :class:`RequestError` unless ``device_outputs`` is ``None`` or ``{output name: Ref}`` of CUDA regions
    naming the model's outputs (what the routes build; a handle caller passing anything else got a 500 from the
    session replica)."""
    if device_outputs is None:
        return
    from ortcapture.serving.shm import Ref

    names = {t.name for t in spec.outputs}
    if not isinstance(device_outputs, dict) or not all(
            isinstance(k, str) and k in names and isinstance(v, Ref) and v.region.kind == "cuda"
            for k, v in device_outputs.items()):
        raise RequestError("device_outputs must be {output name: a CUDA shared memory reference}; it is set by the "
                           f"HTTP and gRPC routes for outputs in CUDA regions (the model's outputs: {sorted(names)})")

