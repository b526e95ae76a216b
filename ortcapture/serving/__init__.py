"""Serving bucketed sessions under real traffic: :class:`BatchRunner` batches requests onto captured graphs.

``ortcapture serve MODEL`` and the Python API (:func:`serve`, :func:`build_app`, :class:`ServeOptions`) put them
behind Ray Serve replicas speaking the Open Inference Protocol (KServe v2) over HTTP: see docs/SERVING.md. The
protocol itself is :mod:`ortcapture.serving.protocol` (pure). Names that need Ray are imported on first use.
"""
from __future__ import annotations

import importlib

from ortcapture.serving.batch import BatchRunner as BatchRunner
from ortcapture.serving.requests import RequestError as RequestError

#: names imported on first use (PEP 562), so ``import ortcapture.serving`` never imports ray:
#: ``{name: module}``
_LAZY: dict[str, str] = {
    "ServeOptions": "ortcapture.serving.config",
    "build_app": "ortcapture.serving.deployment", "serve": "ortcapture.serving.deployment",
    "ServeFailed": "ortcapture.serving.deployment", "model_handle": "ortcapture.serving.deployment",
}

__all__ = sorted(["BatchRunner", "RequestError", *_LAZY])


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ortcapture.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
