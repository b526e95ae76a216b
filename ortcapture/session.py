"""``ortcapture.InferenceSession``: a drop-in ``onnxruntime.InferenceSession`` whose every run path is capture-safe.

Capture is on when the user enabled it the ORT way (``enable_cuda_graph``, ``trt_cuda_graph_enable``,
``enableGraphCapture``; see :mod:`ortcapture._ort.providers`). With capture off this class behaves exactly like ORT.
With capture on, what ORT >= 1.30 guarantees for WebGPU only (ORT PR #32074) holds for every capture-capable EP:

* ``run``/``run_async``/``run_with_ort_values``/``run_with_ortvaluevector`` raise unless the run options set
  ``gpu_graph_id=-1`` (measured on CUDA: ``run()`` after a capture is accepted and replays stale buffers; after a
  release it fails with ``IndexError``);
* ``run_with_iobinding`` pins the IOBinding per ``gpu_graph_id`` (:mod:`ortcapture._core.registry`), refuses CPU-bound,
  ORT-allocated, foreign-device and input/output-aliased bindings, and serialises runs (ORT does not support
  concurrent ``Run`` under capture and does not enforce it);
* ``release_captured_graph`` retires CUDA/TensorRT ids (ORT's release is a no-op there; :meth:`InferenceSession.compact`
  frees them by rebuilding the C session) and ``set_providers`` forgets every graph.

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
