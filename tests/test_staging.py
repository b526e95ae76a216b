"""Host staging of a CapturedGraph (issue 32): ``host_inputs`` / ``host_outputs``, ``copy_outputs="pinned"``, ``out=``,
the replay plan's feed cache, page-locked buffers on CUDA (``@pytest.mark.cuda``) and the pageable fallback."""
from __future__ import annotations

import ctypes
import gc
import os
import threading

import numpy as np
import onnxruntime as ort
import pytest

import ortcapture
from ortcapture._ort import sync as _sync
from ortcapture._transfer import host_copy as _host_copy
from ortcapture._transfer import staging as _staging
from ortcapture._ort import compat
from tests import tiny
from tests.conftest import Backend, cuda_available


@pytest.fixture
def cuda():
    if not cuda_available():
        pytest.skip("CUDA EP unavailable (onnxruntime-gpu on an NVIDIA GPU)")
    return Backend("cuda")


def _expected_kind(backend) -> str:
    return "pinned" if backend.name == "cuda" and compat.has_cuda_python() and _sync.PINNED else "pageable"


# -- API surface, every backend ---------------------------------------------------------------------------------
def test_host_inputs_start_as_the_inputs_and_are_sent_without_a_copy(backend, rng):
    sess = backend.session(tiny.add_model())
    a, b = rng.random((2, 4), np.float32), rng.random((2, 4), np.float32)
    with sess.capture({"A": a, "B": b}, verify=False) as g:
        assert g.host_staging == _expected_kind(backend)
        hi = g.host_inputs
        assert sorted(hi) == ["A", "B"] and hi["A"].shape == (2, 4) and hi["A"].dtype == np.float32
        np.testing.assert_array_equal(hi["A"], a)  # the graph's inputs as they are: feeding them all changes nothing
        np.testing.assert_array_equal(hi["B"], b)
        assert g.host_inputs["A"] is hi["A"]  # one buffer per input, for the graph's life
        hi["A"][...] = 5.0
        np.testing.assert_array_equal(g.run(hi)[0], 5.0 + b)
        hi["B"][...] = -1.0
        np.testing.assert_array_equal(g.run({"B": hi["B"]})[0], np.full((2, 4), 4.0, np.float32))
        np.testing.assert_array_equal(g.run({"A": a})[0], a - 1.0)  # ordinary numpy feeds still work alongside
        assert g.host_staging == _expected_kind(backend)


def test_pinned_outputs_are_the_graphs_own_arrays_until_the_next_replay(backend, rng):
    sess = backend.session(tiny.affine_model())
    x = rng.random((2, 4), np.float32)
    with sess.capture({"X": x}, verify=False) as g:
        (y,) = g.run({"X": x}, copy_outputs="pinned")
        assert y is g.host_outputs["Y"]
        np.testing.assert_array_equal(y, x * 2 + 1)
        (y2,) = g.run({"X": x + 1}, copy_outputs="pinned")
        assert y2 is y  # overwritten by the next replay that returns host outputs
        np.testing.assert_array_equal(y, (x + 1) * 2 + 1)
        (z,) = g.run({"X": x})
        assert z is not y and not np.shares_memory(z, y)  # copy_outputs=True: a new array, as before
        np.testing.assert_array_equal(z, x * 2 + 1)


def test_out_arrays_are_filled_and_returned(backend, rng):
    sess = backend.session(tiny.repeated_output_model(("Y", "Z", "Y")))
    x = rng.random((2, 4), np.float32)
    with sess.capture({"X": x}, verify=False) as g:
        oy = np.full((2, 4), np.nan, np.float32)
        res = g.run({"X": x}, out={"Y": oy})
        assert res[0] is oy and res[2] is oy and res[1] is not oy  # a name fills each of its positions
        np.testing.assert_array_equal(oy, x * 2)
        np.testing.assert_array_equal(res[1], x + 2)
        oz = np.empty((2, 4), np.float32)
        res = g.run({"X": x + 1}, out=[None, oz, None])
        assert res[1] is oz and res[0] is not res[2]  # unnamed positions: new, separate arrays
        np.testing.assert_array_equal(oz, x + 3)
        np.testing.assert_array_equal(res[2], (x + 1) * 2)
        res = g.run({"X": x}, out=g.host_outputs)  # the graph's own arrays are valid targets
        assert res[1] is g.host_outputs["Z"]
        np.testing.assert_array_equal(res[1], x + 2)


def test_out_arrays_that_overlap_are_refused_before_anything_runs(backend, rng):
    """Two outputs copied into overlapping memory: the second copy overwrote the first's rows (a silent wrong
    result); refused like any bad ``out``. Separate views of one buffer are fine."""
    sess = backend.session(tiny.repeated_output_model(("Y", "Z", "Y")))
    x = rng.random((2, 4), np.float32)
    with sess.capture({"X": x}, verify=False) as g:
        before = g.replays
        buf = np.empty((2, 8), np.float32)
        for out in ({"Y": buf[:, :4], "Z": buf[:, 2:6]}, {"Y": buf[:, :4], "Z": buf[:, :4]}, [buf[:, :4]] * 3):
            with pytest.raises(ortcapture.TransferError, match="overlap in memory"):
                g.run({"X": x}, out=out)
        assert g.replays == before
        y, z, _ = g.run({"X": x}, out={"Y": buf[:, :4], "Z": buf[:, 4:]})
        np.testing.assert_array_equal(y, x * 2)
        np.testing.assert_array_equal(z, x + 2)


@pytest.mark.parametrize("bad", ["shape", "dtype", "readonly", "name", "length", "type", "mode", "copy_outputs"])
def test_bad_out_is_refused_before_anything_runs(backend, rng, bad):
    sess = backend.session(tiny.affine_model())
    x = rng.random((2, 4), np.float32)
    with sess.capture({"X": x}, verify=False) as g:
        before = g.replays
        ro = np.empty((2, 4), np.float32)
        ro.flags.writeable = False
        kw = {"shape": {"out": {"Y": np.empty((4, 2), np.float32)}},
              "dtype": {"out": {"Y": np.empty((2, 4), np.float64)}},
              "readonly": {"out": {"Y": ro}},
              "name": {"out": {"nope": np.empty((2, 4), np.float32)}},
              "length": {"out": [None, None]},
              "type": {"out": {"Y": [0.0] * 8}},
              "mode": {"out": {"Y": np.empty((2, 4), np.float32)}, "copy_outputs": "pinned"},
              "copy_outputs": {"copy_outputs": "host"}}[bad]
        with pytest.raises(ortcapture.TransferError):
            g.run({"X": x + 7}, **kw)
        assert g.replays == before
        np.testing.assert_array_equal(ortcapture.to_numpy(g.inputs["X"]), x)  # the feed was not copied either


def test_host_buffers_of_a_released_graph_raise(backend, rng):
    sess = backend.session(tiny.affine_model())
    g = sess.capture({"X": rng.random((2, 4), np.float32)}, verify=False)
    hi = g.host_inputs
    g.release()
    for attr in ("host_inputs", "host_outputs"):
        with pytest.raises(ortcapture.GraphReleasedError):
            getattr(g, attr)
    hi["X"][...] = 1.0  # an array the user still holds stays valid memory
    assert float(hi["X"].sum()) == 8.0


