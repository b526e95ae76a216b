"""Timing for the per-request cost scripts (``ingress_costs.py``, ``client_costs.py``): two callables timed in
alternating blocks in one process, and the command line both scripts share (``--iters``, ``--out``).

Blocks, not call by call in turn: each side's cost depends on what ran just before it (the allocator's state after
the other side's megabyte buffers). Measured on this 2-core machine, 2026-12-08: building ``tritonclient.http``'s
request for a 1.2 MB image took 681 µs timed in turn with ``tritonclient.grpc``'s (a, b, a, b), 470 µs with the
order alternating per pair, and 139 µs in a block of its own calls — what a client that sends only that request pays
(``tritonclient.grpc``'s: 980, 1,300 and 1,590 µs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable


def time_blocks(a: Callable[[], object], b: Callable[[], object], iters: int,
                block: int = 50) -> tuple[list[float], list[float]]:
    """``iters`` calls of ``a`` and of ``b`` (rounded up to whole blocks), in blocks of ``block`` calls of one side,
    the sides alternating (a-block, b-block, then b-block, a-block, ...) so that drift falls on both; one untimed round
    first, and each block's first 5 calls untimed (the allocator settling to that side). Returns each call's wall time
    in µs, per callable."""
    t_a, t_b = [], []
    rounds = -(-iters // block)
    for r in range(rounds + 1):
        order = ((a, t_a), (b, t_b)) if r % 2 == 0 else ((b, t_b), (a, t_a))
        for f, out in order:
            for i in range(block + 5):
                t0 = time.perf_counter_ns()
                f()
                if r and i >= 5:
                    out.append((time.perf_counter_ns() - t0) / 1000)
    return t_a, t_b


def median_ratio(t_num: list[float], t_den: list[float]) -> float:
    """``median(t_num) / median(t_den)``."""
    return statistics.median(t_num) / statistics.median(t_den)


def main(doc: str, measure: Callable[[int], dict]) -> int:
    """The scripts' command line: ``--iters`` (default 300) calls per side, the result ``{"machine", "iters",
    **measure(iters)}`` printed as JSON and written to ``--out`` when given."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)  # calls per side
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"machine": f"{os.cpu_count()} CPUs", "iters": args.iters, **measure(args.iters)}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0
