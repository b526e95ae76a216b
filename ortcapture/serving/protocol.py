"""The Open Inference Protocol (KServe v2) over HTTP: parsing and encoding, nothing else (no server, no Ray).

Pure functions over bytes, numpy arrays and plain dicts, so clients that exist already (Triton's
``tritonclient.http``, KServe's clients) work unchanged and every rule here is unit-testable and fuzzable quickly:

* :func:`parse_infer_request` turns an ``/infer`` body (JSON, or JSON plus the *binary tensor data extension*: the
  ``Inference-Header-Content-Length`` header says how many leading bytes are JSON; each input with
  ``parameters.binary_data_size`` takes that many of the bytes after it, in input order) into ``{input: numpy array}``
  checked against the model: every input once, its datatype exactly (no casts), its rank and fixed dims, the rows
  along the batch axis within ``1..max_rows``. The declared shape x datatype size is checked against the bytes sent
  (and against the body cap) **before** anything is allocated. Nothing is ever unpickled: tensors are built from
  JSON numbers or raw little-endian bytes with ``numpy.frombuffer``.
* :func:`encode_infer_response` writes the response: JSON ``data`` (flat, row-major) or binary outputs when the
  request asked for them (``outputs[i].parameters.binary_data`` or the request's ``parameters.binary_data_output``).
* JSON is strict both ways (RFC 8259): no ``NaN``/``Infinity`` is read or written (a float output holding them is
  sent in binary only), and a JSON number a float datatype holds only as infinity is refused.
* :func:`decode_body` inflates ``gzip`` (every member, RFC 1952 §2.2) and ``deflate`` (one zlib stream) bodies under
  the body cap, refusing bytes after the last member or stream.
* :func:`model_metadata`, :func:`statistics`, :func:`error_body` give the other endpoints' bodies; shapes use -1
  for dynamic dims; the statistics follow Triton's statistics extension.

Every client mistake raises :class:`ProtocolError` with the HTTP status the protocol gives it (400 bad request,
413 past the body cap); a server maps it to ``{"error": message}``.
"""
from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence

import numpy as np

#: the header of the binary tensor data extension: bytes of the JSON part at the start of the body
HEADER_LENGTH = "Inference-Header-Content-Length"
#: the default cap on a request body (bytes, after decompression): 64 MiB
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
#: KServe v2 datatype -> numpy dtype name (little-endian, as the binary extension sends them); BYTES (strings) is not
#: a numeric tensor and is not served
DATATYPES = {
    "BOOL": "bool", "UINT8": "uint8", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "int8",
    "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
}
_BY_NAME = {np.dtype(v).name: k for k, v in DATATYPES.items()}


class ProtocolError(ValueError):
    """A request the protocol refuses: ``status`` is its HTTP status (400, 404, 413, ...), ``str()`` the message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: ``name``, numpy ``dtype``, ``shape`` (ints, -1 for a dynamic dim)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def datatype(self) -> str:
        """The protocol's datatype name (``FP32``, ``INT64``, ``BF16`` for ``ml_dtypes.bfloat16``...)."""
        return datatype_of(self.dtype)


@dataclass(frozen=True)
class ModelSpec:
    """What the protocol needs to know of a served model.

    Attributes:
        name: the model name in the URLs.
        inputs / outputs: :class:`TensorSpec` s in the model's order.
        batch_axes: ``{input name: axis}`` of the inputs that carry the batched dim.
        max_rows: the most rows one request may have along the batched dim.
        version: the one version served (``"1"``); URLs without a version mean it.
        platform: the metadata's ``platform``.
        max_body_bytes: the request body cap in bytes (after decompression); past it: 413.
    """

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_axes: Mapping[str, int] = field(default_factory=dict)
    max_rows: int = 2 ** 31 - 1
    version: str = "1"
    platform: str = "onnxruntime_onnx"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    @classmethod
    def from_runner(cls, name: str, runner, **kwargs) -> "ModelSpec":
        """The spec of a :class:`ortcapture.serving.BatchRunner` (its ``inputs``, ``outputs``, ``input_axes`` and
        ``max_rows``)."""
        return cls(name=name, inputs=tuple(TensorSpec(n, np.dtype(t), tuple(s)) for n, t, s in runner.inputs),
                   outputs=tuple(TensorSpec(n, np.dtype(t), tuple(s)) for n, t, s in runner.outputs),
                   batch_axes=dict(runner.input_axes), max_rows=int(runner.max_rows), **kwargs)


