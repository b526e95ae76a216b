"""Tiny ONNX models built with onnx.helper for the tests (no downloads)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _model(nodes, inputs, outputs, initializers=(), opset=17, check=True) -> bytes:
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    if check:
        onnx.checker.check_model(model)
    return model.SerializeToString()


def vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def add_model(shape=(2, 4), elem=TensorProto.FLOAT) -> bytes:
    """C = A + B."""
    return _model([helper.make_node("Add", ["A", "B"], ["C"])], [vi("A", shape, elem), vi("B", shape, elem)],
                  [vi("C", shape, elem)])


def affine_model(shape=(2, 4)) -> bytes:
    """Y = X * 2 + 1 (one input, one output)."""
    two = numpy_helper.from_array(np.full(shape, 2.0, np.float32), "two")
    one = numpy_helper.from_array(np.full(shape, 1.0, np.float32), "one")
    nodes = [helper.make_node("Mul", ["X", "two"], ["t"]), helper.make_node("Add", ["t", "one"], ["Y"])]
    return _model(nodes, [vi("X", shape)], [vi("Y", shape)], [two, one])


def recurrent_model(n=8) -> bytes:
    """state_out = tanh(state_in * 0.9 + x); y = state_out * 2 — one recurrent step."""
    a = numpy_helper.from_array(np.full((1, n), 0.9, np.float32), "a")
    two = numpy_helper.from_array(np.full((1, n), 2.0, np.float32), "two")
    nodes = [
        helper.make_node("Mul", ["state_in", "a"], ["m"]),
        helper.make_node("Add", ["m", "x"], ["s"]),
        helper.make_node("Tanh", ["s"], ["state_out"]),
        helper.make_node("Mul", ["state_out", "two"], ["y"]),
    ]
    return _model(nodes, [vi("x", [1, n]), vi("state_in", [1, n])], [vi("y", [1, n]), vi("state_out", [1, n])],
                  [a, two])


def recurrent_step(x: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference of :func:`recurrent_model`: returns (y, state_out)."""
    s = np.tanh(state * np.float32(0.9) + x).astype(np.float32)
    return s * np.float32(2.0), s


def counter_model(n=4) -> bytes:
    """state_out = state_in + 1 (detects extra warm-up steps)."""
    one = numpy_helper.from_array(np.ones((n,), np.float32), "one")
    return _model([helper.make_node("Add", ["state_in", "one"], ["state_out"])], [vi("state_in", [n])],
                  [vi("state_out", [n])], [one])


def dynamic_model(named=True) -> bytes:
    """Y = Reshape(X, Shape(X)) * 3 with dims [batch, n] (named) or [?, ?] (unnamed): has a shape subgraph."""
    dims = ["batch", "n"] if named else [None, None]
    three = numpy_helper.from_array(np.array(3.0, np.float32), "three")
    nodes = [
        helper.make_node("Shape", ["X"], ["shp"]),
        helper.make_node("Reshape", ["X", "shp"], ["r"]),
        helper.make_node("Mul", ["r", "three"], ["Y"]),
    ]
    return _model(nodes, [vi("X", dims)], [vi("Y", dims)], [three])