def test_feed_cache_never_trusts_identity_alone(backend, rng):
    """The replay plan remembers OrtValue feeds it validated; numpy feeds are checked and copied on every call (an
    array can change values, shape or dtype in place)."""
    sess = backend.session(tiny.affine_model())
    x = rng.random((2, 4), np.float32)
    with sess.capture({"X": x}, verify=False) as g:
        src = sess.allocate((2, 4), np.float32)
        ortcapture.update_inplace(src, x)
        for _ in range(3):
            np.testing.assert_array_equal(g.run({"X": src})[0], x * 2 + 1)
        ortcapture.update_inplace(src, x + 1)  # new values in the remembered source are read
        np.testing.assert_array_equal(g.run({"X": src})[0], (x + 1) * 2 + 1)
        h = x.copy()
        np.testing.assert_array_equal(g.run({"X": h})[0], x * 2 + 1)
        h += 1
        np.testing.assert_array_equal(g.run({"X": h})[0], (x + 1) * 2 + 1)
        h.shape = (4, 2)  # same object, new shape
        with pytest.raises(ortcapture.TransferError, match="shape"):
            g.run({"X": h})
        h.shape = (2, 4)
        h.dtype = np.int32  # same object and bytes, new dtype
        with pytest.raises(ortcapture.TransferError, match="dtype"):
            g.run({"X": h})
        wrong = sess.allocate((4, 2), np.float32)
        with pytest.raises(ortcapture.TransferError, match="shape"):
            g.run({"X": wrong})
        np.testing.assert_array_equal(g.run({"X": src})[0], (x + 1) * 2 + 1)


def test_host_inputs_of_a_multi_input_graph_mixed_with_device_feeds(backend, rng):
    sess = backend.session(tiny.add_model())
    a, b = rng.random((2, 4), np.float32), rng.random((2, 4), np.float32)
    with sess.capture({"A": a, "B": b}, verify=False) as g:
        dev = sess.allocate((2, 4), np.float32)
        ortcapture.update_inplace(dev, b + 1)
        g.host_inputs["A"][...] = 2.0
        for _ in range(2):  # the second call takes the remembered device feed
            np.testing.assert_array_equal(g.run({"A": g.host_inputs["A"], "B": dev})[0], b + 3.0)
        with pytest.raises(ortcapture.TransferError):  # every feed checked before any is copied
            g.run({"A": np.zeros((2, 4), np.float32), "B": np.zeros((3, 4), np.float32)})
        np.testing.assert_array_equal(ortcapture.to_numpy(g.inputs["A"]), np.full((2, 4), 2.0, np.float32))


# -- the pinned staging's logic, on the CPU with cuda-python's calls played by memmove ---------------------------
class _FakeCudart:
    """cudart's staging calls with host memory standing in for page-locked and device memory (copies are memmoves,
    done at once); counts the calls and what is still queued for freeing."""

    def __init__(self):
        self.blocks = {}
        self.calls = []
        self.freed = []
        self.refuse = set()  # addresses host_register refuses

    def host_alloc(self, nbytes):
        buf = (ctypes.c_char * max(nbytes, 1))()
        self.blocks[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def copy_async(self, dst, src, nbytes, stream):
        self.calls.append(("copy", dst, src, nbytes))
        ctypes.memmove(dst, src, nbytes)

    def new_stream(self, device):
        return "stream"

    def new_event(self, device):
        return object()

    def record(self, event, stream):
        self.calls.append(("record", event))

    def wait_event(self, event):
        self.calls.append(("wait", event))

    def sync_stream(self, stream):
        self.calls.append(("sync",))

    def host_register(self, ptr, nbytes, portable=False, read_only=False):
        if ptr in self.refuse:
            raise RuntimeError("cudaHostRegister failed: cudaErrorHostMemoryAlreadyRegistered")
        self.calls.append(("register", ptr, nbytes) + (("portable",) if portable else ())
                          + (("read_only",) if read_only else ()))

    def host_unregister(self, ptr):
        self.calls.append(("unregister", ptr))

    def memset_async(self, dst, value, nbytes, stream):
        self.calls.append(("memset", dst, value, nbytes))
        ctypes.memset(dst, value, nbytes)

    def release_later(self, kind, handle):
        self.freed.append((kind, handle))

    def free_pending(self, capturing):
        pass

    def set_device(self, device):
        self.calls.append(("device", device))


@pytest.fixture
def fake_pinned(monkeypatch):
    """HostStaging's pinned branch on CPU OrtValues posing as CUDA buffers (their metadata says cuda)."""
    from ortcapture._ort import cudart
    from ortcapture._ort.values import meta

    fake = _FakeCudart()
    for name in ("host_alloc", "copy_async", "new_stream", "new_event", "record", "wait_event", "sync_stream",
                 "release_later", "free_pending", "set_device", "host_register", "host_unregister", "memset_async"):
        monkeypatch.setattr(cudart, name, getattr(fake, name))
    monkeypatch.setattr(compat, "has_cuda_python", lambda: True)
    monkeypatch.setattr(_sync, "PINNED", True)

    def as_cuda(v):
        m = meta(v)
        v.__dict__["_ortcapture_meta"] = m._replace(kind="cuda")
        return v
    return fake, as_cuda


@pytest.mark.parametrize("threads", [1, 3])
def test_pinned_staging_logic_chunks_events_and_frees(fake_pinned, monkeypatch, rng, threads):
    fake, as_cuda = fake_pinned
    monkeypatch.setattr(_sync, "STAGING_THREADS", threads)
    monkeypatch.setattr(_sync, "_POOL", [])
    shape = (3, 1000, 1000)  # 12 MB: chunked
    x = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)))
    small = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 4), np.int64)))
    y = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4)))
    st = _staging.HostStaging({"x": x, "s": small}, {"y": y}, pinned=True)
    assert st.kind == "pinned" and st.pinned
    np.testing.assert_array_equal(st.host_inputs["x"], 0)  # started as the device values
    feed = rng.random(shape, dtype=np.float32)
    assert st.takes("x", feed) and not st.takes("x", feed[:, ::2]) and not st.takes("x", feed.astype(np.float64))
    fake.calls.clear()
    st.upload({"x": feed, "s": np.full((2, 4), 7, np.int64)})
    np.testing.assert_array_equal(x.numpy(), feed)
    np.testing.assert_array_equal(small.numpy(), 7)
    copies = [c for c in fake.calls if c[0] == "copy"]
    assert len(copies) == 12 + 1  # 1 MiB chunks of the big feed, one copy of the small one
    assert sum(c[3] for c in copies) == feed.nbytes + 64
    assert fake.calls[-1] == ("sync",)  # done when upload returns
    fake.calls.clear()
    st.upload_async({"s": np.ones((2, 4), np.int64)})
    st.upload_async({"s": np.full((2, 4), 2, np.int64)})  # the refill waits for the previous copy's event
    assert [c[0] for c in fake.calls] == ["copy", "record", "wait", "copy", "record"]
    st.wait()
    fake.calls.clear()
    st.host_inputs["x"][0, 0, 0] = 42.0
    st.upload({"x": st.host_inputs["x"]})  # its own buffer: no host copy, one DMA
    assert [c[0] for c in fake.calls] == ["copy", "record", "sync"] and x.numpy()[0, 0, 0] == 42.0
    st.read(["y"])
    np.testing.assert_array_equal(st.host_outputs["y"], np.arange(8).reshape(2, 4))
    fake.calls.clear()
    r1, r2 = st.read_new(["y", "y"])  # new arrays, one DMA each straight into a pool block; no host copy
    assert r1 is not r2 and r1.ctypes.data != st.host_outputs["y"].ctypes.data
    np.testing.assert_array_equal(r1, np.arange(8).reshape(2, 4))
    np.testing.assert_array_equal(r2, r1)
    assert [c[0] for c in fake.calls] == ["copy", "copy", "sync"]
    # frees: the blocks go once no array views them (queued, never freed from the finalizer itself)
    view = st.host_inputs["x"]
    del st
    gc.collect()
    kinds = sorted(k for k, _ in fake.freed)
    assert kinds.count("stream") == 1 and kinds.count("event") == 2 and kinds.count("host") == 2  # s and y
    del view
    gc.collect()
    assert sorted(k for k, _ in fake.freed).count("host") == 3


