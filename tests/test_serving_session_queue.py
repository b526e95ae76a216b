"""The session replica's queue (ortcapture.serving.session_replica.ModelSession): batches queued behind the run in
progress are merged into fuller runs, each call gets its own rows back as soon as its runs are done, and a steady
stream of batches never starves a health check on the replay thread. Ray-free: the replica's core is a stand-in
whose runs sleep like a replay (no Ray cluster, no device)."""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("ray")
from ortcapture.serving import session_replica  # noqa: E402
from ortcapture.serving.slots import SlotReader  # noqa: E402
from tests.test_staging import fake_pinned  # noqa: E402, F401 - the fixture


class _Session:
    """``run_on_replay_thread`` as a session with ``replay_thread=True`` has it: ``BucketRunner.submit`` itself (a
    task submitted from the replay thread runs there at once)."""

    def __init__(self):
        from ortcapture._buckets.run import BucketRunner

        self.runner = BucketRunner.__new__(BucketRunner)
        self.runner._worker, self.runner._worker_ident = ThreadPoolExecutor(1, "replay"), None
        self.submit = BucketRunner.submit

    def run_on_replay_thread(self, fn, *args):
        return self.submit(self.runner, fn, *args)


class _Core:
    """A session replica's core whose run takes ``run_s`` and answers ``y = 2 x`` (rows along axis 0)."""

    def __init__(self, run_s: float):
        self.session, self.run_s, self.runs = _Session(), run_s, []

    def run_joined(self, feeds, rows, queued=(), isolate=True, prepare=None):
        time.sleep(self.run_s)
        self.runs.append(list(rows))
        return {"outputs": {"y": feeds["X"] * 2}, "axes": {"y": 0}}

    def check_health(self):
        time.sleep(0.001)

    def close(self):  # the replica's __del__ closes its core
        pass


class _Nothing:
    def __getattr__(self, name):
        return lambda *a, **k: None


class _Options:
    max_batch_size = 8
    buckets = (1, 2, 4, 8)


def _replica(run_s: float):
    ms = session_replica.ModelSession.__new__(session_replica.ModelSession)
    ms.core, ms.options, ms._on_replay_thread, ms._pool = _Core(run_s), _Options(), True, None
    ms._reporter, ms._metrics, ms._slot_reader, ms._scratch = _Nothing(), _Nothing(), SlotReader(), None
    ms._queue, ms._queue_lock, ms._draining = collections.deque(), threading.Lock(), False
    ms.merged_runs, ms._mergeable, ms._merge_rows, ms._loop = 0, True, 8, None
    ms._timing = {"calls": 0, "call_ns": 0, "wait_ns": 0}
    ms._prefetch = ms._listed = None
    return ms


def test_a_steady_stream_of_batches_does_not_starve_a_health_check():
    """16 tiers keep batches queued; Serve's health check goes to the same replay thread. It used to wait until the
    queue was empty (not run after 5 s): now each round of batches lets it in."""
    ms = _replica(0.003)

    async def main():
        stop = False

        async def tier(k):
            while not stop:
                await asyncio.sleep(0.001)
                x = np.full((2, 3), k, np.float32)
                got = await ms.run_batch([({"X": x}, [2])], [[0]])
                np.testing.assert_array_equal(got[0]["outputs"]["y"], 2 * x)

        tiers = [asyncio.ensure_future(tier(k)) for k in range(16)]
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await asyncio.wait_for(ms.check_health(), 5.0)
        waited = time.monotonic() - t0
        stop = True
        await asyncio.gather(*tiers)
        return waited

    waited = asyncio.run(main())
    assert waited < 1.0, f"the health check waited {waited:.2f} s behind the batches"
    assert ms.merged_runs > 0  # and the queued batches were merged meanwhile
    ms.core.session.run_on_replay_thread(lambda: None).result(timeout=10)  # the last round's end (it answers first)
    assert not ms._draining and not ms._queue  # every round ended; nothing left behind


