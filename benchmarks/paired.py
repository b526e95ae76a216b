"""Paired timing for the per-request cost scripts (``ingress_costs.py``, ``client_costs.py``): two callables timed
call by call in turn in one process, and the command line both scripts share (``--iters``, ``--out``)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable


def time_pairs(a: Callable[[], object], b: Callable[[], object], iters: int) -> tuple[list[float], list[float]]:
    """``iters`` calls of ``a`` and of ``b`` in turn (a, b, a, b, ...): each call's wall time in µs, per callable."""
    t_a, t_b = [], []
    for _ in range(iters):
        for f, out in ((a, t_a), (b, t_b)):
            t0 = time.perf_counter_ns()
            f()
            out.append((time.perf_counter_ns() - t0) / 1000)
    return t_a, t_b


def median_ratio(t_num: list[float], t_den: list[float]) -> float:
    """The median of the per-pair ratios ``t_num[i] / t_den[i]``."""
    return statistics.median(n / d for n, d in zip(t_num, t_den))


def main(doc: str, measure: Callable[[int], dict]) -> int:
    """The scripts' command line: ``--iters`` (default 300) pairs, the result ``{"machine", "iters", **measure(iters)}``
    printed as JSON and written to ``--out`` when given."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"machine": f"{os.cpu_count()} CPUs", "iters": args.iters, **measure(args.iters)}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0
