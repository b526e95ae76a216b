"""Bucket specifications: which input dims are bucketed, and which output axes follow them (issue 16).

``buckets={"batch": [1, 2, 4, 8]}`` names a dim by its ``dim_param`` (every input axis with that name is padded), or
``{("images", 0): [...]}`` by input and axis (with every other input axis that shares its ``dim_param``), or by a
tuple of such parts naming one dim that the model spells differently in different inputs (``{(("ids", 1),
("state", 2)): [...]}``: an unnamed axis of a state input that follows the sequence). Sizes are ascending positive
ints. ``pad_values=`` gives the value padded rows hold per input (:func:`check_pad_values`). Which output axes to slice back is decided from the model's behaviour, not its names
(:func:`output_relations`): real models name the batch dim differently in outputs, or leave it unnamed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ortcapture.errors import CaptureError


@dataclass(frozen=True)
class BucketDim:
    """One bucketed dim: ``label`` (the dim_param, or ``"input[axis]"``), its ``sites`` ((input name, axis), ...)
    and ascending ``sizes``."""

    label: str
    sites: tuple[tuple[str, int], ...]
    sizes: tuple[int, ...]

    def bucket_for(self, n: int) -> int | None:
        """The smallest size >= ``n``; ``None`` when ``n`` is beyond the largest (oversize)."""
        for s in self.sizes:
            if s >= n:
                return s
        return None


def parse_buckets(spec: Any, dims: Mapping[str, Sequence[int | str | None]]) -> list[BucketDim]:
    """Check ``buckets=`` against the model's input dims (``{input: [int | dim_param | None]}``).

    Raises:
        CaptureError: not a non-empty mapping; a key that is no dim_param and no (input, axis) of the model, or names a
            fixed dim; sizes not ascending positive ints; two keys for the same dim.
    """
    if not isinstance(spec, Mapping) or not spec:
        raise CaptureError(f"buckets must be a non-empty mapping {{dim_param or (input, axis): [sizes]}}, got {spec!r}")
    out: list[BucketDim] = []
    seen: set[tuple[str, int]] = set()
    for key, sizes in spec.items():
        parts = _parts(key)
        sites = list(dict.fromkeys(s for part in parts for s in _sites(part, dims)))
        sizes = _sizes(key, sizes)
        if seen & set(sites):
            raise CaptureError(f"buckets: {key!r} names a dim already bucketed by another key")
        seen |= set(sites)
        label = "+".join(p if isinstance(p, str) else f"{p[0]}[{p[1]}]" for p in parts)
        out.append(BucketDim(label, tuple(sites), sizes))
    return out


def _is_site(key: Any) -> bool:
    return (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int)
            and not isinstance(key[1], bool))


def _parts(key: Any) -> list:
    """A key's parts: ``[dim_param]``, ``[(input, axis)]``, or a group key's items (each a dim_param or a site)."""
    if isinstance(key, str) or _is_site(key):
        return [key]
    if isinstance(key, tuple) and key and all(isinstance(p, str) or _is_site(p) for p in key):
        return list(key)
    raise CaptureError(f"buckets: a key is a dim_param (str), (input name, axis), or a tuple of these naming one "
                       f"dim, got {key!r}")


def _sites(key: Any, dims: Mapping[str, Sequence]) -> list[tuple[str, int]]:
    if isinstance(key, str):
        sites = [(name, ax) for name, ds in dims.items() for ax, d in enumerate(ds) if d == key]
        if not sites:
            named = sorted({d for ds in dims.values() for d in ds if isinstance(d, str)})
            raise CaptureError(f"buckets: no input dim is named {key!r}; the model's dim_params are {named} (or "
                               "key a dim as (input name, axis))")
        return sites
    name, axis = key
    if name not in dims:
        raise CaptureError(f"buckets: {name!r} is not an input of the model ({list(dims)})")
    ds = list(dims[name])
    if not -len(ds) <= axis < len(ds):
        raise CaptureError(f"buckets: input {name!r} has rank {len(ds)}, no axis {axis}")
    axis %= len(ds)
    d = ds[axis]
    if isinstance(d, int):
        raise CaptureError(f"buckets: axis {axis} of input {name!r} is fixed at {d} in the model; only dynamic dims "
                           "can be bucketed")
    if isinstance(d, str):  # every axis with the same dim_param must be padded alike
        return [(n, a) for n, dd in dims.items() for a, x in enumerate(dd) if x == d]
    return [(name, axis)]


#: the largest bucket size (ORT's dims are int64, but a graph that size cannot be allocated; ORT parses 32-bit ids)
MAX_SIZE = 2**31 - 1


def _short(value: Any) -> str:
    """``repr(value)``, at most 80 characters (an int of 400 digits was printed whole: a tester)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _sizes(key: Any, sizes: Any) -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes)):
        raise CaptureError(f"buckets[{key!r}] must be a list of ints such as [1, 2, 4, 8], got the string {sizes!r}")
    try:
        vals = list(sizes)
    except TypeError:
        raise CaptureError(f"buckets[{key!r}] must be a list of sizes, got {sizes!r}") from None
    if not vals or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= MAX_SIZE
                       for v in vals):  # past MAX_SIZE every request failed at its first run (MemoryError: a tester)
        raise CaptureError(f"buckets[{key!r}] must be ints from 1 to {MAX_SIZE}, got {str(vals)[:200]}")
    if any(b <= a for a, b in zip(vals, vals[1:])):
        raise CaptureError(f"buckets[{key!r}] must be strictly ascending, got {vals!r}")
    return tuple(int(v) for v in vals)


