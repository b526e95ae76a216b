"""Requests without a session: the one check of a request, grouping, packing into runs, joining and slicing rows.

What the batching tier (``ortcapture.serving.tier``, no device, no session) and the session-side
:class:`ortcapture.serving.BatchRunner` share, so a request is checked once and batched the same way on both sides:

* :class:`RequestCheck` — a request's inputs against the model (names, dtypes, ranks, fixed dims, equal rows along
  the batched dim, the row limit) and its values against the device's buffers
  (:func:`ortcapture.transfer.value_rules`); a bad request fails alone with :class:`RequestError` (HTTP 400);
* :func:`group_key` — requests that may share a run (same non-batched dims, equal values of the inputs that do not
  carry the batched dim);
* :func:`pack` — a group cut into runs of at most ``max_rows`` rows, whole requests, first-fit decreasing;
* :func:`join` / :func:`take` — a run's feeds concatenated along the batched dim, and a run's output rows sliced back;
* :class:`HostRows` — a merged run's host rows listed, not joined (the session replica copies them to the device).

Uses only numpy and ortcapture's public API.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ortcapture.errors import TransferError
from ortcapture.serving.cuda_shm import DeviceRows, DeviceTensor
from ortcapture.transfer import check_feeds, host_copy, input_specs


class RequestError(ValueError):
    """One request is bad: names the input and what is wrong (a client error, HTTP 400). The other requests of
    the batch are unaffected.

    Attributes:
        input: the input's name, or ``None`` when the request as a whole is wrong (not a mapping, several inputs
            disagreeing on the rows).
    """

    def __init__(self, message: str, input: str | None = None):  # noqa: A002 - the protocol's word
        super().__init__(message)
        self.input = input


class RequestCheck:
    """The one check of a request, without a session.

    Args:
        inputs: ``[(name, numpy dtype, shape)]`` of the model's inputs in order, ``-1`` for the batched dim (and for
            no other dim: every other dim is fixed).
        input_axes: ``{input name: axis}`` of the inputs that carry the batched dim.
        max_rows: the most rows one request may have (``split=False``).
        value_rules: :func:`ortcapture.transfer.value_rules` of the device the rows are copied to (``{}``: none).
        dim: the batched dim's label, for messages.
        split: ``True``: a request may have more than ``max_rows`` rows (it is cut across runs).
    """

    def __init__(self, inputs: Sequence[tuple[str, Any, Sequence[int]]], input_axes: Mapping[str, int],
                 max_rows: int, value_rules: Mapping | None = None, dim: str = "batch", split: bool = False):
        self.names = [n for n, _, _ in inputs]
        self.types = {n: np.dtype(t) for n, t, _ in inputs}
        self.shapes = {n: tuple(int(d) for d in s) for n, _, s in inputs}
        #: the feed plan's specs (:func:`ortcapture.transfer.input_specs`): -1 is a free dim
        self.specs = input_specs([(n, self.types[n], self.shapes[n]) for n in self.names])
        self.input_axes = dict(input_axes)
        self.max_rows = int(max_rows)
        self.value_rules = dict(value_rules or {})
        self.dim = dim
        self.split = bool(split)

    def rows(self, request: Mapping[str, np.ndarray]) -> int:
        """Check one request alone and return its rows along the batched dim.

        Args:
            request: ``{input name: numpy.ndarray}`` with every model input exactly once, each of the input's dtype
                and rank, fixed dims as in the model, every input carrying the batched dim with the same length.

        Returns:
            The request's rows (>= 1).

        Raises:
            RequestError: not a mapping; an input missing or not the model's; a value that is not a numpy array
                (lists, scalars, device tensors); another dtype (no casts: ``float64`` for a ``float32`` input is
                refused), rank or fixed dim; inputs disagreeing on the rows; 0 rows; more than ``max_rows`` rows
                with ``split=False``; values the device's fixed buffers refuse (``value_rules``: int64 outside int32
                for WebGPU, whose EP would keep the low 32 bits) — the same check the copy into the graph applies,
                so such a value fails its own request here and never the batch it would have joined.
        """
        if not isinstance(request, Mapping):
            raise RequestError(f"a request is a mapping {{input name: numpy array}}, got a {type(request).__name__}")
        checked = request
        if any(isinstance(v, DeviceTensor) for v in request.values()):  # in a CUDA region: shape and dtype only
            checked = {}
            for name, v in request.items():
                if isinstance(v, DeviceTensor) and self.input_axes.get(name) != 0:
                    raise RequestError(f"input {name!r}: CUDA shared memory is for inputs batched on axis 0; send "
                                       "this one in the request or in system shared memory", name)
                checked[name] = v.stand_in() if isinstance(v, DeviceTensor) else v
        try:  # the feed plan's own check, without a device: what passes is what a graph's copy accepts
            check_feeds(self.specs, checked, self.value_rules)
        except TransferError as exc:
            text = str(exc)
            named = next((n for n in (*self.names, *request) if text.startswith(f"input {n!r}")), None)
            raise RequestError(text, named if isinstance(named, str) else None) from None
        rows = {name: int(request[name].shape[axis]) for name, axis in self.input_axes.items()}
        if len(set(rows.values())) > 1:
            raise RequestError(f"the inputs disagree on the rows along {self.dim!r}: "
                               + ", ".join(f"{n!r} axis {self.input_axes[n]}: {r}" for n, r in rows.items()))
        n = next(iter(rows.values()))
        first = next(iter(rows))
        if n < 1:
            raise RequestError(f"input {first!r} has 0 rows along {self.dim!r} (axis {self.input_axes[first]})", first)
        if n > self.max_rows and not self.split:
            raise RequestError(f"input {first!r} has {n} rows along {self.dim!r} (axis {self.input_axes[first]}), "
                               f"more than the {self.max_rows} one run takes: send at most {self.max_rows} per "
                               "request", first)
        return n


def group_key(request: Mapping[str, np.ndarray], names: Sequence[str], input_axes: Mapping[str, int]) -> tuple:
    """A checked request's group: requests of one group may share a run (same non-batched dims; an input that does
    not carry the batched dim is one value for the whole run, so its bytes must be equal)."""
    parts = []
    for name in names:
        v = request[name]
        axis = input_axes.get(name)
        if axis is None:
            parts.append((v.shape, v.tobytes()))
        else:  # rows in CUDA regions are gathered on the device: a group of their own
            parts.append((isinstance(v, DeviceTensor), *(-1 if ax == axis else d for ax, d in enumerate(v.shape))))
    return tuple(parts)


def pack(members: Sequence[tuple[int, int]], max_rows: int) -> list[list[tuple[int, int, int]]]:
    """One group's runs: ``members`` are ``(request index, rows)``; returns lists of ``(index, 0, rows)`` of at most
    ``max_rows`` rows each (whole requests, first-fit decreasing: fewest runs, little padding), requests in order
    inside a run, runs ordered by their first request."""
    bins: list[list] = []  # [rows used, [(index, rows)]]
    for i, n in sorted(members, key=lambda m: -m[1]):
        for b in bins:
            if b[0] + n <= max_rows:
                b[0] += n
                b[1].append((i, n))
                break
        else:
            bins.append([n, [(i, n)]])
    chunks = [sorted((i, 0, n) for i, n in b[1]) for b in bins]
    return sorted(chunks, key=lambda c: c[0][0])


def pieces(requests: Sequence[Mapping[str, np.ndarray]], chunk: Sequence[tuple[int, int, int]], names: Sequence[str],
           input_axes: Mapping[str, int]) -> list[tuple[str, list[np.ndarray], int | None]]:
    """What :func:`join` joins, unjoined: per input ``(name, [pieces], axis)`` — the batched inputs' pieces of
    ``chunk``'s ``(index, first row, end row)`` (views) and their axis; an input without the batched dim is the
    first request's, axis ``None`` (the group agrees on it)."""
    first = requests[chunk[0][0]]
    out = []
    for name in names:
        axis = input_axes.get(name)
        if axis is None:
            out.append((name, [first[name]], None))
            continue
        parts = []
        for i, start, stop in chunk:
            v = requests[i][name]
            if isinstance(v, DeviceTensor):  # a reference: the session replica gathers the rows
                parts.append((v, start, stop))
            elif not isinstance(v, np.ndarray):  # rows gathered on the device (a CUDA OrtValue): taken whole
                parts.append(v)
            else:
                parts.append(v if start == 0 and stop == v.shape[axis] else take(v, axis, start, stop))
        out.append((name, parts, axis))
    return out