def test_pinned_rows_send_only_the_request_and_re_pad_only_stale_rows(fake_pinned, rng):
    """A bucket's request through the pinned staging (issue 42): the request's rows are a prefix of the buffer, sent
    alone; only the rows the previous request wrote beyond them are set to the pad (on the device); only the
    request's output rows come back. Several axes or a pad that is no repeated byte: through the host array."""
    fake, as_cuda = fake_pinned
    full = (8, 3, 5)
    inner = 3 * 5 * 4
    x = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.full(full, -7.0, np.float32)))
    y = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.arange(8 * 6, dtype=np.float32).reshape(8, 6)))
    st = _staging.HostStaging({"x": x}, {"y": y}, pinned=True)
    want = np.zeros(full, np.float32)  # what the device buffer must hold after each request

    def send(n, last):
        a = rng.random((n, 3, 5), dtype=np.float32)
        fake.calls.clear()
        st.upload_rows("x", a, (0,), 0.0, 0, last)
        want[:n] = a
        stop = full[0] if last is None else last[0]
        want[n:stop] = 0.0
        np.testing.assert_array_equal(x.numpy(), want)
        copies = [c for c in fake.calls if c[0] == "copy"]
        assert sum(c[3] for c in copies) == n * inner  # the request's rows only
        sets = [c for c in fake.calls if c[0] == "memset"]
        assert sum(c[3] for c in sets) == max(stop - n, 0) * inner
        return a.shape

    last = send(5, None)  # the whole tail (unknown before) padded once
    last = send(2, last)  # rows 2..4 re-padded, 5..7 left alone
    assert [c[3] for c in fake.calls if c[0] == "memset"] == [3 * inner]
    last = send(7, last)  # growing: nothing to pad
    assert not [c for c in fake.calls if c[0] == "memset"]
    # a pad value that is no repeated byte: the stale rows go from the host array
    a = rng.random((1, 3, 5), dtype=np.float32)
    st.upload_rows("x", a, (0,), np.float32(-1e9), None, last)
    got = x.numpy()
    np.testing.assert_array_equal(got[:1], a)
    assert (got[1:7] == np.float32(-1e9)).all()
    # the output's first rows: one DMA of that prefix into a pool block
    fake.calls.clear()
    r = st.read_rows("y", 0, 3)
    np.testing.assert_array_equal(r, np.arange(18, dtype=np.float32).reshape(3, 6))
    assert [c[3] for c in fake.calls if c[0] == "copy"] == [3 * 6 * 4]
    assert st.read_rows("y", 1, 2) is None  # not a prefix: the caller reads the whole output


def test_rows_on_an_axis_after_the_first_go_through_the_host_array(fake_pinned, rng):
    fake, as_cuda = fake_pinned
    x = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.full((2, 6, 3), 5.0, np.float32)))
    st = _staging.HostStaging({"x": x}, {}, pinned=True)
    a = rng.random((2, 4, 3), dtype=np.float32)
    st.upload_rows("x", a, (1,), 0.0, 0, None)
    got = x.numpy()
    np.testing.assert_array_equal(got[:, :4], a)
    assert (got[:, 4:] == 0).all()
    b = rng.random((2, 1, 3), dtype=np.float32)
    st.upload_rows("x", b, (1,), 0.0, 0, a.shape)
    got = x.numpy()
    np.testing.assert_array_equal(got[:, :1], b)
    assert (got[:, 1:] == 0).all()
    # a feed that fills the buffer (a full bucket: CapturedGraph.run) goes through the same host array; the next
    # request's stale rows are then all of it, not what the last upload_rows wrote (seen on the H200: issue 42)
    for full in (rng.random((2, 6, 3), dtype=np.float32), st.host_inputs["x"]):
        if full is st.host_inputs["x"]:
            full[...] = 9.0  # the graph's own host input filled by the caller, then sent
        st.upload({"x": full})
        np.testing.assert_array_equal(x.numpy(), full)
        c = rng.random((2, 2, 3), dtype=np.float32)
        st.upload_rows("x", c, (1,), 0.0, 0, (2, 6, 3))
        got = x.numpy()
        np.testing.assert_array_equal(got[:, :2], c)
        assert (got[:, 2:] == 0).all(), got[:, 2:]


def test_switching_row_paths_on_one_input_re_pads_right(fake_pinned):
    """``feed_rows`` may name other axes from one call to the next on one graph: the pinned prefix path (rows on the
    first axis) also writes the host array, so the host-array path's record of it must go (a review found the third
    request below re-padded nothing)."""
    fake, as_cuda = fake_pinned
    x = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros((4, 2), np.float32)))
    st = _staging.HostStaging({"x": x}, {}, pinned=True)
    st.upload_rows("x", np.ones((4, 1), np.float32), (1,), 0.0, 0, None)  # through the host array: recorded
    st.upload_rows("x", np.full((3, 2), 5, np.float32), (0,), 0.0, 0, None)  # the prefix path writes host rows 0-2
    c = np.full((4, 1), 2, np.float32)
    st.upload_rows("x", c, (1,), 0.0, 0, None)
    got = x.numpy()
    np.testing.assert_array_equal(got[:, :1], c)
    assert (got[:, 1:] == 0).all(), got


