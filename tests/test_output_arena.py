"""``ortcapture.transfer.outputs_into``: host outputs read straight into memory the caller chose (a serving batch
slot), one DMA each and no host copy; the slot reader skips the copy for outputs already in place and never lets a
copy overwrite an output it has still to write. The staging's pinned branch runs on CPU OrtValues posing as CUDA
buffers (``tests.test_staging.fake_pinned``); the CUDA run of the same path is in ``test_pinned_host``."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import onnxruntime as ort
import pytest

from ortcapture._transfer import staging as _staging
from ortcapture.transfer import OutputArena, outputs_into, tap_device_outputs
from ortcapture._transfer.arena import current, current_tap, suspend_tap
from tests.test_staging import fake_pinned  # noqa: F401 - the fixture


def test_an_arena_hands_out_aligned_arrays_in_order_and_refuses_what_does_not_fit():
    buf = bytearray(10000)
    arena = OutputArena(buf, 100, 9000, align=1024)
    a = arena.take((3, 4), np.float32)
    b = arena.take((2,), np.int64)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    assert a.ctypes.data - base == 100 and b.ctypes.data - base == 100 + 1024
    assert a.flags.c_contiguous and a.flags.writeable and a.dtype == np.float32 and a.shape == (3, 4)
    assert arena.offset == 100 + 2048 and arena.taken == 2
    assert arena.take((10000,), np.uint8) is None and arena.offset == 100 + 2048  # no room: nothing moves
    a[:] = 7
    assert np.frombuffer(buf, np.float32, 12, 100).tolist() == [7.0] * 12  # the buffer's own memory


@pytest.mark.parametrize("bad, exc", [
    (dict(buffer=b"read-only bytes"), ValueError),
    (dict(buffer=np.zeros((4, 4))[:, ::2]), ValueError),
    (dict(buffer=3), TypeError),
    (dict(buffer=np.zeros(4, "M8[s]")), TypeError),
    (dict(buffer=OutputArena(bytearray(64)), start=8), ValueError),
    (dict(buffer=OutputArena(bytearray(64)), align=4096), ValueError),
    (dict(buffer=bytearray(10), start=1.7), TypeError),
    (dict(buffer=bytearray(10), stop="8"), TypeError),
    (dict(buffer=bytearray(10), start=5, stop=11), ValueError),
    (dict(buffer=bytearray(10), start=6, stop=5), ValueError),
    (dict(buffer=bytearray(10), start=-1), ValueError),
    (dict(buffer=bytearray(10), align=3), ValueError),
])
def test_a_bad_buffer_or_range_is_refused_before_the_block(bad, exc):
    with pytest.raises(exc):
        outputs_into(**bad)  # at the call, not when the block is entered
    assert current() is None


def test_the_block_lets_go_of_the_buffer_but_its_arrays_keep_it_while_they_live():
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=8192)
    try:
        with outputs_into(shm.buf) as arena:
            pass
        assert arena.take((2,), np.float32) is None  # let go: hands nothing out any more
        shm.close()  # nothing of the block holds the buffer now
        shm = shared_memory.SharedMemory(name=shm.name)
        with outputs_into(shm.buf) as arena:
            a = arena.take((4,), np.float32)
        a[:] = 1.5
        with pytest.raises(BufferError):  # the array still reads that memory: not unmapped under it
            shm.close()
        assert a.tolist() == [1.5] * 4
        del a, arena
        shm.close()
    finally:
        shm.unlink()


def test_a_block_is_entered_once_at_a_time():
    block = outputs_into(bytearray(4096))
    with block:
        with pytest.raises(RuntimeError):
            with block:
                pass
    with block:  # again after it ended
        assert current() is not None


def test_blocks_nest_and_belong_to_their_thread():
    outer, inner = bytearray(4096), bytearray(4096)
    seen = []
    with outputs_into(outer) as a:
        with outputs_into(inner) as b:
            assert current() is b
            t = threading.Thread(target=lambda: seen.append(current()))
            t.start()
            t.join()
        assert current() is a
    assert current() is None and seen == [None]


def test_a_worker_thread_that_copied_the_context_does_not_use_the_block():
    """``asyncio.to_thread`` runs its function in a copy of the caller's context: two such workers would share one
    arena (not thread-safe) if the block followed the context alone."""
    async def main():
        with outputs_into(bytearray(4096)) as arena:
            here = current()
            there = await asyncio.gather(*(asyncio.to_thread(current) for _ in range(2)))
        return arena, here, there

    arena, here, there = asyncio.run(main())
    assert here is arena and there == [None, None]


def test_a_coroutines_block_does_not_catch_another_coroutines_outputs(fake_pinned):
    """Blocks belong to the asyncio task that entered them: a coroutine awaiting inside its block does not hand its
    buffer to another coroutine on the same thread (that coroutine's answer would change when the buffer is
    reused)."""
    fake, st = _staging_with_output(fake_pinned)
    ring = np.zeros(4 * 4096, np.uint8)

    async def holder(entered, done):
        with outputs_into(ring) as arena:
            entered.set()
            await done.wait()
        return arena.taken

    async def other(entered, done):
        await entered.wait()
        (z,) = st.read_new(["z"])
        done.set()
        return z

    async def main():
        entered, done = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(holder(entered, done), other(entered, done))

    taken, z = asyncio.run(main())
    assert taken == 0 and not np.shares_memory(z, ring)
    np.testing.assert_array_equal(z, np.arange(16).reshape(8, 2) * -1)


def _staging_with_output(fake_pinned, rows=8):
    fake, as_cuda = fake_pinned
    y = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.arange(rows * 6, dtype=np.float32).reshape(rows, 6)))
    z = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.arange(rows * 2, dtype=np.int64).reshape(rows, 2) * -1))
    return fake, _staging.HostStaging({}, {"y": y, "z": z}, pinned=True)


def test_outputs_read_inside_the_block_land_in_the_buffer_with_one_dma_each(fake_pinned):
    fake, st = _staging_with_output(fake_pinned)
    buf = np.zeros(3 * 4096, np.uint8)
    with outputs_into(buf) as arena:
        fake.calls.clear()
        y3 = st.read_rows("y", 0, 3)  # a bucket's rows
        y, z = st.read_new(["y", "z"])  # CapturedGraph.run's whole outputs
    assert [c[0] for c in fake.calls].count("copy") == 3  # one DMA per output, nothing copied on the host
    np.testing.assert_array_equal(y3, np.arange(18, dtype=np.float32).reshape(3, 6))
    np.testing.assert_array_equal(y, np.arange(48, dtype=np.float32).reshape(8, 6))
    np.testing.assert_array_equal(z, np.arange(16).reshape(8, 2) * -1)
    offsets = [a.ctypes.data - buf.ctypes.data for a in (y3, y, z)]
    assert offsets == [0, 4096, 8192] and arena.taken == 3
    outside = st.read_new(["y"])[0]  # after the block: the staging's own pool again
    assert not np.shares_memory(outside, buf)
    np.testing.assert_array_equal(outside, y)


def test_an_output_the_buffer_cannot_hold_goes_to_the_pool_and_later_ones_still_fit(fake_pinned):
    fake, st = _staging_with_output(fake_pinned)
    buf = np.zeros(256, np.uint8)  # y (192 bytes) fits, z (128 bytes) after it does not, one row of y (24) does
    with outputs_into(buf, align=64) as arena:
        y, z = st.read_new(["y", "z"])
        y1 = st.read_rows("y", 0, 1)
    assert np.shares_memory(y, buf) and not np.shares_memory(z, buf)
    assert np.shares_memory(y1, buf) and arena.taken == 2
    np.testing.assert_array_equal(z, np.arange(16).reshape(8, 2) * -1)
    np.testing.assert_array_equal(y1, np.arange(6, dtype=np.float32).reshape(1, 6))
    np.testing.assert_array_equal(y, np.arange(48, dtype=np.float32).reshape(8, 6))


# -- the serving batch slot ---------------------------------------------------------------------------------------

def _slot_pair():
    from ortcapture.serving.slots import SlotPool, SlotReader

    pool, reader = SlotPool(in_bytes=8192, out_bytes=4 * 4096, count=1), SlotReader()
    slot = asyncio.run(pool.acquire())
    assert slot.place([[("x", [np.ones((2, 3), np.float32)], 0)]])
    desc = slot.descriptor()
    reader.inputs(desc)  # maps the pool
    return pool, reader, slot, desc


class _Pinned:
    def close(self):
        pass


def test_the_slot_reader_skips_outputs_already_in_place_and_copies_the_rest():
    pool, reader, slot, desc = _slot_pair()
    try:
        assert reader.output_arena(desc) is None  # not page-locked: a DMA there gains nothing, copy as before
        reader._pins[desc["pool"]] = _Pinned()  # as SlotReader(pin=True) on CUDA
        arena = reader.output_arena(desc)
        y = np.arange(10, dtype=np.float32).reshape(2, 5)
        with outputs_into(arena):
            a = current().take(y.shape, y.dtype)
        a[:] = y
        z = np.array([[1, 2], [3, 4]], np.int64)  # not read there: copied
        where = reader.write_outputs(desc, [{"y": a, "z": z}])
        assert reader.in_place == 1
        got = slot.outputs(where[0])
        np.testing.assert_array_equal(got["y"], y)
        np.testing.assert_array_equal(got["z"], z)
    finally:
        del a, arena
        reader.close()
        pool.close()


def test_an_output_read_into_another_outputs_place_is_kept_before_that_place_is_written():
    """A run whose first output was not read into the slot (say it did not fit then) while the second was: the
    second sits where the first must go. Copying the first there would overwrite the second before it is written
    to its own place: a silent wrong answer. It is taken aside first."""
    pool, reader, slot, desc = _slot_pair()
    try:
        reader._pins[desc["pool"]] = _Pinned()
        arena = reader.output_arena(desc)
        first = np.full((2, 5), 3.0, np.float32)  # elsewhere
        second = arena.take((2, 5), np.float32)  # at the room's start: the first output's place
        second[:] = np.arange(10, dtype=np.float32).reshape(2, 5)
        where = reader.write_outputs(desc, [{"a": first, "b": second}])
        got = slot.outputs(where[0])
        np.testing.assert_array_equal(got["a"], 3.0)
        np.testing.assert_array_equal(got["b"], np.arange(10, dtype=np.float32).reshape(2, 5))
        assert reader.in_place == 0
    finally:
        del second, arena
        reader.close()
        pool.close()


def test_outputs_read_by_a_staging_into_a_slot_are_not_copied_there_again(fake_pinned):
    """The whole way a served batch's outputs take on CUDA: the staging reads them inside the slot reader's arena,
    and the slot reader finds them in place."""
    fake, st = _staging_with_output(fake_pinned)
    pool, reader, slot, desc = _slot_pair()
    try:
        reader._pins[desc["pool"]] = _Pinned()
        arena = reader.output_arena(desc)
        with outputs_into(arena):
            y, z = st.read_new(["y", "z"])
            y2 = st.read_rows("y", 0, 2)
        where = reader.write_outputs(desc, [{"y": y, "z": z}])
        assert reader.in_place == 2
        got = slot.outputs(where[0])
        np.testing.assert_array_equal(got["y"], np.arange(48, dtype=np.float32).reshape(8, 6))
        np.testing.assert_array_equal(got["z"], np.arange(16).reshape(8, 2) * -1)
        np.testing.assert_array_equal(y2, np.arange(12, dtype=np.float32).reshape(2, 6))
    finally:
        del y, z, y2, arena
        reader.close()
        pool.close()


def test_register_off_leaves_the_batch_slots_unpinned(monkeypatch):
    from ortcapture._ort import sync
    from ortcapture.transfer import pinning_in_place

    monkeypatch.setattr(sync, "REGISTER", False)
    assert pinning_in_place() is False
    monkeypatch.setattr(sync, "REGISTER", True)
    assert pinning_in_place() is True


def test_a_task_created_inside_a_block_does_not_use_it(fake_pinned):
    """asyncio.create_task copies the context (and runs on the same thread): the child's outputs are its own."""
    fake, st = _staging_with_output(fake_pinned)
    ring = np.zeros(4 * 4096, np.uint8)

    async def child():
        return st.read_new(["z"])[0]

    async def main():
        with outputs_into(ring) as arena:
            z = await asyncio.create_task(child())
            y = st.read_new(["y"])[0]  # the block's own task still uses it
        return arena.taken, z, y

    taken, z, y = asyncio.run(main())
    assert taken == 1 and not np.shares_memory(z, ring) and np.shares_memory(y, ring)


