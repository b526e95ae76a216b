"""Batch slots (ortcapture.serving.slots): the tier's node-local shared memory for the hop to a session replica —
joined in place, read back as views, every offset checked, by value where they do not fit or the object is not on
this machine. No Ray, no device."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
from multiprocessing import shared_memory
import os
import secrets
import threading
import time

import numpy as np
import pytest

from ortcapture.serving.slots import SlotMissing, SlotPool, SlotReader
from tests.test_staging import fake_pinned  # noqa: F401 - the fixture


def _pool(count=2, in_bytes=1 << 16, out_bytes=1 << 16):
    pool = SlotPool(in_bytes, out_bytes, count)
    return pool


def test_a_batch_joined_into_a_slot_reads_back_equal_and_outputs_come_back():
    pool, reader = _pool(), SlotReader()
    try:
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((1, 3, 4)).astype(np.float32)
        scale = np.array([2.0], np.float32)  # an input without the batched dim: used as it is
        slot = asyncio.run(pool.acquire())
        assert slot.place([[("x", [a, b], 0), ("s", [scale], None)]])
        desc = slot.descriptor()
        (feeds,) = reader.inputs(desc)
        np.testing.assert_array_equal(feeds["x"], np.concatenate([a, b]))
        np.testing.assert_array_equal(feeds["s"], scale)
        assert feeds["x"].ctypes.data % 4096 == 0  # every array page-aligned
        y = feeds["x"] * feeds["s"]
        where = reader.write_outputs(desc, [{"y": y}])
        got = slot.outputs(where[0])
        np.testing.assert_array_equal(got["y"], y)
        assert not np.shares_memory(got["y"], y)  # written into the slot, not a reference
        del feeds, got  # views of the slot hold its mapping: gone before it is closed
    finally:
        reader.close()
        pool.close()


def test_too_big_for_the_slot_goes_by_value():
    pool, reader = _pool(in_bytes=4096, out_bytes=4096), SlotReader()
    try:
        slot = asyncio.run(pool.acquire())
        big = np.zeros((2, 1024), np.float32)  # 8 KiB of input: does not fit
        assert not slot.place([[("x", [big], 0)]])
        assert slot.place([[("x", [np.ones((1, 16), np.float32)], 0)]])
        assert reader.write_outputs(slot.descriptor(), [{"y": big}]) is None  # outputs by value
    finally:
        reader.close()
        pool.close()


def test_a_pool_not_on_this_machine_or_not_a_pool_is_missing():
    reader = SlotReader()
    desc = {"pool": "ortcapture-0-" + "0" * 32, "size": 8192, "runs": [], "out": (0, 4096)}
    with pytest.raises(SlotMissing):
        reader.inputs(desc)
    for name in ("../etc/passwd", "psm_other", 7):
        with pytest.raises(SlotMissing):
            reader.inputs({**desc, "pool": name})
    pool = _pool()
    try:
        with pytest.raises(SlotMissing, match="bytes"):  # a descriptor claiming a bigger pool than the object
            reader.inputs({"pool": pool.name, "size": pool.size + 1, "runs": [], "out": (0, 4096)})
    finally:
        pool.close()
        reader.close()


def test_offsets_outside_the_pool_are_refused_before_any_view():
    pool, reader = _pool(), SlotReader()
    try:
        slot = asyncio.run(pool.acquire())
        assert slot.place([[("x", [np.ones((1, 4), np.float32)], 0)]])
        desc = slot.descriptor()
        bad = {**desc, "runs": [[("x", pool.size - 8, (1, 4), "<f4")]]}
        with pytest.raises(ValueError, match="outside"):
            reader.inputs(bad)
        with pytest.raises(ValueError, match="outside"):
            reader.write_outputs({**desc, "out": (pool.size - 4096, 8192)}, [{"y": np.ones(4, np.float32)}])
        with pytest.raises(ValueError, match="outside"):  # the tier checks the session's answer too
            slot.outputs({"y": (0, (4,), "<f4")})  # the inputs' room, not the output room
    finally:
        reader.close()
        pool.close()


def test_slots_are_handed_out_once_until_released_and_close_unlinks():
    pool = _pool(count=2)

    async def go():
        s1, s2 = await pool.acquire(), await pool.acquire()
        assert s1.index != s2.index and s1.offset != s2.offset
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # both slots have a batch in flight
        pool.release(s1)
        assert (await asyncio.wait_for(waiter, 1)) is s1

    asyncio.run(go())
    path = os.path.join("/dev/shm", pool.name)
    assert os.path.exists(path) and (os.stat(path).st_mode & 0o077) == 0  # the owner's only
    pool.close()
    assert not os.path.exists(path)
    pool.close()  # twice: no error


def _child(name, size, q):
    reader = SlotReader()
    try:
        (feeds,) = reader.inputs({"pool": name, "size": size, "runs": [[("x", 0, (2, 2), "<f4")]], "out": (0, 1)})
        q.put(feeds["x"].tolist())
    finally:
        reader.close()


def test_another_process_on_this_machine_reads_the_slot_and_leaves_it_linked():
    pool = _pool()
    try:
        slot = asyncio.run(pool.acquire())
        assert slot.place([[("x", [np.arange(4, dtype=np.float32).reshape(2, 2)], 0)]])
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(pool.name, pool.size, q))
        p.start()
        got = q.get(timeout=60)
        p.join(60)
        assert got == [[0.0, 1.0], [2.0, 3.0]] and p.exitcode == 0
        assert os.path.exists(os.path.join("/dev/shm", pool.name))  # the reader's exit did not unlink it
    finally:
        pool.close()


def test_answers_read_from_a_slot_never_share_its_memory():
    """The tier's answers outlive the slot (it takes the next batch before Ray sends them): each request's rows are
    copies, also where a request's rows are a contiguous part of the slot (a whole batch of one request, or rows on
    the first axis). On the H100 the views made 135 of 2,000 answers wrong at 32 clients."""
    from ortcapture.serving.requests import answers_of

    pool, reader = _pool(), SlotReader()
    try:
        slot = asyncio.run(pool.acquire())
        assert slot.place([[("x", [np.ones((3, 2), np.float32)], 0)]])
        y = np.arange(6, dtype=np.float32).reshape(3, 2)
        (where,) = reader.write_outputs(slot.descriptor(), [{"y": y}])
        chunks = [[(0, 0, 1), (1, 0, 2)]]  # request 0: row 0; request 1: rows 1-2 (both contiguous in the slot)
        got = answers_of(2, chunks, [{"slot_outputs": where, "axes": {"y": 0}}], slot)
        slot_bytes = np.frombuffer(pool.buf, np.uint8)
        for k, rows in ((0, y[:1]), (1, y[1:])):
            np.testing.assert_array_equal(got[k]["outputs"]["y"], rows)
            assert not np.shares_memory(got[k]["outputs"]["y"], slot_bytes)
        slot.place([[("x", [np.zeros((3, 2), np.float32)], 0)]])
        reader.write_outputs(slot.descriptor(), [{"y": -y}])  # the next batch in the same slot
        np.testing.assert_array_equal(got[1]["outputs"]["y"], y[1:])
        del slot_bytes
    finally:
        reader.close()
        pool.close()


def test_runs_queued_at_a_session_replica_merge_into_fuller_runs_and_split_back():
    """ortcapture.serving.merge: runs in arrival order joined while they fit max_rows; each run's answer cut back
    (its own rows, or its own requests' answers when the merged run failed); a model with an unbatched input keeps
    its runs apart."""
    from ortcapture.serving.merge import merge_runs, mergeable, split_answer

    rng = np.random.default_rng(1)
    runs = [({"x": rng.standard_normal((n, 3)).astype(np.float32)}, rows)
            for n, rows in ((3, [1, 2]), (4, [4]), (2, [2]), (1, [1]))]
    merged = merge_runs(runs, 8)
    assert [m for m, _, _ in merged] == [[0, 1], [2, 3]]
    assert [r for _, _, r in merged] == [[1, 2, 4], [2, 1]]
    np.testing.assert_array_equal(merged[0][1]["x"], np.concatenate([runs[0][0]["x"], runs[1][0]["x"]]))
    assert merged[1][1]["x"].shape == (3, 3)
    assert [m for m, _, _ in merge_runs(runs, 8, merge=False)] == [[0], [1], [2], [3]]
    assert merge_runs(runs[:1], 8)[0][1]["x"] is runs[0][0]["x"]  # alone: its own feeds, no copy
    y = merged[0][1]["x"] * 2
    parts = split_answer({"outputs": {"y": y}, "axes": {"y": 0}}, [[1, 2], [4]])
    np.testing.assert_array_equal(parts[0]["outputs"]["y"], runs[0][0]["x"] * 2)
    np.testing.assert_array_equal(parts[1]["outputs"]["y"], runs[1][0]["x"] * 2)
    failed = split_answer({"answers": ["a0", "a1", "b0"]}, [[1, 2], [4]])
    assert failed == [{"answers": ["a0", "a1"]}, {"answers": ["b0"]}]
    assert mergeable(["x", "y"], {"x": 0, "y": 0}) and not mergeable(["x", "s"], {"x": 0})


def test_dtypes_a_descriptor_cannot_name_go_by_value():
    """A descriptor names a dtype by its string: ml_dtypes' bfloat16 would read back as raw |V2 bytes."""
    from ortcapture.serving.slots import slot_dtype

    assert slot_dtype(np.float32) and slot_dtype(np.bool_) and slot_dtype(np.int64) and slot_dtype(np.float16)
    assert not slot_dtype(np.dtype([("a", "<f4")]))
    pool, reader = _pool(), SlotReader()
    try:
        slot = asyncio.run(pool.acquire())
        try:
            import ml_dtypes
        except ImportError:
            ml_dtypes = None
        if ml_dtypes is not None:
            bf16 = np.ones((1, 4), ml_dtypes.bfloat16)
            assert not slot_dtype(bf16.dtype)
            assert not slot.place([[("x", [bf16], 0)]])  # the batch goes by value
            assert slot.place([[("x", [np.ones((1, 4), np.float32)], 0)]])
            assert reader.write_outputs(slot.descriptor(), [{"y": bf16}]) is None  # outputs by value
    finally:
        reader.close()
        pool.close()


def test_a_dev_shm_without_room_refuses_the_pool_at_once(monkeypatch):
    """tmpfs only sets the size at create: the pool reserves its pages, so a full /dev/shm is an OSError here (the
    tier then sends by value), not a SIGBUS at the first write."""
    import errno

    from ortcapture.serving import slots as slots_mod
    from ortcapture.serving.protocol import ModelSpec, TensorSpec
    from ortcapture.serving.slots import batch_slots

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = set(os.listdir("/dev/shm"))
    monkeypatch.setattr(slots_mod.os, "posix_fallocate", full)
    with pytest.raises(OSError):
        SlotPool(1 << 16, 1 << 16, 2)
    spec = ModelSpec(name="m", inputs=(TensorSpec("x", np.dtype(np.float32), (-1, 4)),),
                     outputs=(TensorSpec("y", np.dtype(np.float32), (-1, 4)),), batch_axes={"x": 0}, max_rows=8)
    assert batch_slots(spec, 8, 2, True) is None
    assert set(os.listdir("/dev/shm")) == before  # nothing left behind


def test_a_retired_slot_is_never_handed_out_again():
    """A batch whose outcome is unknown (its call failed or was cancelled) retires its slot: the session replica
    may still write into it. That turn goes by value (None) from then on."""
    pool = _pool(count=2)

    async def go():
        s1, s2 = await pool.acquire(), await pool.acquire()
        pool.retire(s1)
        pool.release(s2)
        got = [await pool.acquire() for _ in range(6)]
        for g in got:
            if g is not None:
                pool.release(g)
        return s1, got

    try:
        s1, got = asyncio.run(go())
        assert s1 not in got and None in got and pool.retired == 1
    finally:
        pool.close()


def test_a_pool_whose_process_is_gone_is_swept_when_a_pool_is_made():
    """A tier replica killed with SIGKILL cannot unlink its pool: the next pool made on the machine unlinks every
    ``ortcapture-<pid>-<hex>`` object of a pid that no longer runs — never a live process's, nor another name."""
    import secrets
    import subprocess
    import sys

    from ortcapture.serving import slots

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    dead = int(child.stdout)  # exited: its pid runs nothing now (unless reused at once: then it is kept, safely)
    names = {"dead": f"ortcapture-{dead}-{secrets.token_hex(16)}", "live": f"ortcapture-{os.getpid()}-"
             f"{secrets.token_hex(16)}", "other": f"ortcapture-{dead}-notapool", "foreign": f"x-{dead}-"
             f"{secrets.token_hex(16)}"}
    for n in names.values():
        with open(os.path.join(slots.SHM_DIR, n), "wb") as f:
            f.write(b"\0" * 64)
    try:
        pool = _pool()
        pool.close()
        left = set(os.listdir(slots.SHM_DIR))
        assert names["dead"] not in left or slots._alive(dead)
        assert {names["live"], names["other"], names["foreign"]} <= left
        assert pool.name not in left  # its own pool: unlinked by close()
    finally:
        for n in names.values():
            p = os.path.join(slots.SHM_DIR, n)
            if os.path.exists(p):
                os.unlink(p)


def test_a_gone_tier_replicas_pool_is_unpinned_and_unmapped_by_the_session_replica():
    """A long-lived session replica maps (and on CUDA page-locks) each tier replica's pool; one whose tier replica is
    gone (a restarted replica makes a new pool) is dropped the next time a pool is mapped — unpinned at once, and
    unmapped once no view of it is left. A live tier replica's pool is kept."""
    import secrets
    import subprocess
    import sys

    from ortcapture.serving import slots

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    dead = int(child.stdout)
    if slots._alive(dead):
        pytest.skip("the pid was reused at once")
    gone_name = f"ortcapture-{dead}-{secrets.token_hex(16)}"
    gone = shared_memory.SharedMemory(name=gone_name, create=True, size=8192)
    reader = SlotReader()
    closed = []

    class _Pin:
        def close(self):
            closed.append(True)

    live = None
    try:
        desc = {"pool": gone_name, "size": 8192, "runs": [[("x", 0, (2, 4), "<f4")]], "out": (4096, 4096)}
        (feeds,) = reader.inputs(desc)  # a batch of the gone tier replica, still held
        reader._pins[gone_name] = _Pin()
        live = _pool()  # a new tier replica's pool (making it unlinks the gone one's: the mapping stays)
        live_slot = asyncio.run(live.acquire())
        assert live_slot.place([[("x", [np.ones((1, 4), np.float32)], 0)]])
        reader.inputs(live_slot.descriptor())
        assert reader.new_pools
        assert reader.drop_stale() == [] and closed == [True]  # unpinned; still mapped: a view is alive
        assert gone_name in reader._maps and gone_name not in reader._pins and reader.new_pools
        assert float(feeds["x"].sum()) == 0.0  # the view still reads its memory (unmapped under it: a segfault)
        with pytest.raises(SlotMissing):  # a batch of it arriving now goes by value
            reader.inputs(desc)
        del feeds
        assert reader.drop_stale() == [gone_name] and reader.dropped == 1
        assert set(reader._maps) == {live.name} and not reader.new_pools  # the live tier's pool stays
        assert reader.drop_stale() == []
    finally:
        reader.close()
        if live is not None:
            live.close()
        gone.close()
        try:
            gone.unlink()
        except FileNotFoundError:  # swept already: its creator's pid is gone
            pass


def _dead_pid() -> int:
    import subprocess
    import sys

    from ortcapture.serving import slots

    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                             text=True, check=True).stdout)
    if slots._alive(pid):
        pytest.skip("the pid was reused at once")
    return pid


