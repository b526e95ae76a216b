"""Model inspection for capture: view and constant outputs, the WebGPU view rewrite, why a capture was refused.

With ``onnx`` only, plus ORT's node-placement record: view and constant outputs, the WebGPU rewrite of view outputs,
and the causes of a refused capture.

Measured on onnxruntime 1.32 + WebGPU plugin 0.4.0 (software adapter): a graph output produced by a view op
(Reshape, Flatten, Squeeze, Unsqueeze, Identity) is copied into its bound buffer by a data transfer that is not
part of the captured graph, so every replay returns the capture-time value. The same output behind a
``Cast(to=its own type)`` is written by a WebGPU kernel inside the graph and replays right (float32, float16,
int32, uint32, int64, bool; graph optimization levels basic and all: ORT does not eliminate that Cast on the
WebGPU EP, while ``Where``/``Max`` are not defined for every type). :func:`rewrite_view_outputs` adds that Cast.
An output that depends on no input value (an initializer, a ``Constant`` node, ``Shape`` of a static input) is
folded by ORT and never written on replay either, but its value never changes: :func:`constant_outputs` names them
so the capture's check for unwritten outputs leaves them alone.
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping, Sequence

import onnx

#: Ops whose output can be a view of (share the bytes of) their first input.
VIEW_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")
#: Ops whose value changes from run to run without any input changing: never "constant".
RANDOM_OPS = ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli")
#: Ops that only read their input's shape.
SHAPE_OPS = ("Shape", "Size")
#: Tensor element types the WebGPU EP has no kernels for (measured, plugin 0.4.0: an Add of each falls to CPU).
WEBGPU_UNSUPPORTED = ("int8", "int16", "uint16", "double", "uint64", "complex64", "complex128", "string")
#: Session config key that makes ORT record which EP each node went to (``get_provider_graph_assignment_info``).
RECORD_ASSIGNMENT_KEY = "session.record_ep_graph_assignment_info"
#: Suffix of the renamed view result that the added Cast reads.
VIEW_SUFFIX = "__ortcapture_view"


def load_structure(path_or_bytes) -> onnx.ModelProto:
    """The model without its external data (a path, ``bytes``, ``ModelProto`` or a session's
    :class:`~ortcapture._ort.model.ModelSource`: the model as it was loaded): enough to inspect it."""
    from ortcapture._ort.model import ModelSource

    if isinstance(path_or_bytes, ModelSource):
        return path_or_bytes.structure()
    if isinstance(path_or_bytes, onnx.ModelProto):
        return path_or_bytes
    if isinstance(path_or_bytes, (bytes, bytearray)):
        return onnx.load_from_string(bytes(path_or_bytes))
    return onnx.load(os.fspath(path_or_bytes), load_external_data=False)


def try_load_structure(path_or_bytes) -> onnx.ModelProto | None:
    """:func:`load_structure`, or ``None`` when onnx cannot read it (e.g. an ORT-format model ORT itself takes)."""
    try:
        return load_structure(path_or_bytes)
    except Exception:  # noqa: BLE001 - DecodeError, OSError, ...: ORT gives its own error if the model is bad
        return None


def _is_default_domain(node) -> bool:
    return node.domain in ("", "ai.onnx")


def _static_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of tensors whose shape onnx's shape inference knows completely (every dim a number)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - inference is a help here, not a requirement
        inferred = model
    g = inferred.graph
    out = set()
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            out.add(vi.name)
    out.update(i.name for i in g.initializer)
    return out


def constant_outputs(model: onnx.ModelProto) -> frozenset[str]:
    """Graph outputs whose value depends on no input value: computed from initializers (not overridable ones),
    ``Constant`` nodes and the shapes (``Shape``/``Size``) of tensors whose shape is static. Nodes with subgraphs and
    random ops count as input-dependent."""
    g = model.graph
    live = {i.name for i in g.input}  # graph inputs, overridable initializers included
    static = None
    for node in g.node:  # topological order (ONNX requires it)
        ins = [i for i in node.input if i]
        if not any(i in live for i in ins):
            if node.op_type in RANDOM_OPS or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                                 for a in node.attribute):
                live.update(o for o in node.output if o)
            continue
        if node.op_type in SHAPE_OPS and _is_default_domain(node) and ins:
            if static is None:
                static = _static_tensors(model)
            if ins[0] in static:
                continue  # the shape of a static tensor is a constant
        live.update(o for o in node.output if o)
    return frozenset(o.name for o in g.output if o.name not in live)


def view_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """``{output name: view op}`` for graph outputs produced by a view op (:data:`VIEW_OPS`) that are not constants."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    const = constant_outputs(model)
    out = {}
    for vo in model.graph.output:
        node = producer.get(vo.name)
        if node is not None and node.op_type in VIEW_OPS and _is_default_domain(node) and vo.name not in const:
            out[vo.name] = node.op_type
    return out


def _elem_types(model: onnx.ModelProto, names: Iterable[str]) -> dict[str, int]:
    names = set(names)
    found = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.output
             if vi.name in names and vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type}
    if len(found) < len(names):
        try:
            inferred = onnx.shape_inference.infer_shapes(model).graph
        except Exception:  # noqa: BLE001
            return found
        for vi in list(inferred.value_info) + list(inferred.output):
            if vi.name in names and vi.name not in found and vi.type.tensor_type.elem_type:
                found[vi.name] = vi.type.tensor_type.elem_type
    return found


