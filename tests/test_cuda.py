"""CUDA-only behaviour (run on the H200): DLPack sources without host copies, the cuda-python copy backend,
foreign stream capture, DLPack export of fixed outputs."""
from __future__ import annotations

import numpy as np
import pytest

import ortcapture
from ortcapture._ort import sync
from ortcapture._transfer import copy as tcopy
from tests import tiny
from tests.conftest import Backend, cuda_available

pytestmark = pytest.mark.cuda


@pytest.fixture
def cuda():
    if not cuda_available():
        pytest.skip("CUDA EP unavailable (onnxruntime-gpu on an NVIDIA GPU)")
    return Backend("cuda")


def test_torch_cuda_tensor_source_device_to_device(cuda, no_host_path):
    torch = pytest.importorskip("torch")
    sess = cuda.session(tiny.affine_model())
    g = sess.capture({"X": np.zeros((2, 4), np.float32)})
    no_host_path()
    t = torch.arange(8, dtype=torch.float32, device="cuda").reshape(2, 4) * 3  # pending work on torch's stream
    (y,) = g.run({"X": t})
    np.testing.assert_array_equal(y, (t * 2 + 1).cpu().numpy())
    t.mul_(2)  # same tensor, new contents (the cached DLPack wrapping must see them)
    np.testing.assert_array_equal(g.run({"X": t})[0], (t * 2 + 1).cpu().numpy())
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # producer on a side stream: ortcapture must wait for it
        t2 = torch.full((2, 4), 5.0, device="cuda")
        np.testing.assert_array_equal(g.run({"X": t2})[0], np.full((2, 4), 11.0))
    with pytest.raises(ortcapture.TransferError, match="not C-contiguous"):
        g.run({"X": torch.zeros(4, 2, device="cuda").t()})
    with pytest.raises(ortcapture.TransferError, match="dtype mismatch"):
        g.run({"X": torch.zeros(2, 4, dtype=torch.float16, device="cuda")})


def test_cupy_source_device_to_device(cuda, no_host_path):
    cp = pytest.importorskip("cupy")
    sess = cuda.session(tiny.affine_model())
    g = sess.capture({"X": np.zeros((2, 4), np.float32)})
    no_host_path()
    a = cp.arange(8, dtype=cp.float32).reshape(2, 4)
    np.testing.assert_array_equal(g.run({"X": a})[0], cp.asnumpy(a * 2 + 1))


def test_ortvalue_d2d_and_forced_cuda_python_backend(cuda, monkeypatch):
    import onnxruntime as ort

    src = ort.OrtValue.ortvalue_from_numpy(np.arange(6, dtype=np.float32), "cuda", 0)
    dst = ort.OrtValue.ortvalue_from_shape_and_type([6], np.float32, "cuda", 0)
    ortcapture.update_inplace(dst, src)
    np.testing.assert_array_equal(dst.numpy(), np.arange(6))
    from ortcapture._ort import compat

    assert compat.has_cuda_python(), "cuda-python expected on the GPU machine"
    monkeypatch.setattr(sync, "COPY_BACKEND", "cuda-python")
    called = []
    import ortcapture._ort.cudart as cudart

    real = cudart.memcpy_d2d
    monkeypatch.setattr(cudart, "memcpy_d2d", lambda *a: (called.append(a), real(*a)))
    src2 = ort.OrtValue.ortvalue_from_numpy(np.full(6, 7.0, np.float32), "cuda", 0)
    ortcapture.update_inplace(dst, src2)
    assert called and dst.numpy().tolist() == [7.0] * 6
    # replays read what the cuda-python copy wrote (the copy is complete before the replay starts)
    sess = cuda.session(tiny.affine_model())
    g = sess.capture({"X": np.zeros((2, 4), np.float32)})
    for k in range(20):
        v = ort.OrtValue.ortvalue_from_numpy(np.full((2, 4), float(k), np.float32), "cuda", 0)
        assert g.run({"X": v})[0][0, 0] == 2 * k + 1


def test_cuda_ortvalue_pointer_device_is_known(cuda):
    import onnxruntime as ort

    from ortcapture._ort.values import device_id_of

    v = ort.OrtValue.ortvalue_from_shape_and_type([4], np.float32, "cuda", 0)
    assert device_id_of(v) == 0


