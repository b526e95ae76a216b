"""Shape specialization helpers (model editing only; no EP needed)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from ortcapture._ort import specialize as shapes
from ortcapture.errors import CaptureError
from tests import tiny


def test_input_dims_and_dynamic_inputs():
    named = shapes.load_model(tiny.dynamic_model(True))
    unnamed = shapes.load_model(tiny.dynamic_model(False))
    assert shapes.input_dims(named) == {"X": ["batch", "n"]}
    assert shapes.input_dims(unnamed) == {"X": [None, None]}
    assert shapes.dynamic_inputs(shapes.load_model(tiny.add_model())) == {}


@pytest.mark.parametrize("named", [True, False])
def test_fix_input_shapes_fixes_dims_and_still_runs(named):
    import onnxruntime as ort

    fixed = shapes.fix_input_shapes(tiny.dynamic_model(named), {"X": (3, 5)})
    model = onnx.load_from_string(fixed)
    assert shapes.input_dims(model) == {"X": [3, 5]}
    sess = ort.InferenceSession(fixed, providers=["CPUExecutionProvider"])
    x = np.ones((3, 5), np.float32)
    np.testing.assert_array_equal(sess.run(None, {"X": x})[0], 3 * x)


@pytest.mark.parametrize("bad, msg", [
    ({"Q": (1, 2)}, "names input 'Q'"),
    ({"X": (1, 2, 3)}, "rank"),
    ({"X": (-1, 2)}, "negative"),
])
def test_fix_input_shapes_rejects_bad_shapes(bad, msg):
    with pytest.raises(CaptureError, match=msg):
        shapes.fix_input_shapes(tiny.dynamic_model(True), bad)


def test_fix_input_shapes_rejects_contradicting_fixed_dims():
    with pytest.raises(CaptureError, match="contradicts"):
        shapes.fix_input_shapes(tiny.add_model(), {"A": (3, 4)})


def test_shape_signature_is_order_independent():
    assert shapes.shape_signature({"a": [1, 2], "b": (3,)}) == shapes.shape_signature({"b": [3], "a": (1, 2)})
    assert shapes.feed_shapes({"a": np.zeros((2, 3))}) == {"a": (2, 3)}


def test_capture_refusal_detection():
    assert shapes.is_capture_refusal(RuntimeError(
        "This session cannot use the graph capture feature as requested by the user  as all compute graph nodes "
        "have not been partitioned to the WebGpuExecutionProvider"))
    assert not shapes.is_capture_refusal(RuntimeError("file not found"))