def if_model() -> bytes:
    """Y = If(cond, X + 1, X - 1): control flow, which graph capture refuses."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    then_g = helper.make_graph([helper.make_node("Add", ["X", "one_c"], ["t"])], "then", [], [vi("t", [2])],
                               [one])
    then_g.initializer[0].name = "one_c"
    else_g = helper.make_graph([helper.make_node("Sub", ["X", "one_c2"], ["e"])], "else", [], [vi("e", [2])],
                               [helper.make_tensor("one_c2", TensorProto.FLOAT, [], [1.0])])
    node = helper.make_node("If", ["cond"], ["Y"], then_branch=then_g, else_branch=else_g)
    return _model([node], [vi("cond", [], TensorProto.BOOL), vi("X", [2])], [vi("Y", [2])])


def identity_alias_model() -> bytes:
    """Y = Relu(X); Z = Identity(X): output Z is input X through Identity."""
    nodes = [helper.make_node("Relu", ["X"], ["Y"], name="relu"),
             helper.make_node("Identity", ["X"], ["Z"], name="copy_x")]
    return _model(nodes, [vi("X", [2, 4])], [vi("Y", [2, 4]), vi("Z", [2, 4])])


def passthrough_model() -> bytes:
    """Outputs Y = Relu(X) and X itself (a graph output named like the graph input)."""
    return _model([helper.make_node("Relu", ["X"], ["Y"])], [vi("X", [2, 4])], [vi("Y", [2, 4]), vi("X", [2, 4])])


def view_output_model() -> bytes:
    """Y = Reshape(Relu(X), [8]): the graph output comes straight from a view op."""
    shape = numpy_helper.from_array(np.array([8], np.int64), "shape8")
    nodes = [helper.make_node("Relu", ["X"], ["a"], name="relu"),
             helper.make_node("Reshape", ["a", "shape8"], ["Y"], name="flatten_out")]
    return _model(nodes, [vi("X", [2, 4])], [vi("Y", [8])], [shape])


def shape_subgraph_model() -> bytes:
    """Y = X + ConstantOfShape([batch, 1]) with X [batch, n]: ORT places the shape computation (Gather, Unsqueeze,
    Concat, ConstantOfShape) on the CPU EP, so ORT's WebGPU EP refuses capture until the dims are fixed."""
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["X"], ["shp"], name="shape"),
        helper.make_node("Gather", ["shp", "zero"], ["b"], name="gather_batch", axis=0),
        helper.make_node("Unsqueeze", ["b", "axis0"], ["b1"], name="unsqueeze_batch"),
        helper.make_node("Concat", ["b1", "one"], ["cshape"], name="concat_shape", axis=0),
        helper.make_node("ConstantOfShape", ["cshape"], ["c"], name="ones",
                         value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
        helper.make_node("Add", ["X", "c"], ["Y"], name="add"),
    ]
    return _model(nodes, [vi("X", ["batch", "n"])], [vi("Y", ["batch", "n"])],
                  [ints("zero", 0), ints("axis0", [0]), ints("one", [1])])


def bf16_scale_model(shape=(4, 8)) -> bytes:
    """Y (bfloat16) = Cast(Cast(X, float) * 2 + 1, bfloat16): a bfloat16 model that runs on CUDA."""
    from onnx import helper

    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    nodes = [helper.make_node("Cast", ["X"], ["xf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xf", "two"], ["m"]),
             helper.make_node("Add", ["m", "one"], ["yf"]),
             helper.make_node("Cast", ["yf"], ["Y"], to=TensorProto.BFLOAT16)]
    return _model(nodes, [vi("X", shape, TensorProto.BFLOAT16)], [vi("Y", shape, TensorProto.BFLOAT16)], [two, one])


def bucket_model() -> bytes:
    """A dynamic-batch model for batch buckets: X [batch, 4] ->
    ``scores`` = Relu(X @ W + b) [N, 3] (the batch dim named differently), ``probs`` = Softmax(scores) [?, 3]
    (unnamed), ``feat`` = Transpose(scores) [3, M] (batch on axis 1)."""
    rng = np.random.default_rng(7)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    b = numpy_helper.from_array(np.array([0.5, -0.25, 0.1], np.float32), "b")
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["pre"]),
        helper.make_node("Relu", ["pre"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=1),
        helper.make_node("Transpose", ["scores"], ["feat"], perm=[1, 0]),
    ]
    return _model(nodes, [vi("X", ["batch", 4])],
                  [vi("scores", ["N", 3]), vi("probs", [None, 3]), vi("feat", [3, "M"])], [w, b])


