"""Command-line option parsing shared by ``ortcapture demo``, ``bench`` and ``doctor`` (``KEY=VALUE`` lists)."""
from __future__ import annotations

from typing import Sequence

from ortcapture._providers import check_provider_options


def parse_key_values(items: Sequence[str] | None, what: str, example: str) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` (a repeatable command-line option) -> ``{KEY: VALUE}``, keys and values stripped.

    Raises :class:`~ortcapture.errors.CaptureError` for a non-list, an item that is not a string or has no ``=``,
    an empty key, or a key given twice. ``what`` names the items in the messages, ``example`` shows one.
    """
    from ortcapture.errors import CaptureError

    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)) and items is not None:
        raise CaptureError(f"{what}s must be a list of 'KEY=VALUE' strings, got {type(items).__name__}")
    out: dict[str, str] = {}
    for item in items or ():
        if not isinstance(item, str):
            raise CaptureError(f"{what} {item!r} must be a 'KEY=VALUE' string")
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CaptureError(f"{what} {item!r} must be KEY=VALUE (e.g. {example})")
        if key in out:
            raise CaptureError(f"{what} {key!r} given twice")
        out[key] = value.strip()
    return out


def parse_provider_options(items: Sequence[str]) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` (the command line's ``--provider-option``) -> ``{KEY: VALUE}`` for the EP.

    Raises :class:`~ortcapture.errors.CaptureError` as :func:`parse_key_values` does, and for a capture switch
    (``enable_cuda_graph``, ``trt_cuda_graph_enable``, ``enableGraphCapture``): capture is switched on and off by
    the tool itself (``--graph-capture/--no-graph-capture``), never by an option that would silently disagree with
    it.
    """
    return check_provider_options(parse_key_values(items, "provider option", "prefer_nhwc=1"))
