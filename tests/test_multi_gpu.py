"""Two-GPU behaviour (issue 7): runs only where the CUDA EP sees at least two GPUs.

A session on ``device_id=1`` allocates its fixed buffers on GPU 1, captures and replays there with results equal to
the uncaptured run on the same GPU, refuses bindings that live on GPU 0, copies explicitly (peer to peer, never
through the host) when a feed or an ``update_inplace`` source lives on the other GPU, and two capturing sessions
on two GPUs replay correctly from two threads at once.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import ortcapture
from ortcapture._ort import cudart
from ortcapture._ort.providers import session_args
from tests import tiny
from tests.conftest import cuda_available

pytestmark = pytest.mark.cuda


def _gpu_count() -> int:
    from ortcapture._ort import compat

    rt = compat.cudart()
    if rt is None:
        return 0
    err, n = rt.cudaGetDeviceCount()
    return int(n) if int(err) == 0 else 0


@pytest.fixture
def two_gpus():
    if not cuda_available() or _gpu_count() < 2:
        pytest.skip("needs the CUDA EP and two GPUs")


def _args(device_id: int, capture: bool = True) -> dict:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return session_args("cuda", capture, so, device_id=device_id)


def _session(model, device_id: int) -> ortcapture.InferenceSession:
    return ortcapture.InferenceSession(model, **_args(device_id))


def _on_gpu(value, device_id: int) -> bool:
    """Where CUDA itself says the OrtValue's memory lives (not ortcapture's own record)."""
    return cudart.pointer_device(int(value.data_ptr())) == device_id


def test_reference_model_captured_on_gpu1_matches_uncaptured(two_gpus, reference_model_path):
    import onnxruntime as ort

    sess = _session(reference_model_path, 1)
    assert sess.capture_info.device_id == 1
    plain = ort.InferenceSession(reference_model_path, **_args(1, capture=False))
    rng = np.random.default_rng(7)
    xs = [rng.random((1, 3, 320, 320), dtype=np.float32) for _ in range(4)]
    g = sess.capture({"images": xs[0]})
    for name, buf in {**g.inputs, **g.outputs}.items():
        assert _on_gpu(buf, 1), f"fixed buffer {name} is not on GPU 1"
    for x in xs * 3:
        (want,) = plain.run(None, {"images": x})
        (got,) = g.run({"images": x})
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_cross_device_bindings_refused(two_gpus):
    import onnxruntime as ort

    sess = _session(tiny.affine_model(), 1)
    buf = sess.allocate((2, 4), np.float32)
    assert _on_gpu(buf, 1) and ortcapture._memory.buffers.device_id_of(buf) == 1
    on_gpu0 = ort.OrtValue.ortvalue_from_shape_and_type([2, 4], np.float32, "cuda", 0)
    assert _on_gpu(on_gpu0, 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("X", on_gpu0)
    binding.bind_ortvalue_output("Y", sess.allocate((2, 4), np.float32))
    with pytest.raises(ortcapture.BindingError, match="cuda:0"):
        sess.run_with_iobinding(binding, ortcapture.run_options_for(5))
    binding = sess.io_binding()
    binding.bind_ortvalue_input("X", buf)
    binding.bind_ortvalue_output("Y", ort.OrtValue.ortvalue_from_shape_and_type([2, 4], np.float32, "cuda", 0))
    with pytest.raises(ortcapture.BindingError, match="cuda:0"):
        sess.run_with_iobinding(binding, ortcapture.run_options_for(6))
    assert sess.captured_graphs == {}  # nothing was captured by the refused calls
    # the same session still captures once given its own buffers
    g = sess.capture({"X": np.ones((2, 4), np.float32)})
    np.testing.assert_array_equal(g.run({"X": np.full((2, 4), 2.0, np.float32)})[0], np.full((2, 4), 5.0))


def test_cross_gpu_updates_are_peer_copies(two_gpus, no_host_path, monkeypatch):
    import onnxruntime as ort

    sess = _session(tiny.affine_model(), 1)
    g = sess.capture({"X": np.zeros((2, 4), np.float32)})
    dst1 = sess.allocate((2, 4), np.float32)
    dst0 = ort.OrtValue.ortvalue_from_shape_and_type([2, 4], np.float32, "cuda", 0)
    srcs = [ort.OrtValue.ortvalue_from_numpy(np.full((2, 4), float(k), np.float32), "cuda", 0) for k in range(3)]
    no_host_path()
    for k, src in enumerate(srcs):  # GPU 0 OrtValue -> captured graph on GPU 1
        np.testing.assert_array_equal(g.run({"X": src})[0], np.full((2, 4), 2.0 * k + 1))
    ortcapture.update_inplace(dst1, srcs[2])  # GPU 0 -> GPU 1
    from ortcapture._ort import compat

    rt = compat.cudart()
    can = all(int(rt.cudaDeviceCanAccessPeer(a, b)[1]) for a, b in ((0, 1), (1, 0)))
    assert cudart._PEER.get((0, 1)) is can  # peer access switched on by the first cross-GPU copy where possible
    ortcapture.update_inplace(dst0, dst1)  # GPU 1 -> GPU 0
    assert ortcapture.to_numpy(dst0).tolist() == [[2.0] * 4] * 2
    torch = pytest.importorskip("torch")
    t0 = torch.arange(8, dtype=torch.float32, device="cuda:0").reshape(2, 4) * 3  # pending work on GPU 0
    np.testing.assert_array_equal(g.run({"X": t0})[0], (t0 * 2 + 1).cpu().numpy())
    ortcapture.update_inplace(dst1, t0)
    np.testing.assert_array_equal(ortcapture.to_numpy(dst1), t0.cpu().numpy())
    # the cuda-python backend (ORT without OrtValue-to-OrtValue copies) does the same peer copy
    from ortcapture._ort import sync

    monkeypatch.setattr(sync, "COPY_BACKEND", "cuda-python")
    calls = []
    real = cudart.memcpy_d2d
    monkeypatch.setattr(cudart, "memcpy_d2d", lambda *a: (calls.append(a), real(*a)))
    for k in range(10):
        v = ort.OrtValue.ortvalue_from_numpy(np.full((2, 4), float(k), np.float32), "cuda", 0)
        assert g.run({"X": v})[0][1, 3] == 2 * k + 1
    assert len(calls) == 10


def test_two_sessions_two_gpus_two_threads(two_gpus, reference_model_path):
    """Captured in the main thread, replayed from one thread per GPU (ORT keeps CUDA graphs per thread: each
    worker's first replay captures for it, under the process-wide gate); then each thread builds and captures
    its own session while the other thread keeps replaying (ORT captures in cudaStreamCaptureModeGlobal: without
    the gate the other thread's copies break the capture with CUDA error 901)."""
    import onnxruntime as ort

    rng = np.random.default_rng(3)
    xs = [rng.random((1, 3, 320, 320), dtype=np.float32) for _ in range(3)]
    plain = ort.InferenceSession(reference_model_path, **_args(0, capture=False))
    want = [plain.run(None, {"images": x})[0] for x in xs]
    graphs = [_session(reference_model_path, d).capture({"images": xs[0]}) for d in (0, 1)]
    errors, start = [], threading.Barrier(2)

    def worker(k):
        try:
            start.wait()
            for i in range(150):
                got = graphs[k].run({"images": xs[i % 3]})[0]
                if np.abs(got - want[i % 3]).max() > 1e-3:
                    errors.append((k, i, "reference"))
                if i == 20 + 60 * k:  # mid-loop: a new session and capture in this thread, beside the other's replays
                    tg = _session(tiny.affine_model(), k).capture({"X": np.zeros((2, 4), np.float32)})
                if i > 20 + 60 * k:
                    x = np.full((2, 4), float(i + 1000 * k), np.float32)
                    if not np.array_equal(tg.run({"X": x})[0], 2 * x + 1):
                        errors.append((k, i, "affine"))
        except Exception as exc:  # noqa: BLE001 - a failing thread must fail the test
            errors.append((k, repr(exc)))

    ts = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert errors == []
    assert [g.replays for g in graphs] == [150, 150]
