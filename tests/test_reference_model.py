"""The reference model (YOLOv8n, nudenet 3.4.2 320n.onnx) captured and replayed on each backend.

On WebGPU its dynamic batch/height/width make ORT refuse capture at session creation, so ortcapture captures on a
shape-specialised sibling (CapturedGraph path) or on a session specialised up front (static_shapes, raw path).
"""
from __future__ import annotations

import numpy as np
import pytest

import ortcapture
from ortcapture.session import run_options_for

SHAPE = (1, 3, 320, 320)
pytestmark = pytest.mark.slow


def _tol(backend):
    return 1e-3 if backend.name == "webgpu" else 1e-4


def test_reference_model_captured_graph_matches_uncaptured(backend, reference_model_path, rng):
    plain = backend.plain(reference_model_path)
    sess = backend.session(reference_model_path)
    if backend.name == "webgpu":
        assert sess.capture_deferred  # ORT refused capture for the dynamic dims; capture() specialises
    xs = [rng.random(SHAPE, np.float32) for _ in range(3)]
    with sess.capture({"images": xs[0]}) as g:
        assert g.outputs["output0"].shape() == [1, 22, 2100]
        for x in xs[1:] + xs[:1]:
            (got,) = g.run({"images": x})
            (want,) = plain.run(None, {"images": x})
            assert got.shape == (1, 22, 2100)
            np.testing.assert_allclose(got, want, atol=_tol(backend) * max(1.0, np.abs(want).max()), rtol=0)
            assert np.abs(got).max() > 0


def test_reference_model_raw_iobinding_path(backend, reference_model_path, rng):
    plain = backend.plain(reference_model_path)
    sess = backend.session(reference_model_path, static_shapes={"images": SHAPE})
    assert sess.capture_enabled
    x_buf = sess.allocate(SHAPE, np.float32)
    y_buf = sess.allocate((1, 22, 2100), np.float32)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("images", x_buf)
    binding.bind_ortvalue_output("output0", y_buf)
    for _ in range(2):
        x = rng.random(SHAPE, np.float32)
        ortcapture.update_inplace(x_buf, x)
        sess.run_with_iobinding(binding, run_options_for(0))
        want = plain.run(None, {"images": x})[0]
        np.testing.assert_allclose(ortcapture.to_numpy(y_buf), want, atol=_tol(backend) * np.abs(want).max(),
                                   rtol=0)
    with pytest.raises(ortcapture.BindingError):
        binding.bind_ortvalue_input("images", sess.allocate(SHAPE, np.float32))
