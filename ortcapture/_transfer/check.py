"""The checks every transfer makes before any native call: devices, metadata, shapes, dtypes, aliasing, values.

Moved out of :mod:`ortcapture.transfer` unchanged; the public module re-exports the public names.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ortcapture._ort import compat
from ortcapture._ort.compat import C_OrtDevice, C_OrtValue, OrtDevice, OrtValue
from ortcapture._ort.sync import FORKED_DEVICES, check_device
from ortcapture._ort.values import ONNX_TO_NP, ValueMeta, check_webgpu_bytes, meta
from ortcapture.errors import TransferError



CPU, GPU = 0, 1  # OrtDevice::Type


NONE_VENDOR = 0x0000


#: OrtValue device kind -> (OrtDevice type, PCI vendor id) — mirrors ORT's get_vendor_id_for_device_type.
_DEVICE_KINDS = {
    "cpu": (CPU, NONE_VENDOR), "cuda": (GPU, 0x10DE), "webgpu": (GPU, NONE_VENDOR), "dml": (GPU, 0x1414),
    "cann": (3, 0x19E5),
}


def _endpoint(x) -> tuple[int, int, str]:
    """(OrtDevice type, vendor id, kind name) of an OrtValue or OrtDevice."""
    if isinstance(x, C_OrtValue):
        x = OrtValue(x)
    if isinstance(x, OrtValue):
        kind = meta(x).kind
        if kind not in _DEVICE_KINDS:
            raise TransferError(f"unknown OrtValue device {kind!r}")
        return (*_DEVICE_KINDS[kind], kind)
    dev = compat.c_device(x) if isinstance(x, OrtDevice) else x
    if isinstance(dev, C_OrtDevice):
        t = int(dev.device_type())
        v = int(dev.vendor_id()) if hasattr(dev, "vendor_id") else NONE_VENDOR
        if t == CPU:
            return t, v, "cpu"
        if t == GPU and v == NONE_VENDOR:
            return t, v, "webgpu"
        if t == GPU and v == 0x10DE:
            return t, v, "cuda"
        return t, v, f"gpu(vendor=0x{v:04X})"
    raise TransferError(f"expected an OrtValue or OrtDevice, got {type(x).__name__}")


def _can_copy_endpoints(s: tuple[int, int, str], d: tuple[int, int, str]) -> bool:
    (st, sv, sk), (dt, dv, dk) = s, d
    if st == CPU and dt == CPU:
        return True
    if "webgpu" in (sk, dk):
        other_t, other_v = (dt, dv) if sk == "webgpu" else (st, sv)
        return other_t == CPU or (other_t == GPU and other_v == NONE_VENDOR)
    if "cuda" in (sk, dk):
        return (dk if sk == "cuda" else sk) in ("cpu", "cuda")
    return False


def can_copy(src, dst) -> bool:
    """Whether ORT can copy from ``src`` to ``dst`` without misreading memory.

    Mirrors WebGPU ``DataTransfer::CanCopy`` with its vendor guard (ORT #32317): WebGPU buffers (GPU memory with
    vendor id NONE) copy only to and from CPU and other WebGPU buffers; a GPU buffer of a named vendor (CUDA's
    0x10DE, AMD, Intel, Microsoft …) is not a ``WGPUBuffer`` and unpatched ORT would hand its pointer to Dawn.
    CUDA copies to and from CPU and CUDA (any ordinal: peer copies). Any other pair of GPU kinds: no.

    Args:
        src: an OrtValue (any shape and dtype) or an ``onnxruntime.OrtDevice``.
        dst: likewise.

    Returns:
        True when the device pair is copyable.

    Raises:
        TransferError: ``src`` or ``dst`` is neither an OrtValue nor an OrtDevice, or an OrtValue of an unknown device.
    """
    return _can_copy_endpoints(_endpoint(src), _endpoint(dst))


_KIND_PAIR_OK: dict[tuple[str, str], bool] = {}


def _require_copyable(sm: ValueMeta, dm: ValueMeta) -> None:
    key = (sm.kind, dm.kind)
    ok = _KIND_PAIR_OK.get(key)
    if ok is None:
        if sm.kind not in _DEVICE_KINDS or dm.kind not in _DEVICE_KINDS:
            raise TransferError(f"unknown OrtValue device {sm.kind!r} or {dm.kind!r}")
        ok = _KIND_PAIR_OK[key] = _can_copy_endpoints((*_DEVICE_KINDS[sm.kind], sm.kind),
                                                      (*_DEVICE_KINDS[dm.kind], dm.kind))
    if not ok:
        raise TransferError(
            f"refusing to copy {sm.kind} -> {dm.kind}: no data transfer in ORT handles that pair correctly (a WebGPU "
            "transfer would reinterpret foreign GPU memory as a WGPUBuffer, ORT #32317). Copy through the CPU "
            "explicitly, or allocate the source on the destination's device."
        )


def _dst_meta(value: Any, role: str = "destination") -> ValueMeta:
    """The metadata of a value a transfer reads or writes (every public transfer takes each of its values through
    here before any native call). Raises :class:`TransferError` for what cannot be transferred, and
    :class:`~ortcapture.errors.CaptureError` (``kind`` ``"fork"``) for a buffer on a device the process that
    ``os.fork()`` made this one from had in use (:data:`ortcapture._ort.sync.FORKED_DEVICES`: the copy would hang)."""
    m = getattr(value, "_ortcapture_meta", None)  # fast path: values.meta's cache
    if m is None or m.dtype is None:
        if not isinstance(value, OrtValue):
            raise TransferError(f"{role} must be an onnxruntime.OrtValue, got {type(value).__name__}")
        m = meta(value)
        if m.dtype is None:
            hint = (": bfloat16 needs ml_dtypes (pip install 'ortcapture[bf16]')"
                    if m.element_type == "tensor(bfloat16)" else "")
            raise TransferError(
                f"OrtValue element type {m.element_type} is not supported by ortcapture transfers{hint}")
    if FORKED_DEVICES:  # an os.fork() child of a device user: its buffers are the parent's (sync.Origin)
        check_device(m.kind, role)
    return m


def np_dtype_of(value: OrtValue) -> np.dtype:
    """numpy dtype of a tensor OrtValue; raises :class:`TransferError` for types numpy cannot hold."""
    return _dst_meta(value, "value").dtype


def _check_match(dm: ValueMeta, shape: tuple, dtype: np.dtype, what: str) -> None:
    if dtype != dm.dtype:
        raise TransferError(
            f"dtype mismatch: {what} is {dtype}, destination is {dm.dtype}. ORT would reinterpret the bytes; cast "
            "the source explicitly (update_inplace(..., cast=True) for numpy sources)."
        )
    if shape != dm.shape:
        raise TransferError(
            f"shape mismatch: {what} has shape {shape}, destination has {dm.shape}. Fixed buffers keep the "
            "shape they were captured with."
        )


def check_rows(name: str, shape: tuple, dtype: np.dtype, dst: OrtValue, axes: tuple[int, ...]) -> None:
    """Whether a source of ``shape`` and ``dtype`` fits the leading region of fixed buffer ``dst`` (a bucket's
    request, :meth:`CapturedGraph.feed_rows`): the buffer's dtype and rank, each dim along ``axes`` at most the
    buffer's, every other dim equal. Raises :class:`TransferError` naming input ``name``."""
    dm = _dst_meta(dst)
    if dtype != dm.dtype:
        raise TransferError(f"input {name!r}: dtype mismatch: the source is {dtype}, the buffer is {dm.dtype}")
    if len(shape) != len(dm.shape) or any(
            (s > d) if ax in axes else (s != d) for ax, (s, d) in enumerate(zip(shape, dm.shape))):
        raise TransferError(f"input {name!r}: shape mismatch: the source has shape {tuple(shape)}, the buffer "
                            f"{dm.shape} (at most that along axes {tuple(axes)}, equal elsewhere)")


