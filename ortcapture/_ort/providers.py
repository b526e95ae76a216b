"""Which execution providers capture, how capture is switched on, and on which device they run.

ORT's switches (shared/DESIGN.md): CUDA EP ``enable_cuda_graph``, TensorRT EP ``trt_cuda_graph_enable``, WebGPU EP
``enableGraphCapture`` (plugin EP through ``SessionOptions.add_provider_for_devices``: session config key
``ep.webgpuexecutionprovider.enableGraphCapture``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import onnxruntime as ort

from ortcapture._ort import compat

NVIDIA_VENDOR_ID = 0x10DE


@dataclass(frozen=True)
class CaptureEP:
    """A capture-capable execution provider: its capture option, the OrtValue device type and vendor id."""

    name: str
    option: str
    device_type: str  # OrtValue device name: "cuda" | "webgpu"
    vendor_id: int  # PCI vendor id of the device the EP's buffers live on (0 = not vendor-specific)
    device_id_option: str  # provider option naming the device ordinal
    releases_natively: bool  # release_captured_graph really frees the graph (False: ORT no-op)


CAPTURE_EPS: dict[str, CaptureEP] = {
    "CUDAExecutionProvider": CaptureEP(
        "CUDAExecutionProvider", "enable_cuda_graph", "cuda", NVIDIA_VENDOR_ID, "device_id", False
    ),
    "TensorrtExecutionProvider": CaptureEP(
        "TensorrtExecutionProvider", "trt_cuda_graph_enable", "cuda", NVIDIA_VENDOR_ID, "device_id", False
    ),
    "WebGpuExecutionProvider": CaptureEP(
        "WebGpuExecutionProvider", "enableGraphCapture", "webgpu", 0, "deviceId", True
    ),
}


@dataclass(frozen=True)
class CaptureInfo:
    """The EP that captures for a session, and the device its fixed buffers must live on."""

    ep: CaptureEP
    device_id: int

    @property
    def device_type(self) -> str:
        """The OrtValue device name of the capturing EP's buffers: ``"cuda"`` or ``"webgpu"``."""
        return self.ep.device_type

    @property
    def releases_natively(self) -> bool:
        """WebGPU frees a released graph; CUDA/TensorRT ``release_captured_graph`` is a no-op in ORT."""
        return self.ep.releases_natively and compat.has_release_captured_graph()


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def normalize(providers, provider_options) -> list[tuple[str, Mapping[str, Any]]]:
    """``[(provider name, options dict)]`` from ORT's two spellings — ``providers=[name or (name, options)]`` and
    ``provider_options=[options]`` beside names; each options dict a copy (``{}`` where none was given)."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    for i, p in enumerate(providers or []):
        if isinstance(p, (tuple, list)):
            name, opts = p[0], (p[1] if len(p) > 1 else {})
        else:
            name = p
            opts = provider_options[i] if provider_options and i < len(provider_options) else {}
        out.append((str(name), dict(opts or {})))
    return out


#: Execution providers whose work is CUDA work (it must not overlap another thread's CUDA graph capture).
CUDA_EPS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider"})


def device_kind(ep_name: str) -> str | None:
    """The device an execution provider runs on, as ortcapture names it for ``os.fork()`` (see
    :class:`ortcapture._ort.sync.Origin`): ``None`` for ORT's CPU EP (it survives fork), ``"cuda"`` for the CUDA and
    TensorRT EPs, ``"webgpu"`` for WebGPU, the EP's own name for any other EP."""
    if ep_name == "CPUExecutionProvider":
        return None
    ep = CAPTURE_EPS.get(ep_name)
    return ep.device_type if ep is not None else ep_name


def names_cuda_ep(providers) -> bool:
    """Whether the ``providers=[...]`` argument of ``InferenceSession`` names the CUDA or TensorRT EP."""
    return any(name in CUDA_EPS for name, _ in normalize(providers, None))


def _config_entry(sess_options: ort.SessionOptions | None, key: str) -> str | None:
    if sess_options is None:
        return None
    try:
        value = sess_options.get_session_config_entry(key)
    except (RuntimeError, AttributeError):
        return None
    return value or None


