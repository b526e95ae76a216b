"""CPU-only unit tests: drop-in behaviour with capture off, provider parsing, the registry and binding pins."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import ortcapture
from ortcapture import BindingError, CaptureUnsupportedError, GraphReleasedError
from ortcapture._ort.providers import CAPTURE_EPS, CaptureInfo, requested_capture
from ortcapture._core.registry import GraphRegistry
from ortcapture.session import graph_id_of, run_options_for
from tests import tiny

CUDA = CaptureInfo(CAPTURE_EPS["CUDAExecutionProvider"], 0)
WEBGPU = CaptureInfo(CAPTURE_EPS["WebGpuExecutionProvider"], 0)


def test_drop_in_with_capture_off_behaves_like_ort():
    model = tiny.add_model()
    ours = ortcapture.InferenceSession(model, providers=["CPUExecutionProvider"])
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    assert isinstance(ours, ort.InferenceSession)
    assert not ours.capture_enabled and not ours.capture_deferred and ours.capture_info is None
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(ours.run(None, {"A": x, "B": x})[0], theirs.run(None, {"A": x, "B": x})[0])
    v = ort.OrtValue.ortvalue_from_numpy(x)
    np.testing.assert_array_equal(ours.run_with_ort_values(["C"], {"A": v, "B": v})[0].numpy(), 2 * x)
    binding = ours.io_binding()
    assert isinstance(binding, ort.IOBinding)
    binding.bind_cpu_input("A", x)
    binding.bind_cpu_input("B", x)
    binding.bind_output("C")
    ours.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], 2 * x)
    assert ours.captured_graphs == {}
    with pytest.raises(CaptureUnsupportedError, match="graph capture enabled"):
        ours.capture({"A": x, "B": x})
    with pytest.raises(CaptureUnsupportedError):
        ours.allocate((2, 4), np.float32)
    assert ours.get_providers() == theirs.get_providers()


def test_capture_requested_but_unavailable_raises_at_construction():
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has the CUDA EP")
    with pytest.raises(CaptureUnsupportedError, match="without capture"):
        ortcapture.InferenceSession(
            tiny.add_model(), providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"}),
                                         "CPUExecutionProvider"])


@pytest.mark.parametrize(
    "providers, provider_options, expect",
    [
        ([("CUDAExecutionProvider", {"enable_cuda_graph": "1", "device_id": "1"})], None, ("cuda", 1)),
        ([("CUDAExecutionProvider", {"enable_cuda_graph": "0"})], None, None),
        (["CUDAExecutionProvider"], [{"enable_cuda_graph": "True"}], ("cuda", 0)),
        ([("TensorrtExecutionProvider", {"trt_cuda_graph_enable": 1, "device_id": 2})], None, ("cuda", 2)),
        ([("WebGpuExecutionProvider", {"enableGraphCapture": "1"})], None, ("webgpu", 0)),
        (["CPUExecutionProvider"], None, None),
        (None, None, None),
    ],
)
def test_requested_capture_parses_provider_arguments(providers, provider_options, expect):
    info = requested_capture(providers, provider_options, None)
    assert (None if info is None else (info.device_type, info.device_id)) == expect


def test_requested_capture_reads_plugin_ep_session_config():
    so = ort.SessionOptions()
    so.add_session_config_entry("ep.webgpuexecutionprovider.enableGraphCapture", "1")
    info = requested_capture(None, None, so)
    assert info is not None and info.ep.name == "WebGpuExecutionProvider"
    assert WEBGPU.ep.releases_natively is True  # WebGPU frees graphs; CUDA does not
    assert CUDA.releases_natively is False


def test_graph_id_of_run_options():
    assert graph_id_of(None) == 0
    assert graph_id_of(ort.RunOptions()) == 0
    assert graph_id_of(run_options_for(7)) == 7
    assert graph_id_of(run_options_for(-1)) == -1
    ro = ort.RunOptions()
    ro.add_run_config_entry("gpu_graph_id", "x")
    with pytest.raises(ortcapture.CaptureError, match="integer"):
        graph_id_of(ro)
    # int() takes " 0", "+0", "1_0", ORT's parse does not (its run failed inside the capture, the id retired); the
    # range message of "-2" was swallowed into "must be an integer" (a tester)
    for entry, words in [(" 0", "digits"), ("+0", "digits"), ("1_0", "digits"), ("-2", "or in \\[0, 2147483647\\], got -2"),
                         ("2147483648", "got 2147483648")]:
        ro = ort.RunOptions()
        ro.add_run_config_entry("gpu_graph_id", entry)
        with pytest.raises(ortcapture.CaptureError, match=words):
            graph_id_of(ro)


def _cpu_binding():
    sess = ortcapture.InferenceSession(tiny.add_model(), providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    vals = [ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 4), np.float32)) for _ in range(3)]
    binding.bind_ortvalue_input("A", vals[0])
    binding.bind_ortvalue_input("B", vals[1])
    binding.bind_ortvalue_output("C", vals[2])
    return sess, binding, vals


def test_registry_pins_binding_and_refuses_changes():
    sess, binding, vals = _cpu_binding()
    reg = GraphRegistry(CUDA)
    assert reg.check(binding, 0) is None  # first run of id 0 captures
    rec = reg.record(binding, 0)
    assert reg.check(binding, 0) is rec
    assert rec.nbytes == 3 * 32
    for call in (lambda: binding.bind_ortvalue_input("A", vals[2]), binding.clear_binding_inputs,
                 binding.clear_binding_outputs, lambda: binding.bind_cpu_input("A", np.zeros((2, 4), np.float32)),
                 lambda: binding.bind_ortvalue_output("C", vals[0])):
        with pytest.raises(BindingError, match="gpu_graph_id=\\[0\\]"):
            call()
    _, other, _ = _cpu_binding()
    with pytest.raises(BindingError, match="different IOBinding"):
        reg.check(other, 0)
    assert reg.free_id() == 1


def test_registry_retires_cuda_ids_but_frees_webgpu_ids():
    from ortcapture._ort import compat

    # WebGPU releases natively where ORT has release_captured_graph (>= 1.30); CUDA/TensorRT never do
    assert WEBGPU.releases_natively is compat.has_release_captured_graph()
    for info in (CUDA, WEBGPU):
        sess, binding, _ = _cpu_binding()
        reg = GraphRegistry(info)
        reg.record(binding, 3)
        reg.release(3)
        binding.bind_ortvalue_input("A", ort.OrtValue.ortvalue_from_numpy(np.ones((2, 4), np.float32)))  # unpinned
        if not info.releases_natively:
            with pytest.raises(GraphReleasedError, match="new gpu_graph_id"):
                reg.check(binding, 3)
            assert reg.free_id(3) == 4
        else:
            assert reg.check(binding, 3) is None
        reg.reset()
        assert reg.graph_ids == [] and reg.retired_ids == []


def test_signature_tracks_identity_shape_and_device():
    sess, binding, vals = _cpu_binding()
    sig = binding.capture_signature()
    binding.bind_ortvalue_input("A", ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 4), np.float32)))
    assert binding.capture_signature() != sig
    b = binding.bound_inputs["A"]
    assert (b.kind, b.device, b.shape, b.element_type) == ("ortvalue", "cpu", (2, 4), "tensor(float)")


def test_errors_are_value_errors():
    for cls in (ortcapture.CaptureError, BindingError, GraphReleasedError, ortcapture.TransferError,
                CaptureUnsupportedError, ortcapture.StaleOutputError):
        assert issubclass(cls, ValueError) and issubclass(cls, ortcapture.CaptureError)


def test_webgpu_capture_on_too_old_ort_is_refused_clearly():
    """onnxruntime < 1.27 silently never captures with the WebGPU plugin EP: ortcapture refuses at construction."""
    from ortcapture import webgpu
    from ortcapture._ort import compat

    if compat.webgpu_plugin_captures():
        pytest.skip(f"onnxruntime {ort.__version__} captures with the WebGPU plugin EP")
    if not webgpu.plugin_installed():
        pytest.skip("onnxruntime-ep-webgpu not installed")
    so = ort.SessionOptions()
    so.add_session_config_entry("ep.webgpuexecutionprovider.enableGraphCapture", "1")
    with pytest.raises(CaptureUnsupportedError, match="needs onnxruntime >= 1.27.0"):
        ortcapture.InferenceSession(tiny.add_model(), so)


def test_cross_device_binding_refused_without_gpus():
    """The refusal logic of issue 7, on the CPU: buffers recorded as cuda:0 bound to a session capturing on cuda:1."""
    import types

    from ortcapture._core.capture import validate_bindings
    from ortcapture._ort.values import remember

    sess = ortcapture.InferenceSession(tiny.affine_model(), providers=["CPUExecutionProvider"])
    on = {}
    for name, dev in (("x0", 0), ("y0", 0), ("x1", 1), ("y1", 1)):
        on[name] = remember(ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 4), np.float32)), "cuda", dev)
    fake = types.SimpleNamespace(info=CaptureInfo(CAPTURE_EPS["CUDAExecutionProvider"], 1), session=sess)
    good = sess.io_binding()
    good.bind_ortvalue_input("X", on["x1"])
    good.bind_ortvalue_output("Y", on["y1"])
    assert validate_bindings(fake, good) == []
    for x, y, bad in (("x0", "y1", "input 'X' lives on cuda:0"), ("x1", "y0", "output 'Y' lives on cuda:0")):
        b = sess.io_binding()
        b.bind_ortvalue_input("X", on[x])
        b.bind_ortvalue_output("Y", on[y])
        with pytest.raises(BindingError, match=bad + ".*captures on cuda:1"):
            validate_bindings(fake, b)


def test_parse_provider_options_and_session_args_merge():
    from ortcapture._ort.providers import session_args
    from ortcapture.cli.options import parse_provider_options

    assert parse_provider_options(["prefer_nhwc=1", " cudnn_conv_algo_search = HEURISTIC "]) == {
        "prefer_nhwc": "1", "cudnn_conv_algo_search": "HEURISTIC"}
    assert parse_provider_options([]) == {}
    for bad, msg in [(["x"], "KEY=VALUE"), (["=1"], "KEY=VALUE"), (["trt_cuda_graph_enable=1"], "switches"),
                     (["a=1", "a=1"], "twice")]:
        with pytest.raises(ortcapture.CaptureError, match=msg):
            parse_provider_options(bad)
    args = session_args("cuda", True, ep_options={"prefer_nhwc": "1"}, device_id=2)
    (name, opts), cpu = args["providers"]
    assert name == "CUDAExecutionProvider" and cpu == "CPUExecutionProvider"
    assert opts == {"prefer_nhwc": "1", "enable_cuda_graph": "1", "device_id": "2"}
    with pytest.raises(ortcapture.CaptureError, match="switches graph capture"):
        session_args("cuda", False, ep_options={"enable_cuda_graph": "1"})


def test_capture_gate_readers_share_writer_excludes_and_is_preferred():
    import threading
    import time

    from ortcapture._ort.sync import CaptureGate

    g = CaptureGate()
    log, inside = [], threading.Event()
    release_reader = threading.Event()

    def reader(tag, hold=None):
        with g.shared:
            with g.shared:  # re-entrant
                log.append(("in", tag))
                inside.set()
                if hold is not None:
                    hold.wait(5)
        log.append(("out", tag))

    def writer():
        with g.exclusive:
            with g.exclusive:  # re-entrant
                with g.shared:  # the capturing thread's own copies pass straight through
                    log.append(("write", None))

    r1 = threading.Thread(target=reader, args=("r1", release_reader))
    r1.start()
    assert inside.wait(5)
    with g.shared:  # a second reader gets in while r1 is inside
        log.append(("in", "main"))
    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.1)
    assert g.pending and not g.capturing  # waits for r1
    r2 = threading.Thread(target=reader, args=("r2",))
    r2.start()
    time.sleep(0.1)
    assert ("in", "r2") not in log  # a waiting writer keeps new readers out (writer preference)
    release_reader.set()
    for t in (r1, w, r2):
        t.join(5)
    order = [e for e in log if e[0] in ("write", "in")]
    assert order.index(("write", None)) < order.index(("in", "r2"))
    assert g.readers == 0 and not g.capturing and not g.pending
    with g.shared:
        with pytest.raises(RuntimeError, match="wait for itself"):
            with g.exclusive:
                pass



def test_cuda_session_guard_inline_reader_path_keeps_the_gate_protocol():
    """SessionGuard(cuda=True) does the gate's reader fast path inline (issue 32: two Python frames less per replay);
    with the process's real CUDA_GATE it still nests, lets the capturing thread's own work through, waits behind a
    pending writer (writer preference) and leaves the gate as it found it."""
    import threading
    import time

    from ortcapture._ort.sync import CUDA_GATE, CaptureGuard, SessionGuard

    a, b, c, d = (SessionGuard(threading.RLock(), True) for _ in range(4))
    cap = CaptureGuard(threading.RLock(), True)
    log, inside, release = [], threading.Event(), threading.Event()

    def reader():
        with a:
            with b:  # nested: depth 2, the gate's own path, then back to the inline exit of the outermost
                with a:
                    log.append("r1 in")
                    inside.set()
                    release.wait(5)
        log.append("r1 out")

    def writer():
        with cap:
            with c:  # the capturing thread's own copies pass straight through
                log.append("write")

    def late_reader():
        with c:
            log.append("r2 in")

    r1 = threading.Thread(target=reader)
    r1.start()
    assert inside.wait(5)
    with d:  # another reader shares the gate
        log.append("main in")
    assert CUDA_GATE.tls.slot.depth == 0 and not CUDA_GATE.tls.slot.active
    w = threading.Thread(target=writer)
    w.start()
    deadline = time.monotonic() + 5
    while not CUDA_GATE.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert CUDA_GATE.pending and not CUDA_GATE.capturing  # waits for r1
    r2 = threading.Thread(target=late_reader)
    r2.start()
    time.sleep(0.1)
    assert "r2 in" not in log  # the inline path saw the pending writer
    release.set()
    for t in (r1, w, r2):
        t.join(5)
    assert log.index("r1 out") < log.index("write") < log.index("r2 in")
    assert CUDA_GATE.readers == 0 and not CUDA_GATE.capturing and not CUDA_GATE.pending
    with pytest.raises(RuntimeError, match="exited without being entered"):
        a.__exit__(None, None, None) if a._lock.acquire() else None  # noqa: SLF001 - an exit without an enter

def test_names_cuda_ep():
    from ortcapture._ort.providers import names_cuda_ep

    assert names_cuda_ep([("CUDAExecutionProvider", {"device_id": "1"}), "CPUExecutionProvider"])
    assert names_cuda_ep(["TensorrtExecutionProvider"])
    assert not names_cuda_ep(["CPUExecutionProvider"]) and not names_cuda_ep(None) and not names_cuda_ep([])


def test_capture_gate_keeps_idle_threads_and_refuses_misuse():
    """A thread idle between calls when another thread registers must still hold off a capture (helper-found bug:
    registration used to drop idle slots); exits without enters and foreign exclusive exits raise."""
    import threading
    import time

    from ortcapture._ort.sync import CaptureGate

    g = CaptureGate()
    inside, leave, registered = threading.Event(), threading.Event(), threading.Event()

    def a():
        with g.shared:
            pass
        registered.wait(5)  # idle while b registers
        with g.shared:
            inside.set()
            leave.wait(5)

    def b():
        with g.shared:
            pass
        registered.set()

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start()
    tb.start()
    assert inside.wait(5)
    threading.Timer(0.3, leave.set).start()
    t0 = time.perf_counter()
    with g.exclusive:
        assert leave.is_set() and time.perf_counter() - t0 >= 0.25  # waited for a
    ta.join(5)
    tb.join(5)
    with pytest.raises(RuntimeError, match="without being entered"):
        g.shared.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="does not hold it"):
        g.exclusive.__exit__(None, None, None)
    # a thread that dies inside shared (entered by hand, never exited) does not block captures forever
    t = threading.Thread(target=g.shared.__enter__)
    t.start()
    t.join()
    with g.exclusive:
        assert g.capturing
    assert not g.capturing and g.readers == 0


def test_provider_options_are_validated():
    from ortcapture._ort.providers import check_provider_options, device_ordinal, session_args
    from ortcapture.cli.options import parse_provider_options

    for bad in ["a=1", b"a=1", [b"a=1"], [1]]:
        with pytest.raises(ortcapture.CaptureError):
            parse_provider_options(bad)
    for bad in [{"a=b": "c"}, {"x": None}, {"x": 1.5}, {"x": True}, {"": "1"}, {1: "1"}, ["a=1"], "a=1",
                {"device_id": "abc"}, {"deviceId": "1.0"}, {"device_id": -1}, {"enableGraphCapture": "1"}]:
        with pytest.raises(ortcapture.CaptureError):
            check_provider_options(bad)
    assert check_provider_options({"device_id": 1, " prefer_nhwc ": "1"}) == {"device_id": "1", "prefer_nhwc": "1"}
    assert device_ordinal(None) == 0 and device_ordinal(" 3 ") == 3
    (_, opts), _ = session_args("cuda", True, ep_options={"device_id": "1"})["providers"]
    assert opts["device_id"] == "1"  # honoured, not silently overridden by the device_id argument's default
    with pytest.raises(ortcapture.CaptureError, match="device ordinal"):
        ortcapture.InferenceSession(tiny.affine_model(), providers=[
            ("CUDAExecutionProvider", {"enable_cuda_graph": "1", "device_id": "abc"})])


def test_capture_gate_survives_an_interrupted_wait():
    """Ctrl-C while a capture waits for readers (or a reader waits for a capture) must leave the gate usable."""
    import threading

    from ortcapture._ort.sync import CaptureGate

    class Interrupt(BaseException):
        pass

    class InterruptingCondition(threading.Condition):
        armed = False

        def wait(self, timeout=None):
            if self.armed:
                self.armed = False
                raise Interrupt
            return super().wait(timeout)

    g = CaptureGate()
    g.cond = InterruptingCondition(threading.Lock())
    inside, leave = threading.Event(), threading.Event()

    def hold(block):
        with block:
            inside.set()
            leave.wait(5)

    def interrupted(holder, waiter):
        """Another thread holds ``holder``; this thread's ``waiter`` waits for it and is interrupted."""
        inside.clear()
        leave.clear()
        t = threading.Thread(target=hold, args=(holder,))
        t.start()
        assert inside.wait(5)
        g.cond.armed = True
        with pytest.raises(Interrupt):
            with waiter:
                pass
        return t

    t = interrupted(g.shared, g.exclusive)  # a capture waiting for a reader
    assert not g.pending and not g.writers.locked() and not g.capturing
    with g.shared:  # readers still get in
        pass
    leave.set()
    t.join(5)
    t = interrupted(g.exclusive, g.shared)  # a reader waiting for a capture
    assert g.tls.slot.depth == 0 and not g.tls.slot.active
    leave.set()
    t.join(5)
    with g.exclusive:  # this thread can still capture: it is not left "inside" shared
        assert g.capturing


