"""Issue 19: bookkeeping slips — repeated graph outputs, outputs sharing one buffer, pointer bindings and their
owners, runs with ``disable_synchronize_execution_providers=1``, aborted captures, bool DLPack feeds.

WebGPU runs on the software adapter; CUDA parts carry ``@pytest.mark.cuda`` (through the ``backend`` fixture or
the ``cuda`` fixture below)."""
from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import onnxruntime as ort
import pytest

import ortcapture
from ortcapture._transfer import sources as tsources
from ortcapture._ort import sync as _sync
from ortcapture._core.run import run_options_for
from ortcapture.errors import (BindingError, CaptureAbortedError, GraphReleasedError, PointerLifetimeWarning,
                               TransferError)
from tests import tiny
from tests.conftest import Backend, cuda_available, webgpu_available

SHAPE = (2, 4)


@pytest.fixture
def cuda():
    if not cuda_available():
        pytest.skip("CUDA EP unavailable (onnxruntime-gpu on an NVIDIA GPU)")
    return Backend("cuda")


def _cpu_reference(model, feeds):
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


# -- 1. one value listed twice as a graph output ----------------------------------------------------------------
@pytest.mark.parametrize("order", [("Y", "Z", "Y"), ("Y", "Y", "Z")])
def test_repeated_graph_output_gives_one_array_per_entry(backend, order):
    model = tiny.repeated_output_model(order)
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    sess = backend.session(model)
    assert [o.name for o in sess.get_outputs()] == list(order)
    g = sess.capture({"X": x})
    assert list(g.outputs) == ["Y", "Z"]  # one fixed buffer per value
    for k in range(3):
        feed = x + k
        want = _cpu_reference(model, {"X": feed})
        got = g.run({"X": feed})
        assert len(got) == len(order) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        assert got[order.index("Y")] is not got[len(order) - 1 - order[::-1].index("Y")]  # separate arrays
        outs = g.run({"X": feed}, copy_outputs=False)
        assert len(outs) == len(order)
        for a, b in zip(outs, want):
            np.testing.assert_array_equal(a.numpy(), b)
    g.release()


@pytest.mark.parametrize("order", [("Y", "Z", "Y"), ("Y", "Y", "Z")])
def test_repeated_graph_output_through_the_drop_in_and_raw_path(backend, order):
    model = tiny.repeated_output_model(order)
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    with ortcapture.patched(backend.name):
        sess = ort.InferenceSession(model)
        for k in range(3):
            got = sess.run(None, {"X": x + k})
            want = _cpu_reference(model, {"X": x + k})
            assert len(got) == 3
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(sess.run(["Z", "Y"], {"X": x})[0], x + 2)
        assert sess.stats["captured"] == 1 and sess.stats["uncaptured"] == 0
    # raw IOBinding path: the value is bound once, and that binding is complete
    raw = backend.session(model)
    X, Y, Z = raw.allocate(SHAPE, np.float32), raw.allocate(SHAPE, np.float32), raw.allocate(SHAPE, np.float32)
    io = raw.io_binding()
    io.bind_ortvalue_input("X", X)
    io.bind_ortvalue_output("Y", Y)
    io.bind_ortvalue_output("Z", Z)
    for k in range(3):
        ortcapture.update_inplace(X, x + k)
        raw.run_with_iobinding(io, run_options_for(1))
        np.testing.assert_array_equal(ortcapture.to_numpy(Y), (x + k) * 2)
        np.testing.assert_array_equal(ortcapture.to_numpy(Z), x + k + 2)
    assert list(raw.captured_graphs) == [1]


# -- 2. two outputs bound to one buffer ---------------------------------------------------------------------------
def test_two_outputs_bound_to_one_buffer_are_refused(backend):
    sess = backend.session(tiny.two_output_model())
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    X, shared = sess.allocate(SHAPE, np.float32), sess.allocate(SHAPE, np.float32)
    ortcapture.update_inplace(X, x)
    io = sess.io_binding()
    io.bind_ortvalue_input("X", X)
    io.bind_ortvalue_output("Y", shared)
    io.bind_ortvalue_output("Z", shared)
    with pytest.raises(BindingError, match="'Y' and 'Z' are bound to one buffer"):
        sess.run_with_iobinding(io, run_options_for(1))
    assert sess.captured_graphs == {} and not io.pinned_ids
    io.bind_ortvalue_output("Z", sess.allocate(SHAPE, np.float32))  # fixed: separate buffers capture
    sess.run_with_iobinding(io, run_options_for(1))
    np.testing.assert_array_equal(ortcapture.to_numpy(shared), x * 2)