def requested_capture(
    providers: Sequence[Any] | None,
    provider_options: Sequence[Mapping[str, Any]] | None,
    sess_options: ort.SessionOptions | None,
) -> CaptureInfo | None:
    """The capture the user asked for, the ORT way, before any session exists; ``None`` when none.

    Looks at ``providers``/``provider_options`` (as ``InferenceSession`` takes them) and, for plugin EPs added with
    ``SessionOptions.add_provider_for_devices``, at the session config entries ``ep.<ep name lower>.<option>``.
    """
    for name, opts in normalize(providers, provider_options):
        ep = CAPTURE_EPS.get(name)
        if ep is not None and _truthy(opts.get(ep.option, "0")):
            return CaptureInfo(ep, device_ordinal(opts.get(ep.device_id_option, 0), ep.device_id_option))
    for ep in CAPTURE_EPS.values():  # plugin EPs: their options live in the session config
        prefix = f"ep.{ep.name.lower()}."
        if _truthy(_config_entry(sess_options, prefix + ep.option) or "0"):
            dev = _config_entry(sess_options, prefix + ep.device_id_option)
            return CaptureInfo(ep, device_ordinal(dev, ep.device_id_option))
    return None


def device_ordinal(value: Any, option: str = "device_id") -> int:
    """A device-ordinal provider option (``device_id``, ``deviceId``) as an int >= 0; ``None``/``""`` give 0.
    Raises :class:`~ortcapture.errors.CaptureError` for anything else (``"abc"``, ``"1.0"``, ``-1``, ``True``)."""
    from ortcapture.errors import CaptureError

    if value is None or value == "":
        return 0
    text = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
    if not (text.isascii() and text.isdigit()) or int(text) >= 2**31:
        raise CaptureError(f"provider option {option}={value!r} must be a device ordinal, a whole number from 0 "
                           "(ASCII digits)")
    return int(text)


def detect_capture(session: ort.InferenceSession, requested: CaptureInfo | None) -> CaptureInfo | None:
    """The capture a created session really does; ``None`` when it will not capture.

    Reads the session's provider list and provider options (CUDA/TensorRT), and the C session's
    ``is_webgpu_graph_capture_enabled()`` where ORT has it (WebGPU).
    """
    active = session.get_providers()
    options = session.get_provider_options()
    for name in active:
        ep = CAPTURE_EPS.get(name)
        if ep is None:
            continue
        opts = options.get(name, {})
        if ep.device_type == "webgpu":
            if compat.has_webgpu_capture_query():
                on = bool(compat.c_session(session).is_webgpu_graph_capture_enabled())
            else:
                on = _truthy(opts.get(ep.option, "0")) or (requested is not None and requested.ep is ep)
        else:
            on = _truthy(opts.get(ep.option, "0"))
        if on:
            dev = opts.get(ep.device_id_option)
            if dev in (None, "") and requested is not None and requested.ep is ep:
                return requested
            return CaptureInfo(ep, int(dev or 0))
    return None


def check_provider_options(options: Mapping[str, Any] | None) -> dict[str, str]:
    """Validate extra EP options ``{KEY: VALUE}`` (strings, or ints for numbers) and return them as strings.

    Raises :class:`~ortcapture.errors.CaptureError` for a non-mapping, a key that is empty, not a string or holds
    ``=``, a value that is not a string or int (``None``, floats, bools are ambiguous to ORT's parser), a device
    ordinal (``device_id``, ``deviceId``) that is not a whole number, and a capture switch
    (``enable_cuda_graph``, ``trt_cuda_graph_enable``, ``enableGraphCapture``): capture is switched by the tool
    itself (``--graph-capture/--no-graph-capture``, ``session_args(capture=...)``), never by an option that could
    silently disagree with it.
    """
    from ortcapture.errors import CaptureError

    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise CaptureError(f"provider options must be a mapping {{KEY: VALUE}}, got {type(options).__name__}")
    switches = {ep.option for ep in CAPTURE_EPS.values()}
    ordinals = {ep.device_id_option for ep in CAPTURE_EPS.values()}
    out: dict[str, str] = {}
    for key, value in options.items():
        if not isinstance(key, str) or not key.strip() or "=" in key:
            raise CaptureError(f"provider option key {key!r} must be a non-empty string without '='")
        key = key.strip()
        if key in switches:
            raise CaptureError(f"provider option {key!r} switches graph capture; ortcapture sets it itself "
                               "(bench: --graph-capture/--no-graph-capture; doctor always tries a capture)")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise CaptureError(f"provider option {key}={value!r}: the value must be a string or an int")
        if key in ordinals:
            if str(value).strip() == "":
                raise CaptureError(f"provider option {key!r} is empty; give a device ordinal or leave it out")
            device_ordinal(value, key)
        out[key] = str(value).strip()
    return out


