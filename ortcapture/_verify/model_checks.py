"""What the ``onnx`` model alone says about results a captured replay would get wrong (issue 15).

Two questions, answered from the graph (no session), used by the core at construction and capture and by
``ortcapture doctor``:

* :func:`int64_arithmetic_nodes` — nodes that *produce* int64 values from int64 arithmetic. ORT's WebGPU EP runs
  int64 tensors as 32-bit in a session with ``enableGraphCapture=1`` (measured, onnxruntime 1.32 + WebGPU plugin
  0.4.0: ``Y = X - 1`` on ``3000000000`` gives ``-1294967297``, in captured *and* ``gpu_graph_id=-1`` runs; a
  session without capture is right). A range check of the inputs cannot catch an intermediate that overflows.
* :func:`int64_wide_constants` — int64 constants (initializers, ``Constant`` nodes) holding values beyond int32 that
  a WebGPU kernel reads as data (``Where(b, 5000000000, x)`` gave ``705032704``, captured and uncaptured alike,
  while the capture check compared it with the same wrong value). Shape-like operands ORT reads on the host
  (``Slice`` ends of ``INT64_MAX``, ``Reshape`` shapes, axes, ...) and nodes that are all constant (folded) are not
  data reads.
* :func:`copy_only_nodes` — kernels that only copy their input (a single-input ``Max``/``Min``/``Sum``/``Mean``, a
  ``ScatterND``/``ScatterElements`` whose ``data`` is a graph input): their copy is not replayed, so the nodes they
  feed see the capture-time values. Named when the varied-input verification finds an output that kept its value.

Placement is approximated from the graph (ORT's own placement needs a session built for it): int64 values computed
only from shapes and constants (``Shape``/``Size`` outputs, initializers, ``Constant``) are shape arithmetic, which
ORT folds (fixed dims) or places on the CPU EP; every other int64 arithmetic node is assumed to run on WebGPU.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import onnx

#: ops that compute new values (int64 overflow / truncation in 32 bits matters); reads (Gather indices, Reshape
#: shape, Slice starts, Shape, Cast *from* int64, comparisons, Max/Min of two tensors) are range-checked instead
INT64_ARITHMETIC_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Pow", "CumSum", "CumProd", "ReduceSum", "ReduceProd",
    "ReduceSumSquare", "ReduceL1", "MatMul", "MatMulInteger", "Gemm", "Einsum", "Sum", "Mean", "Range",
    "BitShift", "Sign",
})
#: ops whose value comes from shapes or constants only (ORT folds them or runs them on the CPU EP)
_SHAPE_SOURCES = frozenset({"Shape", "Size", "Constant"})
#: single-input reductions over a list of tensors: a plain copy
_COPY_IF_SINGLE = frozenset({"Max", "Min", "Sum", "Mean"})
_SCATTERS = frozenset({"ScatterND", "ScatterElements", "Scatter"})
_INT64 = onnx.TensorProto.INT64


def label(node) -> str:
    """``OpType 'name'`` (or the outputs for an unnamed node)."""
    name = f"'{node.name}'" if node.name else f"(unnamed, output {', '.join(repr(o) for o in node.output if o)})"
    return f"{node.op_type} {name}"


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - custom ops, huge models: fall back to what the model declares
        inferred = model
    g = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.input) + list(g.output)
             if vi.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def _static_values(graph) -> set[str]:
    """Values computed from shapes and constants only (initializers, Constant, Shape/Size and what follows)."""
    static = {t.name for t in graph.initializer}
    for node in graph.node:  # topological order (ONNX requires it)
        if node.op_type in _SHAPE_SOURCES or all(i in static for i in node.input if i):
            static.update(o for o in node.output if o)
    return static


def int64_arithmetic_nodes(model: onnx.ModelProto) -> list[str]:
    """Labels of the main-graph nodes that produce int64 from int64 arithmetic on values that are not shape
    arithmetic (see the module docstring); empty when there are none."""
    graph = model.graph
    types = _elem_types(model)
    static = _static_values(graph)
    found = []
    for node in graph.node:
        if node.op_type not in INT64_ARITHMETIC_OPS or node.domain not in ("", "ai.onnx"):
            continue
        outs = [o for o in node.output if o]
        ins = [i for i in node.input if i]
        if not outs or all(i in static for i in ins):
            continue
        out_int64 = types.get(outs[0]) == _INT64
        in_int64 = any(types.get(i) == _INT64 for i in ins)
        if out_int64 and (in_int64 or not ins):
            found.append(label(node))
    return found


#: operand positions ORT reads on the host (shapes, axes, sizes, counts): an int64 beyond int32 there is a value for
#: the host code (``Slice``'s ``INT64_MAX`` ends), not data on the device
HOST_READ_OPERANDS = {
    "Slice": {1, 2, 3, 4}, "Reshape": {1}, "Expand": {1}, "Tile": {1}, "Pad": {1, 3}, "Resize": {1, 2, 3},
    "Upsample": {1}, "TopK": {1}, "Unsqueeze": {1}, "Squeeze": {1}, "ConstantOfShape": {0}, "OneHot": {1},
    "Split": {1}, "CumSum": {1}, "CumProd": {1}, "NonMaxSuppression": {2}, "ReduceSum": {1}, "ReduceMean": {1},
    "ReduceMax": {1}, "ReduceMin": {1}, "ReduceProd": {1}, "ReduceL1": {1}, "ReduceL2": {1},
    "ReduceLogSum": {1}, "ReduceLogSumExp": {1}, "ReduceSumSquare": {1}, "Range": {0, 1, 2},
    "Loop": {0}, "Trilu": {1}, "DFT": {1, 2}, "STFT": {1, 3}, "Col2Im": {1, 2}, "CenterCropPad": {1},
    "MaxUnpool": {2}, "SplitToSequence": {1},
}
_INT32 = (-(2**31), 2**31 - 1)


def _wide_int64(tensor) -> int | None:
    """A value of int64 ``tensor`` (a TensorProto) outside int32, or ``None`` (in range, not int64, or its data not
    loaded: external data is not read for this check)."""
    if tensor.data_type != _INT64 or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None
    from onnx import numpy_helper

    try:
        a = numpy_helper.to_array(tensor)
    except Exception:  # noqa: BLE001 - a malformed tensor: ORT says so when it loads the model
        return None
    if a.size == 0:
        return None
    lo, hi = int(a.min()), int(a.max())
    return lo if lo < _INT32[0] else hi if hi > _INT32[1] else None


def int64_wide_constants(model: onnx.ModelProto) -> list[str]:
    """``"initializer 'NAME' (e.g. 5000000000) read by Where 'w'"`` for each main-graph int64 constant (an
    initializer or a ``Constant`` node's value) beyond int32 that a node which is not all constant reads as data
    (not at a :data:`HOST_READ_OPERANDS` position); empty when there are none (see the module docstring)."""
    graph = model.graph
    wide: dict[str, tuple[str, int]] = {}
    for t in graph.initializer:
        v = _wide_int64(t)
        if v is not None:
            wide[t.name] = (f"initializer {t.name!r}", v)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            for a in node.attribute:
                v = None
                if a.name == "value" and a.HasField("t"):
                    v = _wide_int64(a.t)
                elif a.name == "value_int" and not _INT32[0] <= a.i <= _INT32[1]:
                    v = int(a.i)
                elif a.name == "value_ints":
                    v = next((int(x) for x in a.ints if not _INT32[0] <= x <= _INT32[1]), None)
                if v is not None:
                    wide[node.output[0]] = (f"{label(node)}'s value", v)
    if not wide:
        return []
    static = _static_values(graph)
    found = []
    for node in graph.node:
        ins = [i for i in node.input if i]
        if node.op_type == "Constant" or not ins or all(i in static for i in ins):
            continue  # folded by ORT
        host = HOST_READ_OPERANDS.get(node.op_type, set()) if node.domain in ("", "ai.onnx") else set()
        for pos, name in enumerate(node.input):
            if name in wide and pos not in host:
                what, v = wide[name]
                found.append(f"{what} (e.g. {v}) read by {label(node)}")
    return found


def int64_inputs(model: onnx.ModelProto) -> list[str]:
    """Graph inputs of type int64 (initializers excluded)."""
    inits = {t.name for t in model.graph.initializer}
    return [vi.name for vi in model.graph.input if vi.name not in inits and vi.type.HasField("tensor_type")
            and vi.type.tensor_type.elem_type == _INT64]


def copy_only_nodes(model: onnx.ModelProto, outputs: Iterable[str], state_inputs: Sequence[str] = ()) -> list[str]:
    """Labels of copy-only kernels (see the module docstring) among the producers of ``outputs`` and their
    ancestors. ``state_inputs``: graph inputs carried with ``state=`` (also graph inputs, listed for clarity)."""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    inputs = {vi.name for vi in graph.input if vi.name not in inits} | set(state_inputs)
    producer = {o: n for n in graph.node for o in n.output if o}
    seen, found, todo = set(), [], list(outputs)
    while todo:
        name = todo.pop()
        node = producer.get(name)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        ins = [i for i in node.input if i]
        if node.op_type in _COPY_IF_SINGLE and len(ins) == 1:
            found.append(label(node))
        elif node.op_type in _SCATTERS and ins and ins[0] in inputs:
            found.append(label(node))
        todo.extend(ins)
    return found
