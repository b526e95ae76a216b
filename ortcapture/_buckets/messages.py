"""The bucket runner's longer error messages: a model that fails on padded feeds, and why a probe run failed.

Moved out of :mod:`ortcapture._buckets.run` unchanged (functions of what the runner knows, no state of their own).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ortcapture._buckets.values import shape_of
from ortcapture.errors import CaptureError


def host_read_hint(host_read) -> str:
    """A sentence on the inputs ORT reads on the host (``host_read``), or ``""`` where there are none."""
    host = sorted(host_read)
    return (f" The inputs ORT reads on the host ({host}) keep their values when the bucketed dims are padded; one "
            "that encodes the batch size (e.g. a Reshape shape [n, ...]) cannot be bucketed." if host else "")


def padding_failed(exc: Exception, label: str, host_read) -> CaptureError:
    """The error for a model that ORT runs on the request's feeds but not on them padded (or cut) to ``label``:
    typically an input ORT reads on the host that encodes the batch size (a Reshape shape ``[n, -1]``)."""
    return CaptureError(f"buckets: the model fails on the feeds padded or cut to {label} (ORT: "
                        f"{str(exc).strip()[:300]}).{host_read_hint(host_read)} Run such requests with "
                        "gpu_graph_id=-1 or use the session without buckets=.")


def probe_failure(dims: Sequence, sites: Mapping, inputs: Sequence, feeds: dict, request: Mapping[str, int] | None,
                  sizes: Mapping[str, int], exc: Exception) -> str:
    """Why an uncaptured run on feeds resized along the bucketed axes failed: most often an input (a recurrent
    state, a cache) whose shape follows a bucketed dim on an axis the buckets do not name, so it was not
    padded alongside. Names such axes: dynamic, not bucketed, as long as a bucketed dim in the request.

    Args:
        dims: the runner's :class:`~ortcapture._buckets.spec.BucketDim` s; ``sites``: ``{input: ((axis, label),
            ...)}``; ``inputs``: the session's ``get_inputs()``; ``feeds``: the request; ``request``: its sizes per
            bucketed dim (``None`` when inconsistent); ``sizes``: what the probe resized them to; ``exc``: ORT's error.
    """
    request = request or {}
    hints = []  # (input, axis, length, dim)
    for m in inputs:
        bucketed = {a for a, _ in sites.get(m.name, ())}
        shape = shape_of(feeds[m.name])
        for ax, d in enumerate(m.shape):
            if isinstance(d, int) or ax in bucketed or ax >= len(shape):
                continue
            hints += [(m.name, ax, n, label) for label, n in request.items() if shape[ax] == n]
    text = ", ".join(f"{k}={v}" for k, v in sizes.items())
    msg = (f"buckets: the uncaptured run with the feeds padded or cut to {text} along the bucketed axes failed "
           f"({str(exc).strip()[:300]}). An input whose shape follows a bucketed dim on an axis the buckets do "
           "not name (e.g. a recurrent state fed every call) cannot be padded alongside; ")
    if hints:
        name, ax, _, label = hints[0]
        dim = next(d for d in dims if d.label == label)
        part = label if "[" not in label and "+" not in label else dim.sites[0]
        msg += ("candidates: " + "; ".join(f"input {n!r} axis {a} (length {k}, as {lb})" for n, a, k, lb in hints)
                + f". Name it in the same key, e.g. buckets={{({part!r}, ({name!r}, {ax})): [...]}} (a key may "
                "be a tuple of dim_params and (input, axis) pairs).")
    else:
        msg += "name such an axis in the same bucket key (a tuple of dim_params and (input, axis) pairs)."
    return msg