def check_pad_values(spec: Any, input_types: Mapping[str, np.dtype | None],
                     dims: Sequence[BucketDim]) -> dict[str, Any]:
    """Normalise ``pad_values=`` (``{input: scalar}``) to ``{input: numpy scalar of the input's dtype}``.

    ``input_types`` maps every model input to its numpy dtype (``None``: a type numpy cannot hold, e.g. string).
    Raises :class:`CaptureError`: not a mapping; an input the model lacks or that carries no bucketed dim (its pad
    value would never be used); a value that is not a scalar or does not survive the cast to the input's dtype
    (``1.5`` for int64, ``-1`` for uint8, ``300`` for int8, a float for bool, ``1e39`` for float32; floats round).
    """
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise CaptureError(f"pad_values must be a mapping {{input name: scalar}}, got {spec!r}")
    padded = {name for d in dims for name, _ in d.sites}
    out: dict[str, Any] = {}
    for name, value in spec.items():
        if name not in input_types:
            raise CaptureError(f"pad_values: {name!r} is not an input of the model ({list(input_types)})")
        if name not in padded:
            raise CaptureError(f"pad_values: input {name!r} carries no bucketed dim, so it is never padded")
        dtype = input_types[name]
        arr = np.asarray(value)
        if arr.ndim != 0 or arr.dtype.kind not in "biuf" or dtype is None:
            raise CaptureError(f"pad_values[{name!r}] must be a real scalar for a numeric input, got {_short(value)}")
        with np.errstate(all="ignore"):
            cast = arr.astype(dtype)
        if np.dtype(dtype).kind == "f":  # rounding is fine (0.1 in float32); overflow to inf is not
            same = bool(np.isfinite(cast)) or not bool(np.isfinite(arr))
        else:  # ints and bool: exactly, and bool never from a float
            same = (not np.isnan(arr.astype(np.float64)) and float(cast) == float(arr)
                    and not (np.dtype(dtype) == np.bool_ and arr.dtype.kind == "f"))
        if not same:
            raise CaptureError(f"pad_values[{name!r}] = {_short(value)} does not fit the input's dtype {np.dtype(dtype)}")
        out[name] = cast[()]
    return out


#: how an output axis relates to a bucketed dim: ("follow", label) or ("fn", label, size function)
Relation = tuple