def join(requests: Sequence[Mapping[str, np.ndarray]], chunk: Sequence[tuple[int, int, int]], names: Sequence[str],
         input_axes: Mapping[str, int]) -> dict[str, np.ndarray]:
    """The feeds of one run: each batched input of ``chunk``'s ``(index, first row, end row)`` pieces concatenated
    along its axis (one piece: the request's own array, no copy); an input without the batched dim is the first
    request's (the group agrees on it)."""
    return {name: DeviceRows.of(parts) if isinstance(parts[0], tuple) else
            parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
            for name, parts, axis in pieces(requests, chunk, names, input_axes)}


def join_into(parts: Sequence[np.ndarray], axis: int, out: np.ndarray) -> np.ndarray:
    """``np.concatenate(parts, axis, out=out)``; along axis 0 each part is one block of ``out``, copied with
    :func:`ortcapture.transfer.host_copy` (big ones split over the staging threads: the batching tier's event loop
    and the session replica's replay thread wait a third as long). Raises ``ValueError`` where the parts do not
    fill ``out`` exactly (no broadcasting)."""
    if axis != 0:
        return np.concatenate(parts, axis=axis, out=out)
    at = 0
    for part in parts:
        host_copy(part, out[at:at + part.shape[0]])
        at += part.shape[0]
    if at != out.shape[0]:
        raise ValueError(f"join_into: {at} rows for {out.shape[0]}")
    return out