@dataclass
class InferRequest:
    """A parsed ``/infer`` request: ``id`` (echoed back, or ``None``), ``inputs`` ``{name: numpy array}``, and
    ``outputs``: ``[(output name, binary)]`` to return, in order."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]]


def datatype_of(dtype) -> str:
    """The protocol datatype of a numpy dtype. Raises :class:`ValueError` for one the protocol has no name for."""
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":
        return "BF16"
    name = _BY_NAME.get(dt.name)
    if name is None:
        raise ValueError(f"numpy dtype {dt} has no Open Inference Protocol datatype")
    return name


def _dtype_for(spec: TensorSpec) -> np.dtype:
    """The little-endian numpy dtype the wire carries for ``spec`` (``BF16`` is the model's own dtype)."""
    if spec.datatype == "BF16":
        return spec.dtype
    return np.dtype(DATATYPES[spec.datatype])


def error_body(message: str) -> bytes:
    """``{"error": message}`` as JSON bytes (the protocol's error body)."""
    return json.dumps({"error": str(message)}, allow_nan=False).encode()


def model_metadata(spec: ModelSpec) -> dict:
    """The body of ``GET /v2/models/{name}``: name, versions, platform, and inputs/outputs with datatypes and shapes
    (-1 for dynamic dims)."""
    def t(s: TensorSpec) -> dict:
        return {"name": s.name, "datatype": s.datatype, "shape": [int(d) for d in s.shape]}
    return {"name": spec.name, "versions": [spec.version], "platform": spec.platform,
            "inputs": [t(s) for s in spec.inputs], "outputs": [t(s) for s in spec.outputs]}


#: bytes of compressed data fed to zlib first for each member, doubled per feed up to _MAX_PIECE: a member's
#: leftover input is copied once when it ends, so tiny members cost little and a body costs linear time
_FIRST_PIECE = 64
_MAX_PIECE = 1 << 20


def model_config(spec: ModelSpec) -> dict:
    """The body of ``GET /v2/models/{name}/config``, in the shape of Triton's model configuration (what
    ``tritonclient``'s ``get_model_config`` returns): ``name``, ``platform``, ``backend``, ``max_batch_size`` (the
    rows one request may have) and ``input``/``output`` with ``data_type`` (``TYPE_FP32``...) and ``dims`` — without
    the batch dim where the tensor carries it (Triton's convention when ``max_batch_size`` > 0), -1 for dynamic.
    Triton's convention gives *every* tensor an implicit batch dim when ``max_batch_size`` > 0, so a model with an
    input that has none (one value per request) is described with ``max_batch_size`` 0 and full shapes (the batch
    dim -1), as Triton describes a model that batches itself; a client built from either form sends the right
    shapes."""
    def t(s: TensorSpec, batched: bool) -> dict:
        dims = [int(d) for d in s.shape]
        if batched and dims:
            dims = dims[1:]
        return {"name": s.name, "data_type": "TYPE_" + s.datatype.replace("BYTES", "STRING"),
                "dims": dims}
    batch0 = {n for n, ax in spec.batch_axes.items() if ax == 0}
    if any(s.name not in batch0 for s in spec.inputs):  # an input without the batch dim: full shapes
        batch0 = set()
    batched_out = bool(batch0)
    return {"name": spec.name, "platform": spec.platform, "backend": "onnxruntime",
            "max_batch_size": int(spec.max_rows) if batch0 else 0,
            "input": [t(s, s.name in batch0) for s in spec.inputs],
            "output": [t(s, batched_out and bool(s.shape) and s.shape[0] == -1) for s in spec.outputs]}


def decode_body(body: bytes, content_encoding: str | None, cap: int) -> bytes:
    """``body`` decompressed per ``Content-Encoding`` (``gzip``, ``deflate`` (zlib), ``identity`` or none), at most
    ``cap`` bytes. ``gzip`` is a series of members (RFC 1952 §2.2), each inflated in turn (empty ones too);
    ``deflate`` is one zlib stream (RFC 1950).

    Raises:
        ProtocolError: (413) past the cap, counting every member's output (checked while decompressing: a small
            body that inflates past it is refused without inflating it all). (400) bad or truncated compressed data;
            any bytes after the last gzip member that are not a complete member (padding too) or after the zlib
            stream; another encoding.
    """
    enc = (content_encoding or "identity").strip().lower()
    if enc in ("", "identity"):
        if len(body) > cap:
            raise ProtocolError(f"request body of {len(body)} bytes is past the cap of {cap} bytes", 413)
        return body
    if enc not in ("gzip", "deflate"):
        raise ProtocolError(f"Content-Encoding {content_encoding!r} is not supported (gzip, deflate, identity)")
    view, out = memoryview(body), bytearray()
    pos = members = 0
    while True:
        try:
            end = _inflate_member(view, pos, 31 if enc == "gzip" else 15, out, cap)
        except zlib.error as exc:
            raise ProtocolError(_after_members(enc, members, len(view) - pos, f"not valid {enc} data: {exc}")) from None
        if end is None:
            raise ProtocolError(_after_members(enc, members, len(view) - pos, f"truncated {enc} data"))
        members, pos = members + 1, end
        if pos == len(view):
            return bytes(out)
        if enc == "deflate":
            raise ProtocolError(f"request body has {len(view) - pos} bytes after the end of its deflate (zlib) "
                                "stream")


def _inflate_member(view: memoryview, pos: int, wbits: int, out: bytearray, cap: int) -> int | None:
    """Inflate the one gzip member or zlib stream (``wbits``) that starts at ``view[pos]``, appending to ``out``.
    Returns the offset just past it, or ``None`` when the body ends first. Raises :class:`ProtocolError` (413) once
    ``out`` passes ``cap`` bytes (zlib never makes more than one byte past it), ``zlib.error`` for bad data."""
    d = zlib.decompressobj(wbits=wbits)
    piece = _FIRST_PIECE
    while pos < len(view):
        chunk = view[pos:pos + piece]
        out += d.decompress(chunk, cap + 1 - len(out))
        if len(out) > cap:
            raise ProtocolError(f"request body inflates past the cap of {cap} bytes", 413)
        if d.eof:
            return pos + len(chunk) - len(d.unused_data)
        pos += len(chunk)  # output under its limit: zlib took the whole chunk
        piece = min(piece * 2, _MAX_PIECE)
    return None


def _after_members(enc: str, members: int, left: int, what: str) -> str:
    """The message for bad compressed data: of the body itself, or of the ``left`` bytes after ``members`` members."""
    if members == 0:
        return f"request body is {what}"
    return (f"request body has {left} bytes after its {members} complete gzip member(s) that are not a complete gzip "
            f"member ({what}): RFC 1952 allows only members")


def _header_length(value, body_len: int) -> int | None:
    """The header's value (a string of ASCII digits, as HTTP carries it, or an int) as an int; ``None`` when absent.
    ``"32.0"``, ``"+32"``, ``"3_2"``, non-ASCII digits, a bool or a float are refused (``int()`` would take some)."""
    if value is None:
        return None
    if _is_int(value):
        n = value
    elif isinstance(value, (str, bytes)) and re.fullmatch(rb"\s*[0-9]{1,20}\s*", value if isinstance(value, bytes)
                                                         else value.encode("utf-8", "replace")):
        n = int(value)
    else:
        raise ProtocolError(f"{HEADER_LENGTH} must be a non-negative integer, got {_what(value)}")
    if n < 0 or n > body_len:
        raise ProtocolError(f"{HEADER_LENGTH} is {n}, but the body has {body_len} bytes")
    return n


def _no_constant(token: str):
    raise ValueError(f"{token} is not JSON (RFC 8259 §6 has no NaN or infinity): send such tensors as binary data")


def _load_json(raw: bytes) -> Any:
    """``raw`` parsed as strict JSON: Python's ``NaN``, ``Infinity`` and ``-Infinity`` tokens are refused (400), and
    so is an empty body (said as such)."""
    if not bytes(raw).strip():
        raise ProtocolError("the request body is empty: an infer request is a JSON object with 'inputs'")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"the request is not valid JSON: {str(exc)[:200]}") from None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_JSON_TYPES = {bool: "boolean", str: "string", float: "number", list: "array", dict: "object", type(None): "null"}