def test_a_block_that_ends_out_of_order_is_never_current_again():
    arena = OutputArena(bytearray(8192))  # the caller's: usable after its blocks

    def gen():
        with outputs_into(arena):
            yield

    g = gen()
    next(g)  # block A entered
    with outputs_into(bytearray(4096)) as inner:  # block B
        assert current() is inner
        g.close()  # A ends inside B
    assert current() is None  # B's end would bring A back: it ended, so it is not used


def test_an_async_generators_block_closed_by_the_event_loop_ends_quietly():
    errors, arenas = [], []

    async def agen():
        with outputs_into(bytearray(4096)) as arena:
            arenas.append(arena)
            yield 1
            yield 2

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx.get("exception")))
        await agen().__anext__()  # left suspended in its block: asyncio.run's shutdown_asyncgens closes it

    asyncio.run(main())
    assert errors == [] and arenas[0].take((1,), np.uint8) is None  # ended, and its buffer let go


@pytest.mark.parametrize("kind", ["outputs_into", "tap_device_outputs"])
def test_a_middle_block_ending_first_leaves_the_innermost_open_block_current(kind):
    """Blocks D > E > F with E ending first (generators): F stays current (not D, whose buffer its owner may
    rewrite, or whose tap would copy into memory its owner may have freed), then D once F ends, then nothing once D
    ends — for ``outputs_into``'s blocks and ``tap_device_outputs``' alike."""
    if kind == "outputs_into":
        block, now, values = outputs_into, current, [OutputArena(bytearray(8192)), bytearray(4096), bytearray(4096)]
    else:
        block, now, values = tap_device_outputs, current_tap, [lambda *_: None, lambda *_: None, lambda *_: None]
    d, e, f = (block(v) for v in values)
    d_value = d.__enter__()
    e.__enter__()
    f_value = f.__enter__()
    e.__exit__(None, None, None)
    assert now() is f_value
    f.__exit__(None, None, None)
    assert now() is d_value
    d.__exit__(None, None, None)
    assert now() is None