def test_numpy_feeds_fed_again_are_page_locked_in_place(fake_pinned, monkeypatch, rng):
    """A plain numpy feed fed a second time (the same array, unchanged address and size) is registered once and then
    sent by one DMA from its own memory (no staging copy), reading its contents as they are at each call; a rotation
    of up to REGISTER_KEEP arrays stays registered, the least recently fed beyond it is unregistered (queued, with the
    array kept alive until then); arrays made per call, small ones, refused ones and run_many's asynchronous uploads
    are never registered; a gone staging queues every registration."""
    fake, as_cuda = fake_pinned
    monkeypatch.setattr(_sync, "STAGING_THREADS", 1)
    monkeypatch.setattr(_staging, "REGISTER_KEEP", 3)
    shape = (1, 3, 320, 320)  # 1.2 MB: above REGISTER_MIN
    x = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)))
    small = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 4), np.float32)))
    y = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 4), np.float32)))
    st = _staging.HostStaging({"x": x, "s": small}, {"y": y}, pinned=True)
    n = x.tensor_size_in_bytes()

    def send(arr, name="x"):
        fake.calls.clear()
        st.upload({name: arr})  # noqa: F821 -- bound above; ruff misreads a later `del st`
        np.testing.assert_array_equal((x if name == "x" else small).numpy(), arr)
        return [c for c in fake.calls if c[0] in ("copy", "register")]

    a = rng.random(shape, dtype=np.float32)
    staged = send(a)
    assert len(staged) == 2 and all(c[2] != a.ctypes.data for c in staged)  # first time: through the staging buffer
    assert send(a) == [("register", a.ctypes.data, n), ("copy", x.data_ptr(), a.ctypes.data, n)]
    a[0, 0, 0, 0] = 123.0  # its contents as they are now: one DMA from the array itself, no new registration
    assert send(a) == [("copy", x.data_ptr(), a.ctypes.data, n)]
    for _ in range(3):  # a new array every call: never registered
        assert all(c[0] == "copy" for c in send(rng.random(shape, dtype=np.float32)))
    ring = [rng.random(shape, dtype=np.float32) for _ in range(4)]
    for arr in ring * 3:  # a rotation of more arrays than may stay registered: none is (no register/evict churn)
        assert all(k == "copy" for k, *_ in send(arr))
    del ring
    b, c, d = (rng.random(shape, dtype=np.float32) for _ in range(3))
    for arr in (b, c, b, c):  # rotation: each registered on its second call
        send(arr)
    regs = st._inplace.registered()
    assert [id(r) for r in regs] == [id(c), id(b), id(a)]
    fake.freed.clear()
    send(d)
    send(d)  # a fourth: the least recently fed (a) is unregistered, the array handed along to stay alive until then
    assert [id(r) for r in st._inplace.registered()] == [id(d), id(c), id(b)]
    assert [(k, h[0], h[1] is a) for k, h in fake.freed] == [("registered", a.ctypes.data, True)]
    assert all(k == "copy" for k, *_ in send(a))  # seen once again since: copied
    tiny_feed = np.ones((2, 4), np.float32)
    send(tiny_feed, "s")
    assert all(k == "copy" for k, *_ in send(tiny_feed, "s"))  # under REGISTER_MIN: always copied
    e = rng.random(shape, dtype=np.float32)
    fake.refuse.add(e.ctypes.data)
    send(e)
    assert all(k == "copy" for k, *_ in send(e))  # refused: copied, and not asked again
    assert all(k == "copy" for k, *_ in send(e))
    shm = bytearray(a.nbytes)  # memory numpy does not own (a buffer that can go away under a live array): copied
    view = np.frombuffer(shm, np.float32).reshape(shape)
    view[...] = 5.0
    send(view)
    assert all(k == "copy" for k, *_ in send(view))
    monkeypatch.setattr(_staging, "REGISTER_KEEP", 4)  # room for a 4th per input, but not in the graph's bytes:
    monkeypatch.setattr(_sync, "REGISTER_BYTES", 3 * n + n // 2)  # 3 arrays (d, c, b are in)
    h = rng.random(shape, dtype=np.float32)
    send(h)
    fake.freed.clear()
    assert all(k == "copy" for k, *_ in send(h))  # declined: nothing evicted for it (no churn), copied
    assert not fake.freed and [id(r) for r in st._inplace.registered()] == [id(d), id(c), id(b)]
    monkeypatch.setattr(_sync, "REGISTER_BYTES", 256 << 20)
    monkeypatch.setattr(_staging, "REGISTER_KEEP", 3)
    f = rng.random(shape, dtype=np.float32)
    for _ in range(3):  # run_many's path: the caller does not wait before the array may change
        fake.calls.clear()
        st.upload_async({"x": f})
        st.wait()
        assert not any(k == "register" for k, *_ in fake.calls)
    monkeypatch.setattr(_sync, "REGISTER", False)
    g_ = rng.random(shape, dtype=np.float32)
    send(g_)
    assert all(k == "copy" for k, *_ in send(g_))  # ORTCAPTURE_REGISTER=0
    assert [id(r) for r in st._inplace.registered()] == [id(d), id(c), id(b)]
    fake.freed.clear()
    del st
    gc.collect()
    queued = [(k, h[1]) for k, h in fake.freed if k == "registered"]
    assert sorted(id(arr) for _, arr in queued) == sorted(map(id, (b, c, d)))


def test_one_array_fed_to_two_graphs_shares_one_registration(fake_pinned, monkeypatch, rng):
    """The same request buffer fed again to two graphs of one size (a bucket's and a CapturedGraph's: issue 42's
    paired arms on the H200): the driver locks a range once (a second cudaHostRegister is refused,
    cudaErrorHostMemoryAlreadyRegistered), so the second staging shares the first one's registration and sends from
    the array too; the range is unregistered once, when the last staging using it lets go."""
    fake, as_cuda = fake_pinned
    monkeypatch.setattr(_sync, "STAGING_THREADS", 1)
    locked = set()

    def host_register(ptr, nbytes):
        if ptr in locked:
            raise RuntimeError("cudaHostRegister failed: cudaErrorHostMemoryAlreadyRegistered")
        locked.add(ptr)
        fake.calls.append(("register", ptr, nbytes))
    from ortcapture._ort import cudart
    monkeypatch.setattr(cudart, "host_register", host_register)
    shape = (1, 3, 320, 320)
    xs = [as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))) for _ in range(2)]
    sts = [_staging.HostStaging({"x": x}, {}, pinned=True) for x in xs]
    n = xs[0].tensor_size_in_bytes()
    a = rng.random(shape, dtype=np.float32)
    for _ in range(3):
        for st, x in zip(sts, xs):
            fake.calls.clear()
            st.upload({"x": a})
            np.testing.assert_array_equal(x.numpy(), a)
    # the last round: both send straight from the array, nothing registered again
    for st, x in zip(sts, xs):
        fake.calls.clear()
        st.upload({"x": a})
        assert [c for c in fake.calls if c[0] in ("copy", "register")] == [("copy", x.data_ptr(), a.ctypes.data, n)]
    assert [id(r) for st in sts for r in st._inplace.registered()] == [id(a), id(a)]
    fake.freed.clear()
    sts[0].unregister_in_place()
    assert not fake.freed  # the other staging still sends from it
    sts[1].unregister_in_place()
    assert [(k, h[0], h[1] is a) for k, h in fake.freed] == [("registered", a.ctypes.data, True)]
    assert not _staging._SHARED