def test_rounds_go_on_without_growing_the_stack():
    """Each round of the queue is a task of its own on the replay thread (submitted through the event loop): 400
    rounds in a row with batches always queued neither recurse nor leave a batch unanswered."""
    ms = _replica(0.0005)
    depths = []
    run = ms.core.run_joined

    def counting(*args, **kwargs):
        import inspect

        depths.append(len(inspect.stack(0)))
        return run(*args, **kwargs)

    ms.core.run_joined = counting

    async def main():
        async def tier(k):
            for i in range(50):
                x = np.full((1, 3), k * 1000 + i, np.float32)
                got = await ms.run_batch([({"X": x}, [1])], [[0]])
                np.testing.assert_array_equal(got[0]["outputs"]["y"], 2 * x)

        await asyncio.wait_for(asyncio.gather(*(tier(k) for k in range(8))), 60)

    asyncio.run(main())
    assert max(depths) - min(depths) < 20, f"the stack grew from {min(depths)} to {max(depths)} frames"
    ms.core.session.run_on_replay_thread(lambda: None).result(timeout=10)  # the last round's end (it answers first)
    assert not ms._draining and not ms._queue


def test_queued_batches_merge_and_each_call_gets_its_own_rows_as_soon_as_they_are_done():
    ms = _replica(0.02)

    async def main():
        loop = asyncio.get_running_loop()
        done_at = {}

        async def call(k, n):
            x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 100 * k  # values unique per call
            got = await ms.run_batch([({"X": x}, [n])], [[0]])
            done_at[k] = loop.time()
            np.testing.assert_array_equal(got[0]["outputs"]["y"], 2 * x)

        t0 = loop.time()
        await asyncio.gather(*(call(k, n) for k, n in enumerate([1, 3, 4, 2, 6, 2, 8, 8])))
        return {k: t - t0 for k, t in done_at.items()}

    times = asyncio.run(main())
    runs = ms.core.runs
    assert runs[0] == [1]  # the first batch ran at once, alone
    assert len(runs) < 8 and ms.merged_runs == 8 - len(runs)  # the rest queued behind it and were merged
    assert all(sum(r) <= 8 for r in runs)
    assert times[1] < 0.6 * max(times.values())  # answered when its run was done, not at the end of its round


def test_a_failed_call_to_the_session_replica_is_each_requests_500():
    """A call from the tier to the session replica that fails with something Ray does not wrap (a transport limit:
    the 4 MiB gRPC message cap raised ``AioRpcError`` through ``DeploymentResponse``) gives each request of the
    batch a 500 that names it, instead of the exception escaping to every caller of the batch."""
    from ortcapture.serving.batcher import Item

    t = _tier_whose_batches_raise([ValueError("Received message larger than max (5242880 vs. 4194304)")])
    items = [Item(1, ({"X": np.full((1, 4), k, np.float32)}, None)) for k in range(3)]
    got = asyncio.run(t._run_batch(items))
    assert [a["status"] for a in got] == [500] * 3, got
    assert all("ValueError" in a["error"] and "larger than max" in a["error"] for a in got)


def _tier_whose_batches_raise(raised: list):
    """A batching-tier replica (no Ray Serve context) whose calls to the session replica raise ``raised[0]``."""
    from types import SimpleNamespace

    from ortcapture.serving import tier as tier_mod
    from ortcapture.serving.config import ServeOptions

    async def fail(*args):
        raise raised[0]

    t = tier_mod.ModelTier.__new__(tier_mod.ModelTier)
    t.options = ServeOptions("m.onnx", max_batch_size=8)
    t.check = SimpleNamespace(names=["X"], input_axes={"X": 0})
    t.session, t._slots, t._sent = SimpleNamespace(run_batch=SimpleNamespace(remote=fail)), None, collections.Counter()
    t._draining, t._ready, t._ready_at, t._ready_lock, t._session_app = False, False, 0.0, None, "app"
    t._ready_resets, t._distrusted_at, t._refresh = 0, float("-inf"), None
    return t