def test_foreign_stream_capture_is_refused(cuda):
    torch = pytest.importorskip("torch")
    sess = cuda.session(tiny.affine_model())
    g = sess.capture({"X": np.zeros((2, 4), np.float32)})
    static = torch.zeros(4, device="cuda")
    tg = torch.cuda.CUDAGraph()
    refused = None
    with torch.cuda.graph(tg):
        static.add_(1)
        try:
            g.run({"X": np.ones((2, 4), np.float32)})
        except ortcapture.CaptureError as exc:
            refused = exc
    assert refused is not None and "#32081" in str(refused)
    tg.replay()
    torch.cuda.synchronize()
    assert static.tolist() == [1.0] * 4
    np.testing.assert_array_equal(g.run({"X": np.ones((2, 4), np.float32)})[0], np.full((2, 4), 3.0))


def test_cuda_python_blocking_stream_capture_is_refused_from_any_thread(cuda):
    """A capture of a blocking stream begun through cuda-python (global mode): g.run is refused in the
    capturing thread (the probe's driver query) and in a new thread with no CUDA context yet (the runtime fallback),
    and the foreign capture is left valid."""
    import threading

    from ortcapture._ort import compat

    rt = compat.cudart()
    assert rt is not None and compat.cudadrv() is not None, "cuda-python expected on the GPU machine"
    try:  # torch's CUDA initialised where torch is here: its own query of its current (legacy) stream then
        import torch  # raises cudaErrorStreamCaptureImplicit, which must not escape as torch's error

        torch.zeros(1, device="cuda")
    except ImportError:
        pass
    sess = cuda.session(tiny.affine_model())
    g = sess.capture({"X": np.zeros((2, 4), np.float32)})
    x = np.ones((2, 4), np.float32)
    err, stream = rt.cudaStreamCreateWithFlags(0)  # a blocking stream
    assert int(err) == 0
    refused = []

    def other():
        try:
            g.run({"X": x})
        except ortcapture.CaptureError as exc:
            refused.append(exc)

    # A foreign global-mode capture must not see a CUDA free: garbage of earlier tests (sessions, buffers in reference
    # cycles) collected inside it ends in cudaFree during capture and ORT aborts the process (seen on the H100 in the
    # full CUDA suite, "Garbage-collecting" in the new thread). Capturing code does what torch.cuda.graph does:
    # collect first, and keep the collector out of the capture.
    import gc

    gc.collect()
    gc.disable()
    (err,) = rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)
    assert int(err) == 0
    try:
        with pytest.raises(ortcapture.CaptureError, match="#32081"):
            g.run({"X": x})
        t = threading.Thread(target=other)
        t.start()
        t.join()
    finally:
        err, graph = rt.cudaStreamEndCapture(stream)
        gc.enable()
    assert int(err) == 0, "the probe invalidated the foreign capture"
    assert len(refused) == 1 and "#32081" in str(refused[0])
    err, exec_ = rt.cudaGraphInstantiate(graph, 0)
    assert int(err) == 0
    rt.cudaGraphExecDestroy(exec_)
    rt.cudaGraphDestroy(graph)
    rt.cudaStreamDestroy(stream)
    np.testing.assert_array_equal(g.run({"X": x})[0], np.full((2, 4), 3.0))


def test_fixed_outputs_export_through_dlpack(cuda):
    torch = pytest.importorskip("torch")
    sess = cuda.session(tiny.affine_model())
    g = sess.capture({"X": np.zeros((2, 4), np.float32)})
    (out,) = g.run({"X": np.ones((2, 4), np.float32)}, copy_outputs=False)
    t = torch.from_dlpack(out)
    assert t.is_cuda and t.tolist() == [[3.0] * 4] * 2


def test_update_inplace_d2d_overhead_reasonable(cuda):
    """Not a timing test: checks the OrtValue->OrtValue path takes the device-to-device backend."""
    import onnxruntime as ort

    from ortcapture._ort import compat

    assert compat.has_update_inplace_ortvalue()
    src = ort.OrtValue.ortvalue_from_numpy(np.ones((1, 3, 320, 320), np.float32), "cuda", 0)
    dst = ort.OrtValue.ortvalue_from_shape_and_type([1, 3, 320, 320], np.float32, "cuda", 0)
    ortcapture.update_inplace(dst, src)
    assert float(dst.numpy().sum()) == 3 * 320 * 320


