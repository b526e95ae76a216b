"""Construction-time helpers of :class:`ortcapture.InferenceSession` (module-level, no session state of their own).

The provider arguments with capture switched off, the ORT-version and WebGPU int64 checks, TensorRT profiles for
``buckets=``, the text of a refused capture, the model's constant outputs and the numeric-tensor I/O check.

Moved verbatim out of :mod:`ortcapture.session` (then ``ortcapture._session_setup``); the behaviour they guard against
is described in :mod:`ortcapture._session.session`.
"""
from __future__ import annotations

import functools
import os

import onnxruntime as ort

from ortcapture._ort import compat
from ortcapture._verify import inspect as _inspect
from ortcapture._ort import specialize as shapes
from ortcapture._ort.compat import OrtInferenceSession
from ortcapture._ort.providers import CaptureInfo
from ortcapture.errors import CaptureUnsupportedError


def without_capture(providers, provider_options, requested: CaptureInfo):
    """The provider arguments with the capture switch turned off (for a session that must not capture)."""
    out = []
    for i, p in enumerate(providers or []):
        name, opts = (p[0], dict(p[1])) if isinstance(p, (tuple, list)) else (p, None)
        if opts is None and provider_options and i < len(provider_options):
            opts = dict(provider_options[i])
        if name == requested.ep.name and opts is not None:
            opts[requested.ep.option] = "0"
        out.append((name, opts or {}))
    return out


def build_without_capture(session, model, sess_options, providers, provider_options, kwargs, requested) -> None:
    """ORT's constructor on ``session`` with the requested capture switched off (provider option, or the plugin EP's
    session config entry, restored afterwards)."""
    if providers:
        OrtInferenceSession.__init__(session, model, sess_options,
                                     without_capture(providers, provider_options, requested), None, **kwargs)
        return
    key = f"ep.{requested.ep.name.lower()}.{requested.ep.option}"
    sess_options.add_session_config_entry(key, "0")
    try:
        OrtInferenceSession.__init__(session, model, sess_options, providers, provider_options, **kwargs)
    finally:
        sess_options.add_session_config_entry(key, "1")


def refusal_text(model, sess_options, providers, provider_options, kwargs, requested, static_shapes) -> str:
    """Why ORT refused capture, for :class:`CaptureUnsupportedError`: the model's I/O types the EP cannot take
    and the nodes ORT placed off the EP (an uncaptured session that records placement, made only here)."""
    off = None
    so = sess_options if sess_options is not None else ort.SessionOptions()
    so.add_session_config_entry(_inspect.RECORD_ASSIGNMENT_KEY, "1")
    try:
        probe = compat.OrtInferenceSession.__new__(compat.OrtInferenceSession)
        build_without_capture(probe, model, so, providers, provider_options, kwargs, requested)
        off = _inspect.assigned_off_ep(probe, requested.ep.name)
    except Exception:  # noqa: BLE001 - the placement is a help for the message only
        off = None
    finally:
        so.add_session_config_entry(_inspect.RECORD_ASSIGNMENT_KEY, "0")
    return _inspect.refusal_message(requested.ep.name, _inspect.try_load_structure(model), off, static_shapes,
                                    requested.device_type)


def check_version(requested: CaptureInfo | None) -> None:
    if requested is not None and requested.device_type == "webgpu" and not compat.webgpu_plugin_captures():
        raise CaptureUnsupportedError(
            f"onnxruntime {ort.__version__} accepts enableGraphCapture for the WebGPU plugin EP but never "
            "captures (measured on 1.24.4 and 1.25.1: every run recomputes, rebinding is not even ignored); "
            "WebGPU graph capture needs onnxruntime >= 1.27.0"
        )