def test_a_pool_kept_once_is_dropped_later_and_a_failed_unpin_never_fails_the_runs(monkeypatch):
    """A pool whose object is still linked when the sweep looks (its tier replica draining in a rolling update) is
    looked at again: every DROP_EVERY_S, and at once while one waits. Unpinning that raises (a sticky CUDA error)
    keeps the pool for later instead of failing the round of runs that called it."""
    import secrets

    from ortcapture.serving import slots

    name = f"ortcapture-{_dead_pid()}-{secrets.token_hex(16)}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=8192)
    reader = SlotReader()
    fails = [RuntimeError("cudaHostUnregister: cudaErrorIllegalAddress")]

    class _Pin:
        def close(self):
            if fails:
                raise fails.pop()

    try:
        desc = {"pool": name, "size": 8192, "runs": [[("x", 0, (2, 4), "<f4")]], "out": (4096, 4096)}
        reader.inputs(desc)
        reader._pins[name] = _Pin()
        assert reader.drop_due() and reader.drop_stale() == []  # still linked: kept
        assert not reader.drop_due()
        shm.unlink()  # now its object is gone too
        monkeypatch.setattr(slots, "DROP_EVERY_S", 0.0)
        reader._next_drop = 0.0
        assert reader.drop_due()  # the time came
        assert reader.drop_stale() == [] and "cudaErrorIllegalAddress" in reader.pin_error  # did not raise
        assert reader.new_pools and name in reader._maps and name in reader._pins  # kept, tried again
        assert reader.drop_stale() == [name] and not reader._pins and not reader._maps
    finally:
        reader.close()
        shm.close()
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