def test_pinned_staging_falls_back_to_pageable_when_cuda_refuses(fake_pinned, monkeypatch):
    """Page-locked staging that cannot be set up (no pinned memory left, a cuda-python whose calls differ) leaves
    the graph on ordinary host memory, with one RuntimeWarning, instead of failing its runs."""
    from ortcapture._ort import cudart

    _, as_cuda = fake_pinned

    def refuse(*a):
        raise TypeError("argument 'flags' has an incorrect type")
    monkeypatch.setattr(cudart, "new_event", refuse)
    monkeypatch.setattr(_staging, "_WARNED", [])
    x = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.arange(8, dtype=np.float32)))
    y = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros(8, np.float32)))
    with pytest.warns(RuntimeWarning, match="page-locked host staging is unavailable"):
        st = _staging.HostStaging({"x": x}, {"y": y}, pinned=True)
    assert st.kind == "pageable" and not st.pinned
    np.testing.assert_array_equal(st.host_inputs["x"], np.arange(8))
    _staging.HostStaging({"x": x}, {"y": y}, pinned=True)  # warned once per process


@pytest.mark.parametrize("threads", [1, 3])
def test_host_copy_splits_big_copies_exactly(monkeypatch, rng, threads):
    monkeypatch.setattr(_sync, "STAGING_THREADS", threads)
    monkeypatch.setattr(_sync, "_POOL", [])
    for shape in [(), (0, 3), (7,), (3, 333, 1001)]:  # the last: ~4 MB, split over the threads
        src = rng.random(shape).astype(np.float32)
        out = _host_copy.host_copy(src)
        assert out.shape == src.shape and out.dtype == src.dtype and not np.shares_memory(out, src)
        np.testing.assert_array_equal(out, src)
        into = np.empty_like(src)
        assert _host_copy.host_copy(src, into) is into
        np.testing.assert_array_equal(into, src)
    strided = np.empty((3, 333, 2002), np.float32)[:, :, ::2]  # a non-contiguous target: numpy's own copy
    _host_copy.host_copy(src, strided)
    np.testing.assert_array_equal(strided, src)


def test_pageable_staging_where_no_pinned_memory(backend, monkeypatch, rng):
    """WebGPU has no page-locked memory; with ORTCAPTURE_PINNED=0 (_sync.PINNED) CUDA graphs stage in ordinary
    host memory too: same API, same results."""
    monkeypatch.setattr(_sync, "PINNED", False)
    sess = backend.session(tiny.affine_model())
    x = rng.random((2, 4), np.float32)
    with sess.capture({"X": x}, verify=False) as g:
        assert g.host_staging == "pageable"
        g.host_inputs["X"][...] = x + 1
        (y,) = g.run(g.host_inputs, copy_outputs="pinned")
        assert y is g.host_outputs["Y"] and isinstance(y, np.ndarray)
        np.testing.assert_array_equal(y, (x + 1) * 2 + 1)
        np.testing.assert_array_equal(g.run({"X": x})[0], x * 2 + 1)


# -- CUDA: page-locked buffers ------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_host_buffers_are_page_locked(cuda, rng):
    pytest.importorskip("cuda.bindings", reason="cuda-python")
    rt = compat.cudart()
    sess = cuda.session(tiny.affine_model())
    with sess.capture({"X": rng.random((2, 4), np.float32)}) as g:
        assert g.host_staging == "pinned"
        for arr in (*g.host_inputs.values(), *g.host_outputs.values()):
            err, attrs = rt.cudaPointerGetAttributes(arr.ctypes.data)
            assert int(err) == 0 and int(attrs.type) == 1  # cudaMemoryTypeHost: page-locked


@pytest.mark.cuda
def test_cuda_staging_is_unasked_for_big_graphs_only(cuda, rng, monkeypatch):
    """A graph of at least PINNED_AUTO_MIN bytes (default 1 MiB; ``ORTCAPTURE_PINNED_MIN``) stages plain numpy feeds
    and new host outputs through page-locked memory from the first call; a smaller one pins nothing until its host
    buffers are asked for; ``None`` (``off``) keeps every graph on ORT's path until asked."""
    pytest.importorskip("cuda.bindings", reason="cuda-python")
    assert _sync.PINNED_AUTO_MIN == _sync.PINNED_AUTO_DEFAULT or os.environ.get("ORTCAPTURE_PINNED_MIN")
    monkeypatch.setattr(_sync, "PINNED_AUTO_MIN", 1 << 20)
    small = cuda.session(tiny.affine_model())
    x = rng.random((2, 4), np.float32)
    with small.capture({"X": x}) as g:
        np.testing.assert_array_equal(g.run({"X": x})[0], x * 2 + 1)
        assert g._staging is None
        assert g.host_staging == "pinned"  # what asking would give
        g.run({"X": x}, copy_outputs="pinned")
        assert g._staging is not None and g._staging.kind == "pinned"
    shape = (1, 3, 320, 320)  # 1.2 MB in, 1.2 MB out
    big = cuda.session(tiny.affine_model(shape))
    xb = rng.random(shape, dtype=np.float32)
    with big.capture({"X": xb}, verify=False) as g:
        assert g._staging is None
        np.testing.assert_array_equal(g.run({"X": xb})[0], xb * 2 + 1)
        assert g._staging is not None and g._staging.kind == "pinned"
    monkeypatch.setattr(_sync, "PINNED_AUTO_MIN", None)
    with big.capture({"X": xb}, verify=False) as g:
        np.testing.assert_array_equal(g.run({"X": xb})[0], xb * 2 + 1)
        assert g._staging is None  # off: plain numpy keeps ORT's path


@pytest.mark.cuda
def test_cuda_new_outputs_come_from_recycled_page_locked_blocks(cuda, rng, monkeypatch):
    """copy_outputs=True through pinned staging: every call returns new arrays of their own (an earlier result is
    never overwritten by a later replay), in page-locked memory; a dropped result's block is reused; results kept
    past the pool's cap are still right (copied out of the staging buffer)."""
    rt = pytest.importorskip("cuda.bindings.runtime", reason="cuda-python")
    monkeypatch.setattr(_sync, "OUTPUT_POOL_BYTES", 0)  # the pool: two sets of outputs
    shape = (2, 3, 320, 320)
    sess = cuda.session(tiny.affine_model(shape))
    with sess.capture({"X": np.zeros(shape, np.float32)}, verify=False) as g:
        g.host_outputs  # noqa: B018 - asks for the staging
        kept = []
        for i in range(5):
            x = rng.random(shape, dtype=np.float32)
            res = g.run({"X": x})
            kept.append((x, res))
        for x, res in kept:  # 2 in blocks of the pool, 3 copied out: all their own, all right
            np.testing.assert_array_equal(res[0], x * 2 + 1)
        pool = g._staging._out_pool
        assert pool.held == 2 * pool.nbytes["Y"]
        err, attrs = rt.cudaPointerGetAttributes(kept[0][1][0].ctypes.data)
        assert int(err) == 0 and int(attrs.type) == 1  # cudaMemoryTypeHost: page-locked
        del kept, res
        addresses = set()
        for i in range(6):  # dropped results: their blocks come back; nothing new is allocated
            x = rng.random(shape, dtype=np.float32)
            (y,) = g.run({"X": x})
            np.testing.assert_array_equal(y, x * 2 + 1)
            addresses.add(y.ctypes.data)
            del y
        assert pool.held == 2 * pool.nbytes["Y"] and len(addresses) <= 2
        view = g.run({"X": x})[0][0]  # a view keeps its block: the next result is elsewhere
        (other,) = g.run({"X": x + 1})
        np.testing.assert_array_equal(view, (x * 2 + 1)[0])
        np.testing.assert_array_equal(other, (x + 1) * 2 + 1)
    rep = cuda.session(tiny.repeated_output_model(shape=(512, 1024)))  # Y listed twice: separate arrays, as ORT
    x = rng.random((512, 1024), dtype=np.float32)
    with rep.capture({"X": x}, verify=False) as g:
        g.host_outputs  # noqa: B018
        want = [x * 2, x + 2, x * 2]  # Y, Z, Y
        res = g.run({"X": x})
        assert len({id(r) for r in res}) == len(res) == len(want)
        for r, w in zip(res, want):
            np.testing.assert_array_equal(r, w)