def _what(x) -> str:
    """``x`` for a message: its JSON type and a short repr (``string '32'``, ``number 32.0``, ``boolean true``)."""
    kind = _JSON_TYPES.get(type(x), type(x).__name__)
    strict = isinstance(x, (bool, type(None))) or (isinstance(x, float) and math.isfinite(x))
    text = json.dumps(x, allow_nan=False) if strict else repr(x)
    return f"{kind} {text[:20]}"


def _parameters(obj: Mapping, where: str) -> Mapping:
    p = obj.get("parameters", {})
    if p is None:
        return {}
    if not isinstance(p, Mapping):
        raise ProtocolError(f"{where} 'parameters' must be an object")
    return p


def _flatten(data: Any, count: int, name: str, kind: str) -> list:
    """The JSON ``data`` of an input (flat or nested lists) as a flat list of ``count`` elements, each checked for
    ``kind`` (``b`` bool, ``i`` integer, ``f`` number). Walks iteratively and stops past ``count``."""
    if not isinstance(data, list):
        raise ProtocolError(f"input {name!r}: 'data' must be a list")
    out: list = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            ok = (isinstance(x, bool) if kind == "b" else _is_int(x) if kind == "i"
                  else (_is_int(x) or isinstance(x, float)))
            if not ok:
                want = {"b": "true/false", "i": "integers", "f": "numbers"}[kind]
                raise ProtocolError(f"input {name!r}: 'data' holds {type(x).__name__} {str(x)[:20]!r}; this "
                                    f"datatype takes {want}")
            out.append(x)
            if len(out) > count:
                raise ProtocolError(f"input {name!r}: 'data' has more than the {count} elements its shape declares")
        else:
            stack.pop()
    if len(out) != count:
        raise ProtocolError(f"input {name!r}: 'data' has {len(out)} elements, its shape declares {count}")
    return out