# -- tap_device_outputs: the graph's device buffers offered before each read ---------------------------------------

def _device_bytes(ptr: int, shape, dtype) -> np.ndarray:
    """What ``ptr`` holds (the fake staging's "device" buffers are CPU memory)."""
    import ctypes

    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    return np.frombuffer(bytes((ctypes.c_char * n).from_address(ptr)), dt).reshape(shape)


def test_the_tap_sees_each_read_output_s_device_buffer_and_the_rows_read_before_the_read(fake_pinned):
    fake, st = _staging_with_output(fake_pinned)
    seen = []

    def copy(name, ptr, shape, dtype, stream):
        seen.append((name, tuple(shape), np.dtype(dtype), stream is st._stream))
        fake.calls.append(("tap", name))
        np.testing.assert_array_equal(_device_bytes(ptr, shape, dtype), st.outputs[name].numpy()[:shape[0]])

    with tap_device_outputs(copy) as got:
        assert got is copy and current_tap() is copy
        fake.calls.clear()
        y3 = st.read_rows("y", 0, 3)
        y, z = st.read_new(["y", "z"])
    assert current_tap() is None
    assert seen == [("y", (3, 6), np.dtype(np.float32), True), ("y", (8, 6), np.dtype(np.float32), True),
                    ("z", (8, 2), np.dtype(np.int64), True)]
    kinds = [c[0] for c in fake.calls]
    assert kinds.index("tap") < kinds.index("copy")  # offered before the read's own copy is queued
    np.testing.assert_array_equal(y3, np.arange(18, dtype=np.float32).reshape(3, 6))
    np.testing.assert_array_equal(z, np.arange(16).reshape(8, 2) * -1)
    seen.clear()
    st.read_new(["y"])  # after the block: no tap
    assert seen == []