def bucket_cpu_answer():
    """``x -> {output name: array}``: :func:`bucket_model` run by the CPU EP alone (uncaptured), what a served request's
    answer must equal."""
    import onnxruntime as ort

    sess = ort.InferenceSession(bucket_model(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return lambda x: dict(zip(names, sess.run(None, {"X": x})))


def bucket_reference(x: np.ndarray) -> dict[str, np.ndarray]:
    """What :func:`bucket_model` computes, in numpy (float64, for tolerances)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((4, 3)).astype(np.float32).astype(np.float64)
    s = np.maximum(x.astype(np.float64) @ w + np.array([0.5, -0.25, 0.1]), 0)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return {"scores": s, "probs": e / e.sum(axis=1, keepdims=True), "feat": s.T}


def batch_pooled_model() -> bytes:
    """Y = ReduceMean(X, axis 0) [1, 4] for X [batch, 4]: zero padding along batch changes it."""
    return _model([helper.make_node("ReduceMean", ["X"], ["Y"], axes=[0], keepdims=1)],
                  [vi("X", ["batch", 4])], [vi("Y", [1, 4])])


def batch_max_model() -> bytes:
    """M = ReduceMax(X, axis 0) [4] and Y = 2 X for X [batch, 4]: zero padding along batch is harmless to M for a
    batch of positive values only (a tester's case: the bucket passed its check on positive rows, then gave 0 for
    negative ones)."""
    return _model([helper.make_node("ReduceMax", ["X"], ["M"], axes=[0], keepdims=0),
                   helper.make_node("Add", ["X", "X"], ["Y"])],
                  [vi("X", ["batch", 4])], [vi("M", [4]), vi("Y", ["batch", 4])], opset=17)


def masked_batch_max_model() -> bytes:
    """B = ReduceMax(X * V + (1 - V) * -1e4, axis 0) [4] for X [batch, 4] and a 0/1 row mask V [batch, 1] (float):
    padded rows (V = 0) can never win, whatever X holds."""
    c = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("one", 1.0), ("neg", -1e4))]
    return _model([helper.make_node("Mul", ["X", "V"], ["xv"]), helper.make_node("Sub", ["one", "V"], ["inv"]),
                   helper.make_node("Mul", ["inv", "neg"], ["off"]), helper.make_node("Add", ["xv", "off"], ["s"]),
                   helper.make_node("ReduceMax", ["s"], ["B"], axes=[0], keepdims=0)],
                  [vi("X", ["batch", 4]), vi("V", ["batch", 1])], [vi("B", [4])], c, opset=17)


def batch_doubled_model() -> bytes:
    """Y = Concat(X, X) along axis 0: [2*batch, 4], a length that is a function of the batch."""
    return _model([helper.make_node("Concat", ["X", "X"], ["Y"], axis=0)], [vi("X", ["batch", 4])],
                  [vi("Y", ["twice", 4])])


def batch_reshaped_model() -> bytes:
    """Y = Reshape(X, [-1, 2]): X [batch, 4] -> Y [2*batch, 2] (rows of one request stay first: a size function
    ``2 * batch`` slices it right)."""
    shape = numpy_helper.from_array(np.array([-1, 2], np.int64), "shape")
    return _model([helper.make_node("Reshape", ["X", "shape"], ["r"]), helper.make_node("Neg", ["r"], ["Y"])],
                  [vi("X", ["batch", 4])], [vi("Y", ["rows", 2])], [shape])


def batch_last_model() -> bytes:
    """Y = X * 2 + T with X [4, batch] (the batch on axis 1) and T [4, 1]: bucketed by ("X", 1)."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    return _model([helper.make_node("Mul", ["X", "two"], ["m"]), helper.make_node("Add", ["m", "T"], ["Y"])],
                  [vi("X", [4, "cols"]), vi("T", [4, 1])], [vi("Y", [4, "cols"])], [two])


def repeated_output_model(order=("Y", "Z", "Y"), shape=(2, 4)) -> bytes:
    """Y = X * 2, Z = X + 2, with graph outputs listed as ``order`` (one value may appear twice, as ONNX allows)."""
    two = numpy_helper.from_array(np.full(shape, 2.0, np.float32), "two")
    nodes = [helper.make_node("Mul", ["X", "two"], ["Y"]), helper.make_node("Add", ["X", "two"], ["Z"])]
    return _model(nodes, [vi("X", shape)], [vi(n, shape) for n in order], [two])


def two_output_model(shape=(2, 4)) -> bytes:
    """Y = X * 2, Z = X + 2 (two outputs of one shape)."""
    return repeated_output_model(("Y", "Z"), shape)


def where_model(shape=(2, 4)) -> bytes:
    """Y = Where(C, A, B): a bool input."""
    return _model([helper.make_node("Where", ["C", "A", "B"], ["Y"])],
                  [vi("C", shape, TensorProto.BOOL), vi("A", shape), vi("B", shape)], [vi("Y", shape)])


def identity_chain_model(rows=64, n=128, depth=4) -> bytes:
    """Y = X @ I @ I ... (``depth`` MatMuls with an n x n identity): Y == X exactly for small integer X (also under
    TF32), and as much device work per run as ``rows``, ``n`` and ``depth`` ask for."""
    eye = numpy_helper.from_array(np.eye(n, dtype=np.float32), "eye")
    names = ["X", *[f"h{i}" for i in range(1, depth)], "Y"]
    nodes = [helper.make_node("MatMul", [names[i], "eye"], [names[i + 1]]) for i in range(depth)]
    return _model(nodes, [vi("X", [rows, n])], [vi("Y", [rows, n])], [eye])


def recurrent_view_model(n=8, dynamic=False) -> bytes:
    """A recurrent step whose outputs are views (issue 17): s = tanh(state_in * 0.9 + x + zeros(Shape)); outputs
    ``y = Unsqueeze(ReduceSum(s, axis 1), 1)`` [b, 1], ``state_out = Reshape(s, Shape(state_in))`` [b, n] and
    ``flat = Flatten(Identity(s))`` [b, n]. Dims [1, n], or ["batch", n] with ``dynamic`` (its shape subgraph
    then falls to the CPU EP, so WebGPU capture is deferred to shape-specialised siblings)."""
    b = "batch" if dynamic else 1
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    a = numpy_helper.from_array(np.array(0.9, np.float32), "a")
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"], name="shape"),
        helper.make_node("Gather", ["shp", "zero"], ["b"], name="gather_batch", axis=0),
        helper.make_node("Unsqueeze", ["b", "axis0"], ["b1"], name="unsqueeze_batch"),
        helper.make_node("Concat", ["b1", "one"], ["cshape"], name="concat_shape", axis=0),
        helper.make_node("ConstantOfShape", ["cshape"], ["c"], name="zeros",
                         value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("Mul", ["state_in", "a"], ["m"], name="decay"),
        helper.make_node("Add", ["m", "x"], ["p"], name="add_x"),
        helper.make_node("Add", ["p", "c"], ["q"], name="add_zeros"),
        helper.make_node("Tanh", ["q"], ["s"], name="tanh"),
        helper.make_node("ReduceSum", ["s", "axis1"], ["r"], name="sum", keepdims=0),
        helper.make_node("Unsqueeze", ["r", "axis1"], ["y"], name="unsqueeze_y"),
        helper.make_node("Shape", ["state_in"], ["sshape"], name="state_shape"),
        helper.make_node("Reshape", ["s", "sshape"], ["state_out"], name="reshape_state"),
        helper.make_node("Identity", ["s"], ["si"], name="identity_s"),
        helper.make_node("Flatten", ["si"], ["flat"], name="flatten", axis=1),
    ]
    return _model(nodes, [vi("x", [b, n]), vi("state_in", [b, n])],
                  [vi("y", [b, 1]), vi("state_out", [b, n]), vi("flat", [b, n])],
                  [a, ints("zero", 0), ints("axis0", [0]), ints("one", [1]), ints("axis1", [1])])


def constant_outputs_model() -> bytes:
    """Y = Relu(X) and outputs that depend on no input value (issue 17): the initializer ``W0`` itself,
    ``K = Reshape(W0, [4])``, ``C`` from a Constant node and ``S = Shape(X)`` of the static input X [2, 4]."""
    w0 = numpy_helper.from_array(np.array([[1.5, -2.0], [3.0, 4.25]], np.float32), "W0")
    s4 = numpy_helper.from_array(np.array([4], np.int64), "s4")
    nodes = [
        helper.make_node("Relu", ["X"], ["Y"], name="relu"),
        helper.make_node("Reshape", ["W0", "s4"], ["K"], name="reshape_w"),
        helper.make_node("Constant", [], ["C"], name="const",
                         value=helper.make_tensor("cv", TensorProto.INT32, [3], [7, 8, 9])),
        helper.make_node("Shape", ["X"], ["S"], name="shape_x"),
    ]
    return _model(nodes, [vi("X", [2, 4])],
                  [vi("Y", [2, 4]), vi("W0", [2, 2]), vi("K", [4]), vi("C", [3], TensorProto.INT32),
                   vi("S", [2], TensorProto.INT64)], [w0, s4])


def overridable_model() -> bytes:
    """Y = X * W + B with W an overridable initializer (an initializer also listed as a graph input) and B not."""
    w = numpy_helper.from_array(np.full((2, 4), 2.0, np.float32), "W")
    b = numpy_helper.from_array(np.full((2, 4), 0.5, np.float32), "B")
    nodes = [helper.make_node("Mul", ["X", "W"], ["m"]), helper.make_node("Add", ["m", "B"], ["Y"])]
    return _model(nodes, [vi("X", [2, 4]), vi("W", [2, 4])], [vi("Y", [2, 4])], [w, b])


def shapeless_model() -> bytes:
    """Y = X + ConstantOfShape(Shape(X)) with X declared without any shape (not even a rank): ORT places the shape
    computation on the CPU EP, so WebGPU refuses capture until the shape is fixed."""
    nodes = [
        helper.make_node("Shape", ["X"], ["shp"], name="shape"),
        helper.make_node("ConstantOfShape", ["shp"], ["c"], name="ones",
                         value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
        helper.make_node("Add", ["X", "c"], ["Y"], name="add"),
    ]
    x = helper.make_value_info("X", helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    y = helper.make_value_info("Y", helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    return _model(nodes, [x], [y], check=False)  # onnx's checker wants a shape; ORT takes the model


def round_model(dims=("batch", 4)) -> bytes:
    """Y = Round(X * X): Round has no WebGPU kernel, so capture is refused whatever the dims."""
    nodes = [helper.make_node("Mul", ["X", "X"], ["sq"], name="square"),
             helper.make_node("Round", ["sq"], ["Y"], name="round_it")]
    return _model(nodes, [vi("X", list(dims))], [vi("Y", list(dims))])


def dtype_model(elem, dims=(2, 4)) -> bytes:
    """Y = X + X in element type ``elem``."""
    return _model([helper.make_node("Add", ["X", "X"], ["Y"], name="add")], [vi("X", list(dims), elem)],
                  [vi("Y", list(dims), elem)])


def zipmap_model() -> bytes:
    """Y = Softmax(X) [1, 3] and Z = ZipMap(Y): a sequence of maps, as classifiers exported by skl2onnx end."""
    nodes = [helper.make_node("Softmax", ["X"], ["Y"], name="softmax", axis=1),
             helper.make_node("ZipMap", ["Y"], ["Z"], name="zipmap", domain="ai.onnx.ml",
                              classlabels_int64s=[0, 1, 2])]
    z = helper.make_value_info("Z", helper.make_sequence_type_proto(
        helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, []))))
    graph = helper.make_graph(nodes, "zipmap", [vi("X", [1, 3])], [vi("Y", [1, 3]), z])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def sequence_model() -> bytes:
    """Y = Relu(X) and Q = SequenceConstruct(X, Y): a sequence output."""
    nodes = [helper.make_node("Relu", ["X"], ["Y"], name="relu"),
             helper.make_node("SequenceConstruct", ["X", "Y"], ["Q"], name="seq")]
    q = helper.make_value_info("Q", helper.make_sequence_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 4])))
    return _model(nodes, [vi("X", [2, 4])], [vi("Y", [2, 4]), q])


