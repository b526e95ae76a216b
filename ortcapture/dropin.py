"""ortcapture inside code you do not control: install its session as ``onnxruntime.InferenceSession``.

Libraries (pipelines, model zoos, OCR toolkits) create their own sessions with ``onnxruntime.InferenceSession(...)``
and call plain ``sess.run(output_names, feeds)``. :func:`patch_onnxruntime` (or the :func:`patched` context
manager) replaces that name with :class:`AutoCaptureSession`, an :class:`ortcapture.InferenceSession` that

* gets the capture provider when the caller names none (``provider=``: ``"cuda"``, ``"webgpu"`` or ``"auto"``), and
  switches capture on for a CUDA/TensorRT EP the caller names without it;
* serves plain ``run()`` from captured graphs: one graph per distinct set of input shapes and dtypes (and per value
  of the inputs ORT reads on the host, e.g. a Reshape shape or a Slice start: those are capture-time constants),
  captured on first use, verified at capture (:mod:`ortcapture._verify.compare`: the example and a varied input set
  against the reference run: on CUDA the same session uncaptured), replayed afterwards;
* never raises what ORT would not: a ``run()`` it cannot serve captured (more distinct shapes than ``max_graphs``, a
  graph whose check failed, an input missing, a refused capture) runs uncaptured (``gpu_graph_id=-1``) with one
  warning per session and reason; ``run_with_ort_values``/``run_with_ortvaluevector``/``run_async`` and
  ``run_with_iobinding`` without an explicit ``gpu_graph_id`` run uncaptured too;
* behaves as ORT does for what no graph can serve, before any replay: run options a replay cannot honour
  (``terminate``), output names ORT refuses (an unknown name, a string), feeds that are no arrays (a numpy scalar
  ``np.float32(0.5)``; 0-d arrays are served) go to ORT's own run, which returns or raises as it does; ``run_async``
  is serialised with the other runs like ``run`` (:meth:`ortcapture.InferenceSession.run_async`).

Limits (documented, by design): sessions created before patching are untouched; a library that did
``from onnxruntime import InferenceSession`` at import time keeps ORT's class unless it is imported after patching;
CUDA graphs live per thread (ORT), so each thread captures its own copy on first use.

This module only re-exports: the implementation is :mod:`ortcapture._session.dropin`.
"""
from __future__ import annotations

from typing import Sequence

from ortcapture._session.dropin import (
    AutoCaptureSession, is_patched, patch_onnxruntime, patched, unpatch_onnxruntime,
)

__all__: Sequence[str] = ["AutoCaptureSession", "patch_onnxruntime", "unpatch_onnxruntime", "patched", "is_patched"]