def test_views_of_a_slot_on_either_side_keep_its_mapping():
    """Every numpy view of a slot holds an export of the mapping: closing the pool's SharedMemory while one lives
    raises BufferError instead of unmapping the memory under it (reading it then would be a segfault)."""
    pool, reader = _pool(count=1), SlotReader()
    try:
        slot = asyncio.run(pool.acquire())
        assert slot.place([[("x", [np.arange(8, dtype=np.float32).reshape(2, 4)], 0)]])
        desc = slot.descriptor()
        (feeds,) = reader.inputs(desc)
        where = reader.write_outputs(desc, [{"y": feeds["x"] * 2}])
        got = slot.outputs(where[0])["y"]
        with pytest.raises(BufferError):
            pool._shm.close()
        assert got.tolist() == [[0, 2, 4, 6], [8, 10, 12, 14]]
        shm = reader._maps[desc["pool"]]
        with pytest.raises(BufferError):
            shm.close()
        assert feeds["x"].sum() == 28.0
        with pytest.raises(SlotMissing):  # half closed: a batch now goes by value
            reader.inputs(desc)
    finally:
        del feeds, got
        reader.close()
        pool.close()


def test_a_failed_unpin_really_is_tried_again_and_the_pool_stays_mapped_until_then(fake_pinned, monkeypatch):
    """The real PinnedHostMemory (fake CUDA): an unregistration that raises leaves the pin open, so drop_stale's
    next round calls cudaHostUnregister again, and the pool is unmapped only after it succeeded."""
    from ortcapture._ort import cudart

    unregistered, fails = [], [RuntimeError("cudaHostUnregister failed")]

    def host_unregister(ptr):
        unregistered.append(ptr)
        if fails:
            raise fails.pop()
    monkeypatch.setattr(cudart, "host_unregister", host_unregister)
    name = f"ortcapture-{_dead_pid()}-{secrets.token_hex(16)}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=8192)
    reader = SlotReader(pin=True)
    try:
        reader.inputs({"pool": name, "size": 8192, "runs": [[("x", 0, (2, 4), "<f4")]], "out": (4096, 4096)})
        assert name in reader._pins
        shm.unlink()
        assert reader.drop_stale() == [] and "Unregister failed" in reader.pin_error  # kept, mapped
        assert reader.drop_stale() == [name] and len(unregistered) == 2  # tried again, then unmapped
    finally:
        reader.close()
        shm.close()


