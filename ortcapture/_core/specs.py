"""The checks a capture makes before anything is built: the example feeds against the model, the declared state.

Moved out of :mod:`ortcapture.graph` unchanged (which re-exports ``example_specs``). ``_check_state`` is a method of
:class:`ortcapture._core.graph.CapturedGraph` (assigned in its class body).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ortcapture._ort.values import ONNX_TO_NP
from ortcapture._transfer import check as tcheck
from ortcapture.errors import CaptureError, TransferError


def check_state(self, state: Mapping[str, str]) -> dict[str, str]:
    targets = list(state.values())
    twice = sorted({i for i in targets if targets.count(i) > 1})
    if twice:
        raise CaptureError(f"state input(s) {twice} are fed by more than one state output; each state input "
                           "takes exactly one output")
    for out, inp in state.items():
        if out not in self.outputs:
            raise CaptureError(f"state output {out!r} is not an output of the model ({list(self.outputs)})")
        if inp not in self.inputs:
            raise CaptureError(f"state input {inp!r} is not an input of the model ({list(self.inputs)})")
        o, i = self.outputs[out], self.inputs[inp]
        if tuple(o.shape()) != tuple(i.shape()) or o.data_type() != i.data_type():
            raise CaptureError(
                f"state {out!r} -> {inp!r}: output is {tuple(o.shape())} {o.data_type()}, input is "
                f"{tuple(i.shape())} {i.data_type()}; they must match to carry the state"
            )
    return dict(state)



def _source_spec(name: str, value: Any) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, numpy dtype) of an example feed: numpy array (0-d included), OrtValue or DLPack tensor; raises
    :class:`TransferError` naming the input and the type for anything else (:func:`ortcapture.transfer.source_spec`)."""
    try:
        return tcheck.source_spec(value)
    except TransferError as exc:
        raise TransferError(f"feed {name!r}: {exc}") from None



def example_specs(session, example_feeds: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{input name: (shape, dtype)}`` of ``example_feeds`` for ``session``'s inputs (in ``get_inputs()`` order,
    then the overridable initializers fed), after the checks every capture makes before anything is built.

    Raises:
        TransferError: not a mapping; unknown or missing inputs (named); a feed that is no array (its type named:
            a string, ``None``, a numpy scalar); a dtype or fixed dim that contradicts the model's input.
    """
    if not isinstance(example_feeds, Mapping):
        raise TransferError(f"example feeds must be a mapping {{input name: value}}, got "
                            f"{type(example_feeds).__name__}")
    metas = {m.name: m for m in session.get_inputs()}
    names = list(metas)
    # overridable initializers (initializers also listed as graph inputs) are inputs when fed
    overridable = {m.name: m for m in session.get_overridable_initializers() if m.name in example_feeds}
    unknown = sorted(set(example_feeds) - set(names) - set(overridable))
    if unknown:
        raise TransferError(f"unknown input(s) {unknown}; the model's inputs are {names}")
    missing = [n for n in names if n not in example_feeds]
    if missing:
        raise TransferError(f"example feeds miss input(s) {missing}; capture needs a value for every input")
    metas.update(overridable)
    names += list(overridable)
    specs = {name: _source_spec(name, example_feeds[name]) for name in names}
    for name, (shape, dtype) in specs.items():
        _check_model_input(metas[name], shape, dtype)
    return specs



def _check_model_input(meta, shape: tuple, dtype: np.dtype) -> None:
    """Refuse an example feed whose dtype or fixed dims contradict the model's input (before ORT errors out)."""
    want = ONNX_TO_NP.get(meta.type)
    if want is not None and dtype != want:
        raise TransferError(f"input {meta.name!r} is {meta.type} in the model; the example feed is {dtype}")
    dims = list(meta.shape or [])
    if dims and (len(dims) != len(shape) or any(isinstance(d, int) and d != s for d, s in zip(dims, shape))):
        raise TransferError(f"input {meta.name!r} has dims {dims} in the model; the example feed has shape {shape}")
