"""``ortcapture bench --stream 1-8``: a seeded stream of requests with varying batch sizes (issue 16).

Arms, alternated within one process (their order rotates every pass), after one untimed warm pass:

* ``single``: one plain ``onnxruntime.InferenceSession`` with ORT's defaults (on CUDA ``cudnn_conv_algo_search``
  EXHAUSTIVE: every batch-size change pays an algorithm search) — only the first ``--single-requests`` requests;
* ``single-algo-default`` (CUDA): the same with ``cudnn_conv_algo_search=DEFAULT``, same request limit;
* ``per-size``: one plain session per batch size (the careful user's workaround);
* ``buckets``: ``ortcapture.InferenceSession(buckets={batch: [1, 2, 4, 8]})`` through plain ``sess.run()``.

Each request: host feeds in, host outputs out (``run()``'s contract). Reported per arm: mean time per request
(ms), p50/p90, requests/s; for buckets the padding waste, captures and the largest relative difference from the
per-size sessions' outputs. JSON + PNG.
"""
from __future__ import annotations

import json
import time

import numpy as np


def parse_range(text: str) -> tuple[int, int]:
    """``"1-8"`` (or ``"4"``: 4-4) -> (1, 8); raises ValueError naming the form: integers ``1 <= LO <= HI < 2**31``
    (a batch dim; numpy's seeded draw takes int64, and a larger batch cannot be allocated anyway)."""
    lo, sep, hi = str(text).strip().partition("-")
    try:
        lo, hi = int(lo), int(hi if sep else lo)
    except ValueError:
        lo = hi = None
    if lo is None or not 1 <= lo <= hi < 2 ** 31:
        raise ValueError(f"wants LO-HI, two integers with 1 <= LO <= HI < 2**31 (e.g. 1-8), got {text!r}")
    return lo, hi


def stream_sizes(lo: int, hi: int, n: int, seed: int) -> list[int]:
    """The seeded stream: ``n`` batch sizes uniform in [lo, hi]."""
    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi, size=n, endpoint=True)]


def run_stream(model: str, provider: str, input_name: str, item_shape: tuple[int, ...], lo: int, hi: int, *,
               buckets: list[int], requests: int = 200, single_requests: int = 24, passes: int = 5, seed: int = 0,
               ep_options: dict | None = None, progress=None) -> dict:
    """Run the stream benchmark in this process; returns the result dict (see the module docstring)."""
    import onnxruntime as ort  # noqa: F401 - initialised before sessions

    import ortcapture
    from ortcapture._ort.compat import OrtInferenceSession
    from ortcapture.cli.bench_common import session_args

    sizes = stream_sizes(lo, hi, requests, seed)
    rng = np.random.default_rng(seed + 1)
    feeds = [rng.random((n, *item_shape), dtype=np.float32) for n in sizes]
    opts = dict(ep_options or {})

    def plain(extra=None):
        return OrtInferenceSession(model, **session_args(provider, False, {**opts, **(extra or {})}))

    arms: dict[str, dict] = {}
    arms["single"] = {"sess": plain(), "limit": single_requests}
    if provider == "cuda":
        arms["single-algo-default"] = {"sess": plain({"cudnn_conv_algo_search": "DEFAULT"}),
                                       "limit": single_requests}
    per_size = {n: plain() for n in sorted(set(sizes))}
    arms["per-size"] = {"sess": per_size, "limit": requests}
    t0 = time.perf_counter()
    bucketed = ortcapture.InferenceSession(model, **session_args(provider, True, opts),
                                           buckets={("%s" % input_name, 0): buckets})
    arms["buckets"] = {"sess": bucketed, "limit": requests}
    setup = {"buckets_session_s": time.perf_counter() - t0}

    def call(arm, i):
        s = arms[arm]["sess"]
        x = feeds[i]
        if isinstance(s, dict):
            s = s[x.shape[0]]
        return s.run(None, {input_name: x})

    worst, setup["warm_pass_s"] = warm_pass(arms, call, requests, "per-size", requests, progress)

    samples = time_arms(arms, call, passes, progress)
    result = {"model": model, "provider": provider, "stream": [lo, hi], "requests": requests, "seed": seed,
              "passes": passes, "buckets": buckets, "single_requests": single_requests, "setup": setup,
              "arms": {}, "max_rel_diff_buckets_vs_per_size": worst, "bucket_stats": bucketed.bucket_stats()}
    return with_arm_stats(result, samples)


