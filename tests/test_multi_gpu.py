"""Two-GPU behaviour (issue 7): runs only where the CUDA EP sees at least two GPUs."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import ortcapture
from tests import tiny
from tests.conftest import cuda_available

pytestmark = pytest.mark.cuda


def _gpu_count() -> int:
    from ortcapture import compat

    rt = compat.cudart()
    if rt is None:
        return 0
    err, n = rt.cudaGetDeviceCount()
    return int(n) if int(err) == 0 else 0


@pytest.fixture
def two_gpus():
    if not cuda_available() or _gpu_count() < 2:
        pytest.skip("needs the CUDA EP and two GPUs")


def _session(device_id):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ortcapture.InferenceSession(tiny.affine_model(), so, providers=[
        ("CUDAExecutionProvider", {"enable_cuda_graph": "1", "device_id": str(device_id)}), "CPUExecutionProvider"])


def test_capture_on_second_gpu_and_refuse_cross_device(two_gpus):
    import onnxruntime as ort

    sess = _session(1)
    assert sess.capture_info.device_id == 1
    buf = sess.allocate((2, 4), np.float32)
    assert ortcapture.buffers.device_id_of(buf) == 1
    g = sess.capture({"X": np.ones((2, 4), np.float32)})
    np.testing.assert_array_equal(g.run({"X": np.full((2, 4), 2.0, np.float32)})[0], np.full((2, 4), 5.0))
    on_gpu0 = ort.OrtValue.ortvalue_from_shape_and_type([2, 4], np.float32, "cuda", 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("X", on_gpu0)
    binding.bind_ortvalue_output("Y", sess.allocate((2, 4), np.float32))
    with pytest.raises(ortcapture.BindingError, match="cuda:0"):
        sess.run_with_iobinding(binding, ortcapture.run_options_for(5))
    # explicit cross-GPU update (peer copy) into the GPU-1 buffer
    src = ort.OrtValue.ortvalue_from_numpy(np.full((2, 4), 4.0, np.float32), "cuda", 0)
    np.testing.assert_array_equal(g.run({"X": src})[0], np.full((2, 4), 9.0))


def test_two_sessions_two_gpus_two_threads(two_gpus):
    graphs = [_session(d).capture({"X": np.zeros((2, 4), np.float32)}) for d in (0, 1)]
    errors = []

    def worker(k):
        for i in range(200):
            x = np.full((2, 4), float(i + 1000 * k), np.float32)
            if not np.array_equal(graphs[k].run({"X": x})[0], 2 * x + 1):
                errors.append((k, i))

    ts = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert errors == []