def test_outputs_on_overlapping_pointer_spans_are_refused(backend):
    """Pointer bindings overlap by the byte span their shape and element type declare (no buffer is touched)."""
    from ortcapture._core.capture import _overlaps

    io = backend.session(tiny.two_output_model()).io_binding()
    base = np.zeros(64, np.float32)
    ptr = base.ctypes.data
    io.bind_output("Y", "cpu", 0, np.float32, list(SHAPE), ptr, owner=base)
    io.bind_output("Z", "cpu", 0, np.float32, list(SHAPE), ptr + 16, owner=base)  # 32-byte spans, 16 apart
    y, z = io.bound_outputs["Y"], io.bound_outputs["Z"]
    assert y.nbytes == z.nbytes == 32
    assert _overlaps(y, z)
    io.bind_output("Z", "cpu", 0, np.float32, list(SHAPE), ptr + 32, owner=base)
    assert not _overlaps(y, io.bound_outputs["Z"])


# -- 3. pointer bindings ------------------------------------------------------------------------------------------
def test_pointer_binding_keeps_its_owner_alive(backend):
    sess = backend.session(tiny.affine_model())
    io = sess.io_binding()
    arr, out = np.arange(8, dtype=np.float32).reshape(SHAPE), np.zeros(SHAPE, np.float32)
    a_ref, o_ref = weakref.ref(arr), weakref.ref(out)
    io.bind_input("X", "cpu", 0, np.float32, list(SHAPE), arr.ctypes.data, owner=arr)
    io.bind_output("Y", "cpu", 0, np.float32, list(SHAPE), out.ctypes.data, owner=out)
    del arr, out
    gc.collect()
    assert a_ref() is not None and o_ref() is not None
    assert io.bound_inputs["X"].owner is a_ref() and io.bound_outputs["Y"].owner is o_ref()
    io.clear_binding_inputs()
    io.clear_binding_outputs()
    gc.collect()
    assert a_ref() is None and o_ref() is None


