"""Whether padding changes an output that has no rows along a batch dim, on data the example does not cover.

A bucket's verification compares the replay of a padded request with the uncaptured run of the unpadded one. For an
output that follows the bucketed dim that shows whether padding leaks into the request's rows. An output with *no*
axis along a batch dim (a reduction over the batch, a constant) takes the padded rows in whole — and whether that
changes it can depend on the data: ``ReduceMax`` over the batch, zero-padded, is right for every request whose values
are all above zero and wrong for the next one whose values are all below (found by a tester: ``[0, 0, 0]`` came back
for a batch of negative rows after a bucket had passed its check on positive ones). :func:`pad_sensitive_outputs`
checks such outputs again on the request's values moved all below zero and all above zero (each float input that
carries the dim, masks of 0 and 1 left alone: ``x - max(x) - 1`` and ``x - min(x) + 1``), padded against unpadded,
both uncaptured: a pad value
that is harmless only for data of one sign shows. A pad value that is harmless for every input stays accepted
(``ReduceMax(Relu(x))`` or a sum over the batch, zero-padded). Only for dims bucketed on axis 0 of every input that
carries them (a batch of independent samples: a padded row is a whole fake sample); along a sequence dim the pad
value of one input (an attention mask's 0) is what makes another's padded steps harmless, and moving the mask's
values would prove nothing.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np


def batch_dims(sites: Mapping[str, Sequence[tuple[int, str]]]) -> set[str]:
    """The bucketed dims (labels) that every input carrying them has on axis 0 (``sites``: ``{input: [(axis,
    label)]}``)."""
    axes: dict[str, set[int]] = {}
    for pairs in sites.values():
        for axis, label in pairs:
            axes.setdefault(label, set()).add(axis)
    return {label for label, a in axes.items() if a == {0}}


def rowless_outputs(relations: Mapping[str, Mapping[int, tuple]], labels: set[str]) -> dict[str, set[str]]:
    """``{batch dim label: outputs with no axis along it}`` (``relations``: ``{output: {axis: Relation}}``; an axis
    that follows the dim or whose length is a declared function of it has rows along it)."""
    out = {}
    for label in labels:
        names = {n for n, rel in relations.items()
                 if not any(isinstance(r, tuple) and len(r) >= 2 and r[1] == label for r in rel.values())}
        if names:
            out[label] = names
    return out


def _moved(feeds: Mapping[str, np.ndarray], names: Sequence[str], up: bool) -> dict | None:
    """``feeds`` with the float inputs among ``names`` moved all above zero (``up``: ``x - min(x) + 1``) or all
    below (``x - max(x) - 1``); ``None`` when none of them is a float input (nothing to move). An input whose values
    are all 0 or 1 is a mask (``x * valid + (1 - valid) * -1e4``: its pad value 0 is what keeps the padded rows out,
    and moved it would let them in) and stays as it is."""
    out, changed = dict(feeds), False
    for name in names:
        x = feeds[name]
        if not np.issubdtype(x.dtype, np.floating) or x.size == 0 or bool(np.all((x == 0) | (x == 1))):
            continue
        x64 = x.astype(np.float64)
        out[name] = (x64 - x64.min() + 1 if up else x64 - x64.max() - 1).astype(x.dtype)
        changed = True
    return out if changed else None


def pad_sensitive_outputs(run: Callable[[dict], Sequence[np.ndarray]], request: Mapping[str, np.ndarray],
                          pad: Callable[[dict], dict], carriers: Sequence[str], names: Sequence[str],
                          check: set[str], rtol: float) -> list[str]:
    """The outputs in ``check`` whose uncaptured value for the request padded to the bucket (``pad(feeds)``)
    differs from the unpadded request's, on the request's values moved all above and all below zero.

    Args:
        run: host feeds -> the outputs (in ``names`` order), uncaptured.
        request: the unpadded request's host feeds.
        pad: feeds -> the same padded with the pad values to the bucket's sizes.
        carriers: the inputs that carry the dim (axis 0).
        names: the output names ``run`` returns, in order.
        check: the outputs with no axis along the dim.
        rtol: relative tolerance (with an absolute floor of ``rtol`` times the output's largest magnitude).
    """
    found: list[str] = []
    for up in (False, True):
        fs = _moved(request, carriers, up)
        if fs is None:
            return []
        want = dict(zip(names, run(dict(fs))))
        got = dict(zip(names, run(pad(fs))))
        for name in names:
            if name not in check or name in found:
                continue
            a, b = np.asarray(want[name]), np.asarray(got[name])
            if a.shape != b.shape:
                found.append(name)
            elif np.issubdtype(a.dtype, np.floating):
                scale = float(np.max(np.abs(a), initial=0.0))
                if not np.allclose(a, b, rtol=rtol, atol=rtol * max(scale, 1e-6), equal_nan=True):
                    found.append(name)
            elif not np.array_equal(a, b):
                found.append(name)
    return found


def check_bucket(reference: Callable[[dict], Sequence[np.ndarray]], resized: Callable[[dict, Mapping], dict],
                 host: Mapping[str, np.ndarray], worst: Mapping[str, int], entry, sites, relations,
                 names: Sequence[str], level: str) -> None:
    """For each batch dim that ``entry``'s bucket pads for the most padded request it serves (``worst`` sizes), the
    outputs without an axis along it must come out as unpadded on the request's values moved all below and all above
    zero (:func:`pad_sensitive_outputs`).

    Args:
        reference: host feeds -> outputs (``names`` order), uncaptured.
        resized: ``(feeds, sizes) -> feeds`` padded with the pad values or cut along the bucketed axes.
        host: the request's host feeds; ``entry``: the bucket (``bucket``, ``label``); ``sites``: ``{input: [(axis,
            label)]}``; ``relations``: ``{output: {axis: Relation}}``; ``level``: the verification level.

    Raises:
        VerificationError: naming the outputs (``input_set`` ``"padding"``).
    """
    from ortcapture._verify import compare as _verify

    for label, check in rowless_outputs(relations, batch_dims(sites)).items():
        if worst[label] >= entry.bucket[label]:
            continue  # nothing padded along this dim
        carriers = [n for n, pairs in sites.items() if (0, label) in pairs]
        bad = pad_sensitive_outputs(reference, resized(dict(host), worst), lambda fs: resized(fs, entry.bucket),
                                    carriers, names, check, _verify.DEFAULT_RTOL)
        if bad:
            raise _verify.VerificationError(
                f"bucket {entry.label}: output(s) {bad} have no axis along {label!r}, and padding changes them for the "
                "request's values moved all below or all above zero (a reduction over the batch whose pad value is "
                "harmless only for some inputs; the example could not show it). Drop these buckets, choose a "
                "pad value harmless for every input (pad_values=), or compute such outputs outside the model "
                "(docs/BUCKETS.md)",
                bad, "padding", _verify.Report(level))