def test_a_ready_is_trusted_until_a_batch_finds_no_session_replica(monkeypatch):
    """Asking Serve's controller whether a session replica runs costs a tier replica ~40 ms of CPU (5-9 % of a busy
    one's when asked every 0.5 s): a yes is trusted for READY_TRUST_S, and a batch that no session replica could run
    makes the next request ask again (a 503 then says "not ready" until one runs)."""
    from ortcapture.serving import tier as tier_mod
    from ortcapture.serving.batcher import Item

    import ray
    from ray.serve.exceptions import BackPressureError

    asked, running, raised = [], [True], [ray.exceptions.RayActorError()]
    monkeypatch.setattr(tier_mod, "session_running", lambda app: asked.append(app) or running[0])

    t = _tier_whose_batches_raise(raised)
    batch = [Item(1, ({"X": np.zeros((1, 4), np.float32)}, None))]

    async def main():
        got = [await t.ready() for _ in range(20)]
        assert got == [True] * 20 and len(asked) == 1  # asked once, then trusted
        running[0] = False
        answers = await t._run_batch(batch)
        assert answers[0]["status"] == 503
        assert await t.ready() is False and len(asked) == 2  # asked again at once, and the no is the answer
        running[0] = True
        await asyncio.sleep(0.06)  # a no is asked again after 50 ms
        assert await t.ready() is True and len(asked) == 3
        # an overloaded replica is not a missing one: no new asks (each costs the controller's ~40 ms of CPU)
        raised[0] = BackPressureError(num_queued_requests=1, max_queued_requests=1)
        for _ in range(5):
            assert (await t._run_batch(batch))[0]["status"] == 503
        assert await t.ready() is True and len(asked) == 3

    asyncio.run(main())


def test_a_ready_asked_before_a_batch_found_no_session_replica_is_not_trusted(monkeypatch):
    """A review's race: the controller's yes, asked while a batch failed for want of a session replica, came back
    after the failure and was trusted for 5 s. Now it is asked again; and repeated failures ask at most once a
    second."""

    import ray

    from ortcapture.serving import tier as tier_mod
    from ortcapture.serving.batcher import Item

    asked = []

    def slow_yes(app):
        asked.append(app)
        time.sleep(0.2)  # the controller answers while the batch below fails
        return True

    monkeypatch.setattr(tier_mod, "session_running", slow_yes)

    t = _tier_whose_batches_raise([ray.exceptions.RayActorError()])
    batch = [Item(1, ({"X": np.zeros((1, 4), np.float32)}, None))]

    async def main():
        asking = asyncio.ensure_future(t.ready())
        await asyncio.sleep(0.05)
        await t._run_batch(batch)  # fails while the yes is being asked
        assert await asking is True
        assert await t.ready() is True and len(asked) == 2  # the earlier yes was not trusted: asked again
        for _ in range(5):  # failing again within the second: no more asks
            await t._run_batch(batch)
        assert await t.ready() is True and len(asked) == 2

    asyncio.run(main())


def test_a_stale_yes_is_answered_while_it_is_asked_again_in_the_background(monkeypatch):
    """When the trust in a yes ran out, every request of a tier replica waited for the controller's answer (a
    ``serve.status()``, ~40 ms of CPU on an H100 host, longer under load) — every READY_TRUST_S, on every tier
    replica: a stall that lands in the p99. Now the stale yes is answered at once and asked again in the background,
    one ask at a time; a no that comes back is the next request's answer."""
    from ortcapture.serving import tier as tier_mod

    asked, running = [], [True]

    def slow(app):
        asked.append(app)
        time.sleep(0.3)
        return running[0]

    monkeypatch.setattr(tier_mod, "session_running", slow)
    monkeypatch.setattr(tier_mod, "READY_TRUST_S", 0.5)
    t = _tier_whose_batches_raise([RuntimeError("unused")])

    async def main():
        assert await t.ready() is True and len(asked) == 1  # the first answer is waited for
        await asyncio.sleep(0.6)  # the yes is stale now
        running[0] = False
        t0 = time.monotonic()
        got = [await t.ready() for _ in range(10)]
        assert got == [True] * 10 and time.monotonic() - t0 < 0.1  # nobody waited for the controller
        await asyncio.sleep(0.05)
        assert len(asked) == 2  # one ask in the background for all ten
        await asyncio.sleep(0.4)  # its answer came back: no
        assert await t.ready() is False

    asyncio.run(main())


