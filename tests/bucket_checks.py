"""What the bucket tests share: the CPU EP reference, the TF32-aware comparison, and running work in threads."""
from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort

#: against the CPU EP: CUDA's MatMul runs in TF32 by default (~1e-3 relative), WebGPU in float32
TOL = {"cuda": 1e-2, "webgpu": 1e-4}


def cpu(model):
    """A plain CPU EP session of ``model`` (the reference)."""
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def close(got, want, rtol=1e-4):
    """``got`` equals ``want`` in shape and within ``rtol`` of ``want``'s largest magnitude."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-6)
    assert float(np.abs(got - want).max(initial=0.0)) <= rtol * scale


def run_threads(work, n: int = 4) -> None:
    """``work(i)`` for i in range(n), each in its own thread; returns when all are done."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
