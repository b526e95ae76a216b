"""Reading HTTP request bodies on a tier replica, bounded in number, idle time and size.

At most ``limit`` bodies arrive at once, a body that makes no progress for a while is refused, and a flood of
connections that send headers and stall never locks a normal request out.

Ray Serve's proxy hands a request over after its headers and streams the body on demand, so without these bounds a
thousand connections that send headers and never their body hold every slot (issue 43, item 2; issue 44).

:class:`BodyGate` is pure asyncio (no Ray): the slots, the handing over of a freed slot, and the eviction of the
stalest body. :func:`read_body` reads one body through it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import AsyncIterator

from ortcapture.serving.protocol import ProtocolError
from ortcapture.serving.routes import RETRY_AFTER_S, Refusal

#: seconds without progress after which a pending request body gives its slot up to a new request at the cap
EVICT_IDLE_S = 0.5
#: the longest a new request waits at the cap for a slot (freed, or taken from a body evicted for it)
EVICT_WAIT_S = 1.0
#: ... and a body arriving slower than this many bytes a second on average, once it is EVICT_RATE_AFTER_S old
#: (Apache's mod_reqtimeout ``MinRate`` idea: one byte every 0.3 s is progress, but no client's honest rate)
EVICT_MIN_RATE = 500.0
#: ... the age (seconds) from which a body's average rate is held against EVICT_MIN_RATE
EVICT_RATE_AFTER_S = 1.0


class PendingBody:
    """A request body being read: when it started and last made progress (``time.monotonic()``), the bytes
    received, the read in progress."""

    __slots__ = ("start", "last", "received", "waiter", "evicted")

    def __init__(self):
        self.start = self.last = time.monotonic()
        self.received = 0
        self.waiter: asyncio.Future | None = None
        self.evicted = False

    def evictable_at(self, idle_s: float) -> float:
        """When (``time.monotonic()``) this body may be evicted for a waiting request: ``idle_s`` after its last
        progress, or once its average rate is below :data:`EVICT_MIN_RATE` after :data:`EVICT_RATE_AFTER_S` —
        whichever comes first. (Headers with no body byte yet get the full ``idle_s``: under a burst Serve's proxy
        can deliver a normal request's body hundreds of milliseconds after its headers; a 0.1 s grace tried for
        them evicted such a request beside 1,100 stalled connections.)"""
        return min(self.last + idle_s, self.start + max(EVICT_RATE_AFTER_S, self.received / EVICT_MIN_RATE))

    def evict(self) -> bool:
        """Stop the read (its reader answers 503 with ``Retry-After``; the slot is free once it has unwound).
        ``False`` when its read cannot be stopped now (not started, or just done): it keeps its slot."""
        if self.waiter is None or not self.waiter.cancel():
            return False
        self.evicted = True
        return True


class BodyGate:
    """At most ``limit`` request bodies arriving at once (per tier replica, on its event loop).

    At the cap a new request waits, without polling, for a slot:

    - a slot freed by a body that ended is handed to the **newest** waiter (last in, first out). Under a flood of
      connections that sent headers and stall, the ones that came first cannot keep a request that came after them
      waiting; a waiter that gets no slot within ``wait_s`` seconds is refused (503) as before, so no waiter waits
      longer than that either way;
    - while requests wait, one eviction task (one per gate, not one per waiter) stops the reads of the bodies that
      may be evicted (:meth:`PendingBody.evictable_at`: no progress for ``idle_s`` seconds, or slower than
      :data:`EVICT_MIN_RATE` bytes a second on average after :data:`EVICT_RATE_AFTER_S`), earliest first, as many
      as there are waiters, and sleeps until the next body
      may be, or a new request waits. An evicted request is answered 503 with ``Retry-After``, not 408: under a
      burst Serve's proxy itself may deliver a body late that its client sent whole, so the server's load
      shedding must not blame the client (a body that makes no progress for ``body_timeout_s`` is the 408).

    A normal request's body arrives in milliseconds, with its headers; a client that keeps sending at an honest rate
    is never evicted. A connection that trickles a byte now and then holds a slot at most ~1 s (found by a tester:
    four connections sending a byte every 0.3 s held ``--max-pending-bodies 4`` for as long as they liked).
    Connections that send headers and stall hold their slot 0.5 s each when requests wait: a flood of more than
    ``limit / 0.5`` new ones a second (128 per tier replica by default) keeps most requests out while it lasts.
    The cost of waiting does not grow with the number of waiters times the slots (the polling loop it replaces made
    every waiter scan every slot every 20 ms: with 1,000 stalled connections that kept a CI machine's event loop
    busy for seconds, and the normal request waited 2.8 s and got a 503).

    Args:
        limit: slots (``ServeOptions.max_pending_bodies``), >= 1.
        idle_s: seconds without progress before a body may be evicted for a waiter.
        wait_s: seconds a new request waits at the cap before it is refused.
    """

    def __init__(self, limit: int, idle_s: float = EVICT_IDLE_S, wait_s: float = EVICT_WAIT_S):
        self.limit = int(limit)
        self.idle_s = float(idle_s)
        self.wait_s = float(wait_s)
        self.held = 0  # slots taken (a slot handed to a waiter stays taken)
        self.bodies: dict[int, PendingBody] = {}
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._evictor: asyncio.Task | None = None
        self._arrived = asyncio.Event()  # a new waiter: the eviction task looks again at once
        self.closed = False  # close(): the server stops; every body read stopped, no new one admitted

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return sum(not f.done() for f in self._waiters)

    def close(self) -> None:
        """The server is stopping (a graceful drain): stop every body read now (each answers 503) and admit no new
        one, so a stalled connection cannot hold the drain for ``graceful_shutdown_s`` (a tester: two stalled
        connections held a stop 32 s longer)."""
        self.closed = True
        for body in list(self.bodies.values()):
            body.evict()
        for fut in list(self._waiters):
            if not fut.done():
                fut.cancel()

    async def enter(self) -> PendingBody | None:
        """A slot for one body: its :class:`PendingBody` (give it back with :meth:`leave`), or ``None`` when none
        came within ``wait_s`` seconds or the gate is closed. Cancelled while waiting (the client went away): no
        slot is kept."""
        if self.closed:
            return None
        if self.held < self.limit and not self._waiters:
            self.held += 1
            return self._start()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._wake_evictor()
        try:
            await asyncio.wait((fut,), timeout=self.wait_s)
        except asyncio.CancelledError:
            self._forget(fut)
            raise
        if fut.done() and not fut.cancelled():
            if self.closed:  # handed over as the gate closed: passed on, not used
                self.leave(PendingBody())
                return None
            return self._start()  # a slot was handed over
        self._forget(fut)
        return None

    def leave(self, body: PendingBody) -> None:
        """Give ``body``'s slot back: to the newest waiter still waiting, else free."""
        self.bodies.pop(id(body), None)
        while self._waiters:
            fut = self._waiters.pop()
            if not fut.done():
                fut.set_result(None)  # the slot moves to it: ``held`` unchanged
                return
        self.held -= 1

    def _start(self) -> PendingBody:
        body = PendingBody()
        self.bodies[id(body)] = body
        return body

    def _forget(self, fut: asyncio.Future) -> None:
        """A waiter that stopped waiting (refused or cancelled); a slot handed to it in the meantime moves on."""
        handed = fut.done() and not fut.cancelled()
        if not fut.done():
            fut.cancel()
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass  # already popped by leave()
        if handed:
            self.leave(PendingBody())  # an unregistered body: only its slot moves on

    def _wake_evictor(self) -> None:
        self._arrived.set()
        if self._evictor is None or self._evictor.done():
            self._evictor = asyncio.ensure_future(self._evict_while_waited())

    async def _evict_while_waited(self) -> None:
        """While requests wait: evict the bodies stale for ``idle_s``, stalest first, one per waiter not yet
        covered by an eviction in progress; then sleep until the stalest remaining body could be evicted, or a new
        request waits (a body already stale is then evicted for it at once)."""
        while self.waiting:
            self._arrived.clear()
            now = time.monotonic()
            live = sorted(((b.evictable_at(self.idle_s), id(b), b) for b in self.bodies.values() if not b.evicted))
            need = self.waiting - sum(b.evicted for b in self.bodies.values())
            for at, _, body in live:
                if need <= 0 or at > now:
                    break
                if body.evict():
                    need -= 1
            later = [at for at, _, b in live if not b.evicted and at > now]
            # the next body that may be evicted, or (none can be now: reads not started, or slots being handed
            # over) a short look again
            pause = min(later) - now if later else 0.05
            try:
                await asyncio.wait_for(self._arrived.wait(), max(pause, 0.005))
            except asyncio.TimeoutError:
                pass