def test_tensorrt_cuda_graph_capture_when_tensorrt_loads(cuda):
    """TensorRT EP with trt_cuda_graph_enable: same guards (skipped where the TensorRT libraries are absent)."""
    import onnxruntime as ort

    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime without the TensorRT EP")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        sess = ortcapture.InferenceSession(tiny.affine_model(), so, providers=[
            ("TensorrtExecutionProvider", {"trt_cuda_graph_enable": "1"}), "CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - libnvinfer missing: ORT cannot create the EP
        pytest.skip(f"TensorRT EP cannot be created here: {str(exc).splitlines()[0][:200]}")
    assert sess.capture_info.ep.name == "TensorrtExecutionProvider"
    g = sess.capture({"X": np.zeros((2, 4), np.float32)})
    np.testing.assert_array_equal(g.run({"X": np.ones((2, 4), np.float32)})[0], np.full((2, 4), 3.0))
    g.release()
    with pytest.raises(ortcapture.GraphReleasedError):
        b = sess.io_binding()
        b.bind_ortvalue_input("X", sess.allocate((2, 4), np.float32))
        b.bind_ortvalue_output("Y", sess.allocate((2, 4), np.float32))
        sess.run_with_iobinding(b, ortcapture.run_options_for(g.graph_id))


def test_ort_keeps_cuda_graphs_per_thread(cuda):
    """The ORT behaviour ortcapture guards against (CUDAExecutionProvider::PerThreadContext): with raw onnxruntime,
    the first run of a captured gpu_graph_id from a new thread is not a replay — ORT runs the model uncaptured again
    and captures anew, so in-place state advances several steps. Fails if a future ORT shares graphs across threads
    (then ortcapture's per-thread capture is merely redundant)."""
    import threading

    import onnxruntime as ort

    raw = ort.InferenceSession(tiny.counter_model(), **cuda.session_args(True))
    buf = ort.OrtValue.ortvalue_from_numpy(np.zeros(4, np.float32), "cuda", 0)
    b = raw.io_binding()
    b.bind_ortvalue_input("state_in", buf)
    b.bind_ortvalue_output("state_out", buf)
    ro = ortcapture.run_options_for(0)
    raw.run_with_iobinding(b, ro)  # capture: warm-up run(s) + capture + replay
    first = float(buf.numpy()[0])
    raw.run_with_iobinding(b, ro)
    assert float(buf.numpy()[0]) == first + 1  # a replay is one step
    before = float(buf.numpy()[0])
    t = threading.Thread(target=raw.run_with_iobinding, args=(b, ro))
    t.start()
    t.join()
    assert float(buf.numpy()[0]) - before == first  # the new thread re-ran the whole capture sequence


def test_capture_beside_replays_in_another_thread(cuda):
    """A capture waits for other threads' CUDA work and keeps it out meanwhile (ortcapture._ort.sync)."""
    import threading

    ga = cuda.session(tiny.affine_model()).capture({"X": np.zeros((2, 4), np.float32)})
    stop, errors, count = threading.Event(), [], [0]

    def loop():
        try:
            i = 0
            while not stop.is_set():
                x = np.full((2, 4), float(i), np.float32)
                if not np.array_equal(ga.run({"X": x})[0], 2 * x + 1):
                    errors.append(i)
                i += 1
            count[0] = i
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    plain = cuda.session(tiny.add_model(), capture=False)  # uncaptured CUDA runs are CUDA work too

    def plain_loop():
        try:
            ones = np.ones((2, 4), np.float32)
            while not stop.is_set():
                if not np.array_equal(plain.run(None, {"A": ones, "B": ones})[0], 2 * ones):
                    errors.append("plain")
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    t = threading.Thread(target=loop)
    t.start()
    t2 = threading.Thread(target=plain_loop)
    t2.start()
    try:
        for k in range(6):
            sess = cuda.session(tiny.add_model())
            feeds = {"A": np.full((2, 4), float(k), np.float32), "B": np.ones((2, 4), np.float32)}
            g = sess.capture(feeds)
            np.testing.assert_array_equal(g.run(feeds)[0], np.full((2, 4), k + 1.0))
    finally:
        stop.set()
        t.join()
        t2.join()
    assert errors == [] and count[0] > 0


