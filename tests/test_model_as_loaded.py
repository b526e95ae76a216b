"""The model as it was loaded (issue 30, item 6), and models past protobuf's 2 GB limit (item 7).

A session keeps running the model it was built from, as ORT does: shape-specialised siblings (``capture()`` on a
shape-deferred session, buckets), ``static_shapes=`` and ``compact()`` (ORT's ``_reset_session`` reads
``_model_path`` again) are built from the bytes read at construction. Before the fix a model file replaced after
construction was silently captured (``verify=False``) or refused as a capture fault (``verify=True``), and a deleted
one gave a bare ``FileNotFoundError``. Weights in external data files stay on disk: a changed or missing one is a
``CaptureError`` that says so.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortcapture
from ortcapture.session import run_options_for
from tests.tiny import vi


def scaled_model(w: np.ndarray) -> onnx.ModelProto:
    """Y = X * W + ConstantOfShape([batch, 1]) (ones), X [batch, 4]: the shape subgraph makes ORT's WebGPU EP defer
    capture to shape-specialised siblings."""
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["X"], ["shp"]),
        helper.make_node("Gather", ["shp", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
        helper.make_node("Concat", ["b1", "one"], ["cshape"], axis=0),
        helper.make_node("ConstantOfShape", ["cshape"], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [1],
                                                                                        [1.0])),
        helper.make_node("Mul", ["X", "W"], ["m"]),
        helper.make_node("Add", ["m", "c"], ["Y"]),
    ]
    graph = helper.make_graph(nodes, "scaled", [vi("X", ["batch", 4])], [vi("Y", ["batch", 4])],
                              [numpy_helper.from_array(w.astype(np.float32), "W"), ints("zero", 0), ints("axis0", [0]),
                               ints("one", [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


W_A = np.array([2, 2, 2, 2], np.float32)
W_B = np.array([5, 5, 5, 5], np.float32)


def _save(model, path, external=False):
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data", size_threshold=45)  # W only (sys.getsizeof: 49 bytes)
    else:
        onnx.save(model, str(path))


def _check(graph, x, w=W_A):
    for k in range(2):
        np.testing.assert_array_equal(graph.run({"X": x + k})[0], (x + k) * w + 1)


@pytest.mark.parametrize("change", ["replaced", "deleted"])
def test_a_replaced_or_deleted_model_file_changes_nothing(backend, tmp_path, change):
    path = tmp_path / "model.onnx"
    _save(scaled_model(W_A), path)
    sess = backend.session(str(path))
    fixed = backend.session(str(path), static_shapes={"X": (2, 4)})
    bucketed = backend.session(str(path), buckets={"batch": [4]})
    if change == "replaced":
        _save(scaled_model(W_B), path)  # same inputs and outputs, other weights
    else:
        path.unlink()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    _check(sess.capture({"X": x}, verify=False), x)  # before: the new file's weights, silently
    g = sess.capture({"X": np.ones((3, 4), np.float32)}, verify=True)  # before: VerificationError (or no file)
    np.testing.assert_array_equal(g.run({"X": x[:1].repeat(3, 0)})[0], x[:1].repeat(3, 0) * W_A + 1)
    _check(fixed.capture({"X": x}), x)
    np.testing.assert_array_equal(bucketed.run(None, {"X": x})[0], x * W_A + 1)
    sess.compact()  # ORT's _reset_session would read the file again
    _check(g, np.ones((3, 4), np.float32))
    fixed.compact()
    np.testing.assert_array_equal(fixed.run(None, {"X": x}, run_options_for(-1))[0], x * W_A + 1)


def test_a_model_given_as_bytes_is_kept_as_given(backend):
    data = scaled_model(W_A).SerializeToString()
    sess = backend.session(data)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    _check(sess.capture({"X": x}), x)
    sess.compact()
    _check(sess.capture({"X": x + 1}), x)


@pytest.mark.parametrize("change", ["changed", "gone"])
def test_changed_or_missing_external_data_is_refused(backend, tmp_path, change):
    path = tmp_path / "model.onnx"
    _save(scaled_model(W_A), path, external=True)
    data = tmp_path / "model.onnx.data"
    sess = backend.session(str(path))
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    g = sess.capture({"X": x})
    _check(g, x)
    if change == "changed":
        os.replace(data, tmp_path / "saved.data")
        _save(scaled_model(W_B), tmp_path / "other.onnx", external=True)
        shutil.copyfile(tmp_path / "other.onnx.data", data)  # same size, other weights
    else:
        data.unlink()
    if sess.capture_deferred:  # a sibling for new shapes would read the weights from disk
        with pytest.raises(ortcapture.CaptureError, match=f"external data file.*{change}: .*model.onnx.data"):
            sess.capture({"X": np.ones((3, 4), np.float32)})
    with pytest.raises(ortcapture.CaptureError, match=r"compact\(\) refused: the model's external data"):
        sess.compact()
    _check(g, x)  # nothing touched: the graph runs with the weights it was built with


# -- models over 2 GB (issue 30, item 7) ---------------------------------------------------------------------------
#: float32 elements of the big initializer: 2 GiB + 4 MiB of weights, past protobuf's 2 GB message limit
BIG_ELEMENTS = (1 << 29) + (1 << 20)
BIG_HEAD = np.array([2, 3, 4, 5], np.float32)  # its first four values; the rest are zeros (a sparse file)


def big_model(tmp_path) -> str:
    """``big.onnx`` + ``big.onnx.data`` (2.15 GB external data, written sparse: quick, little disk):
    Y = X * Slice(Wbig, 0:4) + ConstantOfShape([batch, 1]) and Z = Reshape(Y, [-1]) (a view output, which the WebGPU
    session rewrites), X [batch, 4]. ORT folds the Slice at session creation, so it reads the external data."""
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    big = TensorProto(name="Wbig", data_type=TensorProto.FLOAT, dims=[BIG_ELEMENTS])
    big.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "big.onnx.data"), ("offset", "0"), ("length", str(BIG_ELEMENTS * 4))):
        entry = big.external_data.add()
        entry.key, entry.value = key, value
    with open(tmp_path / "big.onnx.data", "wb") as f:
        BIG_HEAD.tofile(f)
        f.truncate(BIG_ELEMENTS * 4)
    nodes = [
        helper.make_node("Slice", ["Wbig", "s0", "s4"], ["w"]),
        helper.make_node("Shape", ["X"], ["shp"]),
        helper.make_node("Gather", ["shp", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
        helper.make_node("Concat", ["b1", "one"], ["cshape"], axis=0),
        helper.make_node("ConstantOfShape", ["cshape"], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [1],
                                                                                        [1.0])),
        helper.make_node("Mul", ["X", "w"], ["m"]),
        helper.make_node("Add", ["m", "c"], ["Y"]),
        helper.make_node("Reshape", ["Y", "flat"], ["Z"]),
    ]
    graph = helper.make_graph(nodes, "big", [vi("X", ["batch", 4])], [vi("Y", ["batch", 4]), vi("Z", [None])],
                              [big, ints("s0", [0]), ints("s4", [4]), ints("zero", 0), ints("axis0", [0]),
                               ints("one", [1]), ints("flat", [-1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "big.onnx"
    path.write_bytes(model.SerializeToString())  # the graph only: the weights are in big.onnx.data
    return str(path)


@pytest.fixture
def big(tmp_path):
    if shutil.disk_usage(tmp_path).free < 6 << 30:
        pytest.skip("needs 6 GB of free disk for a 2 GB external-data model")
    return big_model(tmp_path)


def test_models_over_2gb_specialise_rewrite_and_rebuild(backend, big):
    """Every path that re-serialises the model (shape specialisation, static_shapes=, bucket siblings, the WebGPU
    view-output rewrite) serialises the graph only and points ORT at the weights' folder. Before the fix each
    failed in protobuf (the weights were loaded into the message: EncodeError / "exceeds maximum protobuf size")."""
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    want = x * BIG_HEAD + 1

    def check(outs, want=want):
        np.testing.assert_array_equal(outs[0], want)
        np.testing.assert_array_equal(outs[1], want.ravel())

    # each session build reads the 2 GB (ORT folds the Slice): ~1.5 s each here, so four builds in all
    fixed = backend.session(big, static_shapes={"X": (2, 4)})  # static_shapes= (+ the view rewrite on WebGPU)
    check(fixed.capture({"X": x}, verify="example").run({"X": x}))
    fixed.compact()  # the rebuilt C session finds the weights too
    check(fixed.run(None, {"X": x}, run_options_for(-1)))
    # shape-deferred on WebGPU: the bucket graph is captured on a shape-specialised sibling
    bucketed = backend.session(big, buckets={"batch": [4]}, output_axes={"Z": {0: lambda n: 4 * n}})
    check(bucketed.run(None, {"X": x}))
    assert bucketed.bucket_stats()["replayed"] == 1


def test_external_folder_lets_ort_build_a_rewritten_graph_from_bytes(tmp_path):
    """On every supported ORT (CPU EP; checked on 1.24.4 and 1.32.0): a graph rewritten without its external data
    builds from bytes once ``session.model_external_initializers_file_folder_path`` points at the weights; the
    caller's SessionOptions get their own value back."""
    import onnxruntime as ort

    from ortcapture._ort.model import EXTERNAL_FOLDER_KEY, ModelSource, external_folder
    from ortcapture._ort.specialize import fix_input_shapes

    path = tmp_path / "model.onnx"
    _save(scaled_model(W_A), path, external=True)
    source = ModelSource(str(path))
    assert source.external_files == [str(tmp_path / "model.onnx.data")]
    fixed = fix_input_shapes(source, {"X": (2, 4)})
    assert b"model.onnx.data" in fixed and len(fixed) < 1000  # the graph only: the weights stay referenced
    so = ort.SessionOptions()
    so.log_severity_level = 3
    with pytest.raises(Exception, match="(?i)external|model_path"):  # ORT: no folder for a model from bytes
        ort.InferenceSession(fixed, so, providers=["CPUExecutionProvider"])
    with external_folder(so, source.build_kwargs()["folder"]) as opts:
        assert opts is so
        sess = ort.InferenceSession(fixed, opts, providers=["CPUExecutionProvider"])
    assert so.get_session_config_entry(EXTERNAL_FOLDER_KEY) == ""  # put back: "" is unset for ORT
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(sess.run(None, {"X": x})[0], x * W_A + 1)
    with external_folder(None, source.folder) as opts:  # no caller options: new ones
        assert opts is not None and opts.get_session_config_entry(EXTERNAL_FOLDER_KEY) == source.folder
    source.check_external()
    (tmp_path / "model.onnx.data").unlink()
    with pytest.raises(ortcapture.CaptureError, match="gone: .*model.onnx.data"):
        source.check_external()