def warm_pass(arms: dict, call, requests: int, ref_arm: str, checked: int, progress=None) -> tuple[float, float]:
    """The untimed warm pass: every arm sees its requests once (captures, algorithm searches, arenas), and the
    ``"buckets"`` arm's outputs of the first ``checked`` requests are compared with ``ref_arm``'s (:func:`rel_diff`).
    Returns (the largest relative difference, seconds)."""
    t0 = time.perf_counter()
    worst = 0.0
    for i in range(requests):
        got = call("buckets", i)
        if i < checked:
            worst = max(worst, rel_diff(got, call(ref_arm, i)))
        if progress:
            progress(i + 1, requests, "warm pass")
    for arm in arms:
        if arm not in (ref_arm, "buckets"):
            for i in range(arms[arm]["limit"]):
                call(arm, i)
    return worst, time.perf_counter() - t0


def rel_diff(got, want) -> float:
    """Largest difference between two output lists, relative to each reference output's largest magnitude."""
    worst = 0.0
    for g, w in zip(got, want):
        scale = max(float(np.abs(w).max(initial=0.0)), 1e-6)
        worst = max(worst, float(np.abs(g.astype(np.float64) - w).max(initial=0.0)) / scale)
    return worst


def with_arm_stats(result: dict, samples: dict[str, list[float]]) -> dict:
    """``result`` with ``arms`` (per arm: requests timed, mean/p50/p90 ms, requests/s) and ``speedup_buckets_vs``
    filled from ``samples`` (seconds per request)."""
    result["arms"] = {}
    for arm, xs in samples.items():
        a = np.asarray(xs) * 1e3
        result["arms"][arm] = {"requests_timed": len(xs), "mean_ms": float(a.mean()),
                               "p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
                               "requests_per_s": float(1e3 / a.mean())}
    b = result["arms"]["buckets"]["mean_ms"]
    result["speedup_buckets_vs"] = {arm: r["mean_ms"] / b for arm, r in result["arms"].items() if arm != "buckets"}
    return result


def time_arms(arms: dict, call, passes: int, progress=None) -> dict[str, list[float]]:
    """``passes`` timed passes over every arm's first ``limit`` requests (arm order rotating every pass); seconds
    per ``call(arm, i)``."""
    samples: dict[str, list[float]] = {a: [] for a in arms}
    order = list(arms)
    for p in range(passes):
        rot = order[p % len(order):] + order[:p % len(order)]
        for arm in rot:
            for i in range(arms[arm]["limit"]):
                t = time.perf_counter()
                call(arm, i)
                samples[arm].append(time.perf_counter() - t)
        if progress:
            progress(p + 1, passes, "timed passes")
    return samples


