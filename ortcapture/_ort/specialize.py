"""Shape specialization: fixed-dim copies of a model, so that dynamic-shape models can be captured.

Capture needs static shapes. ORT refuses WebGPU capture when a dynamic-dim model's shape subgraph falls to the CPU
EP (measured, onnxruntime 1.32 + WebGPU plugin 0.4.0: "all compute graph nodes have not been partitioned to the
WebGpuExecutionProvider", raised by the ``InferenceSession`` constructor). Fixing the input dims in the model
(named ``batch``-style dims as well as unnamed ``?`` dims) lets ORT fold that subgraph away.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np
import onnx

from ortcapture.errors import CaptureError

#: Substrings of ORT errors that mean "capture refused because of where nodes landed" (dynamic shapes).
_CAPTURE_REFUSALS = (
    "have not been partitioned to the",
    "cannot use the graph capture feature",
)


def is_capture_refusal(exc: BaseException) -> bool:
    """Whether an ORT session-creation error is ORT refusing graph capture for the model's node placement."""
    return any(s in str(exc) for s in _CAPTURE_REFUSALS)


def load_model(path_or_bytes) -> onnx.ModelProto:
    """Load an ONNX model (with external data) from a path, ``bytes`` or ``ModelProto``."""
    if isinstance(path_or_bytes, onnx.ModelProto):
        return path_or_bytes
    if isinstance(path_or_bytes, (bytes, bytearray)):
        return onnx.load_from_string(bytes(path_or_bytes))
    return onnx.load(os.fspath(path_or_bytes))


