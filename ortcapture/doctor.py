"""``ortcapture doctor MODEL.onnx``: say whether a model can be captured — and what to change when it cannot —
before anyone waits for a failed capture.

``ortcapture doctor MODEL.onnx [--provider auto|cuda|webgpu|none] [--shape NAME=1x3x320x320 ...]
[--provider-option KEY=VALUE ...] [--json]``. ``--provider-option`` gives every session doctor creates the EP options
you will run with (validated as ``ortcapture bench`` validates them): they can change the verdict — measured on
onnxruntime-gpu 1.31.1 (H200), the reference model with ``prefer_nhwc=1`` and its dims dynamic is refused capture
by the CUDA EP ("all compute graph nodes have not been partitioned"), so it captures only via shape specialization.

Static checks (the ``onnx`` library; no execution provider needed):

* **control flow** — ``If``/``Loop``/``Scan`` and every other node that carries a subgraph, nested subgraphs and
  model-local functions included. ORT refuses graph capture for such models when the session is created
  (measured, onnxruntime 1.32 WebGPU: "the model has control flow nodes which can't be supported by
  WebGpuExecutionProvider").
* **dynamic input dims** — named (``batch``) and unnamed (``?``) — and whether ``--shape`` fixes them. Shapes are
  validated against the model (known input, rank, dims the model already fixes): a bad ``--shape`` is exit 2.
  ORT's WebGPU EP refuses capture when a dynamic model's shape subgraph falls to the CPU EP; shape
  specialization (``InferenceSession(..., static_shapes=...)``, or ``capture(feeds)``) fixes the dims.
* **input and output types** — string/sequence/map inputs or outputs cannot live in a fixed device buffer: not
  capturable (no capture is attempted).
* **outputs that alias inputs** — a graph output that *is* a graph input, or is one only through ``Identity``.
  Measured on WebGPU (onnxruntime 1.32): replay never refreshes such an output (a pass-through output stays zero,
  an ``Identity`` output keeps its capture-time value), so captured results are silently wrong. CUDA copes.
* **outputs straight from a view op** (``Reshape``/``Squeeze``/``Unsqueeze``/``Flatten``) — measured on WebGPU
  (onnxruntime 1.32, raw ORT IOBinding capture as well): every replay returns the capture-time value.
* **carried state** (info) — output/input pairs like ``state_out``/``state_in``, ``present.*``/``past_key_values.*``
  with one type and shape: bind them to separate buffers and carry them with ``capture(feeds, state=...)``.
* **data-dependent output shapes** (``NonZero``, ``Unique``, ``NonMaxSuppression``, ``Compress``): a replay keeps
  the shapes of the capture.

Nodes without a kernel on the EP cannot be known statically; the dynamic checks find them.

Dynamic checks, when a capture-capable EP is present (``auto``: the CUDA EP when onnxruntime-gpu offers it, else
the WebGPU plugin EP when a child-process probe captures on it — Dawn without an adapter ends the process — else
none):

* **node placement** — an uncaptured session created with ``session.record_ep_graph_assignment_info=1`` lists
  the nodes ORT placed on the CPU EP (``get_provider_graph_assignment_info()``, where ORT has it), and the
  optimized model ORT writes lists the Memcpy nodes it inserted (ORT 1.32 leaves them out of the assignment info).
  For a model with dynamic dims a second session with the dims fixed tells the shape subgraph (gone once dims are
  fixed) from nodes that stay on CPU (no kernel on the EP: capture refused).
* **ORT's own warnings and errors** while sessions are made and the capture runs (``set_default_logger_callback``
  where ORT has it, else file descriptor 2 redirected): the refusal reason, "shape massaging nodes", Memcpy notes.
* **stable reference** — two uncaptured runs with the same feeds must agree, or no replay can be judged against
  them (random ops; or an EP option computing wrong results — measured, onnxruntime-gpu 1.31.1 on an H200: CUDA
  ``fuse_conv_bias=1`` gets the reference model right on the first run and wrong on every later one).
* **a real capture** — ``ortcapture.InferenceSession(MODEL, <capture on>).capture(feeds)`` with random feeds of
  the given (or derived) shapes, one replay with other random feeds, compared with an uncaptured run. Outcome:
  captured directly, captured via shape specialization, refused (with ORT's reason), or replay mismatch. A
  successful capture with a matching replay overrules static findings (downgraded, their fixes dropped).

Verdict: exit 0 capturable, 1 not capturable, 2 error (model unreadable, bad ``--shape`` or ``--provider-option``,
provider missing), with "what to change" lines. ``--json`` prints one JSON object instead of the report.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Mapping, Sequence

#: Ops whose body is a subgraph the capturing EP cannot record (ORT: "the model has control flow nodes").
CONTROL_FLOW_OPS = ("If", "Loop", "Scan")
#: Ops whose output shape depends on input values: a captured replay keeps the capture-time shape.
DATA_DEPENDENT_OPS = ("NonZero", "Unique", "NonMaxSuppression", "Compress")
#: Ops whose output may be a view of their input: as a graph output, its copy into the bound buffer is not part
#: of a WebGPU capture (measured, onnxruntime 1.32: replay returns the capture-time value).
VIEW_OPS = ("Reshape", "Squeeze", "Unsqueeze", "Flatten")
#: Session config key that makes ORT record which EP each node went to (read by get_provider_graph_assignment_info).
RECORD_ASSIGNMENT_KEY = "session.record_ep_graph_assignment_info"
#: Models larger than this are not re-serialized by ORT to list Memcpy nodes (protobuf's 2 GiB limit, time).
_OPTIMIZED_MODEL_LIMIT = 1 << 30

EXIT_CAPTURABLE, EXIT_NOT_CAPTURABLE, EXIT_ERROR = 0, 1, 2
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


# ---------------------------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--provider", choices=["auto", "cuda", "webgpu", "none"], default="auto",
                   help="EP for the placement checks and the capture attempt (none: static checks only)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=1x3x320x320",
                   help="input shape to check and capture with (repeat per input); dynamic dims without one get "
                        "batch 1 and 320 for the other dims")
    p.add_argument("--provider-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an execution provider option for every session doctor creates (repeatable), e.g. "
                        "prefer_nhwc=1; check with the options you will run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


def parse_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``["images=1x3x320x320", ...]`` -> ``{"images": (1, 3, 320, 320)}``. Raises :class:`DoctorError`."""
    from ortcapture import shapes
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
    from ortcapture import shapes

    dims = shapes.input_dims(model)
    for name, shape in given.items():
        if name not in dims:
            raise DoctorError(f"--shape names input {name!r}, but the model's inputs are {sorted(dims)}")
        have = dims[name]
        if len(shape) != len(have):
            raise DoctorError(f"--shape {name}={_fmt_shape(shape)}: input {name!r} has rank {len(have)} "
                              f"({_fmt_dims(have)}), the shape has rank {len(shape)}")
        for i, (want, d) in enumerate(zip(shape, have)):
            if isinstance(d, int) and d != want:
                raise DoctorError(f"--shape {name}={_fmt_shape(shape)}: dim {i} of {name!r} is fixed to {d} in the "
                                  f"model ({_fmt_dims(have)})")
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


