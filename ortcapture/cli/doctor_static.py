"""``ortcapture doctor``'s static checks: what the ``onnx`` library alone says about capturing a model.

The findings types (:class:`Finding`, :class:`DoctorError`) and the op lists live here too; the checks are described
in :mod:`ortcapture.cli.doctor`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

#: Ops whose body is a subgraph the capturing EP cannot record (ORT: "the model has control flow nodes").
CONTROL_FLOW_OPS = ("If", "Loop", "Scan")
#: Ops whose output shape depends on input values: a captured replay keeps the capture-time shape.
DATA_DEPENDENT_OPS = ("NonZero", "Unique", "NonMaxSuppression", "Compress")
#: Ops whose output may be a view of their input: as a graph output, its copy into the bound buffer is not part
#: of a WebGPU capture (measured, onnxruntime 1.32: replay returns the capture-time value).
VIEW_OPS = ("Reshape", "Squeeze", "Unsqueeze", "Flatten")

SEVERITIES = ("error", "warning", "info")


class DoctorError(Exception):
    """A problem with the request itself (model path, ``--shape``, provider): exit code 2."""


@dataclass
class Finding:
    """One observation. ``severity``: ``error`` (blocks capture), ``warning`` (capture works with a caveat or after
    a change), ``info``. ``fix``: what to change, or ``None``."""

    kind: str
    severity: str
    message: str
    fix: str | None = None
    details: dict = field(default_factory=dict)



def parse_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``["images=1x3x320x320", ...]`` -> ``{"images": (1, 3, 320, 320)}``. Raises :class:`DoctorError`."""
    from ortcapture._ort import specialize as shapes
    from ortcapture.errors import CaptureError

    try:
        return shapes.parse_shape_args(items)
    except CaptureError as exc:
        raise DoctorError(str(exc)) from None


def _fmt_shape(shape: Sequence[Any]) -> str:
    return "x".join(str(d) for d in shape) if len(shape) else "scalar"