def input_dims(model: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """Graph inputs (initializers excluded) -> dims: int when fixed, the dim_param name, or ``None`` when unnamed."""
    inits = {i.name for i in model.graph.initializer}
    out: dict[str, list[int | str | None]] = {}
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        dims = []
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.dim_param:
                dims.append(d.dim_param)
            else:
                dims.append(None)
        out[vi.name] = dims
    return out


def dynamic_inputs(model: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """The subset of :func:`input_dims` with at least one non-fixed dim."""
    return {n: d for n, d in input_dims(model).items() if any(not isinstance(x, int) for x in d)}


def shapeless_inputs(model: onnx.ModelProto) -> list[str]:
    """Tensor graph inputs (initializers excluded) without any shape information (not even a rank): their
    :func:`input_dims` entry is ``[]``, which does not mean a scalar."""
    inits = {i.name for i in model.graph.initializer}
    return [vi.name for vi in model.graph.input if vi.name not in inits and vi.type.HasField("tensor_type")
            and not vi.type.tensor_type.HasField("shape")]


def specializable_inputs(model: onnx.ModelProto) -> list[str]:
    """Inputs whose shape :func:`fix_input_shapes` can fix: dynamic dims or no shape information at all."""
    return list(dynamic_inputs(model)) + shapeless_inputs(model)


def shape_signature(shapes: Mapping[str, Sequence[int]]) -> tuple:
    """Hashable, order-independent key for a ``{input name: shape}`` mapping."""
    return tuple(sorted((str(n), tuple(int(d) for d in s)) for n, s in shapes.items()))


def fix_input_shapes(path_or_bytes, static_shapes: Mapping[str, Sequence[int]]) -> bytes:
    """Serialized copy of the model with the named inputs' dims fixed to ``static_shapes``.

    ``path_or_bytes``: a path, ``bytes``, ``ModelProto`` (never changed), or a session's
    :class:`~ortcapture._ort.model.ModelSource` — then the model as it was loaded, and only its graph is serialised:
    tensors stored as external data keep their references (protobuf cannot serialise a message over 2 GB, so
    loading the weights first failed with ``EncodeError`` for large models); build the session with
    :func:`ortcapture._ort.model.external_folder`. A path is loaded with its external data (a self-contained copy).

    Raises :class:`~ortcapture.errors.CaptureError` for an unknown input name, a rank mismatch, or a dim that
    contradicts a dim already fixed in the model.
    """
    import operator

    if not isinstance(static_shapes, Mapping):
        raise CaptureError(f"static_shapes must be a mapping {{input name: shape}}, got {type(static_shapes).__name__}")
    from ortcapture._ort.model import ModelSource

    if isinstance(path_or_bytes, ModelSource):
        model = path_or_bytes.structure()
    elif isinstance(path_or_bytes, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(path_or_bytes)
    else:
        model = load_model(path_or_bytes)
    dims = input_dims(model)
    shapeless = set(shapeless_inputs(model))
    for name, shape in static_shapes.items():
        if name not in dims:
            raise CaptureError(f"static_shapes names input {name!r}, but the model's inputs are {sorted(dims)}")
        try:
            shape = [operator.index(x) for x in shape]
        except TypeError:
            raise CaptureError(f"static_shapes[{name!r}] must be a sequence of ints, got {shape!r}") from None
        if name in shapeless:  # no shape information: any rank
            if any(x < 0 for x in shape):
                raise CaptureError(f"input {name!r}: shape {shape} has a negative dim")
            continue
        if len(shape) != len(dims[name]):
            raise CaptureError(f"input {name!r} has rank {len(dims[name])} ({dims[name]}), got shape {shape}")
        for want, have in zip(shape, dims[name]):
            if isinstance(have, int) and have != want:
                raise CaptureError(f"input {name!r} has fixed dims {dims[name]}; shape {shape} contradicts them")
            if want < 0:
                raise CaptureError(f"input {name!r}: shape {shape} has a negative dim")
    for vi in model.graph.input:
        if vi.name in shapeless and vi.name in static_shapes:
            shape_proto = vi.type.tensor_type.shape
            shape_proto.SetInParent()  # a scalar has a shape with no dims
            for want in static_shapes[vi.name]:
                shape_proto.dim.add().dim_value = int(want)
        elif vi.name in static_shapes:
            for d, want in zip(vi.type.tensor_type.shape.dim, static_shapes[vi.name]):
                d.Clear()
                d.dim_value = int(want)
    return model.SerializeToString()


def feed_shapes(feeds: Mapping[str, object]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of numpy arrays / OrtValues / DLPack tensors in ``feeds``."""
    out = {}
    for name, value in feeds.items():
        shape = value.shape() if callable(getattr(value, "shape", None)) else np.shape(value)
        out[name] = tuple(int(d) for d in shape)
    return out


def parse_shape_args(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``["images=1x3x320x320", ...]`` (the CLI's ``--shape``) -> ``{"images": (1, 3, 320, 320)}``.

    Raises :class:`~ortcapture.errors.CaptureError` for bad syntax, non-integer or negative dims, or one name given
    twice with different shapes.
    """
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise CaptureError(f"--shape {item!r}: expected NAME=DIMxDIMx... (e.g. images=1x3x320x320)")
        if not dims.strip():
            raise CaptureError(f"--shape {item!r}: no dims (scalar inputs need no --shape)")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise CaptureError(f"--shape {item!r}: dims must be integers separated by 'x'") from None
        if any(d < 0 for d in shape):
            raise CaptureError(f"--shape {item!r}: negative dim")
        if name in out and out[name] != shape:
            raise CaptureError(f"--shape given twice for {name!r}: {out[name]} and {shape}")
        out[name] = shape
    return out


#: OrtMemoryInfo names (lower case) of host memory: inputs ORT reads there are constants of a captured graph
_HOST_MEMORY = ("cpu", "cudapinned", "cuda_cpu")


def host_read_inputs(session) -> frozenset[str]:
    """Inputs ORT reads in host memory (a Reshape shape, Slice starts, Clip bounds, ...): their values are constants
    of a captured graph, so they join the graph's key. Without ``get_input_memory_infos`` (ORT < 1.27) every integer
    input is treated as one."""
    metas = session.get_inputs()
    getter = getattr(session, "get_input_memory_infos", None)
    if getter is not None:
        try:
            infos = getter()
            return frozenset(m.name for m, info in zip(metas, infos)
                             if str(getattr(info, "name", "")).lower().startswith(_HOST_MEMORY))
        except Exception:  # noqa: BLE001 - fall back to the conservative rule
            pass
    return frozenset(m.name for m in metas if "int" in m.type)