def _alias(a: OrtValue, am: ValueMeta, b: OrtValue, bm: ValueMeta) -> str | None:
    """``"same"`` when a and b are one buffer, ``"overlap"`` when their bytes overlap, else ``None``."""
    if a is b or compat.c_value(a) is compat.c_value(b):
        return "same"
    if am.kind == bm.kind == "webgpu":  # no byte ranges, but data_ptr() is the buffer handle: equal = same buffer
        try:
            return "same" if a.data_ptr() == b.data_ptr() != 0 else None
        except Exception:  # noqa: BLE001
            return None
    if am.kind != bm.kind or am.span is None or bm.span is None or am.device_id != bm.device_id:
        return None
    if am.span == bm.span:
        return "same"
    if am.span[0] < bm.span[1] and bm.span[0] < am.span[1]:
        return "overlap"
    return None


def _is_c_contiguous(obj: Any) -> bool:
    fn = getattr(obj, "is_contiguous", None)
    if callable(fn):  # torch
        return bool(fn())
    flags = getattr(obj, "flags", None)
    if flags is not None and hasattr(flags, "c_contiguous"):  # numpy, cupy
        return bool(flags.c_contiguous)
    return True  # unknown producers: ORT's from_dlpack is trusted to reject what it cannot read


def _name_it(exc: TransferError, name: str) -> None:
    """Prefix a refusal with the input it concerns (no cost on the path that succeeds)."""
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith("input "):
        exc.args = (f"input {name!r}: {exc.args[0]}", *exc.args[1:])