#: the largest dim of a request's tensor of no elements (its other dims are not bounded by the body's bytes)
MAX_DIM = 2**31 - 1


def _check_shape(tensor: Mapping, spec: TensorSpec, model: ModelSpec) -> tuple[int, ...]:
    shape = tensor.get("shape")
    if not isinstance(shape, list):
        raise ProtocolError(f"input {spec.name!r}: 'shape' must be a list of integers >= 0, got {_what(shape)}")
    for ax, d in enumerate(shape):
        if not _is_int(d) or d < 0:
            raise ProtocolError(f"input {spec.name!r}: 'shape' must be a list of integers >= 0; entry {ax} is "
                                + (_what(d) if not _is_int(d) else str(d)[:40]))
    if 0 in shape and max(shape) > MAX_DIM:  # no bytes bound it; numpy's reshape then failed: a 500 (a tester)
        ax = next(a for a, d in enumerate(shape) if d > MAX_DIM)
        raise ProtocolError(f"input {spec.name!r}: a tensor of no elements with dims up to {MAX_DIM}; entry {ax} is "
                            f"{str(shape[ax])[:40]}")
    if len(shape) != len(spec.shape):
        raise ProtocolError(f"input {spec.name!r}: rank {len(shape)} (shape {shape}); the model's is "
                            f"{len(spec.shape)} (shape {list(spec.shape)})")
    for ax, (want, got) in enumerate(zip(spec.shape, shape)):
        if want >= 0 and got != want:
            raise ProtocolError(f"input {spec.name!r}: axis {ax} is {got}; the model fixes it at {want} "
                                f"(shape {list(spec.shape)})")
    axis = model.batch_axes.get(spec.name)
    if axis is not None and not 1 <= shape[axis] <= model.max_rows:
        raise ProtocolError(f"input {spec.name!r}: {shape[axis]} rows along axis {axis}; a request has 1 to "
                            f"{model.max_rows}")
    return tuple(shape)