def test_one_part_failing_to_close_leaves_the_others_closed():
    """SlotReader.close() goes on past a pin that fails to close (keeping it and its mapping), and the session
    replica's shutdown closes its other parts (the CUDA IPC handles) before raising the first error."""
    pytest.importorskip("ray", reason="the session replica imports Ray (ortcapture[serve])")
    from ortcapture.serving.session_replica import ModelSession

    closed = []

    class _Pin:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def close(self):
            if self.fail:
                raise RuntimeError("cudaHostUnregister failed")
            closed.append(self.name)

    class _Ipc:
        def close(self):
            closed.append("ipc")

    reader = SlotReader()
    reader._pins = {"a": _Pin("a", fail=True), "b": _Pin("b")}
    reader.close()
    assert closed == ["b"] and list(reader._pins) == ["a"] and "a:" in reader.pin_error

    class _Core:
        def close(self):
            raise RuntimeError("core failed")

    ms = ModelSession.__new__(ModelSession)
    ms.core, ms._slot_reader, ms._ipc = _Core(), SlotReader(), _Ipc()
    with pytest.raises(RuntimeError, match="core failed"):
        ms.__del__()
    assert closed == ["b", "ipc"]
    ms.core = ms._ipc = None  # its own __del__ at collection: nothing left to close