async def read_body(gate: BodyGate, stream: AsyncIterator[bytes], cap: int, timeout_s: float,
                    refused: dict) -> bytes:
    """One request body through ``gate``: at most ``cap`` bytes.

    Args:
        gate: the tier replica's :class:`BodyGate`.
        stream: the body's chunks (starlette's ``request.stream()``).
        cap: bytes allowed (the model's body cap).
        timeout_s: seconds a body may make no progress (``ServeOptions.body_timeout_s``).
        refused: the tier replica's refusal counters (``bodies_pending``, ``body_timeout``, ``body_evicted``,
            ``client_gone`` counted here).

    Raises:
        Refusal: 503 (``Retry-After``, ``Connection: close``) when no slot came within ``gate.wait_s``, or the
            body was evicted for a waiting request; 408 (``Connection: close``) when the body made no progress for
            ``timeout_s``; 400 when the client closed the connection before its body arrived.
        ProtocolError: 413 past ``cap`` bytes.
    """
    body = await gate.enter()
    if body is None and gate.closed:
        raise Refusal("the server is shutting down", 503, {"Connection": "close"})
    if body is None:
        refused["bodies_pending"] += 1
        raise Refusal(f"{gate.held} requests are sending their bodies already; try again", 503,
                      {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
    try:
        chunks, n = [], 0
        chunk_iter = stream.__aiter__()
        while True:
            if gate.closed:  # close() came after a chunk arrived, before this read resumed: evict() missed it
                raise Refusal("the server is shutting down", 503, {"Connection": "close"})
            body.waiter = asyncio.ensure_future(chunk_iter.__anext__())
            try:
                chunk = await asyncio.wait_for(body.waiter, timeout_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                refused["body_timeout"] += 1
                raise Refusal(f"the request body made no progress for {timeout_s:g} s", 408,
                              {"Connection": "close"}) from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not body.evicted or (task is not None and getattr(task, "cancelling", lambda: 0)()):
                    raise  # the handler itself is cancelled (the client went away): not an eviction
                if gate.closed:
                    raise Refusal("the server is shutting down", 503, {"Connection": "close"}) from None
                refused["body_evicted"] += 1
                now = time.monotonic()
                why = (f"made no progress for {now - body.last:.1f} s" if now - body.last >= gate.idle_s else
                       f"arrived at {body.received / max(now - body.start, 1e-9):.0f} bytes/s, below the "
                       f"{EVICT_MIN_RATE:.0f} kept")
                raise Refusal(f"the request body {why} while other requests waited for one of the {gate.limit} "
                              "slots; try again", 503, {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
                              ) from None
            except Exception as exc:  # noqa: BLE001 - starlette's ClientDisconnect: the client went away
                refused["client_gone"] += 1
                raise Refusal(f"the client closed the connection before its body arrived "
                              f"({type(exc).__name__})", 400, {"Connection": "close"}) from None
            body.last = time.monotonic()
            body.received += len(chunk)
            n += len(chunk)
            if n > cap:
                raise ProtocolError(f"request body is past the cap of {cap} bytes", 413)
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        gate.leave(body)