def parse_infer_request(body: bytes, header_length, model: ModelSpec, external: Collection[str] = (),
                        pieces: Sequence | None = None, *, align: bool = True) -> InferRequest:
    """Parse and check an ``/infer`` body against ``model``.

    Args:
        body: the (decompressed, capped: :func:`decode_body`) request body.
        header_length: the ``Inference-Header-Content-Length`` header's value, or ``None`` (all JSON).
        model: the served model.
        external: inputs the body leaves out because they are given elsewhere (in CUDA shared memory regions,
            :mod:`ortcapture.serving.cuda_shm`; checked there and by the request check).
        pieces: the binary tensors as separate bytes-like objects, exactly one per input with
            ``binary_data_size``, in input order, each exactly that input's bytes (gRPC's ``raw_input_contents``):
            ``body`` is then the JSON header alone and ``header_length`` its length — the checks of one joined body
            (stricter: a joined body may split its bytes anywhere; here a piece that is not one input's whole
            tensor is refused), without copying the tensors into it. Arrays are read-only when the pieces are
            (``bytes``).
        align: binary inputs at an address that is not a multiple of their item size (the JSON header's length
            decides it) are copied to aligned memory (ORT reads aligned buffers); ``False`` leaves them unaligned
            views, for a caller that copies them anyway.

    Returns:
        :class:`InferRequest` whose arrays have exactly the model's dtypes and the declared shapes (read-only
        views of ``body``, or of ``pieces``, for binary inputs).

    Raises:
        ProtocolError: (400) not JSON (``NaN``, ``Infinity`` and ``-Infinity`` are not: RFC 8259 §6) / not an
            object; a bad header length; ``inputs`` missing, not a list, an input twice, unknown or missing; a
            datatype other than the model's; a bad shape, rank or fixed dim; rows outside ``1..max_rows``; neither or
            both of ``data`` and ``binary_data_size``; a ``binary_data_size`` other than shape x datatype size;
            binary bytes short of or beyond what the inputs declare; BOOL binary bytes other than 0 and 1; JSON data
            of the wrong count or kind, or out of the datatype's range (an integer past an integer datatype's, a
            number that becomes infinity in a float datatype); unknown or non-boolean output requests;
            ``classification`` outputs. (413) a declared tensor larger than the body cap.
    """
    n_header = _header_length(header_length, len(body))
    raw_json = body if n_header is None else body[:n_header]
    binary = memoryview(body)[n_header:] if n_header is not None else memoryview(b"")
    chunks = None if pieces is None else [memoryview(p).cast("B") for p in pieces]
    try:
        req = _load_json(raw_json)
    except ProtocolError as exc:
        if n_header is not None and n_header < len(body):  # e.g. a client that kept the header of another request
            raise ProtocolError(f"{exc} (read as the first {n_header} of {len(body)} bytes, as the {HEADER_LENGTH} "
                                "header says)") from None
        raise
    if not isinstance(req, dict):
        raise ProtocolError("the request must be a JSON object")
    rid = req.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError("'id' must be a string")
    params = _parameters(req, "the request's")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not (inputs or external):
        raise ProtocolError("'inputs' must be a non-empty list")
    specs = {s.name: s for s in model.inputs}
    seen: dict[str, Mapping] = {}
    for t in inputs:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ProtocolError("each input must be an object with a string 'name'")
        name = t["name"]
        if name not in specs:
            raise ProtocolError(f"input {name[:100]!r} is not an input of model {model.name!r} "
                                f"({[s.name for s in model.inputs]})")
        if name in seen:
            raise ProtocolError(f"input {name!r} appears twice")
        seen[name] = t
    missing = [n for n in specs if n not in seen and n not in external]
    if missing:
        raise ProtocolError(f"input(s) {missing} missing: model {model.name!r} takes {list(specs)}")
    arrays: dict[str, np.ndarray] = {}
    offset = used = 0
    for t in inputs:  # binary data is consumed in the order the inputs are listed
        spec = specs[t["name"]]
        if t.get("datatype") != spec.datatype:
            raise ProtocolError(f"input {spec.name!r}: datatype {str(t.get('datatype'))[:20]!r}; the model takes "
                                f"{spec.datatype}")
        shape = _check_shape(t, spec, model)
        count = math.prod(shape)
        wire = _dtype_for(spec)
        nbytes = count * wire.itemsize
        if nbytes > model.max_body_bytes:
            raise ProtocolError(f"input {spec.name!r}: shape {list(shape)} is {nbytes} bytes, past the body cap of "
                                f"{model.max_body_bytes}", 413)
        tparams = _parameters(t, f"input {spec.name!r}")
        size = tparams.get("binary_data_size")
        has_data = "data" in t
        if size is not None:
            if has_data:
                raise ProtocolError(f"input {spec.name!r}: both 'data' and binary_data_size")
            if n_header is None:
                raise ProtocolError(f"input {spec.name!r}: binary_data_size without the {HEADER_LENGTH} header")
            if not _is_int(size) or size < 0:
                raise ProtocolError(f"input {spec.name!r}: binary_data_size must be a non-negative integer, got "
                                    f"{_what(size)}")
            if size != nbytes:
                raise ProtocolError(f"input {spec.name!r}: binary_data_size {str(size)[:20]}; shape {list(shape)} "
                                    f"of {spec.datatype} is {nbytes} bytes")
            if chunks is None:
                if offset + nbytes > len(binary):
                    raise ProtocolError(f"input {spec.name!r}: {nbytes} binary bytes declared, "
                                        f"{len(binary) - offset} sent")
                raw = binary[offset:offset + nbytes]
            else:
                if used >= len(chunks) or chunks[used].nbytes != nbytes:
                    sent = chunks[used].nbytes if used < len(chunks) else 0
                    raise ProtocolError(f"input {spec.name!r}: {nbytes} binary bytes declared, {sent} sent")
                raw = chunks[used]
                used += 1
            if spec.datatype == "BOOL":
                _check_bool_bytes(raw, spec.name)
            arr = np.frombuffer(raw, dtype=wire).reshape(shape)
            if align and not arr.flags.aligned:  # an odd offset in the body: ORT reads aligned buffers
                arr = arr.copy()
            offset += nbytes
        elif has_data:
            kind = "b" if spec.datatype == "BOOL" else "f" if wire.kind == "f" or spec.datatype == "BF16" else "i"
            flat = _flatten(t["data"], count, spec.name, kind)
            arr = _json_array(flat, kind, spec, wire).reshape(shape)
        else:
            raise ProtocolError(f"input {spec.name!r}: neither 'data' nor binary_data_size")
        if arr.dtype != spec.dtype:  # a big-endian host, or the wire's explicit endianness
            arr = arr.astype(spec.dtype)
        arrays[spec.name] = arr
    if chunks is not None and used != len(chunks):
        raise ProtocolError(f"{len(chunks) - used} binary tensor(s) that no input declares")
    if chunks is None and offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes after the tensors that no input declares")
    return InferRequest(rid, arrays, _requested_outputs(req, params, model))