def optional_input_model() -> bytes:
    """Y = Relu(OptionalGetElement(O)) with O an optional(tensor(float)) input."""
    o = helper.make_value_info("O", helper.make_optional_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 4])))
    nodes = [helper.make_node("OptionalGetElement", ["O"], ["x"], name="get"),
             helper.make_node("Relu", ["x"], ["Y"], name="relu")]
    return _model(nodes, [o], [vi("Y", [2, 4])], opset=18)


def string_model() -> bytes:
    """Y = Identity(S) for a string input S [n] (dynamic)."""
    return _model([helper.make_node("Identity", ["S"], ["Y"], name="copy")], [vi("S", ["n"], TensorProto.STRING)],
                  [vi("Y", ["n"], TensorProto.STRING)])


def masked_attention_model() -> bytes:
    """ids, attention_mask int64 [batch, seq] -> hidden [batch, seq, 32], pooled [batch, 32]: masked self-attention
    (ortcapture.cli.models.masked_attention_model; padding with mask 0 is neutral)."""
    from ortcapture.cli.models import masked_attention_model as build

    return build()


def time_mean_model(d=4) -> bytes:
    """X [batch, seq, d] -> Y = ReduceMean over seq [batch, d] (no mask: padding changes it), Z = X * 2."""
    ax = numpy_helper.from_array(np.array([1], np.int64), "ax")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [helper.make_node("ReduceMean", ["X", "ax"], ["Y"], keepdims=0),
             helper.make_node("Mul", ["X", "two"], ["Z"])]
    return _model(nodes, [vi("X", ["batch", "seq", d])], [vi("Y", ["batch", d]), vi("Z", ["batch", "seq", d])],
                  [ax, two], opset=18)