def rewrite_view_outputs(path_or_bytes):
    """For WebGPU capture: the model with every view output (:func:`view_outputs`) computed by an in-graph
    ``Cast(to=its own type)`` after the view, as serialized bytes; ``path_or_bytes`` itself when there is none to
    rewrite. Output names, shapes, types and values are unchanged. A session's
    :class:`~ortcapture._ort.model.ModelSource` is rewritten as it was loaded and only its graph is serialised
    (external data keeps its references: past 2 GB of weights protobuf cannot serialise the whole model); a plain
    path gets its external data loaded into the bytes."""
    model = try_load_structure(path_or_bytes)
    views = view_outputs(model) if model is not None else {}
    if not views:
        return path_or_bytes
    types = _elem_types(model, views)
    views = {n: op for n, op in views.items() if n in types}
    if not views:
        return path_or_bytes
    model = onnx.ModelProto.FromString(model.SerializeToString()) if isinstance(path_or_bytes, onnx.ModelProto) \
        else model  # load_structure gives a ModelSource's model as a fresh copy
    if isinstance(path_or_bytes, (str, os.PathLike)):
        from onnx.external_data_helper import load_external_data_for_model, uses_external_data

        if any(uses_external_data(t) for t in model.graph.initializer):
            load_external_data_for_model(model, os.path.dirname(os.path.abspath(os.fspath(path_or_bytes))))
    taken = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    nodes = []
    for node in model.graph.node:
        nodes.append(node)
        for k, name in enumerate(node.output):
            if name in views:
                inner = name + VIEW_SUFFIX
                while inner in taken:
                    inner += "_"
                taken.add(inner)
                node.output[k] = inner
                nodes.append(onnx.helper.make_node("Cast", [inner], [name], name=f"{name}{VIEW_SUFFIX}_cast",
                                                   to=types[name]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model.SerializeToString()


def _elem_name(elem: int) -> str:
    return onnx.helper.tensor_dtype_to_string(elem).replace("TensorProto.", "").lower() if elem else "undefined"


def type_text(tp: onnx.TypeProto) -> str:
    """An ONNX type as ORT's ``NodeArg.type`` writes it: ``tensor(float)``, ``seq(map(int64,tensor(float)))``,
    ``optional(tensor(float))``."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        word = "tensor" if kind == "tensor_type" else "sparse_tensor"
        return f"{word}({_elem_name(getattr(tp, kind).elem_type)})"
    if kind == "sequence_type":
        return f"seq({type_text(tp.sequence_type.elem_type)})"
    if kind == "map_type":
        return f"map({_elem_name(tp.map_type.key_type)},{type_text(tp.map_type.value_type)})"
    if kind == "optional_type":
        return f"optional({type_text(tp.optional_type.elem_type)})"
    return kind or "undefined"


def io_problems(model: onnx.ModelProto, device_type: str | None = None) -> list[str]:
    """Why a model's inputs/outputs cannot be captured, one phrase each (empty: none seen): inputs or outputs that
    are not numeric tensors (strings, sequences, maps — e.g. from ``ZipMap`` — optional values), and on WebGPU
    tensor element types it has no kernels for (:data:`WEBGPU_UNSUPPORTED`)."""
    inits = {i.name for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output if o}
    out = []
    for role, vi in [("input", v) for v in model.graph.input if v.name not in inits] + \
                    [("output", v) for v in model.graph.output]:
        if not vi.type.HasField("tensor_type"):
            node = producer.get(vi.name)
            by = f" (made by {node.op_type}{' ' + repr(node.name) if node.name else ''})" if node is not None else ""
            out.append(f"{role} {vi.name!r} is {type_text(vi.type)}{by}, not a tensor: no fixed device buffer can "
                       "hold it")
            continue
        name = _elem_name(vi.type.tensor_type.elem_type)
        if name == "string":
            out.append(f"{role} {vi.name!r} is tensor(string): no fixed device buffer can hold strings")
        elif device_type == "webgpu" and name in WEBGPU_UNSUPPORTED:
            out.append(f"{role} {vi.name!r} is tensor({name}), a dtype the WebGPU EP has no kernels for")
    return out


def assigned_off_ep(session, ep_name: str) -> list[tuple[str, str]] | None:
    """``[(node name, op type)]`` of the nodes ORT did not give ``ep_name``, from a session created with
    :data:`RECORD_ASSIGNMENT_KEY` = 1; ``None`` when this ORT cannot tell. (measured on 1.27: a graph all on one EP
    gives an empty answer.)"""
    if not hasattr(session, "get_provider_graph_assignment_info"):
        return None
    try:
        subgraphs = session.get_provider_graph_assignment_info()
    except Exception:  # noqa: BLE001 - older ORT: recording not supported
        return None
    return [(n.name, n.op_type) for sg in subgraphs if sg.ep_name != ep_name for n in sg.get_nodes()]


def node_labels(nodes: Sequence[tuple[str, str]], limit: int = 12) -> str:
    items = [f"{op} '{name}'" if name else op for name, op in nodes]
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def refusal_message(ep_name: str, model: onnx.ModelProto | None, off_ep: Sequence[tuple[str, str]] | None,
                    static_shapes: Mapping[str, Sequence[int]] | None, device_type: str | None) -> str:
    """One message for a capture ORT refused: the I/O problems, the nodes off the EP, and ``doctor``."""
    parts = io_problems(model, device_type) if model is not None else []
    if off_ep:
        parts.append(f"node(s) placed off {ep_name}: {node_labels(off_ep)}")
    elif off_ep is None:
        parts.append("this onnxruntime does not report node placement")
    fixed = f" even with input shapes fixed to {dict(static_shapes)}" if static_shapes else ""
    shape_args = "".join(f" --shape {n}={'x'.join(map(str, s))}" for n, s in (static_shapes or {}).items())
    return (f"{ep_name} cannot capture this model{fixed}: " + "; ".join(parts or ["ORT gives no reason"])
            + f". Run `ortcapture doctor MODEL{shape_args}` for the details and fixes.")