def _check_bool_bytes(raw: memoryview, name: str) -> None:
    """Raises :class:`ProtocolError` (400) unless every byte of BOOL input ``name``'s binary data is 0 or 1 (numpy
    would keep the others as bools that are neither, which nothing downstream defines)."""
    if raw.nbytes and int(np.frombuffer(raw, np.uint8).max()) > 1:
        raise ProtocolError(f"input {name!r}: BOOL binary data holds bytes other than 0 (false) and 1 (true)")


def _all_finite(a: np.ndarray) -> bool:
    return bool(np.isfinite(a.astype(np.float32) if a.dtype.name == "bfloat16" else a).all())


def _json_array(flat: list, kind: str, spec: TensorSpec, wire: np.dtype) -> np.ndarray:
    """The checked JSON values of input ``spec`` (:func:`_flatten`'s ``kind``) as a flat array of its dtype. Numbers
    for a float datatype are read as the nearest float64 (as JSON parsers do), then rounded to the datatype: one that
    rounds to its largest finite value is taken, one that becomes infinity is refused.

    Raises:
        ProtocolError: (400) an integer out of an integer datatype's range, a number past a float datatype's.
    """
    try:
        if kind == "i":
            info = np.iinfo(wire)
            if flat and not (info.min <= min(flat) and max(flat) <= info.max):
                raise OverflowError
        if kind != "f":
            return np.asarray(flat, dtype=wire)
        wide = np.asarray(flat, dtype=np.float64)  # JSON integers too; one past float64: OverflowError
        with np.errstate(over="ignore"):
            arr = wide.astype(spec.dtype if spec.datatype == "BF16" else wire)
        if not _all_finite(arr):  # the JSON read no NaN or infinity: these overflowed
            raise OverflowError
        return arr
    except (OverflowError, ValueError, TypeError):
        raise ProtocolError(f"input {spec.name!r}: 'data' holds values out of {spec.datatype}'s range") from None