def check_output_axes(spec: Any, output_names: Sequence[str], dims: Sequence[BucketDim]) -> dict[str, dict]:
    """Normalise ``output_axes=``: ``{output: None}`` (never sliced) or ``{output: {axis: how}}`` where ``how`` is a
    dim label (the axis follows that bucketed dim), a callable ``f(request size) -> length`` (of the only bucketed
    dim), or ``(label, f)``. Returns ``{output: {axis: Relation}}`` (``{}`` for None). Raises :class:`CaptureError`."""
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise CaptureError(f"output_axes must be a mapping {{output: {{axis: dim or size function}} or None}}, "
                           f"got {spec!r}")
    labels = [d.label for d in dims]
    out: dict[str, dict] = {}
    for name, axes in spec.items():
        if name not in output_names:
            raise CaptureError(f"output_axes: {name!r} is not an output of the model ({list(output_names)})")
        if axes is None:
            out[name] = {}
            continue
        if not isinstance(axes, Mapping):
            raise CaptureError(f"output_axes[{name!r}] must be None or {{axis: dim or size function}}, got {axes!r}")
        rel = {}
        for axis, how in axes.items():
            if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
                raise CaptureError(f"output_axes[{name!r}]: axes are non-negative ints, got {axis!r}")
            if isinstance(how, str) and how in labels:
                rel[axis] = ("follow", how)
            elif callable(how):
                if len(labels) != 1:
                    raise CaptureError(f"output_axes[{name!r}][{axis}]: with several bucketed dims give "
                                       f"(dim, function), one of {labels}")
                rel[axis] = ("fn", labels[0], how)
            elif isinstance(how, tuple) and len(how) == 2 and how[0] in labels and callable(how[1]):
                rel[axis] = ("fn", how[0], how[1])
            else:
                raise CaptureError(f"output_axes[{name!r}][{axis}] must be one of {labels}, a size function or "
                                   f"(dim, size function), got {how!r}")
        out[name] = rel
    return out


def output_relations(run: Callable[[Mapping[str, int]], dict[str, tuple[int, ...]]], dims: Sequence[BucketDim],
                     probe_sizes: Mapping[str, tuple[int, int]], declared: Mapping[str, dict]) -> dict[str, dict]:
    """Which output axes follow which bucketed dim, decided by running the model uncaptured.

    ``run(sizes)`` runs the uncaptured session with each bucketed dim at ``sizes[label]`` and returns the output
    shapes. A baseline run puts every dim at its first probe size; then each dim alone moves to its second. An
    output axis follows a dim when its length equals the dim's size in both runs (and it changed); an axis that
    changed in any other way makes the output unclear, which must be declared in ``output_axes=``. Declared
    outputs are taken as declared.

    Returns ``{output: {axis: Relation}}`` for every output. Raises :class:`CaptureError` naming the unclear
    outputs and the declaration that resolves them.
    """
    base_sizes = {d.label: probe_sizes[d.label][0] for d in dims}
    base = run(base_sizes)
    rel: dict[str, dict] = {name: {} for name in base}
    unclear: dict[str, list[str]] = {}
    for d in dims:
        moved = dict(base_sizes)
        moved[d.label] = probe_sizes[d.label][1]
        other = run(moved)
        for name, shape in base.items():
            if name in declared:
                continue
            shape2 = other[name]
            if len(shape) != len(shape2):
                unclear.setdefault(name, []).append(f"its rank changes with {d.label}")
                continue
            for ax, (a, b) in enumerate(zip(shape, shape2)):
                if a == b:
                    continue
                if a == base_sizes[d.label] and b == moved[d.label]:
                    rel[name][ax] = ("follow", d.label)
                else:
                    unclear.setdefault(name, []).append(
                        f"axis {ax} is {a} at {d.label}={base_sizes[d.label]} and {b} at {d.label}={moved[d.label]}")
    if unclear:
        what = "; ".join(f"{n!r}: {', '.join(w)}" for n, w in unclear.items())
        example = next(iter(unclear))
        raise CaptureError(
            f"buckets: cannot tell how output(s) {sorted(unclear)} relate to the bucketed dim(s) ({what}); slicing "
            f"them would be a guess. Declare it, e.g. output_axes={{{example!r}: {{axis: lambda n: length}}}} (a "
            f"size function of the request's size) or {{{example!r}: None}} (never sliced)."
        )
    rel.update(declared)
    return rel


