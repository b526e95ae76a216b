"""``ortcapture bench --stream 16-128 --axis ids:1``: a seeded stream of requests whose *sequence* dim varies (issue 23).

The streamed axis is ``--axis INPUT:AXIS``; every input axis that shares its dim_param (``ids`` and
``attention_mask`` both ``[batch, seq]``) varies with it, and the bucket key is that dim_param (else
``(INPUT, AXIS)``). Other dims come from ``--shape`` (as ``ortcapture demo``). Float inputs are random, integer
inputs ones (token ids 1, masks 1). ``--pad-value NAME=V`` sets ``pad_values=``. ``--model attention`` is a built-in
synthetic masked-attention encoder (:func:`ortcapture.cli.models.masked_attention_model`, padding-neutral).

Arms, alternated within one process (their order rotates every pass), after one untimed warm pass:

* ``single``: one plain ``onnxruntime.InferenceSession`` fed the unpadded requests (ORT's defaults) — only the first
  ``--single-requests`` requests; its outputs are the reference the buckets arm is compared with;
* ``single-algo-default`` (CUDA): the same with ``cudnn_conv_algo_search=DEFAULT``;
* ``per-bucket``: one plain session per bucket size fed the request padded by hand (numpy, with the pad values;
  outputs not sliced) — the careful user's workaround for a sequence dim with many sizes;
* ``buckets``: ``ortcapture.InferenceSession(buckets=..., pad_values=...)`` through plain ``sess.run()``.
"""
from __future__ import annotations

import time

import numpy as np

from ortcapture.cli.bench_stream import stream_sizes, time_arms, warm_pass, with_arm_stats


def parse_axis(text: str) -> tuple[str, int]:
    """``"ids:1"`` -> ("ids", 1); raises ValueError."""
    name, sep, axis = str(text).rpartition(":")
    if not sep or not name:
        raise ValueError(f"--axis wants INPUT:AXIS, got {text!r}")
    return name, int(axis)


def parse_pad_values(items: list[str]) -> dict[str, float]:
    """``["ids=0", "attention_mask=0"]`` -> {name: number}; raises ValueError."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--pad-value wants NAME=VALUE, got {item!r}")
        out[name] = float(value) if any(c in value for c in ".eEn") else int(value)
    return out


def stream_sites(model: str, axis: tuple[str, int]) -> tuple[object, list[tuple[str, int]]]:
    """The bucket key for ``axis`` (its dim_param, else the (input, axis) pair) and every (input, axis) it pads.
    Raises ValueError for an unknown input, an axis out of range, or a fixed dim."""
    from ortcapture._ort import specialize as shapes

    dims = shapes.input_dims(shapes.load_model(model))
    name, ax = axis
    if name not in dims:
        raise ValueError(f"--axis: {name!r} is not an input of the model ({list(dims)})")
    if not -len(dims[name]) <= ax < len(dims[name]):
        raise ValueError(f"--axis: input {name!r} has rank {len(dims[name])}, no axis {ax}")
    ax %= len(dims[name])
    d = dims[name][ax]
    if isinstance(d, int):
        raise ValueError(f"--axis: axis {ax} of {name!r} is fixed at {d} in the model")
    if isinstance(d, str):
        return d, [(n, a) for n, ds in dims.items() for a, x in enumerate(ds) if x == d]
    return (name, ax), [(name, ax)]


def run_sequence_stream(model: str, provider: str, shapes: dict[str, tuple[int, ...]], axis: tuple[str, int],
                        lo: int, hi: int, *, buckets: list[int], pad_values: dict | None = None,
                        requests: int = 200, single_requests: int = 24, passes: int = 5, seed: int = 0,
                        ep_options: dict | None = None, progress=None) -> dict:
    """Run the sequence stream benchmark in this process; returns the result dict (see the module docstring).
    ``shapes``: every input's base shape (the streamed axes are replaced per request)."""
    import onnxruntime as ort  # noqa: F401 - initialised before sessions

    import ortcapture
    from ortcapture._buckets.values import input_dtype
    from ortcapture._ort.compat import OrtInferenceSession
    from ortcapture.cli.bench_common import session_args

    key, sites = stream_sites(model, axis)
    pads = dict(pad_values or {})
    opts = dict(ep_options or {})

    def plain(extra=None):
        return OrtInferenceSession(model, **session_args(provider, False, {**opts, **(extra or {})}))

    arms: dict[str, dict] = {"single": {"sess": plain(), "limit": single_requests}}
    types = {m.name: input_dtype(m.type) or np.float32 for m in arms["single"]["sess"].get_inputs()}
    sizes = stream_sizes(lo, hi, requests, seed)
    rng = np.random.default_rng(seed + 1)

    def feeds_at(n: int) -> dict:
        out = {}
        for name, shape in shapes.items():
            shp = list(shape)
            for site, ax in sites:
                if site == name:
                    shp[ax] = n
            dt = np.dtype(types[name])
            out[name] = rng.random(shp, dtype=np.float32).astype(dt) if dt.kind == "f" else np.ones(shp, dt)
        return out

    feeds = [feeds_at(n) for n in sizes]

    def padded(f: dict, to: int) -> dict:
        out = {}
        for name, x in f.items():
            for site, ax in sites:
                if site == name and x.shape[ax] < to:
                    width = [(0, 0)] * x.ndim
                    width[ax] = (0, to - x.shape[ax])
                    x = np.pad(x, width, constant_values=pads.get(name, 0))
            out[name] = x
        return out

    if provider == "cuda":
        arms["single-algo-default"] = {"sess": plain({"cudnn_conv_algo_search": "DEFAULT"}), "limit": single_requests}
    arms["per-bucket"] = {"sess": {b: plain() for b in buckets}, "limit": requests}
    t0 = time.perf_counter()
    bucketed = ortcapture.InferenceSession(model, **session_args(provider, True, opts), buckets={key: buckets},
                                           pad_values=pads or None)
    arms["buckets"] = {"sess": bucketed, "limit": requests}
    setup = {"buckets_session_s": time.perf_counter() - t0}
    bucket_of = {n: next((b for b in buckets if b >= n), None) for n in set(sizes)}
    hand_padded = [padded(f, bucket_of[n] or n) for f, n in zip(feeds, sizes)]

    def call(arm, i):
        s = arms[arm]["sess"]
        if isinstance(s, dict):
            b = bucket_of[sizes[i]]
            return (s[b] if b is not None else arms["single"]["sess"]).run(None, hand_padded[i])
        return s.run(None, feeds[i])

    worst, setup["warm_pass_s"] = warm_pass(arms, call, requests, "single", single_requests, progress)

    samples = time_arms(arms, call, passes, progress)
    result = {"model": model, "provider": provider, "stream": [lo, hi], "axis": list(axis), "bucket_key": str(key),
              "pad_values": {k: float(v) for k, v in pads.items()}, "requests": requests, "seed": seed,
              "passes": passes, "buckets": buckets, "single_requests": single_requests, "setup": setup, "arms": {},
              "max_rel_diff_buckets_vs_single": worst, "bucket_stats": bucketed.bucket_stats()}
    return with_arm_stats(result, samples)