def on_device(request: Mapping[str, Any]) -> bool:
    """Whether a checked request has an input in a CUDA region (:class:`DeviceTensor`)."""
    return any(isinstance(v, DeviceTensor) for v in request.values())


@dataclass(frozen=True, eq=False)
class HostRows:
    """A merged run's rows of one input in host memory, listed instead of joined: ``parts`` C-contiguous numpy
    arrays (each a run's rows, in order, all of one dtype and one shape past axis 0), ``shape`` and ``dtype`` of the
    joined tensor. A CUDA session replica copies each part to the device on its own
    (:meth:`ortcapture.serving.cuda_ipc.IpcMemory.gather`: the parts lie in page-locked batch slots, so each is one
    DMA) instead of joining them on the host first."""

    parts: tuple[np.ndarray, ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def of(cls, parts: Sequence[np.ndarray]) -> "HostRows":
        """``parts`` (at least one) joined along axis 0. Raises ``ValueError`` for parts of other dtypes or other
        shapes past axis 0, or one that is not C-contiguous."""
        first = parts[0]
        for p in parts:
            if p.dtype != first.dtype or p.shape[1:] != first.shape[1:] or not p.flags.c_contiguous:
                raise ValueError(f"HostRows: a part of {p.dtype} {list(p.shape)} (C-contiguous "
                                 f"{p.flags.c_contiguous}) cannot follow {first.dtype} {list(first.shape)}")
        return cls(tuple(parts), (sum(int(p.shape[0]) for p in parts), *first.shape[1:]), first.dtype)

    def take(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the joined tensor: a view when they lie in one part, else a new array."""
        out, at = [], 0
        for p in self.parts:
            n = int(p.shape[0])
            a, b = max(start, at), min(stop, at + n)
            if a < b:
                out.append(p[a - at:b - at])
            at += n
        if not out:
            return np.empty((0, *self.shape[1:]), self.dtype)
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)


def split_feeds(feeds: Mapping[str, Any], rows: Sequence[int], input_axes: Mapping[str, int]) -> list[dict]:
    """The inverse of :func:`join`: the joined ``feeds`` cut back into one feeds dict per request of ``rows`` rows
    (views; inputs without the batched dim shared; :class:`DeviceRows` cut into each request's own part,
    :class:`HostRows` into each request's rows). Raises
    ValueError for :class:`DeviceRows` whose parts are not one per request of those rows."""
    out, offset = [], 0
    for k, n in enumerate(rows):
        own = {}
        for name, v in feeds.items():
            if name not in input_axes:
                own[name] = v
            elif isinstance(v, DeviceRows):
                if len(v.parts) != len(rows) or v.parts[k][2] - v.parts[k][1] != n:
                    raise ValueError(f"input {name!r}: {len(v.parts)} CUDA region parts cannot be cut into the rows "
                                     f"{list(rows)} of a run's requests")
                own[name] = DeviceRows.of([v.parts[k]])
            elif isinstance(v, HostRows):  # batched on axis 0 (merged runs only)
                own[name] = v.take(offset, offset + n)
            else:
                own[name] = take(v, input_axes[name], offset, offset + n)
        out.append(own)
        offset += n
    return out


def take(x: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    """``x[start:stop]`` along ``axis`` (a view)."""
    return x[(slice(None),) * axis + (slice(start, stop),)]


def answers_of(n_items: int, chunks: list, answers: list, slot=None) -> list:
    """Each request's answer from a session replica's per-run ``answers`` (``chunks``: per run, the requests'
    ``(index, first row, rows)``): its own rows of the outputs, or its own error. Rows read from a batch slot
    (``slot``, ``"slot_outputs"``) are always copied: the slot takes the next batch as soon as this one is answered,
    before Ray sends these answers on (a view of it, even a contiguous one, would carry the next batch's rows)."""
    results: list[Any] = [None] * n_items
    for chunk, answer in zip(chunks, answers):
        if "answers" in answer:  # the run failed: each request's own answer
            for (k, _, _), a in zip(chunk, answer["answers"]):
                results[k] = a
            continue
        in_slot = "slot_outputs" in answer
        outs = slot.outputs(answer["slot_outputs"]) if in_slot else answer["outputs"]
        own = np.array if in_slot else np.ascontiguousarray  # np.array copies always
        out_axes, offset = answer["axes"], 0
        for k, _, n in chunk:
            results[k] = {"outputs": {name: own(take(o, out_axes[name], offset, offset + n))
                                      for name, o in outs.items()}}
            offset += n
    return results