def test_an_idle_session_replica_drops_gone_pools_on_its_replay_thread():
    """With no batch arriving (a tier replica scaled down), the once-a-second report still runs drop_stale when
    it is due, on the replay thread (where no run reads from a pool)."""
    pytest.importorskip("ray", reason="the session replica imports Ray (ortcapture[serve])")
    import concurrent.futures
    import threading

    from ortcapture.serving.session_replica import ModelSession

    replay = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="replay")
    ran = []

    class _Reader:
        due = True

        def drop_due(self):
            return self.due

        def drop_stale(self):
            ran.append(threading.current_thread().name)
            self.due = False
            return []

        def close(self):
            pass

    class _Stats:
        class report:  # noqa: N801 - a handle's method
            @staticmethod
            async def remote(*args):
                return None

    class _Session:
        def run_on_replay_thread(self, fn, *args):
            return replay.submit(fn, *args)

    class _Core:
        session = _Session()

        def close(self):
            pass

    class _Metrics:
        def graphs(self, core):
            pass

    ms = ModelSession.__new__(ModelSession)
    ms._stats, ms._metrics, ms.core, ms._ipc, ms._on_replay_thread = _Stats(), _Metrics(), _Core(), None, True
    ms._slot_reader, ms._report, ms.replica_id = _Reader(), dict, "r0"
    try:
        asyncio.run(ms._push_report())
        asyncio.run(ms._push_report())  # not due any more: not run again
    finally:
        replay.shutdown()
    assert len(ran) == 1 and ran[0].startswith("replay")