def dims_fix(model, example: Mapping[str, Sequence[int]], only: Sequence[str] | None = None) -> str | None:
    """The "fix dims ..." advice for the dynamic inputs (``only``: restrict to these inputs)."""
    from ortcapture import shapes

    dyn = {n: d for n, d in shapes.dynamic_inputs(model).items() if only is None or n in only}
    if not dyn:
        return None
    labels = [d if isinstance(d, str) else f"{n}[{i}]" for n, ds in dyn.items() for i, d in enumerate(ds)
              if not isinstance(d, int)]
    labels = list(dict.fromkeys(labels))
    flags = " ".join(f"--shape {n}={_fmt_shape(example[n])}" for n in dyn if n in example)
    static = "{" + ", ".join(f"{n!r}: {tuple(example[n])}" for n in dyn if n in example) + "}"
    return (f"fix dims {', '.join(labels)}: pass {flags} here, and InferenceSession(..., static_shapes={static}) "
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
            "view_output", "warning",
            f"output {vo.name!r} comes straight from {_node_label(node)}, whose result can be a view of its input: "
            "the copy into the bound output buffer is not part of the capture (measured on WebGPU, onnxruntime "
            "1.32: every replay returns the capture-time value; the capture attempt checks your EP)",
            f"end the graph with a compute op: export without the trailing {node.op_type} on {vo.name!r} and "
            "reshape the output in the caller (free for numpy/DLPack)",
            {"output": vo.name, "op_type": node.op_type, "node": node.name}))
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
            + check_aliasing(model) + check_view_outputs(model) + check_data_dependent(model))