def refuse_int64_arithmetic(model) -> None:
    """Raise :class:`CaptureUnsupportedError` when WebGPU nodes would produce int64 from int64 arithmetic, or read
    int64 constants beyond int32 as data (see ``InferenceSession``'s ``allow_int64_as_int32``)."""
    from ortcapture._verify.model_checks import int64_arithmetic_nodes, int64_wide_constants

    import onnx

    # the graph only: external weights are not needed (nor loaded) for the analysis
    proto = onnx.load(os.fspath(model), load_external_data=False) if isinstance(model, (str, os.PathLike)) \
        else _inspect.load_structure(model)
    _refuse_int64(int64_arithmetic_nodes(proto), 12, lambda shown: (
        f"node(s) {', '.join(shown)} produce int64 from int64 arithmetic: ORT's WebGPU EP runs int64 as 32-bit under "
        "enableGraphCapture=1 (captured and uncaptured runs; e.g. 3000000000 - 1 gives -1294967297), and a range "
        "check of the inputs cannot catch an intermediate that overflows. Compute them in int32/float, or pass "
        "allow_int64_as_int32=True if every int64 value stays within int32."))
    _refuse_int64(int64_wide_constants(proto), 8, lambda shown: (
        f"{'; '.join(shown)}: int64 constant(s) beyond the int32 range read as data on WebGPU, which runs int64 as "
        "32-bit under enableGraphCapture=1 (captured and uncaptured runs keep the low 32 bits: 5000000000 reads as "
        "705032704, and the capture check compares with the same wrong value). Keep the constants within int32, or "
        "pass allow_int64_as_int32=True if the truncation is harmless."))


def _refuse_int64(names: list[str], shown: int, message) -> None:
    """Raise the ``int64_as_int32`` :class:`CaptureUnsupportedError` naming ``names`` (the first ``shown`` in
    ``message(shown names)``, a count of the rest), if there are any."""
    if names:
        more = [f"... ({len(names) - shown} more)"] if len(names) > shown else []
        err = CaptureUnsupportedError(message(names[:shown] + more))
        err.kind, err.nodes = "int64_as_int32", names
        raise err


def trt_bucket_profiles(path_or_bytes, buckets, providers, provider_options):
    """TensorRT: optimisation profiles covering the buckets (``ortcapture._buckets.spec.trt_profile_options``)."""
    from ortcapture._buckets import spec as _buckets

    dims = shapes.input_dims(_inspect.load_structure(path_or_bytes))  # the graph only: no external weights
    profiles = _buckets.trt_profile_options(_buckets.parse_buckets(buckets, dims), dims)
    if profiles is None:
        return providers, provider_options
    return _buckets.with_trt_profiles(providers, provider_options, profiles)


def constant_outputs_of(path_or_bytes, static_sig):
    """``() -> frozenset``: the model's constant outputs (:func:`ortcapture._verify.inspect.constant_outputs`), computed at
    the first call (a capture) and kept."""
    @functools.cache
    def constant_outputs() -> frozenset:
        model = _inspect.try_load_structure(path_or_bytes)
        if model is None:
            return frozenset()
        if static_sig:
            model = _inspect.load_structure(shapes.fix_input_shapes(model.SerializeToString(), dict(static_sig)))
        return _inspect.constant_outputs(model)

    return constant_outputs


def check_tensor_io(session) -> None:
    """Raise :class:`CaptureUnsupportedError` naming the inputs/outputs that are not numeric tensors (strings,
    sequences, maps such as ``ZipMap``'s, optional values): no fixed device buffer can hold them."""
    from ortcapture._ort.values import ONNX_TO_NP

    bad = [f"{role} {m.name!r} is {m.type}" for role, metas in (("input", session.get_inputs()),
                                                                 ("output", session.get_outputs()))
           for m in metas if m.type not in ONNX_TO_NP]
    if bad:
        raise CaptureUnsupportedError(
            f"capture() needs every input and output to be a numeric tensor held in a fixed device buffer: "
            f"{'; '.join(bad)}. Run that part of the model outside the captured graph (`ortcapture doctor MODEL`)."
        )