def test_pointer_bindings_are_refused_under_webgpu_capture():
    from tests.conftest import webgpu_available

    webgpu_available()
    sess = Backend("webgpu").session(tiny.affine_model())
    X, Y = sess.allocate(SHAPE, np.float32), sess.allocate(SHAPE, np.float32)
    io = sess.io_binding()
    io.bind_input("X", "webgpu", 0, np.float32, list(SHAPE), X.data_ptr(), owner=X)
    io.bind_ortvalue_output("Y", Y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any warning or native call
        with pytest.raises(BindingError, match="raw pointer.*WGPUBuffer"):
            sess.run_with_iobinding(io, run_options_for(1))
    assert sess.captured_graphs == {}


def test_webgpu_pointer_bindings_need_the_owner_they_came_from():
    """A WebGPU buffer_ptr is a WGPUBuffer handle: an int that is no live buffer's crashed ORT's uncaptured run (a
    segfault, ORT 1.32; a break-it session's finding). Refused at the bind unless ``owner`` is the WebGPU OrtValue
    whose handle it is, of its element type and no more elements; with its owner it runs, uncaptured."""
    from tests.conftest import webgpu_available

    webgpu_available()
    sess = Backend("webgpu").session(tiny.affine_model())
    X, Y = sess.allocate(SHAPE, np.float32), sess.allocate(SHAPE, np.float32)
    host = np.zeros(SHAPE, np.float32)
    io = sess.io_binding()
    for ptr, owner, dtype, shape in ((12345, None, np.float32, SHAPE), (X.data_ptr(), None, np.float32, SHAPE),
                                     (12345, X, np.float32, SHAPE), (X.data_ptr(), host, np.float32, SHAPE),
                                     (X.data_ptr(), X, np.int32, SHAPE), (X.data_ptr(), X, np.float32, (4, 4))):
        with pytest.raises(BindingError, match="WebGPU"):
            io.bind_input("X", "webgpu", 0, dtype, list(shape), ptr, owner=owner)
        with pytest.raises(BindingError, match="WebGPU"):
            io.bind_output("Y", "webgpu", 0, dtype, list(shape), ptr, owner=owner)
        with pytest.raises(BindingError, match="WebGPU"):  # ORT's "gpu" (vendor 0) is the WebGPU device too
            io.bind_input("X", "gpu", 0, dtype, list(shape), ptr, owner=owner)
    assert io.bound_inputs == {} and io.bound_outputs == {}
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    ortcapture.update_inplace(X, x)
    io.bind_input("X", "webgpu", 0, np.float32, list(SHAPE), X.data_ptr(), owner=X)
    io.bind_output("Y", "webgpu", 0, np.float32, list(SHAPE), Y.data_ptr(), owner=Y)
    try:
        sess.run_with_iobinding(io, run_options_for(-1))  # not captured: ORT runs on the handles
    except RuntimeError as exc:  # ORT 1.27's WebGPU EP takes no pointer binding at all: its own error, no crash
        assert tuple(int(p) for p in ort.__version__.split(".")[:2]) < (1, 32), exc
        assert "must be tensors on WebGPU buffers" in str(exc)
        return
    (want,) = _cpu_reference(tiny.affine_model(), {"X": x})
    np.testing.assert_allclose(Y.numpy(), want, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_pointer_binding_owner_outlives_the_graph_and_warns_without_owner(cuda):
    sess = cuda.session(tiny.affine_model())
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)

    def pointer_graph(gid, with_owner):
        X = ort.OrtValue.ortvalue_from_shape_and_type(list(SHAPE), np.float32, "cuda", 0)
        Y = ort.OrtValue.ortvalue_from_shape_and_type(list(SHAPE), np.float32, "cuda", 0)
        ortcapture.update_inplace(X, x)
        io = sess.io_binding()
        io.bind_input("X", "cuda", 0, np.float32, list(SHAPE), X.data_ptr(), owner=X if with_owner else None)
        io.bind_output("Y", "cuda", 0, np.float32, list(SHAPE), Y.data_ptr(), owner=Y if with_owner else None)
        return io, X, Y

    # with owner=: no warning; the graph keeps both buffers alive after the caller drops them
    io, X, Y = pointer_graph(1, True)
    refs = (weakref.ref(X), weakref.ref(Y))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PointerLifetimeWarning)
        sess.run_with_iobinding(io, run_options_for(1))
    del X, Y
    gc.collect()
    assert all(r() is not None for r in refs)
    for k in range(3):
        ortcapture.update_inplace(refs[0](), x + k)
        sess.run_with_iobinding(io, run_options_for(1))
        np.testing.assert_array_equal(ortcapture.to_numpy(refs[1]()), (x + k) * 2 + 1)
    sess.release_captured_graph(1)
    del io
    gc.collect()
    assert all(r() is None for r in refs)  # released and unbound: the owners go

    # without owner=: one warning per pointer binding at capture, none on replays
    io, X, Y = pointer_graph(2, False)
    with pytest.warns(PointerLifetimeWarning) as record:
        sess.run_with_iobinding(io, run_options_for(2))
    msgs = [str(w.message) for w in record if issubclass(w.category, PointerLifetimeWarning)]
    assert len(msgs) == 2 and any("input 'X'" in m for m in msgs) and any("output 'Y'" in m for m in msgs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PointerLifetimeWarning)
        for _ in range(3):
            sess.run_with_iobinding(io, run_options_for(2))
    np.testing.assert_array_equal(ortcapture.to_numpy(Y), x * 2 + 1)