def test_merged_rows_are_joined_into_one_reused_buffer_per_input():
    """MergeScratch: a merged run's host rows land in the scratch (equal to the concatenation), the next merged run
    reuses the same memory (grown when larger), a run alone keeps its own feeds, and close() drops the buffers."""
    from ortcapture.serving.merge import MergeScratch, iter_merged_runs

    def merge_runs(runs, max_rows, into):
        return list(iter_merged_runs(runs, max_rows, into=into))

    rng = np.random.default_rng(2)
    scratch = MergeScratch(pin=False)

    def runs(sizes):
        return [({"x": rng.standard_normal((n, 3)).astype(np.float32)}, [n]) for n in sizes]

    first = runs([3, 4, 5])
    merged = merge_runs(first, 8, into=scratch)  # [3, 4] merged, [5] alone
    joined = merged[0][1]["x"]
    np.testing.assert_array_equal(joined, np.concatenate([first[0][0]["x"], first[1][0]["x"]]))
    assert merged[1][1]["x"] is first[2][0]["x"] and scratch.used == 1  # alone: its own feeds
    address = joined.ctypes.data
    assert address % 4096 == 0  # its own mapping: no page shared with other memory (page-locking takes pages)
    second = runs([1, 1])
    joined = merge_runs(second, 8, into=scratch)[0][1]["x"]
    assert joined.ctypes.data == address and joined.shape == (2, 3)  # the same memory again
    np.testing.assert_array_equal(joined, np.concatenate([r[0]["x"] for r in second]))
    bigger = [({"x": rng.standard_normal((n, 5)).astype(np.float32)}, [n]) for n in (4, 4)]
    np.testing.assert_array_equal(merge_runs(bigger, 8, into=scratch)[0][1]["x"],
                                  np.concatenate([r[0]["x"] for r in bigger]))  # grown
    scratch.close()
    assert scratch.used == 3 and not scratch._bufs