def run_command(args) -> int:
    """``ortcapture bench --stream LO-HI --axis INPUT:AXIS``: its argument checks
    (:class:`~ortcapture.cli.bench.BenchError`), the run, the outputs. Moved from ``cli/bench.py``."""
    from ortcapture.cli import bench_stream, models, pick_provider
    from ortcapture.cli.bench_common import BenchError
    from ortcapture.cli.demo import example_shapes
    from ortcapture.cli.options import parse_provider_options
    from ortcapture.errors import CaptureError, CaptureUnsupportedError

    if not args.axis:
        raise BenchError("--pad-value goes with --stream and --axis")
    if args.model in (None, "attention"):
        path = models.cache_dir() / "models" / "masked_attention.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = models.masked_attention_model()
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
        args.model = str(path)
        if not args.shape:
            args.shape = ["ids=4x16", "attention_mask=4x16"]
    lo, hi, buckets = bench_stream.check_stream_args(args)
    try:
        axis = parse_axis(args.axis)
        pads = parse_pad_values(args.pad_value)
        stream_sites(args.model, axis)
    except ValueError as exc:
        raise BenchError(f"--axis/--pad-value: {exc}") from None
    try:
        shp = example_shapes(args.model, 1, args.shape)
        provider = pick_provider(args.provider, cuda_must_load=True)
    except (CaptureError, CaptureUnsupportedError) as exc:
        raise BenchError(str(exc)) from None
    print(f"ortcapture bench --stream {lo}-{hi} --axis {args.axis}: {args.model} on {provider}, inputs "
          f"{ {n: list(s) for n, s in shp.items()} }, {args.requests} requests, buckets {buckets}, {args.passes} "
          "pass(es)", flush=True)
    try:
        result = run_sequence_stream(
            args.model, provider, shp, axis, lo, hi, buckets=buckets, pad_values=pads, requests=args.requests,
            single_requests=args.single_requests, passes=args.passes, seed=args.seed,
            ep_options=parse_provider_options(args.provider_option) if args.provider_option else None,
            progress=lambda d, t, what: print(f"  {what}: {d}/{t}", flush=True) if d == t else None)
    except CaptureError as exc:  # bad pad values, a bucket refused (padding not neutral)
        raise BenchError(str(exc)) from None
    bench_stream.write_outputs(result, args.json, args.plot)
    print(bench_stream.summary(result))
    return 0