def test_device_ordinal_refuses_non_ascii_empty_and_huge():
    from ortcapture._ort.providers import check_provider_options, device_ordinal

    for bad in ["\u00b2", "\u0661", str(2**31), "+1", "0x1"]:
        with pytest.raises(ortcapture.CaptureError, match="device ordinal"):
            device_ordinal(bad)
    with pytest.raises(ortcapture.CaptureError, match="empty"):
        check_provider_options({"device_id": ""})
    assert device_ordinal("7") == 7


def test_paired_extra_cancels_the_call_order_effect():
    """Whichever call of a pair goes second is 20 µs slower; b's true extra cost is 5 µs. The plain median of b - a
    lands on one order's value (25 or -15); timing.paired_extra weighs both orders alike and finds 5."""
    from ortcapture.cli import timing

    rng = np.random.default_rng(0)
    n = 101  # 51 pairs with a first, 50 with b first
    a, b = np.full(n, 100.0), np.full(n, 105.0)
    a[1::2] += 20  # a second
    b[0::2] += 20  # b second
    a += rng.normal(0, 0.5, n)
    b += rng.normal(0, 0.5, n)
    assert abs(float(np.median(b - a)) - 25) < 2
    assert abs(timing.paired_extra(a, b) - 5) < 0.5
    calls = []
    pa, pb = timing.paired(lambda i: calls.append(("a", i)), lambda i: calls.append(("b", i)), 4, warmup=0)
    assert [c for c, _ in calls] == ["a", "b", "b", "a", "a", "b", "b", "a"]  # a first in even pairs
    assert pa.shape == pb.shape == (4,)