def conv1d_model(causal=True, ch=3, k=3) -> bytes:
    """X [batch, ch, seq] -> Y = Conv1d(Tanh(Conv1d(X) + b)) [batch, ch, seq]; ``causal``: each conv padded k-1 on
    the left only (padding on the right is neutral), else k//2 on both sides (a single such conv sees zeros at its
    edge either way; the second one sees the first one's output on padded steps: not neutral)."""
    rng = np.random.default_rng(7)
    w1 = numpy_helper.from_array(rng.standard_normal((ch, ch, k)).astype(np.float32), "W1")
    b1 = numpy_helper.from_array(rng.standard_normal((ch,)).astype(np.float32), "B1")
    w2 = numpy_helper.from_array(rng.standard_normal((ch, ch, k)).astype(np.float32), "W2")
    pads = [k - 1, 0] if causal else [k // 2, k // 2]
    nodes = [helper.make_node("Conv", ["X", "W1", "B1"], ["c1"], pads=pads),
             helper.make_node("Tanh", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "W2"], ["Y"], pads=pads)]
    return _model(nodes, [vi("X", ["batch", ch, "seq"])], [vi("Y", ["batch", ch, "seq"])], [w1, b1, w2])


def batch_state_model(d=4) -> bytes:
    """x [batch, d], h [1, ?, d] (a recurrent state whose batch axis is unnamed) -> h_out = tanh(0.5 h + x)
    [1, ?, d], y = 2 h_out [1, ?, d]."""
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [helper.make_node("Mul", ["h", "half"], ["hh"]), helper.make_node("Add", ["hh", "x"], ["s"]),
             helper.make_node("Tanh", ["s"], ["h_out"]), helper.make_node("Mul", ["h_out", "two"], ["y"])]
    return _model(nodes, [vi("x", ["batch", d]), vi("h", [1, None, d])],
                  [vi("y", [1, None, d]), vi("h_out", [1, None, d])], [half, two])


