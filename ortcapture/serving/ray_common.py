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
#: seconds a client is asked to wait (``Retry-After``) after a 503 for a full queue or too many pending bodies
RETRY_AFTER_S = 1


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