@pytest.mark.cuda
def test_cuda_numpy_feed_fed_again_is_sent_from_its_own_page_locked_memory(cuda, rng):
    """On the GPU: a numpy feed fed a second time is page-locked in place (cudaPointerGetAttributes: host memory)
    and every replay reads the array's contents at its call (rewritten in place between calls, alternating with
    other arrays and device feeds); release() unregisters it and leaves the array as it was."""
    rt = pytest.importorskip("cuda.bindings.runtime", reason="cuda-python")
    shape = (2, 3, 320, 320)  # 2.5 MB: unasked staging, above REGISTER_MIN
    sess = cuda.session(tiny.affine_model(shape))

    def kind(arr):
        err, attrs = rt.cudaPointerGetAttributes(arr.ctypes.data)
        assert int(err) == 0
        return int(attrs.type)  # 0 unregistered, 1 page-locked host

    a = rng.random(shape, dtype=np.float32)
    g = sess.capture({"X": a}, verify=False)
    try:
        np.testing.assert_array_equal(g.run({"X": a})[0], a * 2 + 1)
        assert kind(a) == 0
        for i in range(4):
            np.testing.assert_array_equal(g.run({"X": a})[0], a * 2 + 1)
            assert kind(a) == 1
            a += 1.0  # in place: the next replay must see it
            other = rng.random(shape, dtype=np.float32)
            np.testing.assert_array_equal(g.run({"X": other})[0], other * 2 + 1)
            dev = ort.OrtValue.ortvalue_from_numpy(other + 3, "cuda", 0)
            np.testing.assert_array_equal(ortcapture.to_numpy(g.run({"X": dev}, copy_outputs=False)[0]),
                                          (other + 3) * 2 + 1)
        before = a.copy()
    finally:
        g.release()
    assert kind(a) == 0
    np.testing.assert_array_equal(a, before)


@pytest.mark.cuda
@pytest.mark.parametrize("threads", [1, 4])
def test_cuda_big_numpy_feeds_through_pinned_staging(cuda, rng, monkeypatch, threads):
    """A 12 MB feed goes in 1 MiB chunks (threads filling, DMA per chunk); every replay reads exactly its feed,
    through plain numpy, host_inputs, out= and pinned views, alternating with device feeds."""
    pytest.importorskip("cuda.bindings", reason="cuda-python")
    monkeypatch.setattr(_sync, "STAGING_THREADS", threads)
    monkeypatch.setattr(_sync, "_POOL", [])
    shape = (3, 1000, 1000)
    sess = cuda.session(tiny.affine_model(shape))
    with sess.capture({"X": np.zeros(shape, np.float32)}) as g:
        assert g.host_staging == "pinned"
        out = np.empty(shape, np.float32)
        for i in range(6):
            x = rng.random(shape, dtype=np.float32)
            np.testing.assert_array_equal(g.run({"X": x})[0], x * 2 + 1)
            g.host_inputs["X"][...] = x + 1
            (y,) = g.run(g.host_inputs, copy_outputs="pinned")
            assert y is g.host_outputs["Y"]
            np.testing.assert_array_equal(y, (x + 1) * 2 + 1)
            g.run({"X": x - 1}, out=[out])
            np.testing.assert_array_equal(out, (x - 1) * 2 + 1)
            dev = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
            np.testing.assert_array_equal(ortcapture.to_numpy(g.run({"X": dev}, copy_outputs=False)[0]), x * 2 + 1)


@pytest.mark.cuda
def test_cuda_staging_beside_captures_in_another_thread(cuda, rng):
    """Pinned allocations and copies of one thread while another thread captures (CUDA global capture mode: a
    cudaHostAlloc from another thread would break it) — the gate orders them; no capture fails."""
    pytest.importorskip("cuda.bindings", reason="cuda-python")
    sess_a, sess_b = cuda.session(tiny.affine_model()), cuda.session(tiny.add_model())
    errors = []
    stop = threading.Event()

    def stage():
        try:
            while not stop.is_set():
                with sess_a.capture({"X": rng.random((2, 4), np.float32)}, verify=False) as g:  # new staging each
                    x = np.full((2, 4), 3.0, np.float32)
                    np.testing.assert_array_equal(g.run({"X": x}, copy_outputs="pinned")[0], x * 2 + 1)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=stage)
    t.start()
    try:
        for k in range(10):
            a = np.full((2, 4), float(k), np.float32)
            with sess_b.capture({"A": a, "B": a}, verify=False) as gb:
                np.testing.assert_array_equal(gb.run({"A": a})[0], 2 * a)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors


# -- run_many and copies= -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("copies", [1, 2])
def test_run_many_yields_every_request_in_order(backend, rng, copies):
    sess = backend.session(tiny.add_model())
    a0 = rng.random((2, 4), np.float32)
    with sess.capture({"A": a0, "B": a0}, verify=False, copies=copies) as g:
        assert g.copies == copies
        reqs = [{"A": rng.random((2, 4), np.float32), "B": np.full((2, 4), float(k), np.float32)} for k in range(7)]
        got = list(g.run_many(reqs))
        assert len(got) == 7
        for r, (out,) in zip(reqs, got):
            np.testing.assert_array_equal(out, r["A"] + r["B"])
        assert list(g.run_many([])) == []
        views = [out[0].copy() for out in g.run_many(iter(reqs[:3]), copy_outputs="pinned")]
        for r, v in zip(reqs, views):
            np.testing.assert_array_equal(v, r["A"] + r["B"])
        np.testing.assert_array_equal(g.run({"A": a0, "B": a0})[0], 2 * a0)  # run() after the iterator ended