def test_prefetched_joins_the_next_merged_run_while_the_current_one_is_used_into_the_other_buffers():
    """merge.prefetched over iter_merged_runs with MergeScratch(sets=2): the same merged runs in the same order; the
    join of run k + 1 happens while the caller holds run k (on another thread), into the other set of buffers, so
    run k's rows are intact until the caller asks for run k + 1; run k + 2 reuses run k's buffers."""
    from concurrent.futures import ThreadPoolExecutor

    from ortcapture.serving.merge import MergeScratch, iter_merged_runs, prefetched

    rng = np.random.default_rng(4)
    runs = [({"x": rng.standard_normal((2, 3)).astype(np.float32)}, [2]) for _ in range(8)]  # 4 merged pairs
    plain = list(iter_merged_runs(runs, 4, into=None))
    joined_by = {}

    class Watching(MergeScratch):  # records which thread joined each merged run
        def __call__(self, name, shape, dtype):
            joined_by[len(joined_by)] = threading.current_thread().name
            return super().__call__(name, shape, dtype)

    scratch = Watching(pin=False, sets=2)
    with ThreadPoolExecutor(1, "merge-test") as ex:
        got, addresses = [], []
        for k, (members, feeds, rows) in enumerate(prefetched(iter_merged_runs(runs, 4, into=scratch), ex)):
            deadline = time.monotonic() + 5
            while k + 1 < len(plain) and len(joined_by) < k + 2 and time.monotonic() < deadline:
                time.sleep(0.001)  # the next one is joined while this one is held
            assert len(joined_by) == min(k + 2, len(plain)), (k, joined_by)
            np.testing.assert_array_equal(feeds["x"], plain[k][1]["x"])  # intact: the next went elsewhere
            got.append((members, feeds["x"].copy(), rows))
            addresses.append(feeds["x"].ctypes.data)
    assert [(m, r) for m, _, r in got] == [(m, r) for m, _, r in plain]
    assert set(joined_by.values()) == {"merge-test_0"}
    assert addresses[0] != addresses[1] and addresses[0] == addresses[2] and addresses[1] == addresses[3]
    scratch.close()
    assert not scratch._bufs


def test_prefetched_raises_at_its_item_and_closing_early_waits_for_the_one_being_taken():
    from concurrent.futures import ThreadPoolExecutor

    from ortcapture.serving.merge import prefetched

    def items():
        yield 1
        yield 2
        raise KeyError("the third")

    with ThreadPoolExecutor(1) as ex:
        it = prefetched(items(), ex)
        assert next(it) == 1 and next(it) == 2
        with pytest.raises(KeyError, match="the third"):
            next(it)
        taking, done = threading.Event(), []

        def slow():
            yield "a"
            taking.set()
            time.sleep(0.3)
            done.append(True)
            yield "b"

        it = prefetched(slow(), ex)
        assert next(it) == "a"
        assert taking.wait(5)
        it.close()  # returns only once "b" has been taken: nothing is joined after the caller goes on
        assert done == [True]
        assert list(prefetched(iter(()), ex)) == []
        it = prefetched(iter(range(4)), ex)
        assert next(it) == 0
    ex.shutdown()  # a replica closing mid-round: the round goes on, the next items taken on the caller's thread
    assert list(it) == [1, 2, 3]


def test_merged_rows_in_a_pinned_scratch_go_to_the_graph_with_one_dma(fake_pinned):
    """On CUDA the scratch is page-locked: the merged run's rows are one DMA from it into the graph's input buffer
    (owner_dmas), not a threaded host copy into the staging first; a driver that refuses turns the scratch off."""
    import onnxruntime as ort

    from ortcapture._ort import cudart
    from ortcapture._ort import sync as _sync
    from ortcapture._transfer import staging as _staging
    from ortcapture.serving.merge import MergeScratch, iter_merged_runs

    def merge_runs(runs, max_rows, into):
        return list(iter_merged_runs(runs, max_rows, into=into))

    fake, as_cuda = fake_pinned
    x = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros((8, 1000), np.float32)))
    st = _staging.HostStaging({"x": x}, {}, pinned=True)
    scratch = MergeScratch(pin=True)
    rng = np.random.default_rng(3)
    runs = [({"x": rng.standard_normal((n, 1000)).astype(np.float32)}, [n]) for n in (2, 3)]
    try:
        joined = merge_runs(runs, 8, into=scratch)[0][1]["x"]
        assert scratch.error is None and _sync.owner_pinned(joined.ctypes.data, joined.nbytes)
        fake.calls.clear()
        st.upload_rows("x", joined, (0,), 0.0, 0, None)
        assert [(c[2], c[3]) for c in fake.calls if c[0] == "copy"] == [(joined.ctypes.data, joined.nbytes)]
        assert st.owner_dmas == 1
        got = x.numpy()
        np.testing.assert_array_equal(got[:5], np.concatenate([r[0]["x"] for r in runs]))
        assert (got[5:] == 0).all()
    finally:
        scratch.close()
    assert _sync.HOST_RANGES == []  # unpinned at close
    refusing = MergeScratch(pin=True)

    def refuse(*args, **kwargs):
        raise RuntimeError("cudaHostRegister: cudaErrorHostMemoryAlreadyRegistered")
    original = cudart.host_register
    cudart.host_register = refuse
    try:
        joined = merge_runs(runs, 8, into=refusing)[0][1]["x"]
    finally:
        cudart.host_register = original
    np.testing.assert_array_equal(joined, np.concatenate([r[0]["x"] for r in runs]))  # a new array, as before
    assert "AlreadyRegistered" in refusing.error and refusing.used == 0 and merge_runs(runs, 8, into=refusing)