def sliced_lengths(rel: Mapping[int, Relation], request: Mapping[str, int], shape: Sequence[int] | None = None,
                   name: str = "output") -> dict[int, int]:
    """``{axis: length}`` of one output for a request's sizes (``{label: size}``). With ``shape`` (the bucket graph's
    output shape) a length beyond it raises :class:`CaptureError`: the relation decided at two probe sizes (or
    declared) does not hold at this bucket, and a slice would be silently short (numpy) or read past the buffer
    (a device copy)."""
    out = {}
    for axis, r in rel.items():
        if r[0] == "follow":
            out[axis] = request[r[1]]
        else:
            n = r[2](request[r[1]])
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise CaptureError(f"output_axes size function returned {n!r} for {r[1]}={request[r[1]]}; "
                                   "expected a non-negative int")
            out[axis] = int(n)
    if shape is not None:
        for axis, n in out.items():
            if axis >= len(shape) or n > shape[axis]:
                have = f"length {shape[axis]}" if axis < len(shape) else "no such axis"
                raise CaptureError(
                    f"buckets: output {name!r} (shape {tuple(shape)} in the bucket's graph) has {have} along axis "
                    f"{axis}, where the request needs {n}: it does not follow the bucketed dim the way it was "
                    f"decided or declared; declare it, e.g. output_axes={{{name!r}: {{{axis}: lambda n: length}}}} or "
                    f"{{{name!r}: None}}.")
    return out


def trt_profile_options(dims: Sequence[BucketDim], inputs: Mapping[str, Sequence[int | str | None]]) -> dict | None:
    """TensorRT optimisation profiles covering the buckets: ``{"trt_profile_min_shapes": "X:1x4", ..._max_shapes,
    ..._opt_shapes}`` (min at the smallest bucket, max and opt at the largest), or ``None`` when an input has a
    dynamic dim that is not bucketed (its range is unknown: give the profiles yourself). Untested: no TensorRT
    runtime on the test machines."""
    lo, hi = {}, {}
    for name, ds in inputs.items():
        a, b = [], []
        for ax, d in enumerate(ds):
            dim = next((x for x in dims if (name, ax) in x.sites), None)
            if dim is not None:
                a.append(dim.sizes[0])
                b.append(dim.sizes[-1])
            elif isinstance(d, int):
                a.append(d)
                b.append(d)
            else:
                return None
        lo[name], hi[name] = a, b

    def fmt(shapes):
        return ",".join(f"{n}:{'x'.join(map(str, s))}" for n, s in shapes.items())

    return {"trt_profile_min_shapes": fmt(lo), "trt_profile_max_shapes": fmt(hi), "trt_profile_opt_shapes": fmt(hi)}


def with_trt_profiles(providers, provider_options, profiles: Mapping[str, str]):
    """``(providers, provider_options)`` with ``profiles`` added to the TensorRT EP's options where the caller set
    none of them (the caller's lists are not changed)."""
    if not providers:
        return providers, provider_options
    out, opts_out = [], None if provider_options is None else [dict(o) for o in provider_options]
    for i, p in enumerate(providers):
        name, opts = (p[0], dict(p[1])) if isinstance(p, (tuple, list)) else (p, None)
        if name == "TensorrtExecutionProvider":
            target = opts if opts is not None else (opts_out[i] if opts_out is not None else None)
            if target is None:
                opts = {}
                target = opts
            if not any(k in target for k in profiles):
                target.update(profiles)
        out.append((name, opts) if opts is not None else name)
    return out, opts_out