class _ArenaCore(_Core):
    """:class:`_Core` whose outputs are read as the staging reads them: into the current
    ``ortcapture.transfer.outputs_into`` arena when there is one (CUDA, a page-locked slot)."""

    def run_joined(self, feeds, rows, queued=(), isolate=True, prepare=None):
        from ortcapture._transfer.arena import current

        self.runs.append(list(rows))
        y = feeds["X"] * 2
        arena = current()
        a = arena.take(y.shape, y.dtype) if arena is not None else None
        if a is not None:
            a[:] = y
            y = a
        return {"outputs": {"y": y}, "axes": {"y": 0}}


class _Pinned:
    def close(self):
        pass


def test_outputs_of_a_lone_run_are_read_into_its_slot_and_never_copied_there_again():
    """The session replica reads a call's outputs straight into its page-locked batch slot (no host copy on the
    replay thread); a call of several runs, or runs merged across calls, are copied as before — every answer its
    own rows either way."""
    from ortcapture.serving.slots import SlotPool

    ms = _replica(0.0)
    ms.core = _ArenaCore(0.0)
    pool = SlotPool(in_bytes=1 << 14, out_bytes=1 << 14, count=4)
    rng = np.random.default_rng(3)

    def call(*row_counts):
        slot = asyncio.run(pool.acquire())
        xs = [rng.standard_normal((n, 5)).astype(np.float32) for n in row_counts]
        assert slot.place([[("X", [x], 0)] for x in xs])
        desc = slot.descriptor()
        feeds = ms._slot_reader.inputs(desc)
        ms._slot_reader._pins[desc["pool"]] = _Pinned()  # as SlotReader(pin=True) on CUDA
        return slot, xs, ([(f, [n]) for f, n in zip(feeds, row_counts)], [()] * len(xs), desc)

    def check(slot, xs, answers):
        assert len(answers) == len(xs)
        for x, a in zip(xs, answers):
            np.testing.assert_array_equal(slot.outputs(a["slot_outputs"])["y"], x * 2)

    try:
        lone = call(3)
        (got,) = ms._run_calls([lone[2]])
        check(lone[0], lone[1], got)
        assert ms._slot_reader.in_place == 1  # read into the slot: not copied
        two_runs = call(2, 4)
        (got,) = ms._run_calls([two_runs[2]])
        check(two_runs[0], two_runs[1], got)
        a, b = call(1), call(2)  # two calls' runs merged into one replay
        got_a, got_b = ms._run_calls([a[2], b[2]])
        assert ms.core.runs[-1] == [1, 2]
        check(a[0], a[1], got_a)
        check(b[0], b[1], got_b)
        assert ms._slot_reader.in_place == 1  # neither of those was read into a slot
    finally:
        ms._slot_reader._pins.clear()
        pool.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_merged_runs_joined_into_the_scratch_answer_each_call_its_own_rows(prefetch):
    """With the merge scratch (reused buffers) every call still gets its own rows back: the scratch is written for
    the next merged run only after the run before it returned — or, with the prefetch (the next merged run joined
    on a thread of its own while this one runs), into the scratch's other set of buffers."""
    from ortcapture.serving.merge import MergeScratch

    ms = _replica(0.01)
    ms._scratch = MergeScratch(pin=False, sets=2 if prefetch else 1)
    ms._prefetch = ThreadPoolExecutor(1, "merge") if prefetch else None

    async def main():
        async def call(k, n):
            x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 1000 * k  # values unique per call
            got = await ms.run_batch([({"X": x}, [n])], [[0]])
            np.testing.assert_array_equal(got[0]["outputs"]["y"], 2 * x)

        for _ in range(3):
            await asyncio.gather(*(call(k, n) for k, n in enumerate([1, 3, 4, 2, 6, 2, 1, 5, 3, 3])))

    asyncio.run(main())
    assert ms.merged_runs > 0 and ms._scratch.used > 0
    ms.core.session.run_on_replay_thread(lambda: None).result(timeout=10)
    if prefetch:
        ms._prefetch.shutdown()