def _requested_outputs(req: Mapping, params: Mapping, model: ModelSpec) -> list[tuple[str, bool]]:
    default = params.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise ProtocolError("parameters.binary_data_output must be true or false")
    outputs = req.get("outputs")
    names = [s.name for s in model.outputs]
    if outputs is None:
        return [(n, default) for n in names]
    if not isinstance(outputs, list):
        raise ProtocolError("'outputs' must be a list")
    out = []
    for o in outputs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise ProtocolError("each requested output must be an object with a string 'name'")
        if o["name"] not in names:
            raise ProtocolError(f"output {o['name'][:100]!r} is not an output of model {model.name!r} ({names})")
        op = _parameters(o, f"output {o['name']!r}")
        cls = op.get("classification")
        if cls is not None and not _is_int(cls):
            raise ProtocolError(f"output {o['name']!r}: classification must be a non-negative integer, got "
                                f"{_what(cls)}")
        if cls not in (None, 0):
            raise ProtocolError(f"output {o['name']!r}: the classification extension is not supported")
        binary = op.get("binary_data", default)
        if not isinstance(binary, bool):
            raise ProtocolError(f"output {o['name']!r}: binary_data must be true or false")
        if any(n == o["name"] for n, _ in out):
            raise ProtocolError(f"output {o['name']!r} requested twice")
        out.append((o["name"], binary))
    return out or [(n, default) for n in names]


def _json_data(a: np.ndarray, name: str) -> list:
    """Output ``name`` flat (row-major) as JSON values. Raises :class:`ProtocolError` (400) for non-finite floats."""
    if a.dtype.name == "bfloat16" or a.dtype.kind == "f":
        flat = a.astype(np.float64).ravel()
        if not np.isfinite(flat).all():
            raise ProtocolError(f"output {name!r} holds non-finite values (NaN or infinity), which JSON cannot carry "
                                "(RFC 8259 §6): request it with parameters.binary_data=true")
        return flat.tolist()
    return a.ravel().tolist()


