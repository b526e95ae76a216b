"""Issue 17: models that should capture do (view and constant outputs, overridable initializers, shapeless
inputs), and those that cannot say why (a CaptureUnsupportedError naming the dtype, op, output or nodes off the EP).

WebGPU runs on the software adapter; the ``backend`` fixture's CUDA half is marked ``cuda``.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import ortcapture
from ortcapture._verify import inspect as _inspect
from ortcapture._ort import specialize as shapes
from ortcapture.errors import CaptureError, CaptureUnsupportedError
from tests import tiny
from tests.conftest import webgpu_available


def _x(k: int, shape=(1, 8)) -> np.ndarray:
    return np.sin(0.37 * k + np.arange(np.prod(shape), dtype=np.float32).reshape(shape)).astype(np.float32)


# -- model inspection (CPU only) -----------------------------------------------------------------------------------
def test_inspection_tells_views_from_constants():
    model = onnx.load_from_string(tiny.recurrent_view_model())
    assert _inspect.view_outputs(model) == {"y": "Unsqueeze", "state_out": "Reshape", "flat": "Flatten"}
    assert _inspect.constant_outputs(model) == frozenset()
    const = onnx.load_from_string(tiny.constant_outputs_model())
    assert _inspect.constant_outputs(const) == {"W0", "K", "C", "S"}
    assert _inspect.view_outputs(const) == {}  # Reshape(W0) is a constant, not a stale view
    # Shape of a dynamic input is not a constant
    dyn = onnx.load_from_string(tiny.recurrent_view_model(dynamic=True))
    assert _inspect.view_outputs(dyn) == {"y": "Unsqueeze", "state_out": "Reshape", "flat": "Flatten"}


def test_view_rewrite_keeps_outputs_and_values():
    src = tiny.recurrent_view_model()
    rewritten = onnx.load_from_string(_inspect.rewrite_view_outputs(src))
    original = onnx.load_from_string(src)
    assert [o.SerializeToString() for o in rewritten.graph.output] == \
        [o.SerializeToString() for o in original.graph.output]
    casts = [n for n in rewritten.graph.node if n.op_type == "Cast"]
    assert sorted(n.output[0] for n in casts) == ["flat", "state_out", "y"]
    onnx.checker.check_model(rewritten)
    feeds = {"x": _x(1), "state_in": _x(2)}
    a = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, want in zip(b, a):
        np.testing.assert_array_equal(got, want)
    # nothing to rewrite: the model comes back as given
    plain = tiny.affine_model()
    assert _inspect.rewrite_view_outputs(plain) is plain


def test_shapeless_inputs_are_specialisable():
    model = onnx.load_from_string(tiny.shapeless_model())
    assert shapes.shapeless_inputs(model) == ["X"]
    assert shapes.specializable_inputs(model) == ["X"]
    fixed = onnx.load_from_string(shapes.fix_input_shapes(model.SerializeToString(), {"X": (3, 5)}))
    assert shapes.input_dims(fixed) == {"X": [3, 5]}
    scalar = onnx.load_from_string(shapes.fix_input_shapes(model.SerializeToString(), {"X": ()}))
    assert scalar.graph.input[0].type.tensor_type.HasField("shape") and shapes.input_dims(scalar) == {"X": []}
    with pytest.raises(CaptureError, match="negative"):
        shapes.fix_input_shapes(model.SerializeToString(), {"X": (2, -1)})


def test_io_problems_name_dtype_op_and_output():
    assert "tensor(int8)" in _inspect.io_problems(onnx.load_from_string(tiny.dtype_model(TensorProto.INT8)),
                                                  "webgpu")[0]
    assert _inspect.io_problems(onnx.load_from_string(tiny.dtype_model(TensorProto.INT8)), "cuda") == []
    z = _inspect.io_problems(onnx.load_from_string(tiny.zipmap_model()))
    assert len(z) == 1 and "'Z'" in z[0] and "ZipMap" in z[0] and "seq(map(int64" in z[0]
    o = _inspect.io_problems(onnx.load_from_string(tiny.optional_input_model()))
    assert len(o) == 1 and "input 'O'" in o[0] and "optional" in o[0]


# -- item 1: view outputs ------------------------------------------------------------------------------------------
def _step_reference(plain, x, state):
    return plain.run(None, {"x": x, "state_in": state})


def test_view_outputs_replay_right_over_1000_recurrent_steps(backend):
    """Outputs that are views (Unsqueeze(ReduceSum), Reshape, Flatten(Identity)) of internal tensors, one of them
    carried state: 1000 captured replays equal 1000 uncaptured runs, step by step."""
    model = tiny.recurrent_view_model()
    sess = backend.session(model)
    plain = backend.plain(model)
    assert [(o.name, o.shape) for o in sess.get_outputs()] == [("y", [1, 1]), ("state_out", [1, 8]), ("flat", [1, 8])]
    state0 = _x(-1) * 0.5
    g = sess.capture({"x": _x(0), "state_in": state0}, state={"state_out": "state_in"})
    state = state0
    for k in range(1000):
        x = _x(k)
        got = g.run({"x": x})
        want = _step_reference(plain, x, state)
        for name, a, b in zip(("y", "state_out", "flat"), got, want):
            assert a.shape == b.shape, name
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{name} at step {k}")
        state = want[1]
    assert g.replays == 1000
    g.reset_state()
    np.testing.assert_allclose(g.run({"x": _x(0)})[1], _step_reference(plain, _x(0), state0)[1], rtol=1e-5, atol=1e-6)


def test_view_outputs_on_raw_iobinding_path():
    """The raw path (run_with_iobinding + gpu_graph_id) replays view outputs too: the session's own model is the
    rewritten one on WebGPU."""
    webgpu_available()
    from ortcapture._ort.providers import session_args
    from ortcapture._core.run import run_options_for

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ortcapture.InferenceSession(tiny.view_output_model(), **session_args("webgpu", True, so))
    x, y = sess.allocate((2, 4), np.float32), sess.allocate((8,), np.float32)
    b = sess.io_binding()
    b.bind_ortvalue_input("X", x)
    b.bind_ortvalue_output("Y", y)
    for k in range(4):
        v = _x(k, (2, 4))
        ortcapture.update_inplace(x, v)
        sess.run_with_iobinding(b, run_options_for(1))
        np.testing.assert_array_equal(ortcapture.to_numpy(y), np.maximum(v, 0).reshape(8))


def test_view_outputs_of_capture_deferred_sessions():
    """Dynamic dims whose shape subgraph falls to CPU: capture is deferred to shape-specialised siblings, which get
    the same in-graph outputs (two shapes, several replays each, state carried)."""
    webgpu_available()
    model = tiny.recurrent_view_model(dynamic=True)
    from ortcapture._ort.providers import session_args

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ortcapture.InferenceSession(model, **session_args("webgpu", True, so))
    assert sess.capture_deferred
    plain = ort.InferenceSession(model, **session_args("webgpu", False, ort.SessionOptions()))
    for batch in (1, 3):
        shape = (batch, 8)
        state0 = _x(100, shape)
        g = sess.capture({"x": _x(0, shape), "state_in": state0}, state={"state_out": "state_in"})
        assert g.session.static_shapes == {"x": shape, "state_in": shape}
        state = state0
        for k in range(50):
            got = g.run({"x": _x(k, shape)})
            want = plain.run(None, {"x": _x(k, shape), "state_in": state})
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            state = want[1]


def test_real_stale_outputs_are_still_refused():
    """A pass-through output (the graph output named like the input) is neither a view nor a constant: no kernel
    writes it, so WebGPU capture stays refused."""
    webgpu_available()
    from ortcapture._ort.providers import session_args

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ortcapture.InferenceSession(tiny.passthrough_model(), **session_args("webgpu", True, so))
    with pytest.raises(CaptureError, match="not written by the captured graph's replay"):
        sess.capture({"X": _x(0, (2, 4))})
    assert sess.captured_graphs == {}


# -- item 2: constant outputs --------------------------------------------------------------------------------------
def test_constant_outputs_are_kept():
    """An initializer, a Reshape of one, a Constant node and Shape of a static input as outputs: ORT folds them and
    WebGPU never writes them on replay; their values never change, so the capture keeps them (WebGPU only: on CUDA an
    initializer output's per-run copy is ORT's own business)."""
    webgpu_available()
    from tests.conftest import Backend

    backend = Backend("webgpu")
    model = tiny.constant_outputs_model()
    sess = backend.session(model)
    plain = backend.plain(model)
    g = sess.capture({"X": _x(0, (2, 4))})
    for k in range(1, 6):
        x = _x(k, (2, 4))
        got = g.run({"X": x})
        want = plain.run(None, {"X": x})
        assert [a.dtype for a in got] == [b.dtype for b in want]
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[4], [2, 4])
    np.testing.assert_array_equal(got[2], [1.5, -2.0, 3.0, 4.25])


# -- item 3: overridable initializers ------------------------------------------------------------------------------
def test_overridable_initializers_are_inputs(backend):
    model = tiny.overridable_model()
    sess = backend.session(model)
    plain = backend.plain(model)
    assert [m.name for m in sess.get_overridable_initializers()] == ["W"]
    w0 = np.full((2, 4), 3.0, np.float32)
    g = sess.capture({"X": _x(0, (2, 4)), "W": w0})
    assert [n for n, _, _ in g.shape_key] == ["X", "W"]
    assert "W" in g.inputs and "W" in g.session.captured_graphs[g.graph_id]["inputs"]
    for k in range(4):
        x, w = _x(k, (2, 4)), w0 * (k + 1)
        np.testing.assert_allclose(g.run({"X": x, "W": w})[0], plain.run(None, {"X": x, "W": w})[0], rtol=1e-6)
    np.testing.assert_allclose(g.run({"X": x})[0], x * w + 0.5, rtol=1e-6)  # W keeps its last value
    # not fed: the initializer's own value
    g2 = sess.capture({"X": _x(9, (2, 4))})
    np.testing.assert_allclose(g2.run()[0], _x(9, (2, 4)) * 2 + 0.5, rtol=1e-6)
    with pytest.raises(ortcapture.TransferError, match="unknown input"):
        sess.capture({"X": _x(0, (2, 4)), "B": w0})  # a plain initializer is not an input


# -- item 4: inputs without shape information ----------------------------------------------------------------------
def test_shapeless_inputs_specialise_to_the_example():
    webgpu_available()
    from ortcapture._ort.providers import session_args

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ortcapture.InferenceSession(tiny.shapeless_model(), **session_args("webgpu", True, so))
    assert sess.capture_deferred
    for shape in [(2, 4), (3,)]:
        x = _x(1, shape)
        g = sess.capture({"X": x})
        assert g.session.static_shapes == {"X": shape}
        np.testing.assert_array_equal(g.run({"X": x * 2})[0], x * 2 + 1)
    fixed = ortcapture.InferenceSession(tiny.shapeless_model(), **session_args("webgpu", True, ort.SessionOptions()),
                                        static_shapes={"X": (2, 4)})
    assert fixed.capture_enabled and fixed.static_shapes == {"X": (2, 4)}


# -- item 5: honest refusals ---------------------------------------------------------------------------------------
def _webgpu_args():
    from ortcapture._ort.providers import session_args

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return session_args("webgpu", True, so)


def test_refusal_after_specialising_names_the_nodes_off_the_ep():
    webgpu_available()
    sess = ortcapture.InferenceSession(tiny.round_model(), **_webgpu_args())
    assert sess.capture_deferred
    with pytest.raises(CaptureUnsupportedError) as info:
        sess.capture({"X": _x(0, (2, 4))})
    msg = str(info.value)
    assert "Round 'round_it'" in msg and "ortcapture doctor" in msg and "X=2x4" in msg
    assert "Mul 'square'" not in msg  # Mul runs on the EP
    assert sess.captured_graphs == {}


def test_refusal_of_fixed_dims_names_the_nodes_off_the_ep():
    webgpu_available()
    with pytest.raises(CaptureUnsupportedError) as info:
        ortcapture.InferenceSession(tiny.round_model((2, 4)), **_webgpu_args())
    assert "Round 'round_it'" in str(info.value) and "ortcapture doctor" in str(info.value)
    with pytest.raises(CaptureUnsupportedError, match="Round 'round_it'"):
        ortcapture.InferenceSession(tiny.round_model(), **_webgpu_args(), static_shapes={"X": (2, 4)})


def test_set_providers_on_a_deferred_session_defers_again():
    webgpu_available()
    import onnxruntime_ep_webgpu  # noqa: F401 - the WebGPU tests need it anyway

    from ortcapture import webgpu

    webgpu.register()
    probe = ort.InferenceSession(tiny.affine_model(), providers=["CPUExecutionProvider"])
    probe.set_providers([("WebGpuExecutionProvider", {})])
    if "WebGpuExecutionProvider" not in probe.get_providers():
        pytest.skip(f"onnxruntime {ort.__version__} ignores a plugin EP named in set_providers (falls back to CPU)")
    model = tiny.recurrent_view_model(dynamic=True)
    sess = ortcapture.InferenceSession(model, **_webgpu_args())
    assert sess.capture_deferred
    sess.set_providers([("WebGpuExecutionProvider", {"enableGraphCapture": "1"})])
    assert sess.capture_deferred and "WebGpuExecutionProvider" in sess.get_providers()
    assert "have not been partitioned" in sess.capture_refusal
    shape = (2, 8)
    g = sess.capture({"x": _x(0, shape), "state_in": _x(1, shape)})
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(
        None, {"x": _x(3, shape), "state_in": _x(1, shape)})
    for a, b in zip(g.run({"x": _x(3, shape)}), want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- item 6: name the cause ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("elem", [TensorProto.INT8, TensorProto.INT16, TensorProto.UINT16, TensorProto.DOUBLE,
                                  TensorProto.UINT64])
def test_unsupported_dtypes_are_named(elem):
    webgpu_available()
    name = onnx.helper.tensor_dtype_to_string(elem).replace("TensorProto.", "").lower()
    with pytest.raises(CaptureUnsupportedError) as info:
        ortcapture.InferenceSession(tiny.dtype_model(elem), **_webgpu_args())
    msg = str(info.value)
    assert f"input 'X' is tensor({name})" in msg and "Add 'add'" in msg
    # dynamic dims: refused when capture() specialises, with the same cause
    sess = ortcapture.InferenceSession(tiny.dtype_model(elem, ("batch", 4)), **_webgpu_args())
    with pytest.raises(CaptureUnsupportedError, match=rf"tensor\({name}\)"):
        sess.capture({"X": np.zeros((2, 4), onnx.helper.tensor_dtype_to_np_dtype(elem))})


@pytest.mark.parametrize("builder, cause", [
    ("zipmap_model", "output 'Z' is seq(map(int64"),
    ("sequence_model", "output 'Q' is seq(tensor(float)"),
    ("optional_input_model", "input 'O' is optional("),
])
def test_non_tensor_io_is_named(builder, cause):
    webgpu_available()
    with pytest.raises(CaptureUnsupportedError) as info:
        ortcapture.InferenceSession(getattr(tiny, builder)(), **_webgpu_args())
    assert cause in str(info.value)
    if builder == "zipmap_model":
        assert "ZipMap 'zipmap'" in str(info.value)


def test_string_inputs_are_named():
    webgpu_available()
    sess = ortcapture.InferenceSession(tiny.string_model(), **_webgpu_args())
    with pytest.raises(CaptureUnsupportedError, match=r"input 'S' is tensor\(string\)"):
        sess.capture({"S": np.array(["a", "b"], object)})
