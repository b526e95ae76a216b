"""The batching tier's parts without Ray (issue 44, items 1 and 2): the adaptive batch queue, the session-free request
check, and a session replica's run of a joined batch (rows back per request, a failed run isolated)."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from ortcapture.serving.batcher import AdaptiveBatcher
from ortcapture.serving.requests import RequestCheck, RequestError, join, pack, split_feeds
from tests import tiny


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_lone_request_runs_at_once_though_the_wait_is_long():
    """--batch-wait-ms is the longest wait, not a fixed one: a lone item on an idle queue is not held."""
    seen = []

    async def run(items):
        seen.append(len(items))
        return [it.payload * 2 for it in items]

    async def main():
        b = AdaptiveBatcher(run, max_rows=8, max_wait_s=5.0, max_in_flight=1)
        t0 = time.perf_counter()
        got = await b.submit(1, 21)
        return got, time.perf_counter() - t0

    got, dt = _run(main())
    assert got == 42 and seen == [1]
    assert dt < 0.25, f"a lone request waited {dt * 1000:.0f} ms"


def test_simultaneous_items_share_batches_and_each_gets_its_own_result():
    """16 items submitted at once: fewer batches than items, none above max_rows, each its own result, in order."""
    batches = []

    async def run(items):
        batches.append([it.rows for it in items])
        await asyncio.sleep(0.01)  # the device works: the next batch forms meanwhile
        return [("answer", it.payload) for it in items]

    async def main():
        b = AdaptiveBatcher(run, max_rows=8, max_wait_s=0.5, max_in_flight=2)
        rows = [1 + k % 3 for k in range(16)]
        return rows, await asyncio.gather(*(b.submit(r, k) for k, r in enumerate(rows)))

    rows, got = _run(main())
    assert got == [("answer", k) for k in range(16)]
    assert len(batches) < 16 and max(sum(b) for b in batches) <= 8
    assert sorted(r for b in batches for r in b) == sorted(rows)


def test_a_batch_waits_while_items_keep_arriving_but_not_past_the_longest_wait():
    batches = []

    async def run(items):
        batches.append(len(items))
        return [None] * len(items)

    async def main():
        b = AdaptiveBatcher(run, max_rows=64, max_wait_s=0.05, max_in_flight=1, gap_s=0.02)

        async def trickle():
            tasks = []
            for k in range(30):  # one item every 5 ms for 150 ms: more than the 50 ms longest wait
                tasks.append(asyncio.ensure_future(b.submit(1, k)))
                await asyncio.sleep(0.005)
            await asyncio.gather(*tasks)

        await trickle()

    _run(main())
    assert sum(batches) == 30
    assert max(batches) > 2, batches  # it waited for arrivals
    assert len(batches) >= 2, batches  # and not past 50 ms


def test_a_failing_run_fails_its_own_batch_only_and_a_cancelled_item_leaves():
    async def run(items):
        if any(it.payload == "boom" for it in items):
            raise RuntimeError("boom")
        return [it.payload for it in items]

    async def main():
        b = AdaptiveBatcher(run, max_rows=1, max_wait_s=0.0, max_in_flight=1)
        bad = asyncio.ensure_future(b.submit(1, "boom"))
        gone = asyncio.ensure_future(b.submit(1, "gone"))
        good = asyncio.ensure_future(b.submit(1, "ok"))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(RuntimeError, match="boom"):
            await bad
        return await good

    assert _run(main()) == "ok"
    with pytest.raises(ValueError):
        AdaptiveBatcher(lambda items: items, max_rows=0, max_wait_s=0.0)


def test_request_check_without_a_session():
    check = RequestCheck([("X", np.float32, (-1, 4)), ("T", np.float32, ())], {"X": 0}, max_rows=4)
    assert check.rows({"X": np.zeros((3, 4), np.float32), "T": np.ones((), np.float32)}) == 3
    for bad, words in (({"X": np.zeros((5, 4), np.float32), "T": np.ones((), np.float32)}, "more than the 4"),
                       ({"X": np.zeros((1, 4), np.float64), "T": np.ones((), np.float32)}, "float64"),
                       ({"X": np.zeros((1, 5), np.float32), "T": np.ones((), np.float32)}, "fixed at 4"),
                       ({"X": np.zeros((1, 4), np.float32)}, "missing")):
        with pytest.raises(RequestError, match=words):
            check.rows(bad)
    reqs = [{"X": np.full((n, 4), k, np.float32)} for k, n in enumerate((3, 1, 2, 2))]
    chunks = pack([(k, r["X"].shape[0]) for k, r in enumerate(reqs)], 4)
    assert sorted(sum(stop for _, _, stop in c) for c in chunks) == [4, 4]
    for c in chunks:
        feeds = join(reqs, c, ["X"], {"X": 0})
        for (k, _, _), part in zip(c, split_feeds(feeds, [stop for _, _, stop in c], {"X": 0})):
            np.testing.assert_array_equal(part["X"], reqs[k]["X"])


def test_a_session_replica_runs_a_joined_batch_once_and_isolates_a_failed_one(tmp_path):
    """ReplicaCore.run_joined (what ModelSession.run_batch does per run): one run for the whole batch, every row
    back (the tier slices), no check again; a run that raises is run one request at a time."""
    from ortcapture.serving.config import ServeOptions
    from ortcapture.serving.replica import ReplicaCore

    model = tmp_path / "m.onnx"
    model.write_bytes(tiny.bucket_model())
    core = ReplicaCore(ServeOptions(str(model), provider="cpu").checked(), "cpu")
    reqs = [{"X": np.full((n, 4), 0.1 * (k + 1), np.float32)} for k, n in enumerate((1, 3, 2))]
    feeds = join(reqs, [(k, 0, r["X"].shape[0]) for k, r in enumerate(reqs)], ["X"], {"X": 0})
    answer = core.run_joined(feeds, [1, 3, 2])
    assert answer["axes"] == {"scores": 0, "probs": 0, "feat": 1}
    want = tiny.bucket_reference(feeds["X"])
    for name, w in want.items():
        np.testing.assert_allclose(answer["outputs"][name], w, rtol=1e-4, atol=1e-5)
    rep = core.report()
    assert rep["batches"] == 1 and rep["requests"] == 3 and rep["batch_size_histogram"] == {"6": 1}

    calls = []
    real = core.session.run

    def flaky(names, feeds, *a):  # the joined run fails; each request alone runs, but the 3-row one fails
        calls.append(feeds["X"].shape[0])
        if feeds["X"].shape[0] in (6, 3):
            raise RuntimeError("an index out of range")
        return real(names, feeds, *a)

    core.session.run = flaky
    answer = core.run_joined(feeds, [1, 3, 2])
    assert calls == [6, 1, 3, 2]
    got = answer["answers"]
    assert [("outputs" in a, a.get("status")) for a in got] == [(True, None), (False, 400), (True, None)]
    np.testing.assert_allclose(got[2]["outputs"]["feat"], tiny.bucket_reference(reqs[2]["X"])["feat"], rtol=1e-4,
                               atol=1e-5)
    assert core.report()["isolation_runs"] == 3