def _fmt_dims(dims: Sequence[Any]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


# ---------------------------------------------------------------------------------------------------------------
# static checks (onnx only)
# ---------------------------------------------------------------------------------------------------------------
def _node_label(node) -> str:
    name = f"'{node.name}'" if node.name else f"(unnamed, output {', '.join(repr(o) for o in node.output if o)})"
    return f"{node.op_type} {name}"


def iter_nodes(model) -> Iterator[tuple[Any, str]]:
    """Every node of the model with where it sits: the main graph, subgraphs of any depth, model-local functions."""
    import onnx

    def walk(graph, where):
        for node in graph.node:
            yield node, where
            for attr in node.attribute:
                subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else (
                    list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else [])
                for i, sub in enumerate(subs):
                    suffix = f"[{i}]" if attr.type == onnx.AttributeProto.GRAPHS else ""
                    yield from walk(sub, f"{where} > {_node_label(node)}.{attr.name}{suffix}")

    yield from walk(model.graph, "main graph")
    for fn in model.functions:
        yield from walk(fn, f"function {fn.domain + ':' if fn.domain else ''}{fn.name}")


def check_control_flow(model) -> list[Finding]:
    """``If``/``Loop``/``Scan`` (and any node with a subgraph attribute, e.g. contrib ``BeamSearch``) anywhere."""
    import onnx

    found = []
    for node, where in iter_nodes(model):
        has_subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        if node.op_type in CONTROL_FLOW_OPS or has_subgraph:
            found.append((node, where))
    out = []
    for node, where in found:
        if node.op_type == "If":
            fix = (f"remove {_node_label(node)}: compute both branches and pick with Where, fold the condition at "
                   "export (constant), or split the model at it and run the control flow outside the captured graph")
        elif node.op_type in ("Loop", "Scan"):
            fix = (f"remove {_node_label(node)}: unroll it at export (fixed trip count), or split the model and run "
                   "the loop outside the captured graph, capturing its body as a model of its own")
        else:
            fix = f"split the model at {_node_label(node)} and run it outside the captured graph"
        out.append(Finding(
            "control_flow", "error",
            f"control-flow node {_node_label(node)} in {where}: ORT refuses graph capture for models with "
            "control-flow nodes", fix,
            {"op_type": node.op_type, "node": node.name, "outputs": [o for o in node.output], "where": where}))
    return out


def check_dynamic_dims(model, given: Mapping[str, Sequence[int]]) -> list[Finding]:
    """Dynamic input dims (named and unnamed) and whether ``given`` fixes them. Raises :class:`DoctorError` for a
    ``given`` shape that names no input, has the wrong rank, or contradicts a dim the model fixes."""
    from ortcapture._ort import specialize as shapes
    from ortcapture.cli.options import shape_arg_problem

    dims = shapes.input_dims(model)
    problem = shape_arg_problem(given, dims)
    if problem:
        raise DoctorError(problem)
    out = []
    for name, ds in shapes.dynamic_inputs(model).items():
        labels = [d if isinstance(d, str) else f"{name}[{i}] (unnamed)" for i, d in enumerate(ds)
                  if not isinstance(d, int)]
        if name in given:
            out.append(Finding(
                "dynamic_dims", "info",
                f"input {name!r} {_fmt_dims(ds)} has dynamic dims {', '.join(labels)}, fixed by "
                f"--shape {name}={_fmt_shape(given[name])}",
                None, {"input": name, "dims": ds, "dynamic": labels, "shape": list(given[name])}))
        else:
            out.append(Finding(
                "dynamic_dims", "warning",
                f"input {name!r} {_fmt_dims(ds)} has dynamic dims {', '.join(labels)}: a captured graph replays one "
                "shape (ORT's WebGPU EP even refuses capture while the shape subgraph of such dims falls to the CPU "
                "EP; ortcapture's capture(feeds) then specialises a session to the feeds' shapes)",
                None, {"input": name, "dims": ds, "dynamic": labels, "shape": None}))
    return out


def dims_fix(model, example: Mapping[str, Sequence[int]], only: Sequence[str] | None = None,
             given: Sequence[str] = ()) -> str | None:
    """The "fix dims ..." advice for the dynamic inputs (``only``: restrict to these inputs; ``given``: inputs whose
    ``--shape`` the user passed already, not asked for again)."""
    from ortcapture._ort import specialize as shapes

    dyn = {n: d for n, d in shapes.dynamic_inputs(model).items() if only is None or n in only}
    if not dyn:
        return None
    labels = [d if isinstance(d, str) else f"{n}[{i}]" for n, ds in dyn.items() for i, d in enumerate(ds)
              if not isinstance(d, int)]
    labels = list(dict.fromkeys(labels))
    flags = " ".join(f"--shape {n}={_fmt_shape(example[n])}" for n in dyn if n in example and n not in given)
    static = "{" + ", ".join(f"{n!r}: {tuple(example[n])}" for n in dyn if n in example) + "}"
    here = f"pass {flags} here, and " if flags else ""
    return (f"fix dims {', '.join(labels)}: {here}InferenceSession(..., static_shapes={static}) "
            "for the raw IOBinding path (sess.capture(feeds) specialises by itself)")


def _canonical_state_name(name: str) -> str:
    drop = {"in", "out", "input", "output", "past", "present", "prev", "next", "new", "old"}
    lowered = name.lower().replace("past_key_values", "past")
    parts = [p for p in re.split(r"[._/:\-]+", lowered) if p]
    kept = [p for p in parts if p not in drop]
    return ".".join(kept) if kept != parts else ""


def _value_info_sig(vi):
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
    return t.elem_type, dims


def check_aliasing(model) -> list[Finding]:
    """Outputs that alias inputs (same name, or through ``Identity`` only) and carried-state pairs."""
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in inits]
    input_names = {i.name for i in inputs}
    producer = {o: n for n in graph.node for o in n.output if o}
    out: list[Finding] = []
    aliased = set()
    for vo in graph.output:
        name, chain = vo.name, []
        while name not in input_names and name in producer and producer[name].op_type == "Identity" \
                and producer[name].domain in ("", "ai.onnx"):
            chain.append(producer[name])
            name = producer[name].input[0]
        if name not in input_names:
            continue
        aliased.add(vo.name)
        how = ("is the graph input of the same name" if not chain
               else f"is input {name!r} through {' > '.join(_node_label(n) for n in reversed(chain))}")
        if chain:  # a view output: ortcapture computes it inside the graph on WebGPU (ortcapture._verify.inspect)
            out.append(Finding(
                "alias", "info",
                f"output {vo.name!r} {how}: raw ORT's WebGPU replay keeps its capture-time value (onnxruntime 1.32); "
                "ortcapture's WebGPU sessions compute it inside the graph (a Cast to its own type), so replays "
                "write it", None, {"output": vo.name, "input": name, "via": [n.name for n in chain]}))
            continue
        out.append(Finding(
            "alias", "error",
            f"output {vo.name!r} {how}: no kernel writes it, so a captured replay may never refresh it (measured on "
            "WebGPU, onnxruntime 1.32: a pass-through output stays zero, an Identity output keeps its capture-time "
            "value)",
            f"drop output {vo.name!r} from the graph (it equals input {name!r}: use the input) or compute it with a "
            "real op; never bind one buffer as both input and output",
            {"output": vo.name, "input": name, "via": [n.name for n in chain]}))
    in_sig = {i.name: _value_info_sig(i) for i in inputs}
    for vo in graph.output:
        if vo.name in aliased or vo.name in input_names:
            continue
        key, sig = _canonical_state_name(vo.name), _value_info_sig(vo)
        if not key or sig is None:
            continue
        for iname, isig in in_sig.items():
            if isig == sig and _canonical_state_name(iname) == key:
                out.append(Finding(
                    "state", "info",
                    f"output {vo.name!r} looks like carried state for input {iname!r} (same type and shape)",
                    f"bind state outputs to separate buffers: sess.capture(feeds, state={{{vo.name!r}: {iname!r}}}) "
                    "carries it on the device between replays; one buffer bound as both input and output is refused",
                    {"output": vo.name, "input": iname}))
                break
    return out