def test_fast_pair_is_the_one_hot_path_test(monkeypatch):
    """transfer._fast_pair decides update_inplace's hot path, the one fast copy (CapturedGraph.run copies feeds
    through transfer.copy_feeds, which calls update_inplace). CPU OrtValues stand in for CUDA ones here (their
    device recorded as cuda:N), so every clause can be flipped."""
    from ortcapture._transfer import copy as transfer  # the implementation module: its globals are patched
    from ortcapture._ort import compat, sync
    from ortcapture._ort import values

    monkeypatch.setattr(transfer, "_ORT_D2D", True)
    monkeypatch.setattr(sync, "COPY_BACKEND", None)

    def val(shape=(2, 3), dtype=np.float32, dev=0):
        v = ort.OrtValue.ortvalue_from_numpy(np.arange(np.prod(shape), dtype=dtype).reshape(shape))
        values.remember(v, "cuda", dev)
        values.meta(v)
        return v

    dst, src = val(), val()
    sm, dm = values.meta(src), values.meta(dst)
    assert transfer._fast_pair(sm, dm, src)
    assert not transfer._fast_pair(values.meta(val((3, 2))), dm, src)  # shape
    assert not transfer._fast_pair(values.meta(val(dtype=np.int32)), dm, src)  # dtype
    assert not transfer._fast_pair(None, dm, src)  # metadata not cached yet
    assert not transfer._fast_pair(dm, dm, dst)  # the same buffer
    other_gpu = val(dev=1)
    assert transfer._fast_pair(values.meta(other_gpu), dm, other_gpu)  # peers: update_inplace handles them

    class Sub(ort.OrtValue):
        pass

    sub = Sub(compat.c_value(src))
    sub._ortcapture_meta = sm
    assert not transfer._fast_pair(sm, dm, sub)  # subclasses (ReplayOutput) go through the full checks
    monkeypatch.setattr(sync, "COPY_BACKEND", "cuda-python")
    assert not transfer._fast_pair(sm, dm, src)
    monkeypatch.setattr(sync, "COPY_BACKEND", None)
    monkeypatch.setattr(transfer, "_ORT_D2D", False)
    assert not transfer._fast_pair(sm, dm, src)