def test_run_many_refusals(backend, rng):
    sess = backend.session(tiny.add_model())
    a = rng.random((2, 4), np.float32)
    with pytest.raises(ortcapture.CaptureError, match="copies"):
        sess.capture({"A": a, "B": a}, verify=False, copies=0)
    with pytest.raises(ortcapture.CaptureError, match="copies"):
        sess.capture({"A": a, "B": a}, verify=False, copies=True)
    with pytest.raises(ortcapture.CaptureError, match="from 1 to 16"):  # refused before any capture (was unbounded)
        sess.capture({"A": a, "B": a}, verify=False, copies=10**9)
    assert not sess.captured_graphs
    rec = backend.session(tiny.recurrent_model())
    with pytest.raises(ortcapture.CaptureError, match="state"):
        rec.capture({"x": np.zeros((1, 8), np.float32), "state_in": np.zeros((1, 8), np.float32)},
                    state={"state_out": "state_in"}, verify=False, copies=2)
    g = sess.capture({"A": a, "B": a}, verify=False, copies=2)
    with pytest.raises(ortcapture.TransferError, match="copy_outputs"):
        g.run_many([], copy_outputs=False)
    it = g.run_many([{"A": a, "B": a}, {"A": a}, {"A": a, "B": a}])  # the second misses B
    np.testing.assert_array_equal(next(it)[0], 2 * a)
    with pytest.raises(ortcapture.TransferError, match="every input"):
        next(it)
    it = g.run_many([{"A": a, "B": a}, {"A": a, "B": np.zeros((3, 4), np.float32)}])
    np.testing.assert_array_equal(next(it)[0], 2 * a)
    with pytest.raises(ortcapture.TransferError):
        next(it)
    twin = g._copies[0]
    g.release()
    assert twin.released  # the copies go with the graph
    with pytest.raises(ortcapture.GraphReleasedError):
        list(g.run_many([{"A": a, "B": a}]))


class _ModelStaging:
    """A stand-in for pinned staging on any backend (its copies done by the thread that waits), to check run_many's
    pipeline: the order of its steps, the lookahead and lag, and who may touch which buffers when."""

    kind = "pinned"
    pinned = True
    device_id = 0

    def unregister_in_place(self):
        self.log.append(("unregister",))

    def __init__(self, graph, log):
        self.g = graph
        self.log = log
        self.host_inputs = {n: ortcapture.to_numpy(v) for n, v in graph.inputs.items()}
        self.host_outputs = {n: ortcapture.to_numpy(v) for n, v in graph.outputs.items()}
        self.queued = {}

    def takes(self, name, arr):
        own = self.host_inputs[name]
        return arr.shape == own.shape and arr.dtype == own.dtype

    def upload_async(self, host, settle_first=True):
        self.log.append(("send", id(self), threading.current_thread().name))
        for n, arr in host.items():
            if arr is not self.host_inputs[n]:
                np.copyto(self.host_inputs[n], arr)
            self.queued[n] = self.host_inputs[n].copy()  # what a DMA of that moment would carry

    def upload(self, host):
        self.log.append(("upload", id(self), threading.current_thread().name))
        self.upload_async(host)
        self.wait()

    def fill(self, host):
        self.log.append(("fill", id(self), threading.current_thread().name))
        for n, arr in host.items():
            np.copyto(self.host_inputs[n], arr)

    def wait(self):
        for n, arr in self.queued.items():
            ortcapture.update_inplace(self.g.inputs[n], arr)
        self.queued.clear()

    def read(self, names):
        self.log.append(("read", id(self)))
        for n in names:
            np.copyto(self.host_outputs[n], ortcapture.to_numpy(self.g.outputs[n]))

    def read_new(self, names):
        self.read(dict.fromkeys(names))
        return [self.host_outputs[n].copy() for n in names]


@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("mode", [True, "pinned"])
def test_run_many_pipeline_logic(backend, rng, copies, mode):
    sess = backend.session(tiny.affine_model())
    x0 = rng.random((2, 4), np.float32)
    log = []
    with sess.capture({"X": x0}, verify=False, copies=copies) as g:
        for member in (g, *g._copies):
            member._pin_ok = True
            member._staging = _ModelStaging(member, log)
        xs = [rng.random((2, 4), np.float32) for _ in range(6)]
        seen = []
        for k, (y,) in enumerate(g.run_many(({"X": x} for x in xs), copy_outputs=mode)):
            np.testing.assert_array_equal(y, xs[k] * 2 + 1)
            seen.append(y if mode is True else None)
            with pytest.raises(ortcapture.CaptureError, match="run_many"):  # its buffers are the iterator's
                g.run({"X": x0})
        assert len(seen) == 6
        helper = [e for e in log if e[0] in ("send", "fill") and e[2].startswith("ortcapture-run-many")]
        assert len(helper) == 5  # every request after the first is staged by the helper during a replay
        assert {e[0] for e in helper} == ({"send"} if copies > 1 else {"fill"})
        np.testing.assert_array_equal(g.run({"X": x0})[0], x0 * 2 + 1)  # the iterator let go of the graph
        # a bad request: every one before it comes out (the lagging one included), then the error
        bad = [{"X": xs[0]}, {"X": xs[1]}, {"X": xs[2]}, {"X": np.zeros((3, 4), np.float32)}, {"X": xs[3]}]
        it = g.run_many(bad, copy_outputs=mode)
        for k in range(3):
            np.testing.assert_array_equal(next(it)[0], xs[k] * 2 + 1)
        with pytest.raises(ortcapture.TransferError):
            next(it)
        np.testing.assert_array_equal(g.run({"X": x0})[0], x0 * 2 + 1)
        it = g.run_many({"X": x} for x in xs)  # closed half way: the graph is free again
        next(it)
        it.close()
        np.testing.assert_array_equal(g.run({"X": x0})[0], x0 * 2 + 1)


def test_graph_wiring_of_pinned_staging(backend, rng, monkeypatch):
    """The graph's side of pinned staging (what CUDA with cuda-python does), with the staging played by a model:
    numpy feeds are uploaded through it (alone and beside device feeds), host outputs are read back through it
    (copy_outputs=True, "pinned", out=), device feeds and copy_outputs=False never touch it."""
    log = []
    sess = backend.session(tiny.add_model())
    a, b = rng.random((2, 4), np.float32), rng.random((2, 4), np.float32)
    with sess.capture({"A": a, "B": b}, verify=False) as g:
        made = []
        monkeypatch.setattr(_staging, "HostStaging", lambda i, o, pinned: made.append(pinned) or _ModelStaging(g, log))
        g._pin_ok = True  # as _plan decides for CUDA buffers, a CUDA guard and cuda-python
        g._targets.make_staging = g.staging_now
        np.testing.assert_array_equal(g.run({"A": b})[0], 2 * b)  # numpy feed: staging made, feed uploaded
        assert made == [True] and [e[0] for e in log] == ["upload", "send", "read"]
        log.clear()
        dev = sess.allocate((2, 4), np.float32)
        ortcapture.update_inplace(dev, a)
        np.testing.assert_array_equal(g.run({"A": a, "B": dev})[0], 2 * a)  # mixed: only A through the staging
        assert [e[0] for e in log] == ["upload", "send", "read"]
        log.clear()
        (out,) = g.run({"B": dev}, copy_outputs=False)  # device in, device out: no staging at all
        assert log == [] and isinstance(out, ortcapture.ReplayOutput)
        np.testing.assert_array_equal(out.numpy(), 2 * a)
        (y,) = g.run(None, copy_outputs="pinned")
        assert y is g.host_outputs["C"] and made == [True]  # one staging for the graph's life
        mine = np.empty((2, 4), np.float32)
        assert g.run(out=[mine])[0] is mine
        np.testing.assert_array_equal(mine, 2 * a)