def test_host_copy_is_public_and_equal_to_copyto_for_every_size_and_layout():
    """ortcapture.transfer.host_copy (the staging threads' split copy, used to join merged rows): equal to np.copyto
    for small and split sizes, non-contiguous sources, and a destination of another dtype (cast in this thread);
    a shape mismatch raises before any thread starts."""
    from ortcapture.transfer import host_copy

    rng = np.random.default_rng(5)
    for shape in ((3,), (2, 700, 1000)):  # under and over the split size
        src = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(host_copy(src), src)
        dst = np.empty(shape, np.float32)
        assert host_copy(src, dst) is dst
        np.testing.assert_array_equal(dst, src)
    big = rng.standard_normal((2, 700, 1000)).astype(np.float32)
    np.testing.assert_array_equal(host_copy(big[:, ::2]), big[:, ::2])
    as64 = np.empty(big.shape, np.float64)
    np.testing.assert_array_equal(host_copy(big, as64), big.astype(np.float64))
    with pytest.raises(ValueError):
        host_copy(big, np.empty((3, 3), np.float32))
    with pytest.raises(ValueError):  # no broadcasting: one row into three is refused
        host_copy(np.ones((1, 4), np.float32), np.zeros((3, 4), np.float32))
    from ortcapture.serving.requests import join_into

    with pytest.raises(ValueError):  # joined rows that do not fill the destination
        join_into([np.ones((1, 4), np.float32)] * 2, 0, np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError):  # or whose other dims differ from it
        join_into([np.ones((1, 5), np.float32)] * 3, 0, np.zeros((3, 4), np.float32))
    a = np.arange(4 << 20, dtype=np.float32)
    want = a[:-(1 << 18)].copy()
    host_copy(a[:-(1 << 18)], a[1 << 18:], threads=4)  # overlapping: as np.copyto, right
    np.testing.assert_array_equal(a[1 << 18:], want)


def test_big_pieces_are_placed_by_the_staging_threads_equal_to_a_concatenation():
    """Slot.place splits copies over 1 MiB over the staging threads (host_copy): along the batched axis 0, one
    piece alone, and another axis (numpy's concatenate) all read back equal."""
    pool, reader = _pool(count=1, in_bytes=40 << 20), SlotReader()
    try:
        rng = np.random.default_rng(4)
        a, b = (rng.standard_normal((n, 700, 1000)).astype(np.float32) for n in (2, 1))  # 5.6 and 2.8 MB
        c = rng.standard_normal((3, 700, 1000)).astype(np.float32)
        slot = asyncio.run(pool.acquire())
        assert slot.place([[("x", [a, b], 0)], [("x", [c], 0)], [("x", [a[:, :300], a[:, 300:]], 1)]])
        feeds = reader.inputs(slot.descriptor())
        np.testing.assert_array_equal(feeds[0]["x"], np.concatenate([a, b]))
        np.testing.assert_array_equal(feeds[1]["x"], c)
        np.testing.assert_array_equal(feeds[2]["x"], a)
        del feeds
    finally:
        reader.close()
        pool.close()
