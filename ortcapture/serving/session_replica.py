"""The ``ModelSession`` deployment: the replicas that hold a model's session, one Ray call per batch.

Each replica is one :class:`ortcapture.serving.replica.ReplicaCore` (one ``ortcapture.InferenceSession`` with
``buckets=`` and ``replay_thread=True``, every bucket warmed up in the constructor, one graph per bucket asserted).
The batching tier (:class:`ortcapture.serving.tier.ModelTier`, the ``Model`` deployment) checks every request once,
forms batches and makes one :meth:`ModelSession.run_batch` call per batch, passing each run's rows joined into one
numpy array per input — in the tier's batch slot (:mod:`ortcapture.serving.slots`, node-local shared memory) or by
value through Ray — and the rows of each request. The replica queues the batch for its session's replay thread
(:meth:`ortcapture.InferenceSession.run_on_replay_thread`: no hand-over per run), which takes every batch queued at
once, merges their runs where they fit (:mod:`ortcapture.serving.merge`) and runs them without checking the requests
again; the outputs go back whole (into the slot when they fit): the tier slices each request's rows back. A run that
fails is run again one request at a time, and :meth:`ReplicaCore.answers` decides 400 or 500 by behaviour. On CUDA
the replica also opens clients' CUDA shared memory regions (:mod:`ortcapture.serving.cuda_ipc`: rows gathered device
to device, outputs written into regions; runs in CUDA regions merge with each other, never with numpy rows).

GPUs per replica: 1 for CUDA, 0 otherwise (Ray sets ``CUDA_VISIBLE_DEVICES``). ``check_health()`` replays the
smallest bucket and checks its answer; shutting down lets batches in flight finish (``graceful_shutdown_s``) and
releases the graphs. Per-replica metrics go through ``ray.serve.metrics``; every second each replica also pushes its
counters to the ``ModelStats`` deployment for ``/stats``. This module imports Ray.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from ray import serve as ray_serve

from ortcapture.serving.config import THROUGHPUT_ENV, ServeOptions
from ortcapture.transfer import outputs_into, pinning_in_place, tap_device_outputs
from ortcapture.serving.ray_common import STATS_DEPLOYMENT, Reporter, keep_replica_grpc_on_loopback, quick_gil_handoff
from ortcapture.serving.replica import ReplicaCore
from ortcapture.serving.merge import MergeScratch, iter_merged_runs, mergeable, prefetched, split_answer
from ortcapture.serving.slots import SlotMissing, SlotReader
from ortcapture.serving.cuda_ipc import IpcMemory, RegionTap
from ortcapture.serving.cuda_shm import DeviceRows, InRegion
from ortcapture.serving.requests import HostRows, take
from ortcapture.serving.shm import ShmError

#: seconds a shutting-down replica waits for its replay thread's round in progress before closing the host memory
#: the round reads from (batch slots, the merge scratch)
CLOSE_WAIT_S = 30.0


class ModelSession:
    """The ``ModelSession`` deployment's class (see the module docstring).

    Args:
        options: checked :class:`~ortcapture.serving.config.ServeOptions`.
        provider: the resolved provider (``cuda``, ``webgpu``, ``cpu``).
        stats_app: the application of the ``ModelStats`` deployment (default: this replica's own).

    Raises:
        CaptureError: what :class:`~ortcapture.serving.replica.ReplicaCore` raises (the model does not capture, ...).
    """

    def __init__(self, options: ServeOptions, provider: str, stats_app: str | None = None):
        keep_replica_grpc_on_loopback(options.loopback())
        self.switch_interval_s = quick_gil_handoff(options.switch_interval_ms)  # the GIL back quickly under load
        self.options = options
        self.core = ReplicaCore(options, provider)
        # a capturing session replays on its own thread: batches run there whole (no hand-over per run); the CPU
        # provider's plain session runs max_concurrent_batches batches at once on a pool
        self._on_replay_thread = self.core.captures
        self._pool = None if self._on_replay_thread else ThreadPoolExecutor(options.max_concurrent_batches,
                                                                             "ortcapture-batch")
        ctx = ray_serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self._app = stats_app or ctx.app_name
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self._reporter = Reporter(self._push_report)  # this replica's counters to ModelStats, every second
        # the tier replicas' batch slots (node-local shared memory), mapped once; page-locked on CUDA (one DMA per
        # input from the slot into the graph's buffer)
        pin = provider == "cuda" and pinning_in_place()
        self._slot_reader = SlotReader(pin=pin)
        # the clients' CUDA regions this replica opened (ortcapture.serving.cuda_ipc; CUDA only)
        self._ipc = IpcMemory() if provider == "cuda" else None
        self._registry = None  # the shared memory registry (which of them are still registered), on first use
        self._provider = provider
        # batches queued for the replay thread; it takes them all at once and merges their runs (_drain)
        self._queue: collections.deque = collections.deque()
        self._queue_lock = threading.Lock()
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the replica's event loop (run_batch's)
        self.merged_runs = 0  # runs that shared a replay with an earlier one (/stats: merged_runs)
        # where a call's time goes inside this replica (/stats: calls, call_ns, wait_ns): arrival to answer, and
        # arrival to the start of its round on the replay thread; the tier's round trip minus call_ns is Ray's
        self._timing = {"calls": 0, "call_ns": 0, "wait_ns": 0}
        spec = self.core.layout.spec
        self._mergeable = mergeable([t.name for t in spec.inputs], spec.batch_axes)
        # merged runs stay within a captured bucket (a run past the largest one would run uncaptured)
        self._merge_rows = min(options.max_batch_size, max(options.buckets))
        # merged runs' host rows joined into reused buffers, page-locked where the slots are (one DMA to the graph)
        # and the next merged run joined on a thread of its own while the current one replays (two sets of buffers)
        prefetch = self._on_replay_thread and self._mergeable and options.merge_prefetch
        self._prefetch = ThreadPoolExecutor(1, "ortcapture-merge") if prefetch else None
        self._scratch = MergeScratch(pin=pin, max_rows=self._merge_rows, sets=2 if prefetch else 1) \
            if self._on_replay_thread else None
        # merged runs whose rows all lie in page-locked slots: listed, not joined, each part one DMA to the device
        # (merge.iter_merged_runs' listed; the scratch's host copy was 28 % of the replay thread at 32 clients)
        listed = pin and self._ipc is not None and self._on_replay_thread and options.merge_listed
        self._listed = self._slot_reader.in_pinned_pool if listed else None
        self._stats = None
        self._metrics = _Metrics(options.name)
        self._metrics.graphs(self.core)

    async def run_batch(self, runs: Sequence[tuple[dict | None, Sequence[int]]],
                        queued_ns: Sequence[Sequence[int]] = (), slot: dict | None = None) -> list[dict] | dict:
        """One batch of the tier: several runs (one per group of requests that can share a run).

        Args:
            runs: ``[(feeds, rows)]``: ``feeds`` ``{input: numpy array}`` with the requests' rows joined along the
                batched dim (at most ``max_batch_size`` rows), ``rows`` each request's rows in order. Checked by the
                tier already (:class:`~ortcapture.serving.requests.RequestCheck`): not checked again. ``feeds`` is
                ``None`` with ``slot``. Rows in clients' CUDA regions come as
                :class:`~ortcapture.serving.cuda_shm.DeviceRows` (gathered here on the device), and a run whose
                requests name CUDA regions for outputs is ``(feeds, rows, [{output: Ref} or None per request])``:
                those outputs are written there (:mod:`ortcapture.serving.cuda_ipc`).
            queued_ns: per run, each request's wait in the tier (nanoseconds; ``/stats``' queue time).
            slot: a :meth:`ortcapture.serving.slots.Slot.descriptor`: the runs' feeds are in the tier's node-local
                shared memory (read in place), and the outputs go back there when they fit.

        Returns:
            Per run: :meth:`ReplicaCore.run_joined`'s answer — ``{"outputs", "axes"}`` (every row; the tier slices),
            ``{"slot_outputs", "axes"}`` (the same, written into the slot: ``{name: (offset, shape, dtype)}``) or
            ``{"answers": [...]}`` (the run failed: each request's own answer). ``{"by_value": True}`` (not a list)
            when the slot's shared memory is not on this machine: the tier sends the batch again by value.
        """
        self._reporter.start()
        t0 = time.perf_counter_ns()
        try:
            return await self._run_batch(runs, queued_ns, slot, t0)
        finally:
            self._timing["calls"] += 1
            self._timing["call_ns"] += time.perf_counter_ns() - t0

    async def _run_batch(self, runs, queued_ns, slot, t0: int):
        queued = list(queued_ns) or [()] * len(runs)
        if slot is not None:
            try:
                feeds = self._slot_reader.inputs(slot)
            except SlotMissing:
                return {"by_value": True}
            runs = [(f, rows) for f, (_, rows) in zip(feeds, runs)]
        if self._on_replay_thread:  # queued for the replay thread, which merges what queued (see _drain)
            loop = self._loop = asyncio.get_running_loop()
            future = loop.create_future()
            with self._queue_lock:
                self._queue.append(_Call(list(runs), queued, slot, future, loop, t0))
                start, self._draining = not self._draining, True
            if start:
                try:
                    self.core.session.run_on_replay_thread(self._drain)
                except BaseException:  # the session is closing: nothing will take the queue
                    with self._queue_lock:
                        self._queue.clear()
                        self._draining = False
                    raise
            return await future
        (result,) = await asyncio.get_running_loop().run_in_executor(self._pool, self._run_calls,
                                                                     [(list(runs), queued, slot)])
        if isinstance(result, BaseException):
            raise result
        return result

    def _drain(self) -> None:
        """On the replay thread, one round: every batch queued now (those given up on are skipped), run merged where
        they fit (:mod:`ortcapture.serving.merge`), each call answered on its event loop as soon as its own runs are
        done. The next round is submitted behind whatever else waits for the replay thread (a health check is never
        starved by a steady stream of batches)."""
        with self._queue_lock:
            calls = [c for c in self._queue if not c.future.done()]
            self._queue.clear()
        try:  # from here every call taken is answered, whatever raises
            now = time.perf_counter_ns()
            self._timing["wait_ns"] += sum(now - c.t0 for c in calls)
            self._run_calls([(c.runs, c.queued, c.slot) for c in calls], lambda k, result: _answer(calls[k], result),
                            alive=lambda k: not calls[k].future.done())
        except BaseException as exc:  # noqa: BLE001 - every call of the round not answered yet gets it
            for c in calls:
                _answer(c, exc)
        finally:
            with self._queue_lock:
                again = bool(self._queue)
                self._draining = again
            if again:  # through the event loop: submitted from the replay thread itself it would run inline here
                try:
                    self._loop.call_soon_threadsafe(self._next_round)
                except RuntimeError as exc:  # the event loop is closed: nobody waits for the rest
                    self._fail_queued(exc)

    def _next_round(self) -> None:
        """On the event loop: the next round of :meth:`_drain`, behind whatever waits for the replay thread."""
        try:
            self.core.session.run_on_replay_thread(self._drain)
        except BaseException as exc:  # noqa: BLE001 - the session is closing: nothing takes the queue
            self._fail_queued(exc)

    def _fail_queued(self, exc: BaseException) -> None:
        with self._queue_lock:
            left, self._draining = list(self._queue), False
            self._queue.clear()
        for c in left:
            _answer(c, exc)

    def _run_calls(self, calls: list, done=None, alive=None) -> list:
        """``calls``: ``[(runs, queued, slot)]``; their runs merged into replays of at most ``max_batch_size`` rows
        (and the largest bucket) where the model allows it. Per call: one answer per run (outputs into its slot
        when it has one), or the exception its own runs or slot raised; ``done(k, result)`` is called for call
        ``k`` as soon as it is complete. A call that ``alive(k)`` says was given up on before its run reads nothing
        into its slot, and one given up on before its answer copies nothing there; a call given up on during its run
        may still have its outputs read into the slot (:meth:`_output_arena`), which is why the tier never hands a
        slot out again once its call was given up on (:meth:`ortcapture.serving.slots.SlotPool.retire`)."""
        if self._slot_reader.drop_due():  # a tier replica that is gone leaves its pool mapped and pinned here
            self._slot_reader.drop_stale()
        flat = [(c, run, q) for c, (runs, queued, _) in enumerate(calls) for run, q in zip(runs, queued)]
        # joined one at a time: each right before its run (the scratch holds one merged run's rows per input), or
        # with the prefetch the next one while this one runs (two sets of buffers, each rejoined only after its run)
        merged = iter_merged_runs([run[:2] for _, run, _ in flat], self._merge_rows, self._mergeable,
                                  into=self._scratch, listed=self._listed)
        if self._prefetch is not None:
            merged = prefetched(merged, self._prefetch)
        answers: list[list] = [[] for _ in calls]
        failed: list = [None] * len(calls)
        left = [0] * len(calls)
        for c, _, _ in flat:
            left[c] += 1

        def finish(c: int) -> None:
            slot = calls[c][2]
            if failed[c] is None and slot is not None and (alive is None or alive(c)):
                try:
                    self._into_slot(slot, answers[c])
                except Exception as exc:  # noqa: BLE001 - this call's own failure
                    failed[c] = exc
            if done is not None:
                done(c, failed[c] if failed[c] is not None else answers[c])

        for c, n in enumerate(left):
            if n == 0:
                finish(c)
        with contextlib.closing(merged):  # leaving early waits for a run being joined (nothing writes after it)
            for members, feeds, rows in merged:
                try:
                    if isinstance(feeds, Exception):  # joining this merged run failed (iter_merged_runs)
                        raise feeds
                    queued = [t for i in members for t in flat[i][2]]
                    # rows in CUDA regions, or host rows listed in page-locked slots: gathered on the device
                    device = any(isinstance(v, (DeviceRows, HostRows)) for v in feeds.values())
                    arena = self._output_arena(calls, flat, members, alive)
                    tap = self._region_tap(flat, members, rows, feeds)
                    try:
                        with outputs_into(arena) if arena is not None else contextlib.nullcontext(), \
                                tap_device_outputs(tap) if tap is not None else contextlib.nullcontext():
                            answer = self.core.run_joined(feeds, rows, queued,
                                                          prepare=self._gather if device else None)
                    finally:
                        if arena is not None:  # its hold on the slot's mapping ends here (outputs keep their own)
                            arena.release()
                    self.merged_runs += len(members) - 1
                    parts = [answer] if len(members) == 1 else \
                        split_answer(answer, [flat[i][1][1] for i in members])
                    # each member's requests' outputs into the CUDA regions they name, from its own rows: copied
                    # there on the device as the run's outputs were read (tap), else written from the host answer
                    firsts = itertools.accumulate((len(flat[i][1][1]) for i in members), initial=0)
                    parts = [self._device_outputs(p, flat[i][1][1], flat[i][1][2],
                                                  tap.member(a, a + len(flat[i][1][1])) if tap is not None else None)
                             if len(flat[i][1]) > 2 else p for i, p, a in zip(members, parts, firsts)]
                    self._metrics.batch(sum(rows), parts, len(rows))  # after the regions' own 400s
                except Exception as exc:  # noqa: BLE001 - the calls of this run get it, the others go on
                    parts = [exc] * len(members)
                for i, part in zip(members, parts):
                    c = flat[i][0]
                    if isinstance(part, BaseException):
                        failed[c] = part
                    else:
                        answers[c].append(part)
                    left[c] -= 1
                    if left[c] == 0:
                        finish(c)
        return [f if f is not None else a for f, a in zip(failed, answers)]

    def _output_arena(self, calls: list, flat: list, members: list, alive):
        """Where this run's outputs are read (:func:`ortcapture.transfer.outputs_into`): its call's page-locked
        batch slot, at the place :meth:`_into_slot` copies them to — so that copy (YOLOv8n batch 8: 5.6 MB on the
        replay thread) is skipped. Only for a call of one run, not merged with others (its outputs, and a failed
        run's per-request answers, are the only arrays in that room), still waited for; else ``None``."""
        c = flat[members[0]][0]
        slot = calls[c][2]
        if len(members) != 1 or slot is None or len(calls[c][0]) != 1 or (alive is not None and not alive(c)):
            return None
        try:
            return self._slot_reader.output_arena(slot)
        except (SlotMissing, KeyError, TypeError, ValueError):  # a bad descriptor: its inputs failed already
            return None

    def _gather(self, feeds: dict) -> dict:
        """``feeds`` with each :class:`~ortcapture.serving.cuda_shm.DeviceRows` gathered into a CUDA ``OrtValue``
        (the feed path copies it device to device into the graph's buffer): the ``prepare`` of
        :meth:`ReplicaCore.run_joined`, so a batch that fails is gathered and run again one request at a time there.
        Raises ShmError (a region that cannot be read: its request's 400) or
        :class:`~ortcapture.serving.cuda_ipc.DeviceCopyError` (a copy that fails: the health rule decides)."""
        return {n: self._ipc.gather(n, v) if isinstance(v, (DeviceRows, HostRows)) else v for n, v in feeds.items()}

    def _region_tap(self, flat: list, members: list, rows, feeds: dict) -> RegionTap | None:
        """A :class:`~ortcapture.serving.cuda_ipc.RegionTap` for a run whose requests name CUDA output regions (on
        CUDA), else ``None``; ``feeds``' rows in CUDA regions are its ``inputs``."""
        if not any(len(flat[i][1]) > 2 for i in members) or self._ipc is None:
            return None
        wants = [w for i in members for w in (flat[i][1][2] if len(flat[i][1]) > 2 else [None] * len(flat[i][1][1]))]
        if not any(wants):
            return None
        inputs = [t.ref for v in feeds.values() if isinstance(v, DeviceRows) for t, _, _ in v.parts]
        return RegionTap(self._ipc, rows, wants, self.core.runner.output_axes, inputs)

    def _device_outputs(self, answer: dict, rows, outs, copied=None) -> dict:
        """Each request's rows of the outputs it names into CUDA regions (``outs``: per request ``{output name:
        Ref}`` or ``None``), written there from the host answer unless ``copied`` (per request, the names a
        :class:`~ortcapture.serving.cuda_ipc.RegionTap` copied device to device during the run) has them; a request
        whose region is too small gets its own 400, one whose copy fails on the device
        (:class:`~ortcapture.serving.cuda_ipc.DeviceCopyError`) its own 500 (the others their outputs, and a merged
        run's other members theirs). A request's outputs written into its regions stay out of its answer
        (:class:`~ortcapture.serving.cuda_shm.InRegion`: shape and dtype only), which is then per request: their rows
        never travel back to the tier through Ray."""
        if "outputs" in answer:
            axes, offset, own = answer["axes"], 0, []
            for n in rows:
                own.append({"outputs": {name: take(o, axes[name], offset, offset + n)
                                        for name, o in answer["outputs"].items()}})
                offset += n
        else:
            own = list(answer["answers"])
        bad = placed = False
        if "outputs" not in answer:  # run again one request at a time: what the tap copied is not these answers'
            copied = None
        for k, want in enumerate(outs):
            if not want or "outputs" not in own[k]:
                continue
            try:
                for name, ref in want.items():
                    if copied is None or name not in copied[k]:
                        self._ipc.write(ref, own[k]["outputs"][name], f"output {name!r}")
                # written: the answer keeps their shapes only, not the rows (they are in the regions)
                own[k] = {"outputs": {n: InRegion.of(a) if n in want else a for n, a in own[k]["outputs"].items()}}
                placed = True
            except ShmError as exc:
                own[k] = {"error": str(exc), "status": 400}
                bad = True
            except Exception as exc:  # noqa: BLE001 - DeviceCopyError: the server's, this request's own 500
                own[k] = {"error": f"the server could not write the outputs into the CUDA region "
                                   f"({type(exc).__name__}: {exc})"[:300], "status": 500}
                bad = True
        return {"answers": own} if bad or placed or "answers" in answer else answer

    async def open_cuda_region(self, region) -> str | None:
        """Open a client's CUDA region (:class:`~ortcapture.serving.shm.Region` of kind ``"cuda"``) and keep it
        open: ``None``, or why it cannot be (a server not on CUDA, a handle that does not open here, a size past
        the allocation). The tier asks one replica when a client registers the region; the others open it on first
        use."""
        if self._provider != "cuda":
            return f"CUDA shared memory needs the CUDA provider; this replica runs {self._provider}"
        try:
            # on the replay thread, which gathers from the regions (a name registered again closes its old handle)
            await asyncio.wrap_future(self.core.session.run_on_replay_thread(self._ipc.open, region))
        except ShmError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - cuda-python missing, a driver error: the client's 400
            return f"region {region.name!r}: cannot open the CUDA IPC handle here ({type(exc).__name__}: {exc})"[:300]
        return None

    def _into_slot(self, slot: dict, out: list[dict]) -> None:
        """A call's outputs into its batch slot, when they fit (else they go back by value through Ray)."""
        done = [a for a in out if "outputs" in a]
        try:
            where = self._slot_reader.write_outputs(slot, [a["outputs"] for a in done]) if done else None
        except SlotMissing:  # its pool is being unmapped here (its tier replica is gone): by value
            where = None
        if where is not None:
            for a, w in zip(done, where):
                del a["outputs"]
                a["slot_outputs"] = w

    async def stats(self) -> dict:
        """This replica's report (:meth:`ReplicaCore.report`) with its replica id."""
        return {"replica": self.replica_id, **self._report()}

    def _report(self) -> dict:
        """:meth:`ReplicaCore.report` plus the Ray node this replica runs on (``node``), its GIL switch interval
        (``switch_interval_s``, :func:`ortcapture.serving.ray_common.quick_gil_handoff`), whether it runs with Ray
        Serve's throughput-optimised settings (``serve_throughput_optimized``: its ``runtime_env`` set
        ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, :attr:`ServeOptions.serve_throughput_optimized`), the runs that shared a
        replay with an earlier one (``merged_runs``, :mod:`ortcapture.serving.merge`), the tier replicas' batch slot
        pools page-locked here (``slots_pinned``; ``slot_pin_error``: why one could not be, or ``None``), the
        outputs read straight into their batch slot (``slot_outputs_in_place``: not copied there,
        :meth:`_output_arena`), the pools of tier replicas that are gone, unmapped and unpinned here
        (``slot_pools_dropped``, :meth:`ortcapture.serving.slots.SlotReader.drop_stale`), the merged inputs joined
        into the reused (on CUDA page-locked) buffers of :class:`~ortcapture.serving.merge.MergeScratch`
        (``merge_scratch_used``; ``merge_scratch_error``: why page-locking one failed, which turns them off),
        whether the next merged run is joined while the current one runs (``merge_prefetch``), whether a merged
        run's rows that all lie in page-locked slots are copied to the device part by part instead of joined
        (``merge_listed``; ``merge_listed_gathers``: inputs so gathered), the outputs written
        into CUDA regions (``cuda_region_writes``: ``device_to_device`` from the graph's buffers,
        :class:`~ortcapture.serving.cuda_ipc.RegionTap`, and ``from_host``; ``None`` off CUDA), and
        where the batches' time went in this replica: ``calls`` (``run_batch`` calls), ``call_ns`` (their time from
        arrival to answer, ns) and ``wait_ns`` (from arrival to the start of their round on the replay thread; CPU
        provider: 0)."""
        return {**self.core.report(), "node": self.node_id, "switch_interval_s": self.switch_interval_s,
                "slots_pinned": self._slot_reader.pinned, "slot_pin_error": self._slot_reader.pin_error,
                "slot_outputs_in_place": self._slot_reader.in_place, "slot_pools_dropped": self._slot_reader.dropped,
                "merge_prefetch": self._prefetch is not None, "merge_listed": self._listed is not None,
                "merge_listed_gathers": self._ipc.host_gathers if self._ipc is not None else 0,
                "cuda_region_writes": None if self._ipc is None else
                {"device_to_device": self._ipc.device_writes, "from_host": self._ipc.host_writes},
                "merge_scratch_used": self._scratch.used if self._scratch is not None else 0,
                "merge_scratch_error": self._scratch.error if self._scratch is not None else None,
                "serve_throughput_optimized": os.environ.get(THROUGHPUT_ENV) == "1",
                "merged_runs": self.merged_runs, **self._timing}

    async def check_health(self) -> None:
        """Replay the smallest bucket and check its answer (Ray Serve calls this periodically; raising marks the
        replica unhealthy and Ray replaces it)."""
        self._reporter.start()
        if self._on_replay_thread:
            await asyncio.wrap_future(self.core.session.run_on_replay_thread(self.core.check_health))
        else:
            await asyncio.get_running_loop().run_in_executor(None, self.core.check_health)

    async def _push_report(self) -> None:
        if self._on_replay_thread and self._slot_reader.drop_due():  # an idle replica drops gone tiers' pools too
            await asyncio.wrap_future(self.core.session.run_on_replay_thread(self._slot_reader.drop_stale))
        if self._stats is None:
            self._stats = ray_serve.get_deployment_handle(STATS_DEPLOYMENT, self._app)
        await self._stats.report.remote(self.replica_id, self._report())
        self._metrics.graphs(self.core)
        if self._ipc is not None and self._ipc.names():  # close the handles of CUDA regions unregistered since
            from ortcapture.serving.shm_store import ActorRegistry

            if self._registry is None:
                self._registry = ActorRegistry(f"{self.options.app_name}-shm", create=False)  # never made here
            live = await self._registry.lookup(self._ipc.names())
            # on the replay thread, which gathers from them: never closed under a copy in progress
            await asyncio.wrap_future(self.core.session.run_on_replay_thread(self._ipc.forget, live))

    def _close_host_memory(self) -> None:
        """Close the batch slots' mappings and the merge scratch (on the replay thread, between rounds: no merged run
        is being joined), and end the prefetch thread (a round after this joins on the replay thread)."""
        prefetch = getattr(self, "_prefetch", None)
        if prefetch is not None:
            prefetch.shutdown(wait=True)
        for part in ("_slot_reader", "_scratch"):
            obj = getattr(self, part, None)
            if obj is not None:
                obj.close()

    def __del__(self):
        """Graceful shutdown (Serve calls this after requests in flight finished): release the graphs."""
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        # the host memory the replay thread reads from (batch slots, the merge scratch) closed on that thread, after
        # the round in progress: never unpinned or unmapped under a run
        core = getattr(self, "core", None)
        session = getattr(core, "session", None)
        if getattr(self, "_on_replay_thread", False) and session is not None:
            try:
                session.run_on_replay_thread(self._close_host_memory).result(timeout=CLOSE_WAIT_S)
            except Exception:  # noqa: BLE001 - the replay thread is gone or stuck: closed below, here
                pass
        prefetch = getattr(self, "_prefetch", None)
        if prefetch is not None:  # a merged run being joined finishes before the scratch is closed below
            prefetch.shutdown(wait=True)
        # each part closed even when one before it raised (the first error is raised after the last part)
        first = None
        for part in ("core", "_slot_reader", "_scratch", "_ipc"):
            obj = getattr(self, part, None)
            if obj is None:
                continue
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001
                first = first or exc
        if first is not None:
            raise first


def _settle(future: asyncio.Future, result) -> None:
    """On the call's event loop: its answer, or the exception its batch raised (a call given up on is skipped)."""
    if future.done():
        return
    if isinstance(result, StopIteration):  # a future cannot carry one
        result = RuntimeError(f"the batch raised StopIteration: {result}")
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class _Call:
    """A ``run_batch`` call queued for the replay thread: its runs, queue times and slot, the future its caller
    awaits on event loop ``loop``, and when it arrived (``perf_counter_ns``)."""

    __slots__ = ("runs", "queued", "slot", "future", "loop", "t0")

    def __init__(self, runs, queued, slot, future: asyncio.Future, loop: asyncio.AbstractEventLoop, t0: int):
        self.runs, self.queued, self.slot, self.future, self.loop, self.t0 = runs, queued, slot, future, loop, t0


def _answer(call: _Call, result) -> None:
    """From the replay thread: settle ``call``'s future on its event loop."""
    try:
        call.loop.call_soon_threadsafe(_settle, call.future, result)
    except RuntimeError:  # that call's event loop is closed: nobody waits for it
        pass


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
        if n:
            self._requests.inc(n, tags={**self.tags, "outcome": outcome})

    def batch(self, rows: int, parts: Sequence[dict], requests: int) -> None:
        """One run of ``rows`` rows and ``requests`` requests; ``parts``: its members' final answers (a failed
        request is an ``{"error"}`` entry of a part's ``"answers"``)."""
        self._rows.observe(rows, tags=self.tags)
        bad = sum("error" in a for p in parts for a in p.get("answers", ()))
        self.requests("ok", requests - bad)
        self.requests("failed", bad)

    def graphs(self, core: ReplicaCore) -> None:
        if core.session is None:
            return
        s = core.bucket_stats()
        self._graphs.set(s["captured"], tags=self.tags)
        self._uncaptured.set(s["uncaptured"], tags=self.tags)
        self._waste.set(s["padding_waste"], tags=self.tags)
