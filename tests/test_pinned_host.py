"""Host memory its owner page-locks for feeds (``ortcapture.transfer.pin_host_memory``, issue 44): a numpy feed
inside it goes to the graph's device buffer with one DMA from where it is, never through the staging's host copy;
bad buffers are refused before any CUDA call; the serving batch slots' reader pins the pools it maps. The logic runs
on CPU with cudart's calls faked (``tests.test_staging.fake_pinned``); the real DMA runs in the CUDA-marked test."""
from __future__ import annotations

import gc
import os
import threading
import time
from multiprocessing import shared_memory

import numpy as np
import onnxruntime as ort
import pytest

from ortcapture._ort import cudart
from ortcapture._ort import sync as _sync
from ortcapture._ort.sync import CUDA_GATE
from ortcapture._transfer import staging as _staging
from ortcapture.transfer import PinnedHostMemory, pin_host_memory
from tests.test_staging import cuda, fake_pinned  # noqa: F401 - fixtures

SHAPE = (4, 600, 500)  # 4.8 MB, 1.2 MB a row: a chunked staging fill when it goes through the staging


@pytest.fixture
def shm():
    mem = shared_memory.SharedMemory(create=True, size=int(np.prod(SHAPE)) * 4 + 8192)
    yield mem
    try:
        mem.close()
    finally:
        mem.unlink()


def _copies(fake):
    return [c for c in fake.calls if c[0] == "copy"]


def test_a_feed_inside_pinned_memory_is_one_dma_from_there(fake_pinned, shm, rng, monkeypatch):  # noqa: F811
    fake, as_cuda = fake_pinned
    monkeypatch.setattr(_sync, "_POOL", [])
    x = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros(SHAPE, np.float32)))
    st = _staging.HostStaging({"x": x}, {}, pinned=True)
    view = np.ndarray(SHAPE, np.float32, buffer=shm.buf, offset=4096)  # a slot's input, 4 KiB in
    view[...] = rng.random(SHAPE, dtype=np.float32)
    fake.calls.clear()
    with pin_host_memory(shm.buf) as pin:
        assert isinstance(pin, PinnedHostMemory) and not pin.closed and pin.nbytes == shm.size
        assert fake.calls == [("register", pin.ptr, shm.size, "portable")]
        assert _sync.HOST_RANGES == [(pin.ptr, pin.ptr + shm.size)]
        fake.calls.clear()
        st.upload({"x": view})
        assert [(c[2], c[3]) for c in _copies(fake)] == [(view.ctypes.data, view.nbytes)]  # no host copy first
        np.testing.assert_array_equal(x.numpy(), view)
        assert st.owner_dmas == 1
        # a request's rows (a prefix of the buffer): one DMA of those rows, the rest set on the device
        rows = np.ndarray((1, *SHAPE[1:]), np.float32, buffer=shm.buf, offset=4096)
        rows[...] = 7.0
        fake.calls.clear()
        st.upload_rows("x", rows, (0,), 0.0, 0, None)
        assert [(c[2], c[3]) for c in _copies(fake)] == [(rows.ctypes.data, rows.nbytes)]
        assert [c[0] for c in fake.calls if c[0] == "memset"] == ["memset"]
        got = x.numpy()
        assert (got[0] == 7.0).all() and (got[1:] == 0).all() and st.owner_dmas == 2
        # an array outside the pinned memory goes through the staging as before (chunks)
        other = rng.random(SHAPE, dtype=np.float32)
        fake.calls.clear()
        st.upload({"x": other})
        assert len(_copies(fake)) > 1 and st.owner_dmas == 2
        np.testing.assert_array_equal(x.numpy(), other)
        # ORTCAPTURE_REGISTER=0 turns the use off
        monkeypatch.setattr(_sync, "REGISTER", False)
        fake.calls.clear()
        st.upload({"x": view})
        st.upload_rows("x", rows, (0,), 0.0, 0, None)
        assert st.owner_dmas == 2 and len(_copies(fake)) > 2
        monkeypatch.setattr(_sync, "REGISTER", True)
    assert pin.closed and _sync.HOST_RANGES == [] and ("unregister", pin.ptr) in fake.calls
    pin.close()  # idempotent
    fake.calls.clear()
    st.upload({"x": view})  # closed: staged again
    assert len(_copies(fake)) > 1 and st.owner_dmas == 2
    np.testing.assert_array_equal(x.numpy(), view)