class _FakeCuda:
    """cuda-python's runtime and driver query of the legacy stream, answering what a test sets; calls logged."""

    def __init__(self):
        from types import SimpleNamespace

        self.calls: list = []
        self.answers = {"driver": (0, 0), "runtime": (0, 0)}
        self.rt = SimpleNamespace(cudaStreamIsCapturing=self._query("runtime"), cudaStream_t=int,
                                  cudaGetLastError=lambda: self.calls.append(("runtime", "cudaGetLastError")))
        self.drv = SimpleNamespace(cuStreamIsCapturing=self._query("driver"), CUstream=int, CU_STREAM_LEGACY=1)

    def _query(self, which):
        def q(stream):
            self.calls.append((which, int(stream)))
            return self.answers[which]
        return q

    def install(self, monkeypatch):
        import sys

        from ortcapture._ort import compat

        monkeypatch.setattr(compat, "cudart", lambda: self.rt)
        monkeypatch.setattr(compat, "cudadrv", lambda: self.drv)
        monkeypatch.delitem(sys.modules, "torch", raising=False)  # (the GPU machine's suite imports the real one)

    def ask(self, probe, driver=None, runtime=None):
        if driver is not None:
            self.answers["driver"] = driver
        if runtime is not None:
            self.answers["runtime"] = runtime
        self.calls.clear()
        return probe()