@pytest.mark.cuda
@pytest.mark.parametrize("copies", [1, 2])
def test_cuda_run_many_overlapped_is_exact(cuda, rng, copies):
    """Real page-locked staging, streams and events: 16 requests of a 12 MB input through run_many give exactly
    the outputs of one run each (a refill racing its previous copy, or a readback racing the replay, would not)."""
    pytest.importorskip("cuda.bindings", reason="cuda-python")
    shape = (3, 1000, 1000)
    sess = cuda.session(tiny.affine_model(shape))
    with sess.capture({"X": np.zeros(shape, np.float32)}, copies=copies) as g:
        assert g.host_staging == "pinned" and g.copies == copies
        xs = [rng.random(shape, dtype=np.float32) for _ in range(4)]
        reqs = [{"X": xs[k % 4] + k} for k in range(16)]
        for mode in (True, "pinned"):
            for k, (y,) in enumerate(g.run_many(reqs, copy_outputs=mode)):
                np.testing.assert_array_equal(y, reqs[k]["X"] * 2 + 1)
        np.testing.assert_array_equal(g.run({"X": xs[0]})[0], xs[0] * 2 + 1)


def test_staging_threads_default_and_the_profiles_thread_counts(fake_pinned, rng):
    """The default staging thread count is 3, or the usable CPUs where fewer (the fastest on the H200 for a new array
    per call, benchmarks/README.md); the profile's fills at 1, 2, 4 and 8 threads (host copy alone and pipelined with
    the chunks' DMA) each leave exactly the feed in the device buffer."""
    import os

    if not os.environ.get("ORTCAPTURE_STAGING_THREADS"):
        assert _sync.STAGING_THREADS == min(3, _sync._usable_cpus())
    fake, as_cuda = fake_pinned
    shape = (3, 1000, 1000)
    x = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)))
    y = as_cuda(ort.OrtValue.ortvalue_from_numpy(np.zeros((2,), np.float32)))
    st = _staging.HostStaging({"x": x}, {"y": y}, pinned=True)
    feed = rng.random(shape, dtype=np.float32)
    prof = st.profile("x", feed)
    for t in (1, 2, 4, 8, "8 pinned"):
        t = "8 threads, pinned" if t == "8 pinned" else f"{t} threads"
        st.host_inputs["x"][...] = 0
        prof[f"fill, {t} (host copy only)"]()
        np.testing.assert_array_equal(st.host_inputs["x"], feed)
        np.testing.assert_array_equal(x.numpy(), 0)  # the host copy alone: nothing sent
        fake.calls.clear()
        prof[f"fill + upload, {t} (pipelined)"]()
        np.testing.assert_array_equal(x.numpy(), feed)
        assert sum(c[3] for c in fake.calls if c[0] == "copy") == feed.nbytes and fake.calls[-1] == ("sync",)
        x.update_inplace(np.zeros(shape, np.float32))
    if hasattr(os, "sched_setaffinity"):  # the pinned pool's workers each run on one CPU of the process's mask
        pool = _sync.staging_pool(8, True)
        cpus = [pool.submit(os.sched_getaffinity, 0).result() for _ in range(20)]
        assert all(len(c) == 1 and c <= os.sched_getaffinity(0) for c in cpus)


class _FakeBlock:
    """A _PinnedBlock stand-in in ordinary memory (the pool's bookkeeping without CUDA)."""

    made = 0

    def __init__(self, nbytes):
        _FakeBlock.made += 1
        self.buf = np.empty(max(nbytes, 1), np.uint8)
        self.__array_interface__ = {"data": (self.buf.ctypes.data, False), "shape": self.buf.shape,
                                    "typestr": "|u1", "version": 3}


def test_output_pool_recycles_blocks_when_arrays_and_views_are_gone(monkeypatch):
    """_OutputPool: a block comes back once the array and every view of it are gone (from any thread), is handed
    out again, and past the cap the pool answers None rather than pin more."""
    monkeypatch.setattr(_staging, "_PinnedBlock", _FakeBlock)
    monkeypatch.setattr(_sync, "OUTPUT_POOL_BYTES", 0)
    _FakeBlock.made = 0
    pool = _staging._OutputPool({"y": ((3, 4), np.float32), "z": ((0,), np.int64)})
    assert pool.cap == 2 * 48
    a = pool.take("y")
    assert a.shape == (3, 4) and a.dtype == np.float32 and a.flags.writeable and not a.flags.owndata
    a[...] = 7
    b = pool.take("y")
    assert pool.take("y") is None and pool.held == 96  # two sets of outputs, no more
    assert pool.take("z").shape == (0,)  # an empty output takes no bytes
    addr = a.ctypes.data
    view = a[1:]
    del a
    assert pool.take("y") is None  # the view keeps the block
    t = threading.Thread(target=lambda: view.__class__)  # noqa: F821 -- `view` is bound above  # a release from another thread: just the last ref going
    t.start()
    t.join()
    del view
    gc.collect()
    c = pool.take("y")
    assert c.ctypes.data == addr and _FakeBlock.made == 3
    del b, c
    assert sorted(len(f) for f in pool.free.values()) == [1, 2]


def test_pipelined_fill_never_waits_for_a_worker_that_has_not_started(fake_pinned, monkeypatch, rng):
    """The calling thread claims chunks from the start: with the only worker busy elsewhere (a sleeping core, a
    blocked pool) it copies and sends every chunk itself and returns without waiting; the bytes are all there."""
    from concurrent.futures import ThreadPoolExecutor

    fake, _ = fake_pinned
    pool = ThreadPoolExecutor(1)
    gate = threading.Event()
    blocker = pool.submit(gate.wait, 30)
    monkeypatch.setattr(_sync, "staging_pool", lambda threads=None, pin=None: pool)
    try:
        n = 5 << 20
        src = rng.integers(0, 255, n, dtype=np.uint8)
        flat = np.zeros(n, np.uint8)
        dev = np.zeros(n, np.uint8)
        _host_copy._fill_and_send(flat, src, flat.ctypes.data, dev.ctypes.data, n, "stream", threads=2)
        assert not blocker.done()  # returned while the worker was still held
        np.testing.assert_array_equal(flat, src)
        np.testing.assert_array_equal(dev, src)  # every chunk's DMA queued (the fake copies at once)
        assert len([c for c in fake.calls if c[0] == "copy"]) == 5
    finally:
        gate.set()
        pool.shutdown(wait=True)