def test_pin_host_memory_refuses_bad_buffers_before_any_cuda_call(fake_pinned):  # noqa: F811
    fake, _ = fake_pinned
    fake.calls.clear()
    with pytest.raises(TypeError):
        pin_host_memory(12345)
    with pytest.raises(ValueError, match="C-contiguous"):
        pin_host_memory(np.arange(10.0)[::2])
    with pytest.raises(ValueError, match="empty"):
        pin_host_memory(bytearray())
    assert fake.calls == [] and _sync.HOST_RANGES == []
    buf = np.zeros((4, 1024), np.float32)
    with pin_host_memory(buf):
        with pytest.raises(ValueError, match="overlaps"):
            pin_host_memory(buf[1:])
        assert len(_sync.HOST_RANGES) == 1
    fake.refuse.add(buf.ctypes.data)  # the driver says no: nothing is left registered, the buffer is free again
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pin_host_memory(buf)
    assert _sync.HOST_RANGES == []
    buf.resize((2, 1024), refcheck=True)  # no export of it is left
    grow = bytearray(64)
    with pin_host_memory(grow):
        with pytest.raises(BufferError):  # the buffer cannot be resized (or unmapped) while it is pinned
            grow.extend(b"x")
    grow.extend(b"x")


def test_read_only_memory_is_registered_read_only(fake_pinned):  # noqa: F811
    fake, _ = fake_pinned
    data = bytes(8192)  # a PROT_READ mapping alike: the driver refuses it without cudaHostRegisterReadOnly
    fake.calls.clear()
    with pin_host_memory(data) as pin:
        assert fake.calls == [("register", pin.ptr, 8192, "portable", "read_only")]


def test_a_pin_dropped_without_close_stops_being_used_and_is_undone_later(fake_pinned, shm):  # noqa: F811
    """Collected without close(): its range goes at once (a later mapping at the same address is never taken for
    page-locked), and its cudaHostUnregister is queued for the next safe point with the memoryview, which keeps the
    memory mapped until then."""
    fake, _ = fake_pinned
    pin = pin_host_memory(shm.buf)
    lo = pin.ptr
    del pin
    gc.collect()
    assert _sync.HOST_RANGES == []
    queued = [h for k, h in fake.freed if k == "registered"]
    assert [h[0] for h in queued] == [lo]
    with pytest.raises(BufferError):  # still mapped: the queued unregistration holds the view
        shm.close()
    fake.freed.clear()  # what free_pending does after cudaHostUnregister: the view goes
    del queued
    gc.collect()
    shm.close()  # unmapped now


def test_a_pin_dropped_while_the_lock_is_held_is_undone_by_the_holder(fake_pinned):  # noqa: F811
    """A finalizer may run on the thread that is rebuilding the range list (a collection in the middle of it): it
    never waits for the lock and never writes the list itself then; the holder undoes it before it lets go, and
    the range cannot come back with the holder's own write."""
    from ortcapture._transfer import pinned_host

    fake, _ = fake_pinned
    keep = pin_host_memory(bytearray(4096))
    pin = pin_host_memory(bytearray(8192))
    lo = pin.ptr
    pinned_host._LOCK.acquire()  # this thread is the holder, mid-update
    try:
        read = list(_sync.HOST_RANGES)  # what the holder read before the collection
        del pin
        gc.collect()  # its finalizer runs here, on the holder's thread
        assert any(a == lo for a, _ in _sync.HOST_RANGES)  # deferred, not lost
        _sync.HOST_RANGES = read  # the holder's own write, from what it read
    finally:
        pinned_host._release()
    assert [a for a, _ in _sync.HOST_RANGES] == [keep.ptr]
    assert [h[0] for k, h in fake.freed if k == "registered"] == [lo]
    # from another thread while this one holds the lock: undone when it lets go
    holder = [pin_host_memory(bytearray(8192))]
    lo2 = holder[0].ptr
    pinned_host._LOCK.acquire()
    try:
        t = threading.Thread(target=lambda: (holder.clear(), gc.collect()))
        t.start()
        t.join(5)
        assert any(a == lo2 for a, _ in _sync.HOST_RANGES)
    finally:
        pinned_host._release()
    assert [a for a, _ in _sync.HOST_RANGES] == [keep.ptr]
    keep.close()
    assert _sync.HOST_RANGES == [] and not pinned_host._DROPPED


