"""Command-line option parsing shared by ``ortcapture demo``, ``bench`` and ``doctor`` (``KEY=VALUE`` lists)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence


def int_list(text: str, flag: str) -> list[int]:
    """``"1,2,4"`` (a comma-separated command-line list of sizes) -> ``[1, 2, 4]``; spaces around entries are fine.

    Raises ``ValueError`` naming ``flag`` for an empty list or an empty entry (``"1,,2"``, ``"1,2,"``: a typo, never
    skipped) or an entry that is not an int.
    """
    parts = str(text).split(",")
    if any(not p.strip() for p in parts):
        raise ValueError(f"{flag} {text!r} has an empty entry: give comma-separated ints, e.g. 1,2,4")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


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
    from ortcapture._ort.providers import check_provider_options  # imports onnxruntime: not at the parser's import

    return check_provider_options(parse_key_values(items, "provider option", "prefer_nhwc=1"))


def shape_arg_problem(given: Mapping[str, Sequence[int]], dims: Mapping[str, Sequence[Any]], *,
                      allow_empty: bool = True) -> str | None:
    """The first thing wrong with ``--shape`` values for a model, as a one-line message, or ``None``.

    Args:
        given: ``{input name: shape}`` from :func:`ortcapture._ort.specialize.parse_shape_args`.
        dims: the model's input dims (:func:`ortcapture._ort.specialize.input_dims`: int, dim name, or ``None``).
        allow_empty: False refuses a 0 dim (nothing to capture).

    Checks, in order: an unknown input name, a rank that differs from the model's, a dim the model fixes to another
    value, and (``allow_empty=False``) a 0 dim. Used by ``demo`` and ``doctor`` alike.
    """
    unknown = sorted(set(given) - set(dims))
    if unknown:
        return f"--shape names {unknown}, but the model's inputs are {sorted(dims)}"
    for name, shape in given.items():
        have = dims[name]
        text = "x".join(map(str, shape)) if len(shape) else "scalar"
        shown = "[" + ", ".join("?" if d is None else str(d) for d in have) + "]"
        if len(shape) != len(have):
            return (f"--shape {name}={text}: input {name!r} has rank {len(have)} ({shown}), the shape has rank "
                    f"{len(shape)}")
        for i, (want, d) in enumerate(zip(shape, have)):
            if isinstance(d, int) and d != want:
                return f"--shape {name}={text}: dim {i} of {name!r} is fixed to {d} in the model ({shown})"
        if not allow_empty and 0 in shape:
            return f"--shape {name}={text}: dims must be >= 1 (an empty tensor leaves nothing to capture)"
    return None
