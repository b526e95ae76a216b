"""Ray Serve's application builder for ortcapture: deploy a served model the way Ray users deploy, with Ray's CLI.

``build`` is an *application builder* (Ray Serve calls it with the ``key=value`` arguments of ``serve run`` or the
``args`` of a config file's application) and returns :func:`ortcapture.serving.build_app`'s application: the Open
Inference Protocol ingress bound to the model replicas, one application. So a deployment can outlive the driver that
made it::

    serve run ortcapture.serving.app:build model=/models/320n.onnx buckets=1,2,4,8 dims=height=320,width=320
    serve build ortcapture.serving.app:build -o serve.yaml     # then edit args / http_options, and
    serve deploy serve.yaml                                     # onto a running cluster (ray start --head ...)
    serve status; serve shutdown

The arguments are :class:`~ortcapture.serving.config.ServeOptions` fields, as strings or their types: ``model``
(required), ``name``, ``buckets`` (``"1,2,4,8"``), ``provider`` (``auto``, ``cuda``, ``webgpu``, ``cpu``),
``replicas``, ``ingress_replicas``, ``gpus_per_replica``, ``max_batch_size``, ``batch_wait_ms``,
``max_concurrent_batches``, ``switch_interval_ms``, ``batch_slots``, ``merge_prefetch``, ``merge_listed`` and
``serve_throughput_optimized`` (``true``/``false``), ``dims``
(``"height=320,width=320"``), ``max_body_mib``, ``graceful_shutdown_s``, ``request_timeout_s``, ``max_queued``,
``body_timeout_s``, ``max_pending_bodies``, ``token_file``. Where HTTP listens (and TLS) is Serve's own
``http_options`` (a config file's, or Serve's defaults: 127.0.0.1:8000), not an argument.

Raises (from ``build``, so ``serve run``/``serve deploy`` say it before any replica starts):
    CaptureError: an unknown or malformed argument, a missing model, what
        :meth:`~ortcapture.serving.config.ServeOptions.checked` and
        :func:`~ortcapture.serving.config.model_layout` refuse, no usable provider.
"""
from __future__ import annotations

from typing import Any, Mapping

from ortcapture.errors import CaptureError

#: argument -> (ServeOptions field, parser of its string form)
_INT = ("replicas", "ingress_replicas", "max_batch_size", "max_concurrent_batches", "max_queued", "max_pending_bodies")
_FLOAT = ("gpus_per_replica", "batch_wait_ms", "switch_interval_ms", "graceful_shutdown_s", "request_timeout_s",
          "body_timeout_s")
_STR = ("model", "name", "buckets", "provider", "token_file")
_BOOL = ("batch_slots", "merge_prefetch", "merge_listed", "serve_throughput_optimized")


def options_from_args(args: Mapping[str, Any]):
    """:class:`~ortcapture.serving.config.ServeOptions` (checked) from an application builder's arguments (strings
    as ``serve run`` passes them, or the types a config file gives). Raises :class:`CaptureError`."""
    from ortcapture.serving.config import ServeOptions

    if not isinstance(args, Mapping):
        raise CaptureError(f"ortcapture.serving.app:build takes key=value arguments, got {type(args).__name__}")
    known = set(_INT) | set(_FLOAT) | set(_STR) | set(_BOOL) | {"dims", "max_body_mib"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise CaptureError(f"ortcapture.serving.app:build: unknown argument(s) {unknown}; it takes {sorted(known)}")
    if "model" not in args:
        raise CaptureError("ortcapture.serving.app:build needs model=PATH (an ONNX model readable on every node)")
    kwargs: dict[str, Any] = {}
    for key, value in args.items():
        try:
            if key in _INT:
                kwargs[key] = int(value)
            elif key in _FLOAT:
                kwargs[key] = float(value)
            elif key in _BOOL:
                kwargs[key] = _bool(value)
            elif key == "max_body_mib":
                kwargs["max_body_bytes"] = int(float(value) * 1024 * 1024)
            elif key == "dims":
                kwargs["dims"] = _dims(value)
            else:
                kwargs[key] = str(value)
        except (TypeError, ValueError) as exc:
            raise CaptureError(f"ortcapture.serving.app:build: {key}={value!r}: {exc}") from None
    return ServeOptions(**kwargs).checked()


def _bool(value) -> bool:
    """``true``/``false`` (``1``/``0``, ``yes``/``no``, any case) or a bool; ``ValueError`` otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError("give true or false")


def _dims(value) -> dict[str, int]:
    """``"height=320,width=320"`` (or a mapping) as ``{"height": 320, "width": 320}``; ``ValueError`` otherwise."""
    if not isinstance(value, str):
        return {str(k): int(v) for k, v in dict(value).items()}
    out = {}
    for item in value.split(","):
        name, sep, size = item.partition("=")
        if not sep or not name.strip():
            raise ValueError("give dims as NAME=SIZE,NAME=SIZE, e.g. height=320,width=320")
        out[name.strip()] = int(size)
    return out


def build(args: Mapping[str, Any]):
    """The application builder (see the module docstring): ``args`` -> the Ray Serve application of one served
    model (ingress + model replicas, one application). Raises :class:`CaptureError`."""
    import ortcapture
    from ortcapture.serving.deployment import build_app

    options = options_from_args(args)
    provider = "cpu" if options.provider == "cpu" else ortcapture.pick_provider(options.provider)
    return build_app(options, provider)