def test_concurrent_closes_undo_the_pinning_once(fake_pinned, monkeypatch):  # noqa: F811
    fake, _ = fake_pinned
    slow = fake.host_unregister

    def unregister(ptr):
        time.sleep(0.2)
        slow(ptr)
    monkeypatch.setattr(cudart, "host_unregister", unregister)
    pin = pin_host_memory(bytearray(8192))
    errors = []

    def close():
        try:
            pin.close()
        except BaseException as exc:  # noqa: BLE001 - the test's finding
            errors.append(exc)
    threads = [threading.Thread(target=close) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert errors == [] and sum(c[0] == "unregister" for c in fake.calls) == 1 and pin.closed


def test_pinning_takes_the_capture_gate_before_its_own_lock(fake_pinned):  # noqa: F811
    """T1 inside the gate pins; T2 pins while T3's capture is pending (new readers wait for it); T3 waits for T1.
    With the module's lock taken before the gate, T2 would hold it and wait at the gate: all three stuck."""
    hold, done = threading.Event(), []

    def t1():
        with CUDA_GATE.shared:
            hold.wait(5)
            time.sleep(0.3)  # T2 is in pin_host_memory now, waiting at the gate
            pin_host_memory(bytearray(8192)).close()
            done.append("t1")

    def t2():
        pin_host_memory(bytearray(8192)).close()
        done.append("t2")

    def t3():
        with CUDA_GATE.exclusive:
            done.append("t3")
    a = threading.Thread(target=t1, daemon=True)
    a.start()
    time.sleep(0.1)
    c = threading.Thread(target=t3, daemon=True)
    c.start()
    time.sleep(0.1)  # the capture is pending
    b = threading.Thread(target=t2, daemon=True)
    b.start()
    hold.set()
    for t in (a, b, c):
        t.join(5)
    assert sorted(done) == ["t1", "t2", "t3"], f"deadlock: only {done} finished"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_has_no_pinned_ranges_and_closes_without_cuda(fake_pinned):  # noqa: F811
    fake, _ = fake_pinned
    pin = pin_host_memory(bytearray(8192))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        ok = _sync.HOST_RANGES == []
        fake.calls.clear()
        pin.close()
        ok = ok and not any(c[0] == "unregister" for c in fake.calls)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    got = os.read(r, 1)
    os.close(r)
    pin.close()
    assert got == b"1", "the child inherited the ranges or called cudaHostUnregister"


def test_without_cuda_pinning_raises_a_clear_error_and_keeps_nothing(monkeypatch):
    from ortcapture._ort import compat

    monkeypatch.setattr(compat, "cudart", lambda: None)
    with pytest.raises(RuntimeError, match="cuda-python"):
        pin_host_memory(bytearray(64))
    assert _sync.HOST_RANGES == []


def test_slot_reader_pins_each_pool_once_and_unpins_before_unmapping(fake_pinned):  # noqa: F811
    from ortcapture.serving.slots import SlotPool, SlotReader

    fake, _ = fake_pinned
    pool = SlotPool(1 << 20, 1 << 16, 2)
    try:
        slot = pool.slots[0]
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        assert slot.place([[("x", [x[:1], x[1:]], 0)]])
        reader = SlotReader(pin=True)
        fake.calls.clear()
        (feeds,), (again,) = reader.inputs(slot.descriptor()), reader.inputs(slot.descriptor())
        np.testing.assert_array_equal(feeds["x"], x)
        assert reader.pinned == 1 and reader.pin_error is None
        assert [c[0] for c in fake.calls] == ["register"] and fake.calls[0][2] == pool.size
        lo, hi = _sync.HOST_RANGES[0]
        assert lo <= feeds["x"].ctypes.data and feeds["x"].ctypes.data + feeds["x"].nbytes <= hi
        del feeds, again
        reader.close()
        assert reader.pinned == 0 and _sync.HOST_RANGES == [] and fake.calls[-1][0] == "unregister"
    finally:
        pool.close()


def test_slot_reader_reads_unpinned_when_the_driver_refuses(monkeypatch):
    from ortcapture._ort import compat
    from ortcapture.serving.slots import SlotPool, SlotReader

    monkeypatch.setattr(compat, "cudart", lambda: None)  # no cuda-python: pinning fails, reading does not
    pool = SlotPool(1 << 16, 1 << 16, 1)
    try:
        slot = pool.slots[0]
        x = np.ones((2, 3), np.int64)
        assert slot.place([[("x", [x], None)]])
        reader = SlotReader(pin=True)
        (feeds,) = reader.inputs(slot.descriptor())
        np.testing.assert_array_equal(feeds["x"], x)
        assert reader.pinned == 0 and "cuda-python" in reader.pin_error
        del feeds
        reader.close()
    finally:
        pool.close()


@pytest.mark.cuda
def test_cuda_feeds_from_pinned_shared_memory_are_right(cuda, shm, rng):  # noqa: F811
    """On the GPU: a captured graph fed a view of page-locked shared memory (as the serving batch slots are) answers
    right with the feed sent by one DMA (``owner_dmas``); a request's rows likewise (``upload_rows``, a bucket's
    padded region); unpinned, the same feed is staged as before and still right."""
    pytest.importorskip("cuda.bindings", reason="cuda-python")
    from tests import tiny

    sess = cuda.session(tiny.affine_model(SHAPE))  # Y = 2 X + 1
    view = np.ndarray(SHAPE, np.float32, buffer=shm.buf, offset=4096)
    view[...] = rng.random(SHAPE, dtype=np.float32)
    with sess.capture({"X": np.zeros(SHAPE, np.float32)}, verify=False) as g:
        with pin_host_memory(shm.buf):
            for k in range(3):
                view[0, 0, 0] = k
                np.testing.assert_array_equal(g.run({"X": view})[0], view * 2 + 1)
            assert g._staging is not None and g._staging.kind == "pinned" and g._staging.owner_dmas == 3
        view[...] = rng.random(SHAPE, dtype=np.float32)
        np.testing.assert_array_equal(g.run({"X": view})[0], view * 2 + 1)
        assert g._staging.owner_dmas == 3
    x = ort.OrtValue.ortvalue_from_numpy(np.full(SHAPE, 5, np.float32), "cuda", 0)
    st = _staging.HostStaging({"x": x}, {}, pinned=True)
    rows = np.ndarray((2, *SHAPE[1:]), np.float32, buffer=shm.buf, offset=4096)
    with pin_host_memory(shm.buf):
        st.upload_rows("x", rows, (0,), 0.0, 0, None)
    got = x.numpy()
    np.testing.assert_array_equal(got[:2], rows)
    assert (got[2:] == 0).all() and st.owner_dmas == 1


@pytest.mark.cuda
def test_cuda_outputs_read_into_pinned_shared_memory_are_right(cuda, shm, rng):  # noqa: F811
    """On the GPU: ``outputs_into`` a page-locked shared memory buffer (the serving batch slot's output room) —
    ``CapturedGraph.run``'s outputs and a bucket request's rows land there, one DMA each, equal to the CPU EP."""
    pytest.importorskip("cuda.bindings", reason="cuda-python")
    from ortcapture.transfer import outputs_into
    from tests import tiny

    sess = cuda.session(tiny.affine_model(SHAPE))  # Y = 2 X + 1
    x = rng.random(SHAPE, dtype=np.float32)
    with sess.capture({"X": np.zeros(SHAPE, np.float32)}, verify=False) as g, pin_host_memory(shm.buf):
        g.run({"X": x})  # the staging is made
        with outputs_into(shm.buf, 4096) as arena:
            (y,) = g.run({"X": x})
        assert np.shares_memory(y, np.frombuffer(shm.buf, np.uint8)) and arena.taken == 1
        np.testing.assert_array_equal(y, x * 2 + 1)
        del y, arena
    model = tiny.bucket_model()
    answer = tiny.bucket_cpu_answer()
    bsess = cuda.session(model, buckets={"batch": [2, 4]})
    names = [o.name for o in bsess.get_outputs()]
    with pin_host_memory(shm.buf):
        for n in (3, 4, 1):  # padded rows (read_rows), the whole bucket (read_new), padded again
            xb = rng.standard_normal((n, 4)).astype(np.float32)
            bsess.run(None, {"X": xb})  # each bucket's graph captured outside the block
            with outputs_into(shm.buf) as arena:
                got = dict(zip(names, bsess.run(None, {"X": xb})))
            want = answer(xb)
            for k in names:  # ORT's default use_tf32=1: MatMul rounds to ~1e-3 (another row would differ by ~1)
                np.testing.assert_allclose(got[k], want[k], rtol=1e-2, atol=1e-3)
            assert np.shares_memory(got["scores"], np.frombuffer(shm.buf, np.uint8)), n  # a prefix: read there
            assert arena.taken >= 2
            del got, arena


@pytest.mark.cuda
def test_cuda_tapped_outputs_are_copied_device_to_device_from_the_graph_s_buffers(cuda, rng):  # noqa: F811
    """On the GPU: inside ``tap_device_outputs`` each output read is offered with the graph's own device buffer and
    the rows read; a device-to-device copy queued on the read's stream from there holds the same values as the host
    answer — ``CapturedGraph.run``'s whole outputs and a bucket request's rows (padding cut off)."""
    pytest.importorskip("cuda.bindings", reason="cuda-python")
    from cuda.bindings import runtime as rt

    from ortcapture.transfer import tap_device_outputs
    from tests import tiny

    copies, calls = {}, []

    def copy(name, ptr, shape, dtype, stream):
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        dst = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype).type, "cuda", 0)
        (err,) = rt.cudaMemcpyAsync(dst.data_ptr(), ptr, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream)
        assert int(err) == 0
        copies[name] = dst
        calls.append(name)

    sess = cuda.session(tiny.affine_model(SHAPE))  # Y = 2 X + 1
    x = rng.random(SHAPE, dtype=np.float32)
    with sess.capture({"X": np.zeros(SHAPE, np.float32)}, verify=False) as g:
        g.run({"X": x})  # the staging is made
        with tap_device_outputs(copy):
            (y,) = g.run({"X": x})
        (name,) = copies
        assert copies[name].device_name().lower() == "cuda"
        np.testing.assert_array_equal(copies.pop(name).numpy(), y)
        np.testing.assert_array_equal(y, x * 2 + 1)
    answer = tiny.bucket_cpu_answer()
    bsess = cuda.session(tiny.bucket_model(), buckets={"batch": [2, 4]})
    names = [o.name for o in bsess.get_outputs()]
    for n, first in ((3, True), (4, False), (1, True), (3, False)):
        # padded rows (read_rows), the whole bucket (read_new); a bucket's first request captures it inside the
        # block: its capture's and verification's reads are not offered (suspend_tap), only the answer's
        xb = rng.standard_normal((n, 4)).astype(np.float32)
        copies.clear()
        calls.clear()
        with tap_device_outputs(copy):
            got = dict(zip(names, bsess.run(None, {"X": xb})))
        # each output once (the answer's read only: no capture or verification read); a whole bucket's outputs are
        # all read whole, a padded request's rows only where they are a prefix ("feat", batched on axis 1, is not)
        assert sorted(calls) == (sorted(names) if n == 4 else ["probs", "scores"]), (n, first, calls)
        for k in calls:
            np.testing.assert_array_equal(copies[k].numpy(), got[k])  # the request's rows, not the bucket's
            np.testing.assert_allclose(got[k], answer(xb)[k], rtol=1e-2, atol=1e-3)