def encode_infer_response(model: ModelSpec, request: InferRequest, outputs: Mapping[str, np.ndarray]
                          ) -> tuple[bytes, dict[str, str]]:
    """The ``/infer`` response for ``request`` from the model's ``outputs``.

    Returns:
        ``(body, headers)``: JSON only (``Content-Type: application/json``), or with any binary output the JSON
        header followed by the outputs' raw little-endian bytes in output order (``Content-Type:
        application/octet-stream`` and ``Inference-Header-Content-Length``).

    Raises:
        ProtocolError: (400) an output requested as JSON holds NaN or infinity, which JSON cannot carry (RFC 8259
            §6); binary outputs carry them.
        KeyError: a requested output missing from ``outputs`` (a server error, not the client's).
    """
    specs = {s.name: s for s in model.outputs}
    tensors, blobs = [], []
    for name, binary in request.outputs:
        a = np.asarray(outputs[name])
        spec = specs.get(name)
        datatype = spec.datatype if spec is not None else datatype_of(a.dtype)
        t: dict[str, Any] = {"name": name, "datatype": datatype, "shape": [int(d) for d in a.shape]}
        if binary:
            wire = a.dtype if datatype == "BF16" else np.dtype(DATATYPES[datatype])
            blob = np.ascontiguousarray(a, dtype=wire).tobytes()
            t["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            t["data"] = _json_data(a, name)
        tensors.append(t)
    head: dict[str, Any] = {"model_name": model.name, "model_version": model.version}
    if request.id is not None:
        head["id"] = request.id
    head["outputs"] = tensors
    raw = json.dumps(head, allow_nan=False).encode()
    if not blobs:
        return raw, {"Content-Type": "application/json"}
    return raw + b"".join(blobs), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(raw))}


def _duration(count: int = 0, ns: int = 0) -> dict:
    return {"count": _count(count), "ns": _count(ns)}


def _count(x) -> int:
    """A report's count (or ns) as an int: 0 for a NaN or infinite float, which no count is."""
    if isinstance(x, (float, np.floating)) and not math.isfinite(x):
        return 0
    return int(x)


def _finite(x):
    """``x`` (a report) with every NaN or infinite float as ``None`` (JSON ``null``) and tuples as lists."""
    if isinstance(x, Mapping):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x


def statistics(model: ModelSpec, replicas: Sequence[Mapping]) -> dict:
    """The body of ``GET /v2/models/{name}/stats`` in the shape of Triton's statistics extension, summed over the
    ``replicas``' reports, plus ``model_stats[0]["ortcapture"] = {"replicas": [...]}`` with each report as given.

    A report may hold (all optional, counts and nanoseconds): ``success``/``fail``/``queue``/``compute_infer``
    ``{"count", "ns"}``, ``inference_count`` (rows), ``execution_count`` (batches), ``last_inference`` (ms since the
    epoch) and ``batch_stats`` ``{rows: {"count", "ns"}}``. The body is strict JSON: a NaN or infinite count counts
    0, and the reports' NaN or infinite floats are shown as ``null``.
    """
    keys = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")
    infer = {k: _duration() for k in keys}
    batches: dict[int, dict] = {}
    inference_count = execution_count = last = 0
    for r in replicas:
        for k in keys:
            d = r.get(k) or {}
            infer[k]["count"] += _count(d.get("count", 0))
            infer[k]["ns"] += _count(d.get("ns", 0))
        inference_count += _count(r.get("inference_count", 0))
        execution_count += _count(r.get("execution_count", 0))
        last = max(last, _count(r.get("last_inference", 0)))
        for size, d in (r.get("batch_stats") or {}).items():
            b = batches.setdefault(int(size), _duration())
            b["count"] += _count(d.get("count", 0))
            b["ns"] += _count(d.get("ns", 0))
    batch_stats = [{"batch_size": s, "compute_input": _duration(), "compute_infer": batches[s],
                    "compute_output": _duration()} for s in sorted(batches)]
    return {"model_stats": [{
        "name": model.name, "version": model.version, "last_inference": last,
        "inference_count": inference_count, "execution_count": execution_count, "inference_stats": infer,
        "batch_stats": batch_stats, "memory_usage": [], "ortcapture": {"replicas": [_finite(r) for r in replicas]},
    }]}
