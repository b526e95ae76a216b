"""ortcapture.transfer.check_feeds: the feed plan's check without a device or session (issue 42, item 1)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from ortcapture import transfer
from ortcapture.errors import TransferError
from tests import tiny


def _specs_from_model(model: bytes):
    m = onnx.load_from_string(model)
    triples = []
    for vi in m.graph.input:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        triples.append((vi.name, f"tensor({onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name.replace('float32', 'float')})", dims))
    return transfer.input_specs(triples)


SPECS = _specs_from_model(tiny.bucket_model())  # X [batch, 4] float32


def test_a_feed_ort_takes_passes():
    transfer.check_feeds(SPECS, {"X": np.zeros((3, 4), np.float32)})


@pytest.mark.parametrize("feeds, match", [
    ({}, r"input 'X' missing"),
    ({"X": np.zeros((1, 4), np.float32), "Y": np.zeros(1)}, r"input 'Y' unknown"),
    ({"x": np.zeros((1, 4), np.float32)}, r"^input 'x' unknown and input 'X' missing: the model takes \['X'\]"),
    ({"X": [[0.0] * 4]}, r"input 'X' must be a numpy array, got a list"),
    ({"X": np.zeros((1, 4), np.float64)}, r"input 'X' is float32 in the model, the feed is float64"),
    ({"X": np.zeros((4,), np.float32)}, r"input 'X' has rank 2"),
    ({"X": np.zeros((1, 5), np.float32)}, r"input 'X' axis 1 is fixed at 4"),
])
def test_what_ort_would_refuse_is_refused_naming_the_input(feeds, match):
    with pytest.raises(TransferError, match=match):
        transfer.check_feeds(SPECS, feeds)


def test_value_rules_of_the_device_apply():
    specs = transfer.input_specs([("ids", "tensor(int64)", ["batch", 3])])
    big = np.array([[1, 2, 2**40]], np.int64)
    transfer.check_feeds(specs, {"ids": big}, transfer.value_rules("cuda"))  # CUDA holds int64
    with pytest.raises(TransferError, match=r"input 'ids'.*int32"):
        transfer.check_feeds(specs, {"ids": big}, transfer.value_rules("webgpu"))


def test_session_inputs_and_model_triples_give_the_same_specs():
    import onnxruntime as ort

    sess = ort.InferenceSession(tiny.bucket_model(), providers=["CPUExecutionProvider"])
    a = transfer.input_specs(sess.get_inputs())["X"]
    b = SPECS["X"]
    assert (a.name, a.dtype, a.dims) == (b.name, b.dtype, b.dims) == ("X", np.dtype(np.float32), (None, 4))