def session_args(provider: str, capture: bool, sess_options=None, device_id: int = 0,
                 ep_options: Mapping[str, str] | None = None) -> dict:
    """``InferenceSession`` keyword arguments for ``provider`` (``"cuda"`` or ``"webgpu"``) with its capture switch
    on or off: CUDA through ``providers=[("CUDAExecutionProvider", {...}), "CPUExecutionProvider"]``, WebGPU
    through ``sess_options`` with the plugin EP added by ``add_provider_for_devices`` (ORT 1.30 silently gives a
    CPU-only session for a plugin EP named in ``providers``). ``sess_options``: a fresh ``SessionOptions`` the
    caller configured (the WebGPU EP is added to it, so do not reuse it across sessions); default a new one.
    ``ep_options``: further EP options, strings (e.g. CUDA ``{"prefer_nhwc": "1"}``, ``{"device_id": "1"}``, which
    wins over ``device_id``), checked by :func:`check_provider_options`; ORT itself rejects unknown CUDA keys at
    session creation (the WebGPU EP ignores unknown keys).
    """
    import onnxruntime as ort

    if not isinstance(capture, bool):
        raise TypeError(f"capture must be True or False, got {capture!r}")
    extra = check_provider_options(ep_options)
    so = sess_options if sess_options is not None else ort.SessionOptions()
    if provider == "cuda":
        # a device_id among ep_options wins over the device_id argument (the command line's --provider-option)
        opts = {"device_id": str(device_ordinal(device_id)), **extra, "enable_cuda_graph": "1" if capture else "0"}
        return {"sess_options": so, "providers": [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]}
    if provider != "webgpu":
        raise ValueError(f"provider must be 'cuda' or 'webgpu', got {provider!r}")
    from ortcapture._ort import webgpu

    return {"sess_options": webgpu.session_options(capture, so, extra)}


def pick_provider(requested: str = "auto") -> str:
    """``"cuda"`` when the CUDA EP really loads here (:func:`ortcapture._ort.cuda_probe.status`: onnxruntime-gpu, its
    CUDA libraries, an NVIDIA driver and a device) and ``requested`` allows it, else ``"webgpu"`` when a child-process
    probe captures on WebGPU (ORT aborts the process when Dawn finds no adapter, so it is probed in a child).
    ``"auto"`` skips a CUDA EP that onnxruntime-gpu lists but that does not load (ORT itself would log the load
    failure and run on the CPU). Raises :class:`~ortcapture.errors.CaptureUnsupportedError` saying why when neither
    is usable: ``"cuda"`` names the cause of the failed load; ``"auto"`` names both causes."""
    from ortcapture._ort import webgpu
    from ortcapture._ort import cuda_probe
    from ortcapture.errors import CaptureUnsupportedError

    cuda = cuda_probe.status() if requested in ("auto", "cuda") else None
    if cuda is not None and cuda.loads:
        return "cuda"
    if requested == "cuda":
        if cuda.refusal:
            raise CaptureUnsupportedError(cuda.refusal)
        raise CaptureUnsupportedError("the CUDA EP is not available (install onnxruntime-gpu on a machine with a GPU)")
    why_cuda = cuda.refusal if cuda is not None and cuda.refusal else "no CUDA EP"
    if not webgpu.plugin_installed():
        raise CaptureUnsupportedError(
            f"no capture-capable provider: {why_cuda}, and onnxruntime-ep-webgpu is not installed")
    result = webgpu.probe()
    if not result.get("ok"):
        first = f"{why_cuda}, and " if cuda is not None and cuda.refusal else ""
        raise CaptureUnsupportedError(f"{first}WebGPU is not usable here: {result.get('error')}")
    return "webgpu"