@pytest.mark.cuda
def test_cuda_torch_data_ptr_binding_with_owner(cuda):
    torch = pytest.importorskip("torch")
    sess = cuda.session(tiny.affine_model())
    io = sess.io_binding()
    t_in = torch.arange(8, dtype=torch.float32, device="cuda").reshape(SHAPE)
    t_out = torch.empty(SHAPE, dtype=torch.float32, device="cuda")
    io.bind_input("X", "cuda", 0, np.float32, list(SHAPE), t_in.data_ptr(), owner=t_in)
    io.bind_output("Y", "cuda", 0, np.float32, list(SHAPE), t_out.data_ptr(), owner=t_out)
    ref_in, ref_out = weakref.ref(t_in), weakref.ref(t_out)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PointerLifetimeWarning)
        sess.run_with_iobinding(io, run_options_for(1))
    del t_in, t_out
    gc.collect()
    torch.cuda.empty_cache()
    junk = torch.full((1 << 20,), 7.0, device="cuda")  # would reuse freed blocks
    for k in range(3):
        ref_in().copy_(torch.arange(8, dtype=torch.float32, device="cuda").reshape(SHAPE) + k)
        torch.cuda.synchronize()
        sess.run_with_iobinding(io, run_options_for(1))
        want = (np.arange(8, dtype=np.float32).reshape(SHAPE) + k) * 2 + 1
        np.testing.assert_array_equal(ref_out().cpu().numpy(), want)
    del junk


# -- 4. runs with disable_synchronize_execution_providers=1 ------------------------------------------------------
def _unsynchronised(graph_id):
    ro = run_options_for(graph_id)
    ro.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return ro


def test_unsynchronised_replays_are_settled_before_ortcapture_reads_and_writes(backend, monkeypatch):
    syncs = []
    original = ortcapture.IOBinding.synchronize_outputs

    def counting(self):
        syncs.append(self)
        return original(self)

    monkeypatch.setattr(ortcapture.IOBinding, "synchronize_outputs", counting)
    rows, n, depth = (1024, 2048, 16) if backend.name == "cuda" else (32, 64, 2)
    sess = backend.session(tiny.identity_chain_model(rows, n, depth))
    X, Y = sess.allocate((rows, n), np.float32), sess.allocate((rows, n), np.float32)
    rng = np.random.default_rng(19)
    xs = [rng.integers(0, 1000, (rows, n)).astype(np.float32) for _ in range(13)]
    io = sess.io_binding()
    io.bind_ortvalue_input("X", X)
    io.bind_ortvalue_output("Y", Y)
    ortcapture.update_inplace(X, xs[0])
    sess.run_with_iobinding(io, _unsynchronised(1))  # the capture itself, unsynchronised
    assert any(b is io for b, _ in _sync.UNSETTLED)
    np.testing.assert_array_equal(ortcapture.to_numpy(Y), xs[0])
    assert not _sync.UNSETTLED and syncs
    wrong = 0
    for k in range(12):
        # replay k returns early; the next write must wait for it (it still reads X), the read after it sees k
        sess.run_with_iobinding(io, _unsynchronised(1))
        ortcapture.update_inplace(X, xs[k + 1])
        wrong += not np.array_equal(ortcapture.to_numpy(Y), xs[k])
    assert wrong == 0
    before = len(syncs)
    sess.run_with_iobinding(io, run_options_for(1))  # an ordinary (synchronised) run defers nothing
    assert not _sync.UNSETTLED
    np.testing.assert_array_equal(ortcapture.to_numpy(Y), xs[12])
    assert len(syncs) == before


def test_unsynchronised_runs_are_settled_before_copy_and_replay_output_reads(backend):
    sess = backend.session(tiny.affine_model())
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    X, Y, Y2 = (sess.allocate(SHAPE, np.float32) for _ in range(3))
    io = sess.io_binding()
    io.bind_ortvalue_input("X", X)
    io.bind_ortvalue_output("Y", Y)
    ortcapture.update_inplace(X, x)
    sess.run_with_iobinding(io, _unsynchronised(1))
    ortcapture.to_numpy(Y)
    sess.run_with_iobinding(io, _unsynchronised(1))
    assert _sync.UNSETTLED
    ortcapture.copy([Y], [Y2])
    assert not _sync.UNSETTLED
    np.testing.assert_array_equal(ortcapture.to_numpy(Y2), x * 2 + 1)
    # a CapturedGraph on the same session reads its outputs after the other binding's pending run too
    g = sess.capture({"X": x + 1})
    sess.run_with_iobinding(io, _unsynchronised(1))
    assert _sync.UNSETTLED
    np.testing.assert_array_equal(g.run({"X": x + 2})[0], (x + 2) * 2 + 1)
    assert not _sync.UNSETTLED


