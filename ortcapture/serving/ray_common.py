"""What the Ray Serve deployments of a served model share: their names, the report period, the loopback gRPC fix.

One served model is three deployments (:mod:`ortcapture.serving.deployment` deploys them):

* ``Model`` (:data:`TIER_DEPLOYMENT`, :class:`ortcapture.serving.tier.ModelTier`) — the batching tier: the HTTP
  routes and the handle method ``infer``; what clients and handle users reach;
* ``ModelSession`` (:data:`SESSION_DEPLOYMENT`, :class:`ortcapture.serving.session_replica.ModelSession`) — the
  replicas that hold a session; one Ray call per batch from the tier;
* ``ModelStats`` (:data:`STATS_DEPLOYMENT`, :class:`ortcapture.serving.tier.ModelStats`) — one replica that keeps
  the session replicas' and the tier replicas' latest reports for ``/stats``.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

TIER_DEPLOYMENT = "Model"
SESSION_DEPLOYMENT = "ModelSession"
STATS_DEPLOYMENT = "ModelStats"
#: seconds between a replica's pushes of its counters to ``ModelStats``
REPORT_EVERY_S = 1.0


#: seconds a thread that wants the GIL waits before the running thread is made to drop it, in the replica processes
#: (``sys.setswitchinterval``; Python's default is 0.005)
SWITCH_INTERVAL_S = 0.0005


def quick_gil_handoff(interval_ms: float | None = None) -> float:
    """Set this (replica) process's GIL switch interval to ``interval_ms`` milliseconds (``None``:
    :data:`SWITCH_INTERVAL_S`; 0: leave Python's own, 5 ms) and return the interval in force (seconds).

    A replica replays on worker threads while its event loop thread runs Python (requests arriving, Serve's own
    work). Each time the replay thread waits outside the GIL — ORT's run, a wait for the GPU or a DMA, a hand-over to
    the session's replay thread — it gets the GIL back only when the loop thread is made to drop it, after up to the
    switch interval: with Python's 5 ms, a call that waits a few times costs tens of milliseconds under load (the
    "convoy effect"; measured on the CPU by ``benchmarks/bench_gil_handoff.py``: one 0.2 ms wait per call, 0.32 ms
    alone, 5.4-5.6 ms beside a busy thread at 5 ms, 0.37-0.89 ms at 0.5 ms). Issue 44 saw a synchronous Serve
    method replay a batch of 8 once per 25 ms where a plain process took 3.3 ms."""
    import sys

    if interval_ms is None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    elif interval_ms > 0:
        sys.setswitchinterval(interval_ms / 1000.0)
    return sys.getswitchinterval()


def keep_replica_grpc_on_loopback(loopback: bool) -> None:
    """On a loopback-only cluster (:meth:`ortcapture.serving.config.ServeOptions.loopback`), bind this replica's
    inter-deployment gRPC server to 127.0.0.1. Ray Serve 2.60 binds it to ``[::]:0`` whatever the cluster's address
    (``ray/serve/_private/replica.py``, ``_on_initialized``), so every replica otherwise listens on all of the
    machine's interfaces although the cluster, the proxy and ``--host`` are on loopback. Called from the replicas'
    constructors, which run before that server starts; a Ray without that helper is left as it is."""
    if not loopback:
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


class Reporter:
    """A replica's push of its counters to ``ModelStats`` every :data:`REPORT_EVERY_S` seconds, on the replica's
    event loop: ``push()`` is awaited in a loop whose failures (``ModelStats`` restarting or not up yet) are retried
    at the next period. :meth:`start` (idempotent; call it from the event loop, e.g. on each request) starts it again
    if it ended; :meth:`cancel` stops it."""

    def __init__(self, push: Callable[[], Awaitable[None]]):
        self._push = push
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the push loop unless it runs (from the replica's event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def cancel(self) -> None:
        """Stop the push loop (the replica is shutting down)."""
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            try:
                await self._push()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - ModelStats restarts or is not up yet: push again later
                pass
            await asyncio.sleep(REPORT_EVERY_S)
