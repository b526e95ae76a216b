"""``ortcapture.InferenceSession``, the public face: a drop-in ``onnxruntime.InferenceSession``, capture-safe.

Which ORT behaviour each run path guards against is said in the implementation's docstring.

This module only re-exports: the implementation is :mod:`ortcapture._session.session` (with
:mod:`ortcapture._session.capture`, :mod:`~ortcapture._session.buckets`, :mod:`~ortcapture._session.memory` and
:mod:`~ortcapture._session.setup`).
"""
from __future__ import annotations

from ortcapture._core.run import (
    GRAPH_ID_KEY, MAX_GRAPH_ID, SKIP_GRAPH_ID, check_graph_id, graph_id_of, run_options_for, unsynchronised,
)
from ortcapture._session.session import InferenceSession

__all__ = ["GRAPH_ID_KEY", "MAX_GRAPH_ID", "SKIP_GRAPH_ID", "InferenceSession", "check_graph_id", "graph_id_of",
           "run_options_for", "unsynchronised"]
