"""Serving bucketed sessions under real traffic: :class:`BatchRunner` batches requests onto captured graphs."""
from __future__ import annotations

import importlib

from ortcapture.serving.batch import BatchRunner, RequestError

#: names imported on first use (PEP 562), so ``import ortcapture.serving`` never imports ray:
#: ``{name: module}``
_LAZY: dict[str, str] = {}

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