@pytest.mark.slow
def test_prefer_nhwc_dynamic_dims_captures_via_specialization(cuda, reference_model_path, rng):
    """Measured on onnxruntime-gpu 1.31.1 (H200): ``prefer_nhwc=1`` with the reference model's dims dynamic makes
    the CUDA EP refuse capture at session creation ("all compute graph nodes have not been partitioned to the
    CUDAExecutionProvider"). ortcapture defers and captures on a session specialised to the example shapes."""
    import onnxruntime as ort

    from ortcapture._ort.providers import session_args

    def args(capture):
        so = ort.SessionOptions()
        so.log_severity_level = 4
        return session_args("cuda", capture, so, ep_options={"prefer_nhwc": "1"})

    with pytest.raises(Exception, match="have not been partitioned to the CUDAExecutionProvider"):
        ort.InferenceSession(reference_model_path, **args(True))  # raw ORT: refused
    plain = ort.InferenceSession(reference_model_path, **args(False))
    sess = ortcapture.InferenceSession(reference_model_path, **args(True))
    assert sess.capture_deferred
    xs = [rng.random((1, 3, 320, 320), np.float32) for _ in range(3)]
    with sess.capture({"images": xs[0]}) as g:
        for x in xs[1:] + xs[:1]:
            (got,) = g.run({"images": x})
            (want,) = plain.run(None, {"images": x})
            np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, np.abs(want).max()), rtol=0)


def test_repeated_cuda_feed_takes_the_one_fast_path_and_stays_checked(cuda, monkeypatch):
    """CapturedGraph.run copies feeds through transfer.copy_feeds -> update_inplace, whose one fast path
    (``ortcapture._transfer.copy._fast_pair``) takes CUDA OrtValues seen before without the full checks; anything
    else — a new object (even one reusing a dead feed's id), a ReplayOutput, COPY_BACKEND set — is checked in full."""
    import gc

    import onnxruntime as ort

    sess = cuda.session(tiny.affine_model())
    g = sess.capture({"X": np.zeros((2, 4), np.float32)})
    srcs = [ort.OrtValue.ortvalue_from_numpy(np.full((2, 4), v, np.float32), "cuda", 0) for v in (1.0, 2.0)]
    full = []
    real = tcopy._checked_value_source
    monkeypatch.setattr(tcopy, "_checked_value_source", lambda *a: full.append(1) or real(*a))
    for i in range(6):  # double-buffered feeds: after their first copy both stay on the fast path
        np.testing.assert_array_equal(g.run({"X": srcs[i & 1]})[0], np.full((2, 4), 2.0 * (1 + (i & 1)) + 1))
    assert len(full) == 2
    for _ in range(20):  # dead feeds: a new value may get the same id; it must be validated all the same
        bad = ort.OrtValue.ortvalue_from_numpy(np.zeros((4, 2), np.float32), "cuda", 0)
        ok = ort.OrtValue.ortvalue_from_numpy(np.ones((2, 4), np.float32), "cuda", 0)
        g.run({"X": ok})
        del ok
        gc.collect()
        with pytest.raises(ortcapture.TransferError, match="shape"):
            g.run({"X": bad})
        del bad
    out = g.run({"X": srcs[0]}, copy_outputs=False)[0]
    g.run({"X": srcs[1]})  # out is stale now: feeding it must raise, never copy the newer values silently
    with pytest.raises(ortcapture.StaleOutputError):
        g.run({"X": out})
    old = sync.COPY_BACKEND
    try:
        sync.COPY_BACKEND = "cuda-python"  # the backend switch is honoured on the next call
        if pytest.importorskip("cuda.bindings", reason="cuda-python"):
            np.testing.assert_array_equal(g.run({"X": srcs[0]})[0], np.full((2, 4), 3.0))
    finally:
        sync.COPY_BACKEND = old