# ---------------------------------------------------------------------------------------------------------------
# ORT log capture
# ---------------------------------------------------------------------------------------------------------------
_LOG_LINE = re.compile(r"\[([VIWEF]):onnxruntime:[^,\]]*, ([^\]]*)\] (.*)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SEVERITY = {"V": 0, "I": 1, "W": 2, "E": 3, "F": 4}


class OrtLogCapture:
    """Collect ORT's log messages while the block runs, as ``(severity, code location, message, phase)`` with
    severity >= ``min_severity`` (2: warnings); ``phase`` is whatever the caller set last (which session). Uses
    ``onnxruntime.set_default_logger_callback`` where ORT has it, else points file descriptor 2 (where ORT's default
    sink writes) at a temporary file and parses it afterwards. Not re-entrant; the callback is process-wide."""

    def __init__(self, min_severity: int = 2, use_callback: bool | None = None):
        import onnxruntime as ort

        self.min_severity = min_severity
        self.use_callback = hasattr(ort, "set_default_logger_callback") if use_callback is None else use_callback
        self.records: list[tuple[int, str, str, str]] = []
        self.phase = ""
        self._marks: list[tuple[int, str]] = []  # fd mode: (file offset, phase) — phases resolved on exit

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if not self.use_callback and hasattr(self, "_tmp"):
            sys.stderr.flush()
            self._marks.append((os.lseek(self._tmp.fileno(), 0, os.SEEK_CUR), phase))

    def _callback(self, severity, category, logid, code_location, message):
        if int(severity) >= self.min_severity:
            self.records.append((int(severity), str(code_location), str(message).strip(), self.phase))

    def __enter__(self) -> "OrtLogCapture":
        import onnxruntime as ort

        if self.use_callback:
            ort.set_default_logger_callback(self._callback, self.min_severity)
        else:
            sys.stderr.flush()
            self._tmp = tempfile.TemporaryFile()
            self._saved_fd = os.dup(2)
            os.dup2(self._tmp.fileno(), 2)
            self._marks = [(0, self.phase)]
        return self

    def __exit__(self, *exc) -> None:
        import onnxruntime as ort

        if self.use_callback:
            ort.set_default_logger_callback(None)
            return
        sys.stderr.flush()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._tmp.seek(0)
        raw = self._tmp.read()
        self._tmp.close()
        del self._tmp
        other = []
        marks = self._marks + [(len(raw) + 1, "")]
        for (start, phase), (stop, _) in zip(marks, marks[1:]):
            text = _ANSI.sub("", raw[start:stop].decode("utf-8", "replace"))
            for line in text.splitlines():
                m = _LOG_LINE.search(line)
                if m is None:
                    if line.strip():
                        other.append(line)
                elif _SEVERITY[m.group(1)] >= self.min_severity:
                    self.records.append((_SEVERITY[m.group(1)], m.group(2).strip(), m.group(3).strip(), phase))
        if other:  # not ORT's log: hand it back to stderr
            print("\n".join(other), file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------------
# dynamic checks
# ---------------------------------------------------------------------------------------------------------------
def choose_provider(requested: str) -> tuple[str, str | None]:
    """``(provider, why none)``: ``cuda``/``webgpu`` as :func:`ortcapture.demo.pick_provider` picks them, or ``none``
    (requested, or ``auto`` found no capture-capable EP: the reason is returned). Raises :class:`DoctorError` when
    an explicitly requested EP is unusable."""
    if requested == "none":
        return "none", "--provider none: static checks only"
    from ortcapture.errors import CaptureUnsupportedError
    from ortcapture.providers import pick_provider

    try:
        return pick_provider(requested), None
    except CaptureUnsupportedError as exc:
        why = str(exc)
        if requested == "auto":
            return "none", why
        raise DoctorError(why) from None


_EP_NAMES = {"cuda": "CUDAExecutionProvider", "webgpu": "WebGpuExecutionProvider"}


def _session_args(provider: str, capture: bool, config: Mapping[str, str] = (), optimized_path: str | None = None,
                  ep_options: Mapping[str, str] | None = None):
    """InferenceSession kwargs for ``provider`` with capture on/off, ``config`` session entries, an optional
    optimized-model output path and the ``--provider-option`` values. Log severity stays at the default
    (warnings), so OrtLogCapture sees them."""
    import onnxruntime as ort

    from ortcapture.providers import session_args

    so = ort.SessionOptions()
    for k, v in dict(config).items():
        so.add_session_config_entry(k, v)
    if optimized_path:
        so.optimized_model_filepath = optimized_path
    return session_args(provider, capture, so, ep_options=ep_options)


@dataclass
class Placement:
    """Where ORT put the nodes of one uncaptured session."""

    cpu_nodes: list[tuple[str, str]] | None  # (name, op_type); None: ORT cannot tell (no assignment info)
    memcpy_nodes: list[tuple[str, str, str]] | None  # (name, op_type, tensor copied); None: unknown

    def cpu_labels(self, limit: int = 12) -> str:
        items = [f"{op} '{name}'" if name else op for name, op in self.cpu_nodes or []]
        more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
        return ", ".join(items[:limit]) + more


def _assigned_cpu_nodes(sess) -> list[tuple[str, str]] | None:
    if not hasattr(sess, "get_provider_graph_assignment_info"):
        return None
    try:
        subgraphs = sess.get_provider_graph_assignment_info()
    except Exception:  # noqa: BLE001 - older ORT: recording not supported
        return None
    # an empty answer: nothing off the EP (measured on 1.27: a graph all on one EP gives [])
    return [(n.name, n.op_type) for sg in subgraphs if sg.ep_name == "CPUExecutionProvider" for n in sg.get_nodes()]


def _memcpy_nodes(path: str) -> list[tuple[str, str, str]] | None:
    import onnx

    try:
        opt = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - ORT did not write it
        return None
    return [(n.name, n.op_type, n.input[0] if n.input else "") for n in opt.graph.node
            if n.op_type in ("MemcpyToHost", "MemcpyFromHost")]


def placement_session(model, provider: str, tmpdir: str, tag: str, list_memcpy: bool,
                      ep_options: Mapping[str, str] | None = None):
    """An uncaptured session on ``provider`` that records node placement; returns ``(session, Placement)``."""
    import onnxruntime as ort

    opt_path = os.path.join(tmpdir, f"optimized_{tag}.onnx") if list_memcpy else None
    config = {RECORD_ASSIGNMENT_KEY: "1"}
    try:
        sess = ort.InferenceSession(model, **_session_args(provider, False, config, opt_path, ep_options))
    except Exception:  # noqa: BLE001 - writing the optimized model can fail (compiled nodes): retry without it
        if opt_path is None:
            raise
        opt_path = None
        sess = ort.InferenceSession(model, **_session_args(provider, False, config, None, ep_options))
    memcpy = _memcpy_nodes(opt_path) if opt_path else None
    return sess, Placement(_assigned_cpu_nodes(sess), memcpy)


def random_feeds(model, example: Mapping[str, Sequence[int]], seed: int) -> dict:
    """Random numpy feeds of the example shapes and the model's input element types (numeric inputs only: see
    :func:`check_io_types`). Integers are 0 or 1, so index-like inputs stay in range."""
    import numpy as np
    import onnx

    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits or vi.name not in example:
            continue
        elem = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
        try:
            dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        except Exception:  # noqa: BLE001
            dt = None
        if dt is None or dt.kind not in "biuf":
            raise DoctorError(f"input {vi.name!r} has type {onnx.helper.printable_type(vi.type)}: not a numeric tensor")
        shape = tuple(example[vi.name])
        if dt.kind == "b":
            value = rng.random(shape) < 0.5
        elif dt.kind in "iu":
            value = rng.integers(0, 2, size=shape)
        else:
            value = rng.random(shape)
        out[vi.name] = np.asarray(value, dtype=dt)  # an ndarray for scalars too: ORT refuses numpy scalars
    return out


def _compare(got: Sequence[Any], want: Sequence[Any], tol: float) -> tuple[bool, float, str | None]:
    """(match, max abs diff, what differs) for replay outputs against the uncaptured run."""
    import numpy as np

    if len(got) != len(want):
        return False, float("inf"), f"{len(got)} outputs, expected {len(want)}"
    worst, scale = 0.0, 1.0
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return False, float("inf"), f"output {i} has shape {g.shape}, the uncaptured run {w.shape}"
        if g.size == 0:
            continue
        if g.dtype.kind not in "biuf" or w.dtype.kind not in "biuf":  # strings, objects: equal or not
            if not np.array_equal(g, w):
                return False, float("inf"), f"output {i} ({g.dtype}) differs"
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        if not np.array_equal(np.isnan(g64), np.isnan(w64)):
            return False, float("inf"), f"output {i}: NaNs differ"
        ok = ~np.isnan(w64)
        if ok.any():
            worst = max(worst, float(np.max(np.abs(g64[ok] - w64[ok]))))
            scale = max(scale, float(np.max(np.abs(w64[ok]))))
    return worst <= tol * scale, worst, None


def _ort_reason(text: str) -> str:
    text = re.sub(r"\[ONNXRuntimeError\] : \d+ : [A-Z_]+ : ", "", str(text))
    return re.sub(r"\s+Run `ortcapture doctor MODEL`.*$", "", text).strip()


def attempt_capture(model_path: str, provider: str, feeds0: Mapping, feeds1: Mapping, want: Sequence,
                    tol: float, ep_options: Mapping[str, str] | None = None) -> dict:
    """Capture ``model_path`` through ``ortcapture.InferenceSession(..., capture on).capture(feeds0)``, replay once
    with ``feeds1`` and compare with ``want`` (an uncaptured run on ``feeds1``). Returns the ``capture`` part of the
    report: ``outcome`` is ``captured``, ``captured_specialized`` (ORT refused the model as given, a session with
    the dims fixed captured), ``refused``, ``mismatch`` or ``replay_failed``."""
    import ortcapture

    res: dict[str, Any] = {"attempted": True, "outcome": None, "reason": None, "stage": None, "deferred": None,
                           "static_shapes": None, "max_abs_diff": None, "tolerance": tol, "seconds": None}
    t0 = time.perf_counter()
    try:
        sess = ortcapture.InferenceSession(
            model_path, **_session_args(provider, True, {RECORD_ASSIGNMENT_KEY: "1"}, None, ep_options))
    except Exception as exc:  # noqa: BLE001 - ORT's Fail/EPFail and ortcapture's errors alike
        res.update(outcome="refused", stage="session creation", reason=_ort_reason(exc),
                   error=f"{type(exc).__name__}: {_ort_reason(exc)}", seconds=time.perf_counter() - t0)
        return res
    res["deferred"] = sess.capture_deferred
    try:
        graph = sess.capture(feeds0)
    except Exception as exc:  # noqa: BLE001
        res.update(outcome="refused", stage="capture" + (" on a shape-specialised session" if sess.capture_deferred
                                                          else ""),
                   reason=_ort_reason(exc), error=f"{type(exc).__name__}: {_ort_reason(exc)}",
                   seconds=time.perf_counter() - t0)
        return res
    try:
        if sess.capture_deferred:
            res["static_shapes"] = {n: list(s) for n, s in (graph._session._oc_static_shapes or ())}
        cpu = _assigned_cpu_nodes(graph._session)
        res["cpu_nodes_captured"] = [list(n) for n in cpu] if cpu is not None else None
        got = graph.run(feeds1)
        res["seconds"] = time.perf_counter() - t0
        ok, worst, what = _compare(got, want, tol)
        res["max_abs_diff"] = worst
        if ok:
            res["outcome"] = "captured_specialized" if sess.capture_deferred else "captured"
        else:
            res["outcome"] = "mismatch"
            res["reason"] = what or f"max abs diff {worst:.3g} (tolerance {tol:g} x max(1, max |output|))"
    except Exception as exc:  # noqa: BLE001 - a replay that raises is a failed capture too
        res.update(outcome="replay_failed", stage="replay", reason=_ort_reason(exc),
                   error=f"{type(exc).__name__}: {_ort_reason(exc)}")
    finally:
        try:
            graph.release()
        except Exception:  # noqa: BLE001 - reporting matters more than the release
            pass
    if res["seconds"] is None:
        res["seconds"] = time.perf_counter() - t0
    return res


_CPU_PREFERRED = re.compile(r"Force fallback to CPU execution for node (\S+)")
_CAPTURE_LOG = re.compile(r"graph capture|shape massaging|Memcpy|CUDA Graph", re.IGNORECASE)
#: ORT log lines doctor itself causes (optimized-model dump, ortcapture's capture-off retry): not about the model.
_OWN_NOISE = ("Serializing optimized model", "already exists with value")
_PHASE_AS_GIVEN, _PHASE_FIXED, _PHASE_CAPTURE = "model as given", "dims fixed", "capture attempt"


def _placement_findings(model, ep: str, example, placement: Placement, fixed: Placement | None,
                        capture: dict) -> list[Finding]:
    from ortcapture import shapes

    out: list[Finding] = []
    outcome = capture["outcome"]
    captured = outcome in ("captured", "captured_specialized")
    dynamic = shapes.dynamic_inputs(model)
    if placement.cpu_nodes is None:
        out.append(Finding("placement", "info", "this onnxruntime does not report node placement "
                           "(get_provider_graph_assignment_info): nodes on the CPU EP are not listed"))
    stay = set(fixed.cpu_nodes) if fixed is not None and fixed.cpu_nodes is not None else None
    cpu = list(placement.cpu_nodes or [])
    if dynamic and stay is not None:
        shape_nodes, remaining = [n for n in cpu if n not in stay], [n for n in cpu if n in stay]
    else:
        shape_nodes, remaining = [], cpu
    if shape_nodes:
        others = " (the others stay: see cpu_nodes)" if remaining else ""
        if outcome == "captured":
            verdict = f"ORT captured on {ep} with them on the CPU EP (safe while intermediate shapes depend only on " \
                      "input shapes)"
        elif outcome == "captured_specialized":
            verdict = f"ORT refused {ep} capture of the graph split this way; ortcapture captured on a " \
                      "shape-specialised session"
        else:
            verdict = f"ORT's {ep} capture refuses a graph split this way"
        out.append(Finding(
            "shape_subgraph_cpu", "info" if outcome == "captured" else "warning",
            f"{len(shape_nodes)} node(s) of the model as given run on the CPU EP — the shape computation of its "
            f"dynamic dims: {Placement(shape_nodes, None).cpu_labels(8)}; with the dims fixed they go away{others}. "
            + verdict, None if outcome == "captured" else dims_fix(model, example),
            {"nodes": [list(n) for n in shape_nodes]}))
    if remaining:
        ops = sorted({op for _, op in remaining})
        tail = ("ORT accepted the capture anyway (host-side shape computation: safe while intermediate shapes "
                "depend only on input shapes)" if captured
                else f"ORT captures only a graph whose compute nodes all run on {ep}")
        out.append(Finding(
            "cpu_nodes", "warning" if captured else "error",
            f"{len(remaining)} node(s) run on the CPU EP, not {ep}"
            f"{' (even with the dims fixed)' if dynamic and stay is not None else ''}: "
            f"{Placement(remaining, None).cpu_labels()}; {tail}",
            None if captured else f"replace {', '.join(ops)} with ops {ep} has kernels for, or split the model "
            "there and run those nodes outside the captured graph",
            {"nodes": [list(n) for n in remaining], "op_types": ops}))
    for tag, plc in ((_PHASE_AS_GIVEN, placement), (_PHASE_FIXED, fixed)):
        if plc is None or not plc.memcpy_nodes:
            continue
        copies = ", ".join(f"{op}({t!r})" for _, op, t in plc.memcpy_nodes[:8])
        more = f", ... ({len(plc.memcpy_nodes) - 8} more)" if len(plc.memcpy_nodes) > 8 else ""
        blocking = not captured and (tag == _PHASE_FIXED or not dynamic)
        out.append(Finding(
            "memcpy", "warning" if blocking else "info",
            f"{len(plc.memcpy_nodes)} Memcpy node(s) copy between host and {ep} ({tag}): {copies}{more}",
            None, {"session": tag, "nodes": [list(n) for n in plc.memcpy_nodes]}))
    return out


def _log_findings(records) -> list[Finding]:
    out: list[Finding] = []
    preferred: dict[str, list[str]] = {}
    seen = set()
    for sev, where, msg, phase in records:
        m = _CPU_PREFERRED.search(msg)
        if m:
            preferred.setdefault(phase, [])
            if m.group(1) not in preferred[phase]:
                preferred[phase].append(m.group(1))
            continue
        if any(n in msg for n in _OWN_NOISE) or (sev >= 3 and "cannot use the graph capture" in msg):
            continue  # doctor's own doing / the refusal, which the capture finding quotes
        if (sev, msg) in seen:
            continue
        seen.add((sev, msg))
        out.append(Finding(
            "ort_log", "warning" if (sev >= 3 or _CAPTURE_LOG.search(msg)) else "info",
            f"onnxruntime {'error' if sev >= 3 else 'warning'}{f' ({phase})' if phase else ''}: {msg}", None,
            {"severity": sev, "location": where, "phase": phase}))
    for phase, names in preferred.items():
        out.append(Finding(
            "ort_log", "info",
            f"onnxruntime warning ({phase}): \"Force fallback to CPU execution ... because the CPU execution path is "
            f"deemed faster\" for {len(names)} node(s): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}",
            None,
            {"nodes": names, "phase": phase}))
    return out


def _unstable_finding(ep: str, stable: tuple[bool, float, str | None], ep_options: Mapping[str, str] | None) -> Finding:
    """Two uncaptured runs with the same feeds disagree: random ops, or an EP (option) computing wrong results.
    Measured on onnxruntime-gpu 1.31.1 (H200): CUDA ``fuse_conv_bias=1`` gives the reference model's first run
    right and every later run wrong (max abs diff ~700 against the CPU EP), captured or not."""
    _, worst, what = stable
    opts = f" with EP options {dict(ep_options)}" if ep_options else ""
    fix = ("a model with random ops (seeded or not: ORT's generator advances every run) cannot be checked this way; "
           "without them, ")
    fix += ("drop the EP options one at a time to find the one that changes results (onnxruntime-gpu 1.31.1: "
            "fuse_conv_bias=1 does)" if ep_options else "report the EP's changing results to onnxruntime")
    return Finding("ep_results", "error",
                   f"two uncaptured runs of the {ep} session{opts} with the same inputs disagree "
                   f"({what or f'max abs diff {worst:.3g}'}): random ops, or an EP computes wrong results; "
                   "a captured replay cannot be checked against them, and is not to be trusted either",
                   fix, {"max_abs_diff": worst if math.isfinite(worst) else None})


def _capture_finding(model, ep: str, example, capture: dict, findings: Sequence[Finding]) -> Finding:
    from ortcapture import shapes

    outcome = capture["outcome"]
    if outcome == "captured":
        return Finding("capture", "info", f"captured directly on {ep}; one replay matches the uncaptured run "
                       f"(max abs diff {capture['max_abs_diff']:.3g})")
    if outcome == "captured_specialized":
        fixed = ", ".join(f"{n}={_fmt_shape(s)}" for n, s in (capture["static_shapes"] or {}).items())
        why = capture.get("direct_refusal")
        return Finding(
            "capture", "info",
            f"captured via shape specialization on {ep} (dims fixed to {fixed}); one replay matches the "
            f"uncaptured run (max abs diff {capture['max_abs_diff']:.3g})"
            + (f". ORT refused the model as given: {why}" if why else ""), dims_fix(model, example))
    if outcome == "refused":
        fix = None
        if not any(f.severity == "error" and f.fix for f in findings):
            fix = (dims_fix(model, example) if shapes.dynamic_inputs(model) else
                   "ORT's reason above is all there is: check the nodes listed as off the EP")
        return Finding("capture", "error", f"{ep} refused graph capture ({capture['stage']}): {capture['reason']}",
                       fix, {"error": capture.get("error")})
    suspects = [f.details.get("output") for f in findings if f.kind in ("alias", "view_output")]
    fix = (f"fix the outputs flagged above ({', '.join(map(repr, suspects))}): they are the likely cause"
           if suspects else "look for outputs that alias inputs, data-dependent shapes or random ops")
    what = "the replay failed: " if outcome == "replay_failed" else "one replay differs from the uncaptured run: "
    return Finding("capture", "error", f"captured on {ep}, but {what}{capture['reason']}", fix,
                   {"error": capture.get("error")})


def dynamic_checks(model_path: str, model, provider: str, example: Mapping[str, Sequence[int]],
                   static: Sequence[Finding], progress=None,
                   ep_options: Mapping[str, str] | None = None) -> tuple[list[Finding], dict]:
    """Placement, ORT's log and a real capture on ``provider``; returns (findings, capture result).

    Raises :class:`DoctorError` when ORT cannot even create an uncaptured session for the model."""
    from ortcapture import shapes

    say = progress or (lambda msg: None)
    ep = _EP_NAMES[provider]
    tol = 1e-3 if provider == "webgpu" else 1e-4
    feeds0, feeds1 = random_feeds(model, example, 0), random_feeds(model, example, 1)
    dynamic = shapes.dynamic_inputs(model)
    external = any(t.data_location == 1 for t in model.graph.initializer)  # TensorProto.EXTERNAL
    list_memcpy = not external and os.path.getsize(model_path) < _OPTIMIZED_MODEL_LIMIT
    fixed_placement = None
    with tempfile.TemporaryDirectory(prefix="ortcapture-doctor-") as tmp, OrtLogCapture() as log:
        say(f"placement: uncaptured {ep} session")
        log.set_phase(_PHASE_AS_GIVEN)
        try:
            plain, placement = placement_session(model_path, provider, tmp, "as_given", list_memcpy, ep_options)
        except Exception as exc:  # noqa: BLE001
            raise DoctorError(f"onnxruntime cannot create an uncaptured {ep} session for this model: "
                              f"{_ort_reason(exc)}") from None
        if dynamic and placement.cpu_nodes:
            say("placement: uncaptured session with the dims fixed")
            log.set_phase(_PHASE_FIXED)
            try:
                fixed = shapes.fix_input_shapes(model_path, {n: example[n] for n in dynamic})
                _, fixed_placement = placement_session(fixed, provider, tmp, "fixed", list_memcpy, ep_options)
            except Exception:  # noqa: BLE001 - the capture attempt reports what ORT says
                fixed_placement = None
        say("reference: two uncaptured runs")
        try:
            want = plain.run(None, feeds1)
        except Exception as exc:  # noqa: BLE001 - the example feeds do not fit the model
            raise DoctorError(f"an uncaptured {ep} run with random feeds of shapes "
                              f"{ {n: _fmt_shape(s) for n, s in example.items()} } fails: {_ort_reason(exc)}; "
                              "pass --shape with shapes the model accepts") from None
        try:  # a replay can only be judged against a stable run
            stable = _compare(plain.run(None, feeds1), want, tol)
        except Exception:  # noqa: BLE001 - a second run that fails: the capture attempt reports what ORT says
            stable = (True, 0.0, None)
        del plain
        say(f"capture: one capture and one replay on {ep} (a big model's first capture can take a while)")
        log.set_phase(_PHASE_CAPTURE)
        capture = attempt_capture(model_path, provider, feeds0, feeds1, want, tol, ep_options)
    # ORT logs its refusal before raising: a more precise reason than the wrapped exception
    refusals = [m for sev, _, m, ph in log.records if ph == _PHASE_CAPTURE and sev >= 3 and "graph capture" in m]
    if refusals and capture["outcome"] == "refused":
        capture["reason"] = refusals[-1]
    if refusals and capture.get("deferred"):
        capture["direct_refusal"] = refusals[0]
    findings = _placement_findings(model, ep, example, placement, fixed_placement, capture)
    if not stable[0]:
        findings.append(_unstable_finding(ep, stable, ep_options))
    findings += _log_findings(log.records)
    findings.append(_capture_finding(model, ep, example, capture, list(static) + findings))
    return findings, capture


# ---------------------------------------------------------------------------------------------------------------
# verdict and report
# ---------------------------------------------------------------------------------------------------------------
def diagnose(model_path: str, provider: str = "auto", shape_items: Sequence[str] = (), progress=None,
             option_items: Sequence[str] = ()) -> dict:
    """Run the static checks, then (with a capture-capable EP) the dynamic ones; return the report (the object
    ``--json`` prints). ``option_items``: ``--provider-option`` strings (``KEY=VALUE``) for every session doctor
    creates, validated by :func:`ortcapture.providers.parse_provider_options`. Raises :class:`DoctorError`
    (exit 2) for an unreadable model, a bad ``--shape`` or ``--provider-option``, or an unusable requested
    provider."""
    import onnx
    import onnxruntime as ort

    from ortcapture import shapes
    from ortcapture.demo import example_shapes
    from ortcapture.errors import CaptureError
    from ortcapture.providers import parse_provider_options

    try:
        ep_options = parse_provider_options(list(option_items))
    except CaptureError as exc:
        raise DoctorError(str(exc)) from None
    if not os.path.isfile(model_path):
        raise DoctorError(f"no such model file: {model_path}")
    try:
        model = onnx.load(model_path, load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - DecodeError and friends
        raise DoctorError(f"cannot read {model_path} as an ONNX model: {exc}") from None
    given = parse_shapes(shape_items)
    findings = static_checks(model, given)
    dims = shapes.input_dims(model)
    example = {n: tuple(s) for n, s in example_shapes(model_path, 1, list(shape_items)).items()}
    derived = [n for n, ds in dims.items() if n not in given and any(not isinstance(d, int) for d in ds)]
    if derived:
        findings.append(Finding(
            "shapes", "info",
            f"no --shape for {', '.join(derived)}: checking with "
            f"{', '.join(f'{n}={_fmt_shape(example[n])}' for n in derived)} (batch 1, other dynamic dims 320); "
            "pass --shape with the shapes you will run", None, {"derived": {n: list(example[n]) for n in derived}}))
    for f in findings:
        if f.kind == "dynamic_dims" and f.severity == "warning":
            f.fix = dims_fix(model, example)
    chosen, why_none = choose_provider(provider)
    capture: dict[str, Any] = {"attempted": False, "outcome": "not_attempted", "reason": why_none}
    if chosen != "none" and any(f.kind in ("input_type", "output_type") for f in findings):
        why_none = "some inputs or outputs cannot live in device buffers (see input_type/output_type)"
        capture["reason"] = why_none
        findings.append(Finding("provider", "info", f"no capture attempted on {_EP_NAMES[chosen]}: {why_none}"))
    elif chosen == "none":
        unused = f"; the --provider-option values {ep_options} were not used" if ep_options else ""
        findings.append(Finding("provider", "info", f"no capture attempted: {why_none}{unused}"))
    else:
        more, capture = dynamic_checks(model_path, model, chosen, example, findings, progress, ep_options)
        findings += more
        if capture["outcome"] == "captured":  # ORT captured with the dims dynamic: nothing to fix
            for f in findings:
                if f.kind == "dynamic_dims" and f.severity == "warning":
                    f.severity, f.fix = "info", None
                    at = _fmt_shape(example[f.details["input"]])
                    f.message += f" (here ORT captured the model as given, at {at})"
        if capture["outcome"] in ("captured", "captured_specialized"):
            for f in findings:
                # a real capture and a matching replay outrank a static rule
                if (f.severity == "error" or f.kind == "view_output") and f.kind != "ep_results":
                    f.severity = "warning" if f.severity == "error" else "info"
                    f.details["overruled_by_capture"] = True
                    f.message += " (yet the capture attempt succeeded and its replay matched: ORT copes here)"
    errors = any(f.severity == "error" for f in findings)
    if capture["attempted"]:
        ok = capture["outcome"] in ("captured", "captured_specialized") and not errors
        basis = f"capture attempt on {_EP_NAMES[chosen]}"
    else:
        ok = not errors
        basis = "static checks only"
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: order[f.severity])
    fixes = [f.fix for f in findings if f.fix and (f.severity in ("error", "warning") or f.kind == "capture")
             and not f.details.get("overruled_by_capture")]
    return {
        "model": model_path,
        "verdict": "capturable" if ok else "not capturable",
        "exit_code": EXIT_CAPTURABLE if ok else EXIT_NOT_CAPTURABLE,
        "basis": basis,
        "provider": chosen,
        "ep": _EP_NAMES.get(chosen),
        "onnxruntime": ort.__version__,
        "provider_options": ep_options,
        "inputs": {n: {"dims": ds, "shape": list(example.get(n, ())),
                       "source": "given" if n in given else ("derived" if n in derived else "model")}
                   for n, ds in dims.items()},
        "findings": [asdict(f) for f in findings],
        "capture": capture,
        "what_to_change": list(dict.fromkeys(fixes)),
    }


_OUTCOME_WORDS = {"captured": "captured directly", "captured_specialized": "captured via shape specialization",
                  "refused": "refused", "mismatch": "captured, but the replay does not match the uncaptured run",
                  "replay_failed": "captured, but the replay failed", "not_attempted": "not attempted"}


def format_report(report: dict) -> str:
    """The human-readable report: inputs, findings (errors first), capture outcome, verdict, what to change."""
    lines = [f"ortcapture doctor: {report['model']}",
             f"  onnxruntime {report.get('onnxruntime')}, provider {report.get('ep') or report.get('provider')}"]
    for name, info in (report.get("inputs") or {}).items():
        lines.append(f"  input {name} {_fmt_dims(info['dims'])} -> {_fmt_shape(info['shape'])} ({info['source']})")
    lines.append("")
    for f in report.get("findings", []):
        lines.append(f"  [{f['severity']}] {f['kind']}: {f['message']}")
    cap = report.get("capture") or {}
    if cap.get("attempted"):
        took = f" ({cap['seconds']:.1f} s)" if cap.get("seconds") is not None else ""
        lines.append(f"\n  capture: {_OUTCOME_WORDS.get(cap['outcome'], cap['outcome'])}{took}")
    lines.append(f"\nverdict: {report['verdict']} (exit {report['exit_code']}; {report.get('basis', '')})")
    if report.get("what_to_change"):
        lines.append("what to change:")
        lines += [f"  - {fix}" for fix in report["what_to_change"]]
    return "\n".join(lines)


def _json_safe(obj):
    """``obj`` with non-finite floats (an infinite max abs diff: NaNs or shapes differ) as ``None``: strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def run(args) -> int:
    """Entry point of ``ortcapture doctor``: print the report (``--json``: one JSON object) and return the exit
    code: 0 capturable, 1 not capturable, 2 error."""
    progress = None if args.json else (lambda msg: print(f"ortcapture doctor: {msg} ...", file=sys.stderr,
                                                         flush=True))
    try:
        report = diagnose(args.model, args.provider, args.shape, progress, getattr(args, "provider_option", ()))
    except Exception as exc:  # noqa: BLE001 - DoctorError (the request) or anything unexpected: exit 2
        why = str(exc) if isinstance(exc, DoctorError) else f"doctor failed: {type(exc).__name__}: {exc}"
        if args.json:
            print(json.dumps({"model": args.model, "verdict": "error", "exit_code": EXIT_ERROR, "error": why,
                              "provider": args.provider, "findings": [], "capture": {"attempted": False},
                              "what_to_change": []}))
        else:
            print(f"ortcapture doctor: {why}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(_json_safe(report), default=str, allow_nan=False) if args.json else format_report(report))
    return int(report["exit_code"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="ortcapture doctor")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