def _host_int64_rule(src: OrtValue, sm: ValueMeta, dm: ValueMeta) -> None:
    """The int32-range rule of WebGPU int64 buffers (:func:`_check_int32_range`) for a CPU OrtValue source, as for a
    numpy one (measured before: an OrtValue of int64 beyond int32 was read silently as 32-bit where the same numpy
    array was refused). Attribute compares unless it applies."""
    if dm.kind == "webgpu" and sm.kind == "cpu" and dm.dtype == np.int64 and sm.nbytes:
        _check_int32_range(src.numpy())


def _unsupported(src: Any) -> str:
    """Why ``src`` is no source: a numpy scalar (``np.float32(0.5)``: ORT's own ``run`` refuses it too, "Unable to
    handle object of type"), or another type."""
    if isinstance(src, np.generic):
        return (f"a numpy scalar ({type(src).__name__}), not an array: pass a 0-d array (np.asarray(value) or "
                "np.array(0.5, np.float32)) for a scalar input, as ORT's run() needs")
    return f"unsupported source type {type(src).__name__}: pass a numpy array, an OrtValue or a DLPack tensor"


def source_spec(src: Any) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, numpy dtype)`` of a source :func:`update_inplace` takes (numpy array, 0-d included; OrtValue on any
    device; DLPack tensor), without reading it. Raises :class:`TransferError` naming the type for anything else
    (numpy scalars, Python numbers, strings, ``None``)."""
    if isinstance(src, OrtValue):
        return tuple(src.shape()), np_dtype_of(src)
    if isinstance(src, np.ndarray):
        return tuple(src.shape), src.dtype
    if isinstance(src, C_OrtValue):
        return source_spec(OrtValue(src))
    if hasattr(src, "__dlpack__") and hasattr(src, "shape"):
        dt = str(getattr(src, "dtype", "")).replace("torch.", "")
        try:
            return tuple(int(d) for d in src.shape), np.dtype("bool" if dt == "bool" else dt)
        except TypeError:
            pass
    raise TransferError(_unsupported(src))


#: int64 values a WebGPU buffer holds right: ORT's WebGPU EP runs int64 as 32-bit under enableGraphCapture
INT32_RANGE = (-(2**31), 2**31 - 1)


def _check_int32_range(src: np.ndarray) -> None:
    """Refuse int64 host data for a WebGPU buffer with values outside int32 (issue 15: with enableGraphCapture=1
    the WebGPU EP keeps the low 32 bits, in captured and uncaptured runs alike; measured on onnxruntime 1.32 +
    WebGPU plugin 0.4.0)."""
    lo, hi = int(src.min()), int(src.max())
    if lo < INT32_RANGE[0] or hi > INT32_RANGE[1]:
        bad = lo if lo < INT32_RANGE[0] else hi
        raise TransferError(
            f"int64 value {bad} is outside the int32 range: ORT's WebGPU EP under graph capture "
            "(enableGraphCapture=1) runs int64 tensors as 32-bit and would silently use the low 32 bits. Keep "
            "int64 inputs within [-2**31, 2**31) on WebGPU, or run without capture.")


def value_rules(device_type: str) -> dict[np.dtype, Any]:
    """The rules a host feed's *values* (not its shape or dtype) must keep to be copied into a fixed buffer on
    ``device_type`` (``"cuda"``, ``"webgpu"``, ``"cpu"``): ``{numpy dtype: check(array)}``, each check raising
    :class:`~ortcapture.errors.TransferError`. These are the very functions :func:`update_inplace` applies on every
    host copy, so a caller that holds no device and no session (a serving tier checking a request before it joins a
    batch) refuses exactly what the copy would refuse. Today: int64 into a WebGPU buffer must stay within int32
    (ORT's WebGPU EP under ``enableGraphCapture=1`` keeps the low 32 bits: issue 15)."""
    return {np.dtype(np.int64): _check_int32_range} if device_type == "webgpu" else {}


def check_values(rules: Mapping[np.dtype, Any], feeds: Mapping[str, Any]) -> None:
    """Apply :func:`value_rules` to the numpy arrays of ``feeds`` (``{input name: array}``; other sources are
    skipped: their values are checked where they are copied). No device, no native call.

    Raises:
        TransferError: naming the first input whose values a rule refuses (its own values only).
    """
    if not rules:
        return
    for name, v in feeds.items():
        rule = rules.get(v.dtype) if isinstance(v, np.ndarray) else None
        if rule is not None and v.size:
            try:
                rule(v)
            except TransferError as exc:
                _name_it(exc, name)
                raise


def check_feed_values(device_type: str | None, feeds: Mapping[str, Any], host_read=frozenset()) -> None:
    """:func:`value_rules` of ``device_type`` applied to ``feeds``' numpy arrays, except the inputs ORT reads on the
    host (``host_read``: a Slice end of INT64_MAX is right there). Called on a request's own feeds before a bucket's
    or a shape's first capture, so that a value the copy would refuse is that request's :class:`TransferError` and
    never a refusal remembered for every later request of its key (a break-it session's finding). No device, no
    native call.

    Raises:
        TransferError: naming the first input whose values a rule refuses.
    """
    rules = value_rules(device_type) if device_type else {}
    if rules:
        check_values(rules, {n: v for n, v in feeds.items() if n not in host_read})


class InputSpec:
    """One model input as ORT's plain ``run`` takes it: ``name``, ``dtype`` (numpy; ``None`` for element types numpy
    cannot name: strings, sequences, maps) and ``dims`` (an int where the model fixes the dim, else ``None``). Built
    from a session's ``get_inputs()`` or from the model file alone (``onnx``): no device, no session — the check a
    serving tier applies to each request before it joins a batch is this one (:func:`check_feeds`)."""

    __slots__ = ("name", "dtype", "dims")

    def __init__(self, name: str, onnx_type: Any, shape: Sequence[Any]):
        """``onnx_type``: ORT's type string (``"tensor(float)"``) or a numpy dtype; ``shape``: ints for fixed dims,
        anything else (a dim_param, ``None``, -1) for free ones."""
        self.name = name
        self.dtype = ONNX_TO_NP.get(onnx_type) if isinstance(onnx_type, str) else np.dtype(onnx_type)
        self.dims = tuple(d if isinstance(d, int) and d >= 0 else None for d in shape)

    def problem(self, shape: Sequence[int], dtype: Any) -> str | None:
        """Why a value of ``shape`` and ``dtype`` (numpy dtype, or a framework's dtype name) is not a feed ORT takes
        for this input (another element type — no casts —, rank or fixed dim); ``None`` when it is."""
        if (self.dtype is not None and not (isinstance(dtype, np.dtype) and dtype == self.dtype)
                and str(dtype).replace("torch.", "") != str(self.dtype)):
            return f"input {self.name!r} is {self.dtype} in the model, the feed is {dtype}"
        if len(shape) != len(self.dims):
            return f"input {self.name!r} has rank {len(self.dims)} in the model, the feed has shape {tuple(shape)}"
        for ax, (want, got) in enumerate(zip(self.dims, shape)):
            if want is not None and int(got) != want:
                return f"input {self.name!r} axis {ax} is fixed at {want} in the model, the feed has {int(got)}"
        return None


def input_specs(inputs) -> dict[str, InputSpec]:
    """``{input name: InputSpec}`` of ``inputs``: a session's ``get_inputs()`` (``name``, ``type``, ``shape``) or
    ``(name, ORT type string or numpy dtype, shape)`` triples."""
    out = {}
    for m in inputs:
        name, onnx_type, shape = (m.name, m.type, m.shape) if hasattr(m, "name") else m
        out[name] = InputSpec(name, onnx_type, shape)
    return out


def check_feeds(specs: Mapping[str, InputSpec], feeds: Mapping[str, Any],
                rules: Mapping[np.dtype, Any] | None = None) -> None:
    """The feed plan's check without a device: every input of ``specs`` exactly once, each a numpy array ORT's run
    takes for it (:meth:`InputSpec.problem`), and, with ``rules`` (:func:`value_rules` of the device the graphs run
    on), values the device's buffers hold. What passes here is what a captured graph's copy then accepts.

    Raises:
        TransferError: the first problem, its message starting with ``input 'NAME'`` where it concerns one input.
    """
    if not isinstance(feeds, Mapping):
        raise TransferError(f"feeds must be a mapping {{input name: array}}, got a {type(feeds).__name__}")
    missing = [n for n in specs if n not in feeds]
    unknown = [k for k in feeds if k not in specs]
    if missing or unknown:  # a misspelt name is both: the message names the caller's own name first
        what = [f"input {unknown[0]!r} unknown"] if unknown else []
        what += [f"input {missing[0]!r} missing"] if missing else []
        raise TransferError(f"{' and '.join(what)}: the model takes {list(specs)}")
    for name, spec in specs.items():
        v = feeds[name]
        if not isinstance(v, np.ndarray):
            raise TransferError(f"input {name!r} must be a numpy array, got a {type(v).__name__}")
        problem = spec.problem(v.shape, v.dtype)
        if problem is not None:
            raise TransferError(problem)
    if rules:
        check_values(rules, feeds)


def check_plain_feeds(input_feed: Any, device: Any, host_read: frozenset = frozenset()) -> Any:
    """The feeds of a device session's uncaptured ``run`` (``gpu_graph_id=-1``, the drop-in's and the buckets' runs
    ORT does itself), made safe before ORT's native code sees them; returns them (a new dict where a feed changed,
    never the caller's dict changed).

    * a ``None`` feed: left out, as ORT's Python ``run`` treats it on the CPU EP (an input with an initializer keeps
      its default, a required one gets ORT's own "missing" error) — ORT's WebGPU EP segfaulted on it (ORT 1.32);
    * a numpy array (a subclass too) of non-native byte order (``">f4"``): sent in native order (ORT reads its bytes
      as native: silently wrong values on every EP);
    * ``device`` (the session's capture device, a :class:`~ortcapture._ort.providers.CaptureInfo`, or ``None``) on
      WebGPU (a capturing WebGPU session): a numpy feed over 2 GiB is refused (ORT's WebGPU copies crash), and int64
      values outside int32 are refused (:func:`value_rules`: under ``enableGraphCapture=1`` ORT keeps the low 32 bits
      of device inputs in uncaptured runs too; issue 15) except in the inputs ORT reads on the host (``host_read``: a
      Slice end of INT64_MAX is right there).

    Anything else (a feed that is not a mapping, unknown names, lists, OrtValues) goes to ORT as given: its own
    result or error (the session converts lists first where it checks them: :mod:`ortcapture._session.plain`).

    Raises:
        TransferError: the WebGPU refusals above, naming the input.
    """
    if not isinstance(input_feed, Mapping):
        return input_feed
    out = None
    device_type = getattr(device, "device_type", None)
    rules = value_rules(device_type) if device_type else {}
    for name, v in input_feed.items():
        if v is None:
            out = dict(input_feed) if out is None else out
            del out[name]
            continue
        if not isinstance(v, np.ndarray):
            continue
        if not v.dtype.isnative:
            out = dict(input_feed) if out is None else out
            out[name] = v = v.astype(v.dtype.newbyteorder("="))
        if device_type == "webgpu":
            check_webgpu_bytes(v.nbytes, f"input {name!r}")
            if name not in host_read:
                check_values(rules, {name: v})
    return input_feed if out is None else out