def test_shutdown_closes_the_scratch_after_the_round_in_progress_and_a_closed_scratch_hands_out_nothing(fake_pinned):
    """__del__ (Serve's shutdown, maybe with a round still running on the replay thread) closes the batch slots and
    the merge scratch on the replay thread, after that round: the run's feed stays page-locked while it runs; a
    closed scratch pins nothing again."""
    from ortcapture._ort import sync
    from ortcapture.serving.merge import MergeScratch

    fake, _ = fake_pinned
    started, go, seen = threading.Event(), threading.Event(), {}

    class Slow(_Core):
        def run_joined(self, feeds, rows, queued=(), isolate=True, prepare=None):
            x = feeds["X"]
            started.set()
            go.wait(5)
            seen["pinned"] = sync.owner_pinned(x.ctypes.data, x.nbytes)
            return {"outputs": {"y": x * 2}, "axes": {"y": 0}}

    ms = _replica(0.0)
    ms.core = Slow(0.0)
    ms._scratch = MergeScratch(pin=True, max_rows=8)
    calls = [([({"X": np.full((2, 300), k, np.float32)}, [2])], [()], None) for k in range(2)]  # merged: scratch
    fut = ms.core.session.run_on_replay_thread(ms._run_calls, calls)
    assert started.wait(5)
    closing = threading.Thread(target=ms.__del__)
    closing.start()
    time.sleep(0.2)
    go.set()
    fut.result(5)
    closing.join(10)
    assert seen["pinned"] and ms._scratch.closed and not sync.HOST_RANGES
    registered = sum(c[0] == "register" for c in fake.calls)
    assert ms._scratch("X", (4, 300), np.float32) is None
    assert sum(c[0] == "register" for c in fake.calls) == registered


def test_a_merged_run_whose_join_fails_fails_its_calls_only():
    """An error joining one merged run (here the scratch raising) goes to that run's calls; the round goes on."""
    class Failing:
        def __call__(self, name, shape, dtype):
            if shape[0] == 5:
                raise MemoryError("no room for the scratch")
            return None

        def close(self):
            pass

    ms = _replica(0.0)
    ms._scratch = Failing()
    xs = [np.full((n, 3), k, np.float32) for k, n in enumerate((2, 3, 4, 4))]  # [2, 3] and [4, 4] merge
    calls = [([({"X": x}, [x.shape[0]])], [()], None) for x in xs]
    got = ms.core.session.run_on_replay_thread(ms._run_calls, calls).result(10)
    assert isinstance(got[0], MemoryError) and isinstance(got[1], MemoryError)
    for x, answer in zip(xs[2:], got[2:]):
        np.testing.assert_array_equal(answer[0]["outputs"]["y"], 2 * x)


def test_a_draining_tier_refuses_handle_calls_and_answers_its_own_requests():
    """A handle's ``infer`` was let in while the tier replica drained (HTTP got a 503, gRPC ``UNAVAILABLE``): calls
    that kept coming held the drain to its timeout, which then closed the batch slots and shared memory under them
    (found by review). Now the handle is refused at once, with a 503 and a retry hint; the routes' requests, let in
    before the drain, still run (``_infer``)."""
    from ortcapture.serving import tier as tier_mod

    ran = []

    async def _infer(feeds, device_outputs=None):
        ran.append(feeds)
        return {"outputs": {"Y": feeds["X"]}}

    t = tier_mod.ModelTier.__new__(tier_mod.ModelTier)
    t._refused = {"draining": 0}
    t._infer = _infer
    x = np.ones((1, 4), np.float32)
    t._draining = False
    assert asyncio.run(t.infer({"X": x}))["outputs"]["Y"] is x and len(ran) == 1
    t._draining = True
    res = asyncio.run(t.infer({"X": x}))
    assert res["status"] == 503 and res["error"] == "the server is shutting down" and res["retry_after"] > 0
    assert len(ran) == 1 and t._refused["draining"] == 1
    assert asyncio.run(t._infer({"X": x}))["outputs"]["Y"] is x  # the routes' path is not the handle's
