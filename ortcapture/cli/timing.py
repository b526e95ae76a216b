"""Latency measurement shared by ``demo`` and ``bench``: host wall time per call, in microseconds.

Every timed call must end with the GPU done (output readback or explicit synchronization): WebGPU's
``run_with_iobinding`` returns before the GPU finishes.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np


def measure(fn: Callable[[int], object], iters: int, warmup: int = 5) -> np.ndarray:
    """Call ``fn(i)`` ``warmup`` times untimed, then ``iters`` times; return per-call times in microseconds."""
    for i in range(warmup):
        fn(i)
    out = np.empty(iters, dtype=np.float64)
    clock = time.perf_counter_ns
    for i in range(iters):
        t0 = clock()
        fn(i)
        out[i] = (clock() - t0) / 1e3
    return out


def summary(samples_us: np.ndarray) -> dict:
    """p50, p90, min and mean of ``samples_us`` (microseconds)."""
    return {
        "p50_us": float(np.percentile(samples_us, 50)), "p90_us": float(np.percentile(samples_us, 90)),
        "min_us": float(samples_us.min()), "mean_us": float(samples_us.mean()), "n": int(samples_us.size),
    }


def paired(fn_a: Callable[[int], object], fn_b: Callable[[int], object], iters: int,
           warmup: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Time ``fn_a(i)`` and ``fn_b(i)`` alternately, iteration by iteration (µs each), so drift and noise hit both
    alike; ``a`` goes first in even iterations, ``b`` in odd ones. :func:`paired_extra` turns the result into b's
    extra cost per call."""
    for i in range(warmup):
        fn_a(i)
        fn_b(i)
    a, b = np.empty(iters), np.empty(iters)
    clock = time.perf_counter_ns
    for i in range(iters):
        if i % 2:  # alternate which goes first, too
            t0 = clock(); fn_b(i); t1 = clock(); fn_a(i); t2 = clock()  # noqa: E702
            b[i], a[i] = (t1 - t0) / 1e3, (t2 - t1) / 1e3
        else:
            t0 = clock(); fn_a(i); t1 = clock(); fn_b(i); t2 = clock()  # noqa: E702
            a[i], b[i] = (t1 - t0) / 1e3, (t2 - t1) / 1e3
    return a, b


def paired_extra(a: np.ndarray, b: np.ndarray) -> float:
    """b's extra cost per call (µs) from :func:`paired` samples: the mean of the median ``b - a`` over the pairs
    where ``a`` went first and over those where ``b`` went first. Whichever call of a pair comes second can run
    faster or slower (measured on the H200 host: tens of µs either way, by process), which makes the plain median of
    ``b - a`` jump between the two orders' values; averaging the two orders cancels that effect."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    first_a, first_b = d[0::2], d[1::2]
    if not first_b.size:
        return float(np.median(first_a))
    return float((np.median(first_a) + np.median(first_b)) / 2)
