"""One model replica's work, without Ray: its session, batch runner, warm-up, health check and counters.

:class:`ReplicaCore` is what the Ray Serve deployment (:mod:`ortcapture.serving.deployment`) wraps; it is plain
Python so it can be tested and benchmarked in one process. It builds one :class:`ortcapture.InferenceSession` with
``buckets=`` on the batch dim and ``replay_thread=True`` (one session-owned thread captures and replays every graph:
CUDA graphs are per thread), warms every bucket up in the constructor, and asserts one captured graph per bucket.
Requests go through :class:`ortcapture.serving.BatchRunner`: :meth:`ReplicaCore.run_joined` runs the batches a
batching tier checked and joined already (one run each, no check again); :meth:`ReplicaCore.run` checks, groups,
joins, runs and splits a list of requests itself (tests, one-process use).

The ``cpu`` provider serves an uncaptured session with the same runner (``BatchRunner(dim=...)``): ORT's plain run
of each batch at its own size.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from ortcapture.errors import CaptureError, TransferError
from ortcapture.session import InferenceSession
from ortcapture.serving.batch import RequestError
from ortcapture.serving.config import ModelLayout, ServeOptions, model_layout
from ortcapture.serving.shm import ShmError

_log = logging.getLogger("ortcapture.serving")

#: relative tolerance of the health check's replay against the replay of the same input at start-up (identical
#: replays of one graph: any difference means the graph or its buffers are broken)
HEALTH_RTOL = 1e-6


def _session_options(options: ServeOptions, layout: ModelLayout):
    import onnxruntime as ort

    so = ort.SessionOptions()
    for name, size in options.dims.items():  # the other dynamic dims: fixed, so one graph per bucket
        so.add_free_dimension_override_by_name(name, size)
    return so


def build_session(options: ServeOptions, layout: ModelLayout, provider: str):
    """The replica's session for ``provider`` (``cuda``, ``webgpu`` or ``cpu``).

    ``cuda``/``webgpu``: ``ortcapture.InferenceSession(..., buckets={batch: buckets}, replay_thread=True)`` with
    capture switched on the ORT way (CUDA ``enable_cuda_graph=1`` on the device Ray gave the replica, device 0 of its
    ``CUDA_VISIBLE_DEVICES``; WebGPU through :func:`ortcapture.webgpu.session_options`). ``cpu``: the same session
    without capture (it behaves exactly like ORT's).

    Raises:
        CaptureUnsupportedError / CaptureError: what ``ortcapture.InferenceSession`` raises (the model does not
            capture, a bad bucket); onnxruntime's errors for a model it cannot load.
    """
    from ortcapture import webgpu

    so = _session_options(options, layout)
    if provider == "cuda":
        kwargs = {"providers": [("CUDAExecutionProvider", {"device_id": "0", "enable_cuda_graph": "1"}),
                                "CPUExecutionProvider"]}
    elif provider == "webgpu":
        kwargs = {}
        so = webgpu.session_options(True, so)
    elif provider == "cpu":
        return InferenceSession(options.model, so, providers=["CPUExecutionProvider"])
    else:
        raise CaptureError(f"provider {provider!r}: resolve 'auto' first (ortcapture.pick_provider)")
    return InferenceSession(options.model, so, buckets={layout.bucket_key: list(options.buckets)},
                            replay_thread=True, **kwargs)


def _client_fault(exc: Exception) -> bool:
    """An input check refused the request: :class:`~ortcapture.serving.RequestError`, the session's feed checks
    (``TransferError``), or a shared memory region the request names that cannot be read
    (:class:`~ortcapture.serving.shm.ShmError`: e.g. a CUDA region whose handle no longer opens). Not every
    ``CaptureError``: a bucket whose capture or verification failed is the server's, and goes through
    :meth:`ReplicaCore.answers`' health rule like ORT's own errors."""
    return isinstance(exc, (RequestError, TransferError, ShmError))


class ReplicaCore:
    """A replica's session, runner and counters (see the module docstring).

    Args:
        options: checked :class:`~ortcapture.serving.config.ServeOptions`.
        provider: the resolved provider (``cuda``, ``webgpu``, ``cpu``).

    Raises:
        CaptureError: a bucket was captured more than once or not at all after the warm-up (more graphs than
            buckets: captures happened on several threads, or the other dynamic dims are not fixed), or the model
            does not serve (what :class:`~ortcapture.serving.BatchRunner` refuses); what :func:`build_session`
            raises.
    """

    def __init__(self, options: ServeOptions, provider: str):
        from ortcapture.serving import BatchRunner

        t0 = time.perf_counter()
        self.options = options
        self.provider = provider
        self.layout = model_layout(options)
        self.session = build_session(options, self.layout, provider)
        self.example = {n: np.zeros(s, t.dtype) for (n, s), t in zip(self.layout.example.items(),
                                                                       self.layout.spec.inputs)}
        self.captures = provider != "cpu"
        dim = None if self.captures else self.layout.bucket_key
        self.runner = BatchRunner(self.session, max_rows=options.max_batch_size, example_feeds=self.example, dim=dim)
        if self.captures:
            self.session.warmup(self.example)
            self.check_graphs()
        # the health check's input and its answer, replayed once now
        self._health_feeds = self.example
        before = self._replays()
        self._health_answer = self.session.run(None, self._health_feeds)
        after = self._replays()
        # the bucket the health check replays (counted apart from traffic in report())
        self._health_bucket = next((k for k, n in after.items() if n > before.get(k, 0)), None)
        self.health_replays = 1
        self.warmup_s = time.perf_counter() - t0
        self._lock = threading.Lock()
        self._t = Counter()  # Triton-style totals: counts and nanoseconds
        self._batch_ns: dict[int, list[int]] = {}
        self.last_inference_ms = 0

    # -- checks ------------------------------------------------------------------------------------------------
    def check_graphs(self) -> None:
        """Raise :class:`CaptureError` unless every bucket holds exactly one captured graph (none refused)."""
        stats = self.session.bucket_stats()
        per = stats["buckets"]
        wrong = {label: len(b["gpu_graph_ids"]) for label, b in per.items() if len(b["gpu_graph_ids"]) != 1}
        if wrong or len(per) != len(self.options.buckets) or stats["refused"]:
            raise CaptureError(f"after the warm-up the buckets hold {({k: len(b['gpu_graph_ids']) for k, b in per.items()})}"
                               f" graphs ({stats['refused']} refused); serving needs exactly one graph per bucket "
                               f"{list(self.options.buckets)}")

    def check_health(self) -> None:
        """Replay the smallest bucket on the start-up input and compare with the start-up answer; raise
        :class:`CaptureError` when it differs or the graphs per bucket changed."""
        got = self.session.run(None, self._health_feeds)
        self.health_replays += 1
        for i, (a, b) in enumerate(zip(got, self._health_answer)):
            a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
            scale = max(float(np.max(np.abs(b64))) if b64.size else 0.0, 1e-30)
            if a.shape != b.shape or not np.allclose(a64, b64, rtol=0, atol=HEALTH_RTOL * scale, equal_nan=True):
                raise CaptureError(f"health check: output {i} of the smallest bucket's replay differs from its answer "
                                   "at start-up")
        if self.captures:
            self.check_graphs()

    # -- requests ----------------------------------------------------------------------------------------------
    def rows(self, feeds: Mapping[str, np.ndarray]) -> int:
        """:meth:`BatchRunner.rows` (raises :class:`~ortcapture.serving.RequestError`)."""
        return self.runner.rows(feeds)

    def run(self, requests: Sequence[Mapping[str, np.ndarray]], queued_ns: Sequence[int] = ()) -> list:
        """:meth:`BatchRunner.run` of ``requests`` plus counters; one result dict or exception per request."""
        t0 = time.perf_counter_ns()
        results = self.runner.run(requests)
        self._count(results, sum(self._rows_of(r) for r in requests), time.perf_counter_ns() - t0, queued_ns)
        return results

    def run_joined(self, feeds: Mapping[str, Any], rows: Sequence[int],
                   queued_ns: Sequence[int] = (), isolate: bool = True, prepare=None) -> dict:
        """One batch a batching tier checked and joined (:meth:`BatchRunner.run_joined`: one run, no check again)
        plus counters. Returns ``{"outputs": {name: array}, "axes": {name: axis}}`` (every row of the batch; the
        caller slices each request's rows back along ``axes``), or, when the run failed, ``{"answers": [...]}``:
        each request's own answer (:meth:`answers`, run alone: outputs, a 400 or a 500). ``isolate=False``: a run
        that raises raises here; ``prepare``: the feeds of each run turned into what the session takes (both
        :meth:`BatchRunner.run_joined`)."""
        t0 = time.perf_counter_ns()
        got = self.runner.run_joined(feeds, rows, isolate, prepare)
        results = got if isinstance(got, list) else [None] * len(rows)
        self._count(results, sum(int(r) for r in rows), time.perf_counter_ns() - t0, queued_ns)
        if isinstance(got, list):
            return {"answers": self.answers(got)}
        return {"outputs": got, "axes": self.runner.output_axes}

    def _count(self, results: Sequence, rows: int, dt: int, queued_ns: Sequence[int]) -> None:
        ok = sum(not isinstance(r, Exception) for r in results)
        with self._lock:
            t = self._t
            t["success_count"] += ok
            t["fail_count"] += len(results) - ok
            t["compute_infer_count"] += 1
            t["compute_infer_ns"] += dt
            t["success_ns"] += dt * ok
            t["queue_count"] += len(queued_ns)
            t["queue_ns"] += sum(queued_ns)
            t["inference_count"] += rows
            t["execution_count"] += 1
            b = self._batch_ns.setdefault(rows, [0, 0])
            b[0] += 1
            b[1] += dt
            self.last_inference_ms = int(time.time() * 1000)

    def answers(self, results: Sequence) -> list[dict]:
        """What each request of a batch gets, from :meth:`run`'s ``results``: ``{"outputs": {name: array}}``, or
        ``{"error": message, "status": 400}`` for the request's own fault, or ``{"error": message, "status": 500}``.

        Who is at fault, decided by behaviour, not by message text (the runner has already run every request of a
        failed chunk alone, so an exception here is the request's *own* run's):

        * a :class:`~ortcapture.serving.RequestError` or an ortcapture input check (``TransferError``): 400 with
          its text (it names only this request's inputs);
        * any other exception (ORT's own, e.g. a Gather index out of range on the CPU EP): the request's own fault
          — 400 with its text — when another request of the batch ran, or when the health check
          (:meth:`check_health`, at most once per batch) passes right after; otherwise the device or session is
          broken: 500 that names no values (``the model failed ...: <exception type>``), the full text only in
          the replica's log. A client's value never gets a 5xx while the replica is healthy.
        """
        failed = [i for i, r in enumerate(results) if isinstance(r, Exception) and not _client_fault(r)]
        healthy = len(failed) < len(results) or not failed
        if failed and not healthy:
            try:
                self.check_health()
                healthy = True
            except Exception as exc:  # noqa: BLE001 - unhealthy: the failures are the server's
                _log.error("ortcapture serve: health check after a failed batch failed: %s: %s",
                           type(exc).__name__, exc)
        out = []
        for r in results:
            if not isinstance(r, Exception):
                out.append({"outputs": r})
            elif _client_fault(r) or healthy:
                text = str(r) if _client_fault(r) else f"the model could not run this request: {type(r).__name__}: {r}"
                out.append({"error": text, "status": 400})
            else:
                _log.error("ortcapture serve: a batch failed: %s: %s", type(r).__name__, r)
                out.append({"error": f"the model failed on this batch ({type(r).__name__}; the server's log has "
                                     "the details)", "status": 500})
        with self._lock:
            self._t["client_faults_after_run"] += sum(1 for r in results if isinstance(r, Exception)
                                                      and not isinstance(r, RequestError) and healthy)
        return out

    def _replays(self) -> dict:
        """Replays per bucket so far (``{}`` without buckets)."""
        if not self.captures:
            return {}
        return {k: b["replayed"] for k, b in self.session.bucket_stats()["buckets"].items()}

    def _rows_per_bucket(self, histogram: Mapping[int, int]) -> dict:
        """Request rows run per bucket (``{"batch=4": rows}``, the bucket a run of r rows pads to; runs past the
        largest bucket under ``"uncaptured"``), from the runner's histogram of rows per run."""
        label = next(iter(self.session.bucket_dims())) if self.captures else "batch"
        out: dict[str, int] = {}
        for rows, runs in histogram.items():
            size = next((b for b in self.options.buckets if b >= int(rows)), None)
            key = f"{label}={size}" if size is not None else "uncaptured"
            out[key] = out.get(key, 0) + int(rows) * int(runs)
        return out

    def _rows_of(self, feeds) -> int:
        try:
            return self.rows(feeds)
        except Exception:  # noqa: BLE001 - a bad request counts no rows
            return 0

    # -- reports -----------------------------------------------------------------------------------------------
    def report(self) -> dict:
        """This replica's counters: Triton-style totals (``success``, ``fail``, ``queue``, ``compute_infer``,
        ``inference_count`` rows, ``execution_count`` batches, ``batch_stats`` by rows) and an ``ortcapture``
        part: graphs captured per bucket, rows replayed per bucket, uncaptured fallbacks, padding waste, the
        runner's batch-size histogram, the provider, device and warm-up time."""
        with self._lock:
            t = dict(self._t)
            batch = {str(k): {"count": v[0], "ns": v[1]} for k, v in sorted(self._batch_ns.items())}
            last = self.last_inference_ms
        rep: dict[str, Any] = {
            "success": {"count": t.get("success_count", 0), "ns": t.get("success_ns", 0)},
            "fail": {"count": t.get("fail_count", 0), "ns": 0},
            "queue": {"count": t.get("queue_count", 0), "ns": t.get("queue_ns", 0)},
            "compute_infer": {"count": t.get("compute_infer_count", 0), "ns": t.get("compute_infer_ns", 0)},
            "inference_count": t.get("inference_count", 0), "execution_count": t.get("execution_count", 0),
            "last_inference": last, "batch_stats": batch,
            "provider": self.provider, "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "warmup_s": round(self.warmup_s, 3),
        }
        if self.session is not None:  # None once closed
            info = getattr(self.session, "capture_info", None) or getattr(self.session, "requested_capture", None)
            rep["device"] = (f"{info.device_type}:{info.device_id}" if info is not None
                             else "cuda:0" if self.provider == "cuda" else self.provider)
            bs = self.bucket_stats()
            rep["graphs_per_bucket"] = {k: len(b["gpu_graph_ids"]) for k, b in bs["buckets"].items()}
            # traffic only: the health checks' replays are counted apart (health_replays)
            rep["replayed_per_bucket"] = {k: b["replayed"] - (self.health_replays if k == self._health_bucket else 0)
                                          for k, b in bs["buckets"].items()}
            rep["health_replays"] = self.health_replays
            rep["padding_waste_per_bucket"] = {k: b["padding_waste"] for k, b in bs["buckets"].items()}
            rep["graphs_captured"] = bs["captured"]
            rep["uncaptured"] = bs["uncaptured"]
            rep["oversize"] = bs.get("oversize", 0)
            rep["padding_waste"] = bs["padding_waste"]
            runner = self.runner.stats()
            rep["batch_size_histogram"] = {str(k): v for k, v in runner["batch_rows"].items()}
            rep["rows_per_bucket"] = self._rows_per_bucket(runner["batch_rows"])
            rep["requests"] = runner["requests"]
            rep["failed_requests"] = runner["failed_requests"]
            rep["bad_requests"] = runner["bad_requests"]
            rep["batches"] = runner["batches"]
            rep["failed_batches"] = runner["failed_batches"]
            rep["isolation_runs"] = runner["isolation_runs"]
            rep["client_faults_after_run"] = t.get("client_faults_after_run", 0)
        return rep

    def bucket_stats(self) -> dict:
        """The session's ``bucket_stats()`` (buckets); an uncaptured session: its runs, counted uncaptured."""
        if self.captures:
            return self.session.bucket_stats()
        runner = self.runner.stats()
        return {"replayed": 0, "uncaptured": runner["batches"], "captured": 0, "oversize": 0, "buckets": {},
                "refused": 0, "padding_waste": 0.0}

    def close(self) -> None:
        """Release every captured graph (graceful shutdown); the session is unusable afterwards."""
        sess, self.session = self.session, None
        if sess is None:
            return
        for gid in list(getattr(sess, "captured_graphs", {}) or {}):
            try:
                sess.release_captured_graph(gid)
            except Exception:  # noqa: BLE001 - shutting down: release what can be released
                pass