def check_view_outputs(model) -> list[Finding]:
    """Graph outputs produced directly by a view op (``Reshape``/``Squeeze``/``Unsqueeze``/``Flatten``)."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    out = []
    for vo in model.graph.output:
        node = producer.get(vo.name)
        if node is None or node.op_type not in VIEW_OPS or node.domain not in ("", "ai.onnx"):
            continue
        out.append(Finding(
            "view_output", "info",
            f"output {vo.name!r} comes straight from {_node_label(node)}, whose result can be a view of its input: "
            "in raw ORT the copy into the bound output buffer is not part of the capture (measured on WebGPU, "
            "onnxruntime 1.32: every replay returns the capture-time value); ortcapture's WebGPU sessions compute "
            "it inside the graph (a Cast to its own type after the view), so replays write it",
            None, {"output": vo.name, "op_type": node.op_type, "node": node.name}))
    return out


def check_constant_outputs(model) -> list[Finding]:
    """Graph outputs that depend on no graph input (computed from initializers and ``Constant`` nodes only): ORT
    folds them into constants at session creation, so no kernel writes them on a replay."""
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    live = {i.name for i in graph.input if i.name not in inits}
    for node in graph.node:  # topological order (ONNX requires it)
        has_subgraph = any(a.HasField("g") or len(a.graphs) for a in node.attribute)
        if has_subgraph or any(i in live for i in node.input if i):
            live.update(o for o in node.output if o)
    out = []
    for vo in graph.output:
        if vo.name in live:
            continue
        out.append(Finding(
            "constant_output", "info",
            f"output {vo.name!r} depends on no input (it is computed from constants only): ORT folds it into a "
            "constant that no replay writes; its value never changes, so ortcapture keeps the capture-time value",
            None, {"output": vo.name}))
    return out


def check_data_dependent(model) -> list[Finding]:
    """Ops whose output shape depends on the input values."""
    out = []
    for node, where in iter_nodes(model):
        if node.op_type in DATA_DEPENDENT_OPS and node.domain in ("", "ai.onnx"):
            out.append(Finding(
                "data_dependent_shape", "warning",
                f"{_node_label(node)} in {where} has a data-dependent output shape: a captured replay keeps the "
                "shape of the capture (and its value-dependent host sync may not be capturable)",
                f"make {_node_label(node)}'s output static (a mask or padding to a maximum) or run it outside the "
                "captured graph", {"op_type": node.op_type, "node": node.name, "where": where}))
    return out


def check_io_types(model) -> list[Finding]:
    """Graph inputs and outputs that are not numeric/bool tensors (strings, sequences, maps): no fixed device buffer
    holds them. No capture is attempted for such a model (a WebGPU capture attempt on one with a string output,
    refused with "String tensors are not supported by this API", left onnxruntime 1.32 to abort the process at the
    next such attempt)."""
    import numpy as np
    import onnx

    inits = {i.name for i in model.graph.initializer}
    out = []
    for role, vi in [("input", v) for v in model.graph.input] + [("output", v) for v in model.graph.output]:
        if role == "input" and vi.name in inits:
            continue
        dt = None
        if vi.type.HasField("tensor_type"):
            try:
                dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
            except Exception:  # noqa: BLE001 - undefined/unknown element type
                dt = None
        if dt is None or dt.kind not in "biuf":
            fix = (f"feed {vi.name!r} as a numeric tensor (e.g. token ids instead of strings) or preprocess it "
                   "outside the captured graph" if role == "input" else
                   f"return {vi.name!r} as a numeric tensor (e.g. label ids) and map it to strings outside the "
                   "captured graph")
            out.append(Finding(
                f"{role}_type", "error",
                f"{role} {vi.name!r} is {onnx.helper.printable_type(vi.type)}: not a numeric tensor, so no fixed "
                "device buffer can hold it and the graph cannot be captured", fix, {role: vi.name}))
    return out


def static_checks(model, given: Mapping[str, Sequence[int]]) -> list[Finding]:
    """All static checks; raises :class:`DoctorError` for a ``--shape`` that does not fit the model."""
    return (check_control_flow(model) + check_dynamic_dims(model, given) + check_io_types(model)
            + check_aliasing(model) + check_view_outputs(model) + check_constant_outputs(model)
            + check_data_dependent(model))
