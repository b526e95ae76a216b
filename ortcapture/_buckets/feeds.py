"""The one check of a bucket request's feeds against the model's inputs (issue 16), before any graph is looked up.

A feed that ORT's plain ``run()`` would refuse (another element type, rank or fixed dim) must not reach the bucket
graphs: it would make a new pool key, try a capture on padded copies of it and raise ortcapture's ``TransferError``
instead of ORT's own error (and leave a refused entry behind per bad shape). Such requests run uncaptured, so ORT
says what is wrong, exactly as without buckets. Python lists are converted as ORT converts them (to the input's
element type, ``numpy.array(list, dtype)``); other non-array objects (scalars, tuples) go to ORT unchanged.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ortcapture._ort.values import ONNX_TO_NP


class InputSpec:
    """One model input: ``name``, ``dtype`` (numpy, ``None`` for types numpy cannot name) and ``dims`` (int when
    fixed, else ``None``)."""

    __slots__ = ("name", "dtype", "dims")

    def __init__(self, name: str, onnx_type: str, shape: Sequence[Any]):
        self.name = name
        self.dtype = ONNX_TO_NP.get(onnx_type)
        self.dims = tuple(d if isinstance(d, int) else None for d in shape)

    def problem(self, shape: Sequence[int], dtype: Any) -> str | None:
        """Why a value of ``shape`` and ``dtype`` (numpy dtype, or a framework's dtype name) is not a feed ORT takes
        for this input; ``None`` when it is."""
        if (self.dtype is not None and not (isinstance(dtype, np.dtype) and dtype == self.dtype)
                and str(dtype).replace("torch.", "") != str(self.dtype)):
            return f"input {self.name!r} is {self.dtype} in the model, the feed is {dtype}"
        if len(shape) != len(self.dims):
            return f"input {self.name!r} has rank {len(self.dims)} in the model, the feed has shape {tuple(shape)}"
        for ax, (want, got) in enumerate(zip(self.dims, shape)):
            if want is not None and int(got) != want:
                return f"input {self.name!r} axis {ax} is fixed at {want} in the model, the feed has {int(got)}"
        return None


def specs(session) -> dict[str, InputSpec]:
    """``{input name: InputSpec}`` of a session's inputs."""
    return {m.name: InputSpec(m.name, m.type, m.shape) for m in session.get_inputs()}


def from_list(spec: InputSpec, value: list) -> np.ndarray | None:
    """A Python list as ORT converts it (to the input's element type), or ``None`` where that fails."""
    if spec.dtype is None:
        return None
    try:
        return np.array(value, dtype=spec.dtype)
    except (TypeError, ValueError, OverflowError):
        return None


def requested_outputs(output_names, names: Sequence[str]) -> list[str] | None:
    """``output_names`` as ORT's ``run`` takes them (``None``/empty: every output of ``names``; else a list or tuple
    of known names, repeats allowed), or ``None`` where ORT would refuse them (an unknown name: ORT's
    ``InvalidArgument``; a string or another non-sequence: ORT's ``TypeError``). Whoever serves a run from a graph
    hands such runs to ORT instead, so ORT's own exception is raised before any replay."""
    if output_names is None or (isinstance(output_names, (list, tuple, str)) and not output_names):  # as ORT
        return list(names)
    if not isinstance(output_names, (list, tuple)) or not all(isinstance(n, str) and n in names
                                                              for n in output_names):
        return None
    return list(output_names)
