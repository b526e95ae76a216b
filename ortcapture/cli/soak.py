"""``ortcapture bench --soak SECONDS``: memory over time, for loops that must not grow.

Two modes (``--soak-mode``):

* ``replay`` (default): one graph captured on the model (``state=`` carried for the built-in small model), then
  ``CapturedGraph.run(copy_outputs=False)`` as fast as it goes for SECONDS.
* ``cycles``: capture -> run -> release as fast as it goes for SECONDS (or ``--soak-cycles N``), one session,
  automatic compaction only (``--compact-threshold BYTES`` sets the session's threshold).

Every ``--soak-sample`` seconds it records replays (or cycles) so far, replays/s since the last sample, host RSS
(``/proc/self/statm``) and device memory in use (CUDA: ``total - free`` from ``cudaMemGetInfo`` through
cuda-python; WebGPU: none: on the software adapter device memory is host memory, so RSS shows it), plus the
session's compactions. ``--json`` writes every sample and the summary (growth after warm-up, peak above start);
``--plot`` draws RSS and device memory against time (matplotlib).

MODEL: an ONNX file, ``reference`` (the cached YOLOv8n, batch 1 at 320x320) or ``small`` (default: a 64x64
recurrent ``state_out = state_in * 0.5 + x``, built with onnx.helper).
"""
from __future__ import annotations

import json
import os
import sys
import time

MiB = 1 << 20


def small_model(n: int = 64) -> bytes:
    """A recurrent step on [n, n] float32: ``state_out = state_in * 0.5 + x`` (inputs ``state``, ``x``)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Mul", ["state", "half"], ["m"]), helper.make_node("Add", ["m", "x"], ["state_out"])]
    graph = helper.make_graph(
        nodes, "soak_small",
        [helper.make_tensor_value_info("state", TensorProto.FLOAT, [n, n]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("state_out", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