def write_outputs(result: dict, json_path: str | None, png_path: str | None) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if png_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        arms = list(result["arms"])
        means = [result["arms"][a]["mean_ms"] for a in arms]
        p50 = [result["arms"][a]["p50_ms"] for a in arms]
        p90 = [result["arms"][a]["p90_ms"] for a in arms]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        xs = np.arange(len(arms))
        ax.bar(xs - 0.25, means, 0.25, label="mean")
        ax.bar(xs, p50, 0.25, label="p50")
        ax.bar(xs + 0.25, p90, 0.25, label="p90")
        ax.set_xticks(xs, arms)
        ax.set_yscale("log")
        ax.set_ylabel("ms per request (log)")
        lo, hi = result["stream"]
        what = f"{result['axis'][0]}:{result['axis'][1]}" if "axis" in result else "batch"
        ax.set_title(f"{what} stream {lo}-{hi}, {result['provider']}, buckets {result['buckets']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png_path, dpi=110)
        plt.close(fig)


def summary(result: dict) -> str:
    lines = [f"{'arm':22s} {'mean ms':>9s} {'p50':>8s} {'p90':>8s} {'req/s':>8s} {'buckets faster':>15s}"]
    for arm, r in result["arms"].items():
        sp = result["speedup_buckets_vs"].get(arm)
        lines.append(f"{arm:22s} {r['mean_ms']:9.2f} {r['p50_ms']:8.2f} {r['p90_ms']:8.2f} "
                     f"{r['requests_per_s']:8.1f} {'' if sp is None else f'{sp:.2f}x':>15s}")
    st = result["bucket_stats"]
    ref, diff = next((k.rsplit("_vs_", 1)[1].replace("_", "-"), v) for k, v in result.items() if k.startswith("max_rel_diff_buckets"))
    lines.append(f"buckets: captured {st['captured']}, replayed {st['replayed']}, uncaptured {st['uncaptured']}, "
                 f"padding waste {st['padding_waste']:.1%}; max relative difference from the {ref} arm "
                 f"{diff:.2e}")
    return "\n".join(lines)


def check_stream_args(args) -> tuple[int, int, list[int]]:
    """The one check of the arguments every ``--stream`` mode shares: ``--stream LO-HI``, ascending positive
    ``--buckets``, ``--requests``/``--single-requests``/``--passes`` >= 1 (``--single-requests`` is clamped to
    ``--requests``). Returns (lo, hi, buckets); raises :class:`~ortcapture.cli.bench.BenchError`."""
    from ortcapture.cli.bench_common import BenchError
    from ortcapture.cli.options import int_list

    try:
        lo, hi = parse_range(args.stream)
    except ValueError as exc:
        raise BenchError(f"--stream: {exc}") from None
    try:
        buckets = int_list(args.buckets, "--buckets")
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    if buckets != sorted(set(buckets)) or buckets[0] < 1:
        raise BenchError(f"--buckets must be ascending positive sizes, got {args.buckets!r}")
    for flag in ("requests", "single_requests", "passes"):
        if getattr(args, flag) < 1:
            raise BenchError(f"--{flag.replace('_', '-')} must be >= 1")
    args.single_requests = min(args.single_requests, args.requests)
    return lo, hi, buckets


def run_command(args) -> int:
    """``ortcapture bench --stream LO-HI`` (``--axis``/``--pad-value`` go to
    :func:`ortcapture.cli.bench_seq.run_command`, chosen by ``bench``): its argument checks
    (:class:`~ortcapture.cli.bench.BenchError`),
    the run, the outputs. Moved from ``cli/bench.py``."""
    from ortcapture.cli import pick_provider
    from ortcapture.cli.bench_common import BenchError
    from ortcapture.cli.demo import example_shapes
    from ortcapture.errors import CaptureError, CaptureUnsupportedError

    lo, hi, buckets = check_stream_args(args)
    from ortcapture.cli import models

    try:
        args.model = models.model_or_reference(args.model)
    except models.ModelUnavailable as exc:
        raise BenchError(str(exc)) from None
    try:
        shp = example_shapes(args.model, 1, args.shape)
        provider = pick_provider(args.provider, cuda_must_load=True)
    except (CaptureError, CaptureUnsupportedError) as exc:
        raise BenchError(str(exc)) from None
    if len(shp) != 1:
        raise BenchError(f"--stream feeds models with one input; this one has {list(shp)}")
    (name, shape), = shp.items()
    print(f"ortcapture bench --stream {lo}-{hi}: {args.model} on {provider}, input {name} [batch, "
          f"{', '.join(map(str, shape[1:]))}], {args.requests} requests, buckets {buckets}, {args.passes} pass(es)",
          flush=True)
    from ortcapture.cli.options import parse_provider_options

    result = run_stream(
        args.model, provider, name, tuple(shape[1:]), lo, hi, buckets=buckets, requests=args.requests,
        single_requests=args.single_requests, passes=args.passes, seed=args.seed,
        ep_options=parse_provider_options(args.provider_option) if args.provider_option else None,
        progress=lambda d, t, what: print(f"  {what}: {d}/{t}", flush=True) if d == t else None)
    write_outputs(result, args.json, args.plot)
    print(summary(result))
    return 0