# -- 5. aborted captures ------------------------------------------------------------------------------------------
def test_capture_aborted_by_terminate_is_released_and_named(backend):
    model = tiny.affine_model()
    sess = backend.session(model)
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    X, Y = sess.allocate(SHAPE, np.float32), sess.allocate(SHAPE, np.float32)
    ortcapture.update_inplace(X, x)
    io = sess.io_binding()
    io.bind_ortvalue_input("X", X)
    io.bind_ortvalue_output("Y", Y)
    ro = run_options_for(1)
    ro.terminate = True
    with pytest.raises(CaptureAbortedError, match=r"capturing run of gpu_graph_id=1 was aborted by RunOptions\."
                                                  r"terminate") as info:
        sess.run_with_iobinding(io, ro)
    assert isinstance(info.value, RuntimeError)  # ORT's type for a failed run, still caught as such
    assert sess.captured_graphs == {} and not io.pinned_ids
    if sess.capture_info.releases_natively:
        retry_id = 1
    else:  # ORT cannot release: the id is retired, and the error named another one
        assert "retired gpu_graph_id=1" in str(info.value)
        with pytest.raises(GraphReleasedError):
            sess.run_with_iobinding(io, run_options_for(1))
        retry_id = 2
    for k in range(3):  # the retry captures for real: replays follow the input
        ortcapture.update_inplace(X, x + k)
        sess.run_with_iobinding(io, run_options_for(retry_id))
        np.testing.assert_array_equal(ortcapture.to_numpy(Y), (x + k) * 2 + 1)
    # sess.capture() picks a free id and captures a working graph after the aborted attempt
    g = sess.capture({"X": x})
    assert g.graph_id not in (retry_id,)
    for k in range(3):
        np.testing.assert_array_equal(g.run({"X": x - k})[0], (x - k) * 2 + 1)
    # and so does a fresh session
    fresh = backend.session(model)
    g2 = fresh.capture({"X": x})
    assert g2.graph_id == 1
    np.testing.assert_array_equal(g2.run({"X": x + 5})[0], (x + 5) * 2 + 1)


def test_aborted_capture_leaves_declared_state_untouched(backend):
    """ORT's warm-up runs before the abort must not advance an in-place state pair (restored from its snapshot)."""
    sess = backend.session(tiny.counter_model())
    S = sess.allocate((4,), np.float32)
    ortcapture.update_inplace(S, np.zeros(4, np.float32))
    io = sess.io_binding()
    io.bind_ortvalue_input("state_in", S)
    io.bind_ortvalue_output("state_out", S)
    io.declare_state("state_out", "state_in")
    ro = run_options_for(1)
    ro.terminate = True
    with pytest.raises(CaptureAbortedError):
        sess.run_with_iobinding(io, ro)
    np.testing.assert_array_equal(ortcapture.to_numpy(S), np.zeros(4, np.float32))


# -- 6. bool DLPack feeds -----------------------------------------------------------------------------------------
class _DLPackOnly:
    """A host tensor seen only through the DLPack protocol (not a numpy array)."""

    def __init__(self, arr):
        self._a = arr
        self.shape, self.dtype = arr.shape, arr.dtype

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_bool_dlpack_feeds(backend):
    sess = backend.session(tiny.where_model())
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal(SHAPE).astype(np.float32), rng.standard_normal(SHAPE).astype(np.float32)
    c0 = rng.random(SHAPE) > 0.5
    g = sess.capture({"C": _DLPackOnly(c0), "A": a, "B": b})
    for _ in range(3):
        c = rng.random(SHAPE) > 0.5
        (y,) = g.run({"C": _DLPackOnly(c)})
        np.testing.assert_array_equal(y, np.where(c, a, b))
    c = ~c
    ortcapture.update_inplace(g.inputs["C"], _DLPackOnly(c))
    np.testing.assert_array_equal(ortcapture.to_numpy(g.inputs["C"]), c)
    np.testing.assert_array_equal(g.run()[0], np.where(c, a, b))
    with pytest.raises(TransferError, match="dtype mismatch"):
        g.run({"C": _DLPackOnly(c.view(np.uint8))})