def test_bf16_model_captures_from_numpy_and_torch_sources(cuda):
    """Issue 20: a bfloat16 model captured on CUDA, fed ml_dtypes.bfloat16 arrays and torch.bfloat16 tensors
    (DLPack, device to device); outputs bit-exact against the uncaptured run."""
    import onnxruntime as ort

    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    model = tiny.bf16_scale_model()
    sess = cuda.session(model)
    plain = cuda.plain(model)

    def uncaptured(x):
        v = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), 16)  # onnx.TensorProto.BFLOAT16
        ortcapture.update_inplace(v, x)
        return ortcapture.to_numpy(plain.run_with_ort_values(["Y"], {"X": v})[0])

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 8)).astype(np.float32).astype(bf16) for _ in range(3)]
    with sess.capture({"X": xs[0]}) as g:
        assert g.inputs["X"].data_type() == "tensor(bfloat16)"
        for x in xs:
            (y,) = g.run({"X": x})
            assert y.dtype == bf16
            np.testing.assert_array_equal(y.view(np.uint16), uncaptured(x).view(np.uint16))
            np.testing.assert_array_equal(y.astype(np.float32), (x.astype(np.float32) * 2 + 1).astype(bf16)
                                          .astype(np.float32))
        (out,) = g.run({"X": xs[1]}, copy_outputs=False)
        np.testing.assert_array_equal(out.numpy().view(np.uint16), uncaptured(xs[1]).view(np.uint16))
        torch = pytest.importorskip("torch")
        t = torch.randn(4, 8, device="cuda").to(torch.bfloat16)
        (y,) = g.run({"X": t})
        want = (t.float() * 2 + 1).to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
        np.testing.assert_array_equal(y.view(np.uint16), want)
        assert g.replays == 5


def _queued_copier(g, name, which="last"):
    """The remembered copy of ``name``'s last (``_prev``: the one before) device-to-device feed, and whether it is
    queued on the compute stream."""
    fn = getattr(g._targets, which)[name][1]
    return fn, "async_copier" in getattr(fn, "__qualname__", "")


def test_cuda_graph_session_runs_on_a_compute_stream_of_its_own(cuda):
    """A CUDA-graph session gets ortcapture's own compute stream (ORT's user_compute_stream; hidden from
    get_provider_options as the caller configured it), and a captured graph's repeated device-to-device feeds are
    queued on it ahead of the replay — one source, two in turn, two inputs, after set_providers and compact(): every
    replay sees its source's new contents, and no queued copy fell back to ORT's synchronous one."""
    import onnxruntime as ort

    from ortcapture._ort import compute_stream
    from ortcapture._ort.compat import OrtInferenceSession

    fallbacks = compute_stream.FALLBACKS[0]
    sess = cuda.session(tiny.affine_model((1, 64)))
    stream = sess.compute_stream
    assert stream is not None
    assert OrtInferenceSession.get_provider_options(sess)["CUDAExecutionProvider"]["user_compute_stream"] == str(
        stream)
    assert sess.get_provider_options()["CUDAExecutionProvider"]["user_compute_stream"] == "0"
    raw = ort.InferenceSession(tiny.affine_model((1, 64)), **cuda.session_args(True))  # the same options, raw ORT
    assert sess.get_provider_options() == raw.get_provider_options()
    del raw
    g = sess.capture({"X": np.zeros((1, 64), np.float32)})
    rng = np.random.default_rng(1)
    srcs = [sess.allocate((1, 64), np.float32) for _ in range(2)]

    def check(graph, n, pick):
        for i in range(n):
            x = rng.random((1, 64), dtype=np.float32)
            src = srcs[pick(i)]
            ortcapture.update_inplace(src, x)
            np.testing.assert_array_equal(graph.run({"X": src})[0], x * 2 + 1)

    check(g, 20, lambda i: 0)  # one source, new contents each call
    assert _queued_copier(g, "X")[1]
    check(g, 20, lambda i: i & 1)  # double-buffered: both remembered, both queued
    assert _queued_copier(g, "X")[1] and _queued_copier(g, "X", "_prev")[1]
    sess2 = cuda.session(tiny.add_model((2, 4)))
    g2 = sess2.capture({"A": np.zeros((2, 4), np.float32), "B": np.zeros((2, 4), np.float32)})
    a = ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 4), np.float32), "cuda", 0)
    b = ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 4), np.float32), "cuda", 0)
    for i in range(10):
        ortcapture.update_inplace(a, np.full((2, 4), i, np.float32))
        ortcapture.update_inplace(b, np.full((2, 4), 10 * i, np.float32))
        np.testing.assert_array_equal(g2.run({"A": a, "B": b})[0], np.full((2, 4), 11 * i))
    assert _queued_copier(g2, "A")[1] and _queued_copier(g2, "B")[1]
    sess.set_providers(["CUDAExecutionProvider"], [{"enable_cuda_graph": "1"}])
    assert sess.compute_stream == stream  # the same stream for the new C session
    g = sess.capture({"X": np.zeros((1, 64), np.float32)})
    check(g, 6, lambda i: 0)
    assert _queued_copier(g, "X")[1]
    sess.compact()  # rebuilds the C session through the same build
    assert sess.compute_stream == stream
    g = sess.capture({"X": np.zeros((1, 64), np.float32)})
    check(g, 6, lambda i: 0)
    assert _queued_copier(g, "X")[1]
    assert compute_stream.FALLBACKS[0] == fallbacks


