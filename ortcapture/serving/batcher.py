"""An adaptive batch queue for one asyncio event loop: a lone request runs at once, a batch waits only while more arrive.

:class:`AdaptiveBatcher` is what the batching tier (``ortcapture.serving.tier``) puts in front of its one call per
batch to a session replica. Its contract (the drain policy of LitServe, the queue delay of Triton's dynamic batcher):

* a batch is a list of submitted items whose rows add up to at most ``max_rows``; the items keep their order;
* at most ``max_in_flight`` batches run at once; while they all run, new items queue, and the next batch takes every
  queued item that fits (so under load batches fill from the queue without any waiting);
* once it has its first items, a batch waits for more only while others are arriving: it takes what is queued,
  yields to the event loop once, and waits only if others are arriving — several were queued, one came in during
  that turn, or the last two arrivals were less than ``gap_s`` apart — and then as long as a new item came in
  during the last wait, at most ``gap_s`` per wait and ``max_wait_s`` in all (``--batch-wait-ms``: the longest
  wait, not a fixed one). A lone request on an idle queue therefore runs after one event-loop turn;
* ``run(items)`` must return one result per item, in order; each submitter gets its own item's result. If ``run``
  raises, every item of that batch gets the exception. A submitter that is cancelled (a client gone, a timeout)
  while its item waits leaves the queue; once its batch runs, its result is dropped.

No Ray, no threads: everything happens on the event loop that calls :meth:`AdaptiveBatcher.submit`.
"""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence


@dataclass
class Item:
    """One submitted request: its ``rows``, the caller's ``payload``, when it was queued (``perf_counter_ns``)."""

    rows: int
    payload: Any
    queued_ns: int = field(default_factory=time.perf_counter_ns)
    future: asyncio.Future | None = None


class AdaptiveBatcher:
    """Batches items for ``run`` (see the module docstring).

    Args:
        run: ``async (items: list[Item]) -> list`` of one result per item.
        max_rows: the most rows one batch holds (an item of more rows is a batch alone).
        max_wait_s: the longest a batch waits for more items after its first (seconds, >= 0).
        max_in_flight: batches running at once (>= 1).
        gap_s: the longest one wait for the next arrival (seconds); default ``min(max_wait_s, 1 ms)``.

    Raises:
        ValueError: ``max_rows`` or ``max_in_flight`` < 1, a negative wait.

    Attributes:
        batches: batches run so far; ``items``: items run so far.
    """

    def __init__(self, run: Callable[[list[Item]], Awaitable[Sequence]], *, max_rows: int, max_wait_s: float,
                 max_in_flight: int = 1, gap_s: float | None = None):
        if max_rows < 1 or max_in_flight < 1 or max_wait_s < 0 or (gap_s is not None and gap_s < 0):
            raise ValueError(f"AdaptiveBatcher: max_rows {max_rows} and max_in_flight {max_in_flight} must be >= 1, "
                             f"max_wait_s {max_wait_s} and gap_s {gap_s} >= 0")
        self._run = run
        self.max_rows = int(max_rows)
        self.max_wait_s = float(max_wait_s)
        self.max_in_flight = int(max_in_flight)
        self.gap_s = min(self.max_wait_s, 0.001) if gap_s is None else float(gap_s)
        self._queue: collections.deque[Item] = collections.deque()
        self._arrived: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._loop_task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._last_put = float("-inf")
        self._interval = float("inf")  # between the last two arrivals (seconds)
        self.batches = 0
        self.items = 0

    @property
    def queued(self) -> int:
        """Items waiting for a batch now."""
        return len(self._queue)

    async def submit(self, rows: int, payload: Any) -> Any:
        """Queue one item of ``rows`` rows and return its result (what ``run`` returned for it); raises what ``run``
        raised for its batch."""
        if self._loop_task is None or self._loop_task.done():
            self._arrived = asyncio.Event()
            self._slots = asyncio.Semaphore(self.max_in_flight)
            self._loop_task = asyncio.get_running_loop().create_task(self._form_batches())
        item = Item(int(rows), payload)
        loop = asyncio.get_running_loop()
        item.future = loop.create_future()
        now = loop.time()
        self._interval, self._last_put = now - self._last_put, now
        self._queue.append(item)
        self._arrived.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            try:
                self._queue.remove(item)
            except ValueError:  # in a batch already: its result is dropped
                pass
            raise

    def _take(self, batch: list[Item], rows: int) -> int:
        """Move queued items into ``batch`` while they fit ``max_rows`` (the first always); returns the rows."""
        while self._queue:
            nxt = self._queue[0]
            if batch and rows + nxt.rows > self.max_rows:
                break
            self._queue.popleft()
            if nxt.future.done():  # cancelled while queued
                continue
            batch.append(nxt)
            rows += nxt.rows
        return rows

    async def _form_batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            await self._slots.acquire()
            batch: list[Item] = []
            self._arrived.clear()
            rows = self._take(batch, 0)
            deadline = loop.time() + self.max_wait_s
            await asyncio.sleep(0)  # one turn: what is ready to arrive arrives
            arriving = len(batch) > 1 or self._arrived.is_set() or self._interval < self.gap_s
            rows = self._take(batch, rows)
            while arriving and rows < self.max_rows and batch and not self._queue:  # (a queued item that did not fit: full)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), min(self.gap_s, remaining))
                except asyncio.TimeoutError:
                    arriving = False
                rows = self._take(batch, rows)
            if not batch:  # every item was cancelled
                self._slots.release()
                continue
            task = loop.create_task(self._dispatch(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _dispatch(self, batch: list[Item]) -> None:
        try:
            results = await self._run(batch)
            if len(results) != len(batch):
                raise RuntimeError(f"AdaptiveBatcher: run returned {len(results)} results for {len(batch)} items")
        except Exception as exc:  # noqa: BLE001 - every item of the batch gets it
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
        else:
            for item, result in zip(batch, results):
                if not item.future.done():
                    item.future.set_result(result)
        finally:
            self.batches += 1
            self.items += len(batch)
            self._slots.release()

    def close(self) -> None:
        """Stop forming batches (queued items are cancelled; batches running finish)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.cancel()