def test_bool_dlpack_goes_through_a_uint8_view_where_ort_refuses_bool():
    """ORT <= 1.31's DLPack converter raises a bare RuntimeError for DLPack bool ("Unsupported code 6"); the
    wrapper exports a uint8 view with ORT's is_bool flag instead (ORT 1.32 reads DLPack bool itself)."""
    c = np.array([[True, False, True], [False, False, True]])
    value = tsources._dlpack_value(c, None)
    assert value.data_type() == "tensor(bool)"
    np.testing.assert_array_equal(value.numpy(), c)
    f = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(tsources._dlpack_value(f, None).numpy(), f)


def test_bool_producer_without_a_uint8_view_raises_transfer_error(monkeypatch):
    from ortcapture._ort import compat as _compat

    class NoView(_DLPackOnly):
        def view(self, dtype):
            raise TypeError("no views here")

    monkeypatch.setattr(_compat, "dlpack_takes_bool_flag", lambda: True)
    with pytest.raises(TransferError, match="no uint8 view"):
        tsources._dlpack_value(NoView(np.array([True])), None)


@pytest.mark.cuda
def test_cuda_torch_bool_feeds(cuda, no_host_path):
    torch = pytest.importorskip("torch")
    sess = cuda.session(tiny.where_model())
    a = np.arange(8, dtype=np.float32).reshape(SHAPE)
    b = -a
    g = sess.capture({"C": np.zeros(SHAPE, bool), "A": a, "B": b})
    no_host_path()
    for k in range(3):
        c = (torch.arange(8, device="cuda").reshape(SHAPE) % (k + 2)) == 0
        (y,) = g.run({"C": c})
        np.testing.assert_array_equal(y, np.where(c.cpu().numpy(), a, b))
    ortcapture.update_inplace(g.inputs["C"], ~c)
    np.testing.assert_array_equal(ortcapture.to_numpy(g.inputs["C"]), (~c).cpu().numpy())


def test_to_numpy_of_a_host_ortvalue_is_a_copy():
    """ORT's ``numpy()`` of a CPU OrtValue is a view of its memory: ``to_numpy`` (documented as a new host copy)
    returned it as such, so a later ``update_inplace`` showed through a snapshot taken before, and writing into the
    snapshot changed the value."""
    v = ort.OrtValue.ortvalue_from_numpy(np.arange(4, dtype=np.float32))
    snap = ortcapture.to_numpy(v)
    ortcapture.update_inplace(v, np.full(4, 9.0, np.float32))
    np.testing.assert_array_equal(snap, np.arange(4))
    snap[:] = -1
    np.testing.assert_array_equal(ortcapture.to_numpy(v), np.full(4, 9.0))


def test_webgpu_buffers_of_2_gib_and_more_are_refused_not_crashed():
    """ORT's WebGPU ``copy_tensors`` crashed (SIGSEGV) moving a buffer of 2**31 bytes or more, and a far larger
    allocation only logged Vulkan's out-of-memory: refused with a clear exception, before ORT is called."""
    if not webgpu_available():
        pytest.skip("needs the WebGPU plugin EP")
    sess = Backend("webgpu").session(tiny.affine_model())
    for shape in ((2**31,), (2**42,)):
        with pytest.raises(ortcapture.TransferError, match="crash at 2 GiB"):
            sess.allocate(shape, np.uint8)
    ok = sess.allocate((16,), np.uint8)  # small ones as before
    ortcapture.update_inplace(ok, np.arange(16, dtype=np.uint8))
    np.testing.assert_array_equal(ortcapture.to_numpy(ok), np.arange(16))
