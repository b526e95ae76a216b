"""``CapturedGraph``: capture once, then ``run(feeds) -> outputs`` with strict in-place updates.

What is captured: one ``gpu_graph_id`` of one session, replaying the model on fixed input and output device
buffers allocated from the example feeds' shapes and dtypes. What must stay static: those shapes and dtypes (feeds
are copied into the fixed buffers; a different shape raises). What silently breaks in raw ORT and is guarded here:
rebinding after capture (ignored by replay), wrong-dtype ``update_inplace`` (bytes reinterpreted), warm-up runs
advancing in-place state (ORT #32243), and output OrtValues overwritten by the next replay.

This module only re-exports: the implementation is :mod:`ortcapture._core.graph` (with
:mod:`ortcapture._core.outputs`, :mod:`ortcapture._core.specs` and :mod:`ortcapture._core.many`).
"""
from __future__ import annotations

from ortcapture._core.graph import CapturedGraph
from ortcapture._core.outputs import ReplayOutput, output_names
from ortcapture._core.specs import example_specs

__all__ = ["CapturedGraph", "ReplayOutput", "example_specs", "output_names"]