def test_capture_probe_asks_the_driver_and_falls_back_to_the_runtime(monkeypatch):
    """The foreign-capture probe (ORT PR #32081) asks cuStreamIsCapturing(CU_STREAM_LEGACY) and takes the runtime's
    cudaStreamIsCapturing(cudaStreamLegacy) where the driver has no answer (no current context on a new thread,
    201), counting 900-908 (e.g. 906, a blocking stream of the context capturing) and any status but none as
    capturing on either path; a runtime error is cleared (ORT checks cudaGetLastError() after its launches)."""
    from ortcapture._ort import cudart

    fake = _FakeCuda()
    fake.install(monkeypatch)
    probe = cudart.make_capture_probe()
    build = list(fake.calls)
    assert ("runtime", "cudaGetLastError") in build  # the build-time query leaves no sticky error either
    cases = [  # driver answer, runtime answer, probe's answer, the runtime asked too
        ((0, 0), (0, 1), False, False), ((0, 1), (0, 0), True, False), ((0, 2), (0, 0), True, False),
        ((906, 0), (0, 0), True, False), ((900, 0), (0, 0), True, False), ((908, 0), (0, 0), True, False),
        ((201, 0), (0, 0), False, True), ((201, 0), (0, 1), True, True), ((201, 0), (0, 2), True, True),
        ((201, 0), (906, 0), True, True), ((201, 0), (908, 0), True, True), ((201, 0), (999, 0), False, True),
        ((909, 0), (0, 0), False, True), ((3, 0), (0, 1), True, True)]
    for drv_answer, rt_answer, capturing, fell_back in cases:
        assert fake.ask(probe, drv_answer, rt_answer) is capturing, (drv_answer, rt_answer)
        calls = fake.calls
        assert calls[0] == ("driver", 1)  # CU_STREAM_LEGACY, not 0 (the per-thread stream in such builds)
        assert (("runtime", 1) in calls) is fell_back, (drv_answer, rt_answer)  # cudaStreamLegacy, likewise
        assert (("runtime", "cudaGetLastError") in calls) is (fell_back and rt_answer[0] != 0)
    # a cuda-python without the driver module: the runtime alone, as before
    monkeypatch.setattr(cudart.compat, "cudadrv", lambda: None)
    probe = cudart.make_capture_probe()
    assert fake.ask(probe, (0, 1), (906, 0)) is True
    assert fake.calls == [("runtime", 1), ("runtime", "cudaGetLastError")]
    # a driver module whose libcuda does not load (the query raises when the probe is built): the runtime alone
    monkeypatch.setattr(cudart.compat, "cudadrv", lambda: fake.drv)
    monkeypatch.setattr(fake.drv, "cuStreamIsCapturing", lambda s: (_ for _ in ()).throw(RuntimeError("no libcuda")))
    probe = cudart.make_capture_probe()
    assert fake.ask(probe, runtime=(0, 0)) is False and fake.calls == [("runtime", 1)]


