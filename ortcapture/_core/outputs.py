"""A captured graph's outputs: ``ReplayOutput`` (a fixed output buffer, checked for staleness), their buffers and host copies.

Moved out of :mod:`ortcapture.graph` unchanged (which re-exports ``ReplayOutput``). The functions taking ``self`` are
methods of :class:`ortcapture._core.graph.CapturedGraph` (assigned in its class body).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ortcapture._ort import compat
from ortcapture._ort.compat import OrtValue
from ortcapture._ort.sync import UNSETTLED, settle
from ortcapture._ort.values import meta
from ortcapture._transfer import check as tcheck
from ortcapture._transfer import copy as tcopy
from ortcapture._transfer import staging as _staging
from ortcapture.errors import StaleOutputError, TransferError


class ReplayOutput(OrtValue):
    """A fixed output OrtValue as returned by ``CapturedGraph.run(..., copy_outputs=False)``.

    It *is* the graph's fixed device buffer (no copy), so the next replay overwrites it. Reading it through
    ``numpy()``/``np.asarray``/DLPack after that raises :class:`StaleOutputError`; ``is_stale`` tells. Copy what
    you need to keep (``ortcapture.to_numpy``) before the next ``run``.

    Its three fields are set when it is made (by the graph's replay, without a call) and never change: assign none.
    """

    __slots__ = {
        "fixed_buffer": "The graph's fixed output buffer (an OrtValue of ``CapturedGraph.outputs``) this output is.",
        "graph": "The :class:`~ortcapture.graph.CapturedGraph` whose replay returned it.",
        "generation": "The graph's :attr:`~ortcapture.graph.CapturedGraph.generation` when it was returned.",
    }
    # ORT's own OrtValue fields, read through to the fixed buffer's (OrtValue.__init__ never runs on this class)
    _ortvalue, _session, _numpy_obj = compat.view_fields("fixed_buffer")

    def __init__(self, value: OrtValue, graph: "CapturedGraph", generation: int):  # noqa: F821 (graph.py imports us)
        # the replay hot path (CapturedGraph.run) writes these three fields itself, without this call
        self.fixed_buffer = value  # the registered buffer: its metadata (device kind before ORT 1.30) is known
        self.graph = graph
        self.generation = generation

    @property
    def is_stale(self) -> bool:
        """Whether a later replay (or a re-capture: a new thread's capture, ``sess.compact()``) has rewritten
        the buffer since this output was returned; reading a stale output raises :class:`StaleOutputError`."""
        return self.graph.generation != self.generation

    def _check(self) -> None:
        if self.is_stale:
            raise StaleOutputError(
                f"this output of gpu_graph_id={self.graph.graph_id} was overwritten by a later replay or "
                f"re-capture (a new thread's capture, or sess.compact()) (generation {self.generation}, now "
                f"{self.graph.generation}); copy outputs before the next run"
            )

    def numpy(self) -> np.ndarray:
        """A host copy of the output (shape and dtype of the model's output; waits for an unfinished device run).

        Unlike ORT's ``OrtValue.numpy()`` on a device buffer, the copy is checked against concurrent replays: it
        never mixes two replays' values.

        Raises:
            StaleOutputError: a later replay or re-capture rewrote the buffer before or during the copy.
        """
        self._check()
        arr = tcopy.to_numpy(self.fixed_buffer)
        self._check()  # a replay from another thread began meanwhile: the copy may mix two replays
        return arr

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __dlpack__(self, *, stream=None):
        """Zero-copy export; staleness is checked at export only — the consumer's tensor aliases the fixed buffer
        and shows the next replay's values (copy it, e.g. ``torch.from_dlpack(out).clone()``, to keep them)."""
        self._check()
        if UNSETTLED:  # a run that returned before its device work finished (disable_synchronize_execution_providers)
            settle()
        return super().__dlpack__(stream=stream)



def allocate_outputs(self, new_buffer) -> dict[str, OrtValue]:
    """Run once without capture (gpu_graph_id=-1) to learn output shapes/dtypes, then allocate fixed buffers."""
    cs = self._cs
    session = cs.session
    probe = compat.OrtIOBinding(session)
    for name, buf in self.inputs.items():
        probe.bind_ortvalue_input(name, buf)
    kind, ordinal = _buffer_device(next(iter(self.inputs.values()), None), self._device)
    names = output_names(session)
    for name in names:
        probe.bind_output(name, kind, ordinal)
    with cs.guard:
        cs.run_uncaptured(probe)
    outs = probe.get_outputs()  # one per bound name, in binding order
    return {name: new_buffer(v.shape(), tcheck.np_dtype_of(v)) for name, v in zip(names, outs)}



def check_outputs_arg(self, copy_outputs, out):
    """Validate ``copy_outputs`` (not True/False) and ``out`` before anything runs; ``(mode, {position:
    array})``."""
    if copy_outputs is not True and copy_outputs is not False:
        if type(copy_outputs) is not str:  # 1, 0, None, np.bool_: a truthy or falsy value is no answer
            raise TypeError(f"copy_outputs must be True, False or 'pinned', got {copy_outputs!r}")
        if copy_outputs != "pinned":
            raise TransferError(f"copy_outputs must be True, False or 'pinned', got {copy_outputs!r}")
    if out is None:
        return copy_outputs, None
    if copy_outputs is not True:
        raise TransferError(f"out= needs copy_outputs=True (got copy_outputs={copy_outputs!r})")
    names = self._output_names
    if isinstance(out, Mapping):
        unknown = sorted(set(out) - set(names))
        if unknown:
            raise TransferError(f"out names unknown output(s) {unknown}; the outputs are {names}")
        picked = {i: out[n] for i, n in enumerate(names) if n in out and out[n] is not None}
    elif isinstance(out, (list, tuple)):
        if len(out) != len(names):
            raise TransferError(f"out has {len(out)} entries; the model has {len(names)} outputs ({names})")
        picked = {i: a for i, a in enumerate(out) if a is not None}
    else:
        raise TransferError(f"out must be a mapping {{output name: array}} or a list, got {type(out).__name__}")
    for i, arr in picked.items():
        buf = self._output_list[i]
        m = meta(buf)
        if not isinstance(arr, np.ndarray):
            raise TransferError(f"out[{names[i]!r}] must be a numpy array, got {type(arr).__name__}")
        if arr.shape != m.shape or arr.dtype != m.dtype:
            raise TransferError(f"out[{names[i]!r}] is {arr.shape} {arr.dtype}; output {names[i]!r} is "
                                f"{m.shape} {m.dtype}")
        if not arr.flags.writeable:
            raise TransferError(f"out[{names[i]!r}] is read-only")
    if len(picked) > 1:  # one output's copy would overwrite another's (a silent wrong result)
        _check_disjoint(names, picked)
    return copy_outputs, picked


def _check_disjoint(names, picked: dict) -> None:
    """Raise :class:`TransferError` when two ``out`` arrays of different outputs share memory (one name at several
    positions fills one array). Arrays are swept in the order of their byte ranges: only those whose ranges overlap
    are compared element-exactly (a decoder's 65 outputs cost tens of µs, not a pairwise ``shares_memory``)."""
    spans = sorted((*_byte_bounds(a), i) for i, a in picked.items())
    active: list[tuple[int, int]] = []  # (end, position) of the ranges still open
    for lo, hi, i in spans:
        active = [(h, j) for h, j in active if h > lo]
        for _, j in active:
            if names[i] != names[j] and _overlap(picked[i], picked[j]):
                a, b = sorted((i, j))
                raise TransferError(f"out[{names[a]!r}] and out[{names[b]!r}] overlap in memory: give each output "
                                    "its own array")
        if hi > lo:
            active.append((hi, i))


_byte_bounds = getattr(getattr(np.lib, "array_utils", None), "byte_bounds", None) or np.byte_bounds  # numpy < 2


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays whose byte ranges overlap share an element (exact for simple strides; too hard to decide
    counts as shared)."""
    try:
        return bool(np.shares_memory(a, b, max_work=10_000))
    except _TOO_HARD:
        return True


_TOO_HARD = getattr(getattr(np, "exceptions", None), "TooHardError", None) or np.TooHardError  # numpy < 1.25



def host_outputs(self, mode, out) -> list:
    """The outputs on the host through the graph's staging (the caller holds the guard, after the replay)."""
    st = self.staging_now()
    names = self._output_names
    if mode is True and not out:  # new arrays: each read straight into a recycled page-locked block
        return st.read_new(names)
    st.read(dict.fromkeys(names))
    host = st.host_outputs
    if mode == "pinned":
        return [host[n] for n in names]
    res = []
    for i, n in enumerate(names):
        dst = out.get(i)
        if dst is None:
            res.append(_staging.host_copy(host[n]))
        else:
            if dst is not host[n]:
                _staging.host_copy(host[n], dst)
            res.append(dst)
    return res



def output_names(session) -> list[str]:
    """The model's output names, each once, in ``get_outputs()`` order (ONNX lets a graph list one value as several
    outputs, e.g. ``[Y, Z, Y]``; an IOBinding binds it once)."""
    return list(dict.fromkeys(m.name for m in session.get_outputs()))



def _buffer_device(first_input, device) -> tuple[str, int]:
    """(device kind, ordinal) for the probe's output bindings: the capture device, else where the inputs live."""
    if device is not None:
        return device.device_type, device.device_id
    if first_input is not None:
        from ortcapture._ort.values import meta

        m = meta(first_input)
        return m.kind, m.device_id
    return "cpu", 0