def chaotic_model(n=64, steps=32, dims=None) -> bytes:
    """``steps`` unrolled steps of the logistic map ``x <- r * x * (1 - x)`` (r = 3.99, chaotic) on ``state_in``
    -> ``state_out``; ``y = 2 * state_out``. One factor ``x`` is computed as ``Exp(Log(x))``, which each EP rounds
    its own way (measured on the software WebGPU adapter: Exp alone differs from the CPU EP by one ulp on 61% of
    inputs); the map doubles such a difference every step, so after a few dozen steps the EPs disagree completely,
    while captured and uncaptured runs on one EP stay bit-identical. ``dims``: the state's dims (default ``[n]``;
    e.g. ``["batch", n]`` for a shape-deferred WebGPU session)."""
    dims = list(dims or [n])
    r = numpy_helper.from_array(np.array(3.99, np.float32), "r")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes, cur = [], "state_in"
    for i in range(steps):
        out = "state_out" if i == steps - 1 else f"x{i + 1}"
        nodes += [helper.make_node("Log", [cur], [f"l{i}"]), helper.make_node("Exp", [f"l{i}"], [f"e{i}"]),
                  helper.make_node("Sub", ["one", cur], [f"c{i}"]), helper.make_node("Mul", [f"e{i}", f"c{i}"], [f"p{i}"]),
                  helper.make_node("Mul", ["r", f"p{i}"], [out])]
        cur = out
    nodes.append(helper.make_node("Mul", ["state_out", "two"], ["y"]))
    return _model(nodes, [vi("state_in", dims)], [vi("y", dims), vi("state_out", dims)], [r, one, two])


def chaotic_steps(x: np.ndarray, runs: int, steps=32) -> np.ndarray:
    """numpy float32 logistic map: :func:`chaotic_model`'s ``state_out`` after ``runs`` runs (rounding of numpy's own)."""
    x = np.asarray(x, np.float32)
    for _ in range(runs * steps):
        x = (np.float32(3.99) * (np.exp(np.log(x)) * (np.float32(1) - x))).astype(np.float32)
    return x


def scalar_input_model() -> bytes:
    """Y = X * T with X [batch, 4] and T a 0-d float input (a temperature, a threshold)."""
    return _model([helper.make_node("Mul", ["X", "T"], ["Y"])], [vi("X", ["batch", 4]), vi("T", [])],
                  [vi("Y", ["batch", 4])])