@pytest.mark.parametrize("torch_api", ["c-query", "public"])
def test_capture_probe_asks_torch_after_the_legacy_stream(monkeypatch, torch_api):
    """Torch's current stream (torch.cuda.graph() captures a non-blocking side stream no legacy-stream query sees)
    is asked after the legacy stream, only once torch's CUDA is initialised, also when torch is imported after the
    probe was built (and not while half imported); torch's capture error is "capturing" (inside a blocking-stream
    capture its query of the legacy stream raises cudaErrorStreamCaptureImplicit), any other torch error is
    raised as torch's. Torch's C query where torch has it, else the public API."""
    import sys
    from types import SimpleNamespace

    from ortcapture._ort import cudart

    fake = _FakeCuda()
    fake.install(monkeypatch)
    probe = cudart.make_capture_probe()
    said = []

    def torch_query():
        fake.calls.append(("torch",))
        if isinstance(said[0], Exception):
            raise said[0]
        return said[0]

    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace())  # half imported: no torch.cuda yet
    assert fake.ask(probe) is False and fake.calls == [("driver", 1)]
    if torch_api == "c-query":
        cuda = SimpleNamespace(_initialized=False)
        torch = SimpleNamespace(cuda=cuda, _C=SimpleNamespace(_cuda_isCurrentStreamCapturing=torch_query))
    else:  # a torch without the C query: is_initialized() and is_current_stream_capturing()
        cuda = SimpleNamespace(_initialized=False)
        cuda.is_initialized = lambda: cuda._initialized
        cuda.is_current_stream_capturing = torch_query
        torch = SimpleNamespace(cuda=cuda, _C=SimpleNamespace())
    monkeypatch.setitem(sys.modules, "torch", torch)
    capture_error = RuntimeError("CUDA error: operation would make the legacy stream depend on a capturing blocking "
                                 "stream")
    for initialised, answer, capturing in ((False, True, False), (True, False, False), (True, True, True),
                                           (True, capture_error, True)):
        cuda._initialized = initialised
        said[:] = [answer]
        assert fake.ask(probe, (0, 0), (0, 0)) is capturing, (initialised, answer)
        assert fake.calls[0] == ("driver", 1) and (("torch",) in fake.calls) is initialised
    cuda._initialized = True
    said[:] = [False]
    assert fake.ask(probe, (201, 0), (999, 0)) is False and fake.calls[-1] == ("torch",)  # no legacy answer
    said[:] = [True]
    assert fake.ask(probe, (201, 0), (999, 0)) is True  # ...torch still asked
    assert fake.ask(probe, (906, 0)) is True and ("torch",) not in fake.calls  # the legacy stream's answer first
    said[:] = [RuntimeError("CUDA error: an illegal memory access was encountered")]
    with pytest.raises(RuntimeError, match="illegal memory access"):  # not dressed up as a capture
        fake.ask(probe, (0, 0), (0, 0))