def test_queued_feed_copy_waits_for_work_on_the_legacy_stream(cuda):
    """The queued copy is ordered after work on the calling thread's legacy default stream, as ORT's synchronous
    update_inplace is: a source written on the legacy stream behind ~1 GiB of device copies queued there (cuda-python
    only) is seen by the replay; so is one written by torch on its default stream behind a long kernel."""
    pytest.importorskip("cuda.bindings", reason="cuda-python")
    from cuda.bindings import runtime as rt

    sess = cuda.session(tiny.affine_model((1, 64)))
    g = sess.capture({"X": np.zeros((1, 64), np.float32)})
    src = sess.allocate((1, 64), np.float32)
    ortcapture.update_inplace(src, np.zeros((1, 64), np.float32))
    g.run({"X": src})
    g.run({"X": src})
    assert _queued_copier(g, "X")[1]
    legacy = rt.cudaStream_t(int(rt.cudaStreamLegacy))
    big = 1 << 30
    err, p = rt.cudaMalloc(2 * big)
    assert not int(err)
    try:
        for byte in (0x3F, 0x40, 0x41):
            (err,) = rt.cudaMemcpyAsync(p, p + big, big, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, legacy)
            assert not int(err)
            (err,) = rt.cudaMemsetAsync(src.data_ptr(), byte, 64 * 4, legacy)  # behind the 1 GiB copy
            assert not int(err)
            x = np.frombuffer(bytes([byte]) * 256, np.float32).reshape(1, 64)
            np.testing.assert_array_equal(g.run({"X": src})[0], x * 2 + 1)
    finally:
        rt.cudaDeviceSynchronize()
        rt.cudaFree(p)
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(src)
    assert torch.cuda.current_stream().cuda_stream == 0  # torch's default stream: the legacy one
    for v in (3.0, 5.0, 7.0):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work on the legacy stream, then the write behind it
        t.fill_(v)
        np.testing.assert_array_equal(g.run({"X": src})[0], np.full((1, 64), 2 * v + 1))


def test_callers_compute_stream_is_used_and_reported(cuda, monkeypatch):
    """A user_compute_stream the caller gives is ORT's stream: reported as given, and the one feed copies queue
    on; ORTCAPTURE_COMPUTE_STREAM=0 (compute_stream.ENABLED) leaves ORT its own stream, copies synchronous."""
    pytest.importorskip("cuda.bindings", reason="cuda-python")
    import onnxruntime as ort

    from ortcapture._ort import cudart

    stream = cudart.new_stream(0)
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        opts = {"enable_cuda_graph": "1", "device_id": "0", "user_compute_stream": str(int(stream))}
        sess = ortcapture.InferenceSession(tiny.affine_model((1, 64)), so,
                                           providers=[("CUDAExecutionProvider", opts)])
        assert sess.compute_stream == int(stream)
        assert sess.get_provider_options()["CUDAExecutionProvider"]["user_compute_stream"] == str(int(stream))
        g = sess.capture({"X": np.zeros((1, 64), np.float32)})
        src = sess.allocate((1, 64), np.float32)
        for v in (1.0, 2.0, 3.0):
            ortcapture.update_inplace(src, np.full((1, 64), v, np.float32))
            np.testing.assert_array_equal(g.run({"X": src})[0], np.full((1, 64), 2 * v + 1))
        assert _queued_copier(g, "X")[1]
        del g, sess
        monkeypatch.setattr(sync, "COMPUTE_STREAM", False)
        sess = cuda.session(tiny.affine_model((1, 64)))
        assert sess.compute_stream is None
        g = sess.capture({"X": np.zeros((1, 64), np.float32)})
        for v in (1.0, 2.0):
            ortcapture.update_inplace(src, np.full((1, 64), v, np.float32))
            np.testing.assert_array_equal(g.run({"X": src})[0], np.full((1, 64), 2 * v + 1))
        assert not _queued_copier(g, "X")[1]
        del g, sess
    finally:
        import gc

        gc.collect()
        cudart.release_later("stream", stream)
