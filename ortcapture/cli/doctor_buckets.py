"""``ortcapture doctor MODEL --buckets SPEC``: is the model padding-neutral for these batch buckets?

A bucket replays a request padded up to the bucket size (zeros, or ``pad_values=``) and slices the outputs back
(docs/BUCKETS.md). That is right only when the padded rows do not change the request's rows of any output: a mean,
a softmax or a norm over the bucketed axis is changed by them, and the bucket's capture-time check then refuses it
with a :class:`~ortcapture.VerificationError` that sends the user here. This check runs the real thing: an
``ortcapture.InferenceSession(MODEL, buckets=SPEC)`` on the capture EP, one request per bucket of exactly the bucket
size, whose capture verifies both that request and the most padded request the bucket serves (each bucketed dim one
more than the bucket below) against the uncaptured run of the unpadded request. One finding per bucket:
``padding`` ``info`` (neutral) or ``error`` (the outputs padding changes, with their error and the fixes).

``SPEC``: ``DIM=1,2,4`` where ``DIM`` is a dim_param (``batch``), ``INPUT:AXIS`` (``X:0``) or several of them joined
by ``+`` (one dim named in several inputs); repeat ``--buckets`` for further bucketed dims. It is the command line a
bucket's ``VerificationError`` recommends.
"""
from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

from ortcapture.cli.doctor_static import DoctorError, Finding
from ortcapture.cli.options import int_list

KIND = "padding"


def parse_bucket_items(items: Sequence[str]) -> dict:
    """``["batch=1,2,4", "X:1=8,16", "t+m:1=4"]`` -> ``{"batch": [1, 2, 4], ("X", 1): [8, 16], ("t", ("m", 1)): [4]}``.
    Raises :class:`DoctorError` for bad syntax or a size < 1 (the sizes are checked against the model by
    ``buckets=``)."""
    out: dict = {}
    for item in items:
        key, sep, sizes = str(item).partition("=")
        key = key.strip()
        if not sep or not key or not sizes.strip():
            raise DoctorError(f"--buckets {item!r}: expected DIM=SIZE,SIZE,... with DIM a dim_param or INPUT:AXIS "
                              "(e.g. batch=1,2,4 or images:0=1,2,4)")
        parts: list = []
        for part in key.split("+"):  # one dim named several ways: batch+mask:1 (a group key of buckets=)
            name, colon, axis = part.strip().rpartition(":")
            if colon:
                try:
                    parts.append((name, int(axis)))
                except ValueError:
                    raise DoctorError(f"--buckets {item!r}: the axis after ':' must be an integer") from None
            else:
                parts.append(part.strip())
        try:
            got = int_list(sizes, f"--buckets {item!r}: sizes")
        except ValueError as exc:
            raise DoctorError(str(exc)) from None
        if any(n < 1 for n in got):  # before any session is made
            raise DoctorError(f"--buckets {item!r}: sizes must be ints >= 1")
        out[parts[0] if len(parts) == 1 else tuple(parts)] = got
    return out


def padding_checks(model_path: str, provider: str, spec: Mapping, feeds: Mapping[str, Any],
                   ep_options: Mapping[str, str] | None = None) -> list[Finding]:
    """One ``padding`` finding per bucket of ``spec`` (see the module docstring).

    Args:
        model_path: the model file.
        provider: ``"cuda"`` or ``"webgpu"`` (a capture-capable EP that works here).
        spec: ``buckets=`` as :func:`parse_bucket_items` gives it.
        feeds: ``{input: array}`` random feeds of ``doctor``'s example shapes: their values are cut or repeated
            along the bucketed axes to each bucket size (the other dims stay).
        ep_options: the ``--provider-option`` values.

    Raises:
        DoctorError: ``spec`` does not fit the model (ortcapture's ``CaptureError`` for ``buckets=``).
    """
    import numpy as np

    import ortcapture
    from ortcapture._buckets.spec import parse_buckets
    from ortcapture.cli.doctor_live import _session_args
    from ortcapture.errors import CaptureError

    try:
        sess = ortcapture.InferenceSession(model_path, **_session_args(provider, True, ep_options=ep_options),
                                           buckets=dict(spec), verify="full")
        dims = parse_buckets(dict(spec), {m.name: list(m.shape) for m in sess.get_inputs()})
    except CaptureError as exc:
        raise DoctorError(f"--buckets: {exc}") from None
    findings = []
    for combo in itertools.product(*[d.sizes for d in dims]):
        sizes = {d.label: s for d, s in zip(dims, combo)}
        label = ", ".join(f"{k}={v}" for k, v in sizes.items())
        request = {}
        for name, value in feeds.items():
            x = np.asarray(value)
            for d, size in zip(dims, combo):
                for site, axis in d.sites:
                    if site == name:
                        x = np.take(x, np.arange(size) % max(x.shape[axis], 1), axis=axis)
            request[name] = np.require(x, requirements="C")
        below = {d.label: max([s for s in d.sizes if s < c], default=0) + 1 for d, c in zip(dims, combo)}
        padded = ", ".join(f"{k} {below[k]}->{v}" for k, v in sizes.items() if below[k] != v)
        try:
            sess.run(None, request)
        except ortcapture.VerificationError as exc:
            err = max((exc.report.max_error.get(o, float("inf")) for o in exc.outputs), default=float("inf"))
            findings.append(Finding(
                KIND, "error",
                f"bucket {label}: padding changes output(s) {exc.outputs} ({exc.input_set} request; relative error "
                f"{err:.3g}): the model is not padding-neutral for this dim",
                "make the model padding-neutral for the bucketed dim (mask the padded positions, e.g. an "
                "attention_mask), choose pad_values= that leave the outputs unchanged, or drop the bucket "
                "(docs/BUCKETS.md)",
                {"bucket": sizes, "outputs": list(exc.outputs), "max_error": err, "input_set": exc.input_set}))
            continue
        except CaptureError as exc:
            findings.append(Finding(KIND, "error", f"bucket {label}: not served captured: {exc}", None,
                                    {"bucket": sizes}))
            continue
        what = f"a request padded {padded}" if padded else "the full bucket"
        findings.append(Finding(
            KIND, "info", f"bucket {label}: padding-neutral (the replay of {what} matched the uncaptured run of "
                          "the unpadded request)", None, {"bucket": sizes, "neutral": True}))
    return findings