def test_a_tap_that_raises_fails_the_read_and_a_pageable_staging_never_calls_it(fake_pinned):
    fake, st = _staging_with_output(fake_pinned)

    def broken(*_):
        raise RuntimeError("the caller's copy failed")

    with tap_device_outputs(broken), pytest.raises(RuntimeError, match="caller's copy"):
        st.read_new(["y"])
    pageable = _staging.HostStaging({}, {"y": ort.OrtValue.ortvalue_from_numpy(np.ones((2, 3), np.float32))},
                                    pinned=False)
    with tap_device_outputs(broken):
        np.testing.assert_array_equal(pageable.read_new(["y"])[0], np.ones((2, 3), np.float32))


def test_taps_nest_belong_to_their_thread_and_need_a_callable():
    def outer(*_):
        pass

    def inner(*_):
        pass

    seen = []
    with tap_device_outputs(outer):
        with tap_device_outputs(inner):
            assert current_tap() is inner
            t = threading.Thread(target=lambda: seen.append(current_tap()))
            t.start()
            t.join()
        assert current_tap() is outer
    assert current_tap() is None and seen == [None]
    with tap_device_outputs(outer):
        with suspend_tap():  # the bucket runner's captures and verification reads
            assert current_tap() is None
        assert current_tap() is outer
    with pytest.raises(TypeError, match="callable"):
        tap_device_outputs(3)
    block = tap_device_outputs(outer)
    with block:
        with pytest.raises(RuntimeError, match="entered already"):
            block.__enter__()


def test_a_tap_that_ends_out_of_order_is_never_current_again():
    """As ``outputs_into``'s blocks: a generator's tap that ends inside the caller's never leaves an ended tap
    current (it would copy into memory its owner may have freed); a middle tap ending first: see
    test_a_middle_block_ending_first_leaves_the_innermost_open_block_current."""
    def x(*_):
        pass

    def y(*_):
        pass

    def gen():
        with tap_device_outputs(y):
            yield

    outer = tap_device_outputs(x)
    outer.__enter__()
    g = gen()
    next(g)  # y entered inside x
    assert current_tap() is y
    outer.__exit__(None, None, None)  # x ends while y is still open
    assert current_tap() is y
    g.close()  # y ends: x ended before, so nothing is current
    assert current_tap() is None
