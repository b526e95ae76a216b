"""The one check of a bucket request's feeds against the model's inputs (issue 16), before any graph is looked up.

A feed that ORT's plain ``run()`` would refuse (another element type, rank or fixed dim) must not reach the bucket
graphs: it would make a new pool key, try a capture on padded copies of it and raise ortcapture's ``TransferError``
instead of ORT's own error (and leave a refused entry behind per bad shape). Such requests run uncaptured, so ORT
says what is wrong, exactly as without buckets. Python lists are converted as ORT converts them (to the input's
element type, ``numpy.array(list, dtype)``); other non-array objects (scalars, tuples) go to ORT unchanged.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ortcapture._transfer.check import InputSpec, input_specs


def specs(session) -> dict[str, InputSpec]:
    """``{input name: InputSpec}`` of a session's inputs (:func:`ortcapture._transfer.check.input_specs`)."""
    return input_specs(session.get_inputs())


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
