"""A real library that builds its own ORT session, under ortcapture.patched() (issue 24 item 4): nudenet 3.4.2's
NudeDetector (it calls ``onnxruntime.InferenceSession(model_path)`` with no providers and plain ``run()``). Its
detections are unchanged and its runs are really replayed. CI: WebGPU on the software adapter; timing on the H200:
``benchmarks/dropin_library.py``."""
from __future__ import annotations

import numpy as np
import pytest

import ortcapture


def images(n: int, size=(240, 320)) -> list[np.ndarray]:
    """Synthetic BGR images (uint8) with a few bright blocks: deterministic, no files."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        img = (rng.random((*size, 3)) * 60).astype(np.uint8)
        for _ in range(3):
            y, x = rng.integers(0, size[0] - 60), rng.integers(0, size[1] - 60)
            img[y:y + 60, x:x + 40] = rng.integers(120, 255, 3, dtype=np.uint8)
        out.append(img)
    return out


def _same(got: list[dict], want: list[dict], atol: float) -> None:
    assert [d["class"] for d in got] == [d["class"] for d in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g["box"], w["box"], atol=1.0 + atol)
        assert abs(g["score"] - w["score"]) <= atol


@pytest.mark.slow
def test_nudenet_detector_under_patched_is_unchanged_and_replayed(backend):
    nudenet = pytest.importorskip("nudenet", reason="nudenet 3.4.2 + opencv-python-headless (tools/bootstrap.sh)")
    pytest.importorskip("cv2")
    import onnxruntime as ort

    imgs = images(3)
    original = ort.InferenceSession
    with ortcapture.patched(backend.name):
        det = nudenet.NudeDetector()
    assert ort.InferenceSession is original
    sess = det.onnx_session
    assert isinstance(sess, ortcapture.InferenceSession) and (sess.capture_enabled or sess.capture_deferred)
    got = [det.detect(img) for img in imgs]
    assert sess.stats["captured"] == 1 and sess.stats["replayed"] == 3 and sess.stats["uncaptured"] == 0
    reference = nudenet.NudeDetector()  # unpatched: ORT's CPU session (or ORT's default providers)
    want = [reference.detect(img) for img in imgs]
    for g, w in zip(got, want):
        _same(g, w, atol=2e-3)  # GPU kernels vs the CPU EP
    # synthetic images give few or no detections: compare the model's raw outputs (boxes and class scores) too
    from nudenet.nudenet import _read_image

    for img in imgs:
        x = _read_image(img, det.input_width)[0]
        (y,) = sess.run(None, {det.input_name: x})
        (r,) = reference.onnx_session.run(None, {reference.input_name: x})
        assert y.shape == r.shape == (1, 22, 2100)
        np.testing.assert_allclose(y, r, rtol=1e-3, atol=2e-3 * float(np.abs(r).max()))
    assert sess.stats["replayed"] == 6
