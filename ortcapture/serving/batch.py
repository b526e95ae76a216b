"""The engine-neutral batch runner (issue 29): many requests, grouped, concatenated, run through buckets, split back.

A server receives requests one by one, each a feeds dict (``{input name: numpy array}``) of a few rows; a session
made with ``buckets=`` serves any batch size from a captured graph per bucket. :class:`BatchRunner` joins the two:

1. every request is checked on its own (:meth:`BatchRunner.rows`): a bad one fails alone with
   :class:`RequestError` (a client error: HTTP 400) and never reaches the session;
2. the valid ones are grouped: same non-bucketed dims (e.g. image height and width), and *equal values* for the
   inputs that do not carry the bucketed dim (a 0-d temperature, a threshold): such an input is one value for the
   whole batch, so requests that disagree on it cannot share a run;
3. each group is concatenated along the bucketed dim (``numpy.concatenate``), cut into chunks of at most
   :attr:`BatchRunner.max_rows` rows without splitting a request (first-fit decreasing; ``split=True`` cuts densely
   and may split one), and each chunk runs through the session's plain ``run()``, which pads it to the smallest
   bucket that holds it and replays that bucket's captured graph;
4. the outputs are split back per request along each output's axis that follows the bucketed dim
   (:meth:`ortcapture.InferenceSession.bucket_output_axes`).

Guarantees: one result or one exception per request, in request order; every check that can refuse one request —
its values too (:func:`ortcapture.transfer.value_rules`) — runs on it alone before it joins a run; a chunk whose run
still raises is run again one request at a time (at most one run per request, counted as ``isolation_runs``), so
only the request that fails alone gets an exception, the exception of its own run (whose text can name only its own
values), and its batchmates get their answers; each response is bit-for-bit the slice of ``sess.run`` of its chunk, and equals the request run alone
within the bucket verification's tolerance (:data:`ortcapture.DEFAULT_RTOL`) — exactly where the model treats rows
independently and the EP computes a row the same way whatever the batch size (CUDA with TF32 does not: measured
2.2e-3 on YOLOv8n, issue 16). An output that does not follow the bucketed dim (a reduction over the batch) mixes
requests and is refused when the runner is made.

A session without capture (the CPU EP baseline) is batched the same way with ``dim=`` naming the dim; each batch
then runs at its own size, and the output axes are measured by two probe runs.

Everything runs on the host side of the session: requests and results are numpy arrays in host memory; where the
session's graphs live (CUDA, WebGPU) is the session's business. Uses only ortcapture's public API.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ortcapture.errors import CaptureError
from ortcapture.serving.requests import RequestCheck, RequestError, group_key, join, pack, split_feeds, take
from ortcapture.session import InferenceSession
from ortcapture.transfer import ONNX_TO_NP, value_rules

__all__ = ["BatchRunner", "RequestError"]

#: one model tensor for protocol metadata: (name, numpy dtype, shape with -1 for dynamic dims)
TensorSpec = tuple[str, np.dtype, tuple[int, ...]]


class BatchRunner:
    """Runs a list of requests on one bucketed session as few batched runs (see the module docstring).

    Args:
        session: an :class:`ortcapture.InferenceSession` made with ``buckets=`` on exactly one dim (e.g.
            ``{"batch": [1, 2, 4, 8]}``); its EP (CUDA, TensorRT, WebGPU) and ``replay_thread=`` are its own. With
            ``dim=``: a session without capture instead (an ortcapture or onnxruntime ``InferenceSession``, e.g. on
            the CPU EP: the baseline), run at whatever size each batch has.
        max_rows: the most rows one run gets (default: the largest bucket; required with ``dim=``). Above the
            largest bucket a run goes the session's ``oversize=`` way (uncaptured by default: slow on CUDA).
        split: ``False`` (default): a request with more than ``max_rows`` rows fails alone with
            :class:`RequestError`, and no request is ever split across runs. ``True``: such requests are cut into
            chunks (and the group is packed densely); their outputs are joined back.
        example_feeds: ``{input: numpy array}`` for the output-axis probes when the session has not decided them
            yet and has dynamic dims that are not batched (see
            :meth:`ortcapture.InferenceSession.bucket_output_axes`); ``None``: zeros.
        dim: only for a session without ``buckets=``: the dim to batch along, a ``dim_param`` (``"batch"``: every
            input axis of that name) or ``(input name, axis)``, as ``buckets=`` keys it. The output axes that follow
            it are measured by two runs of the session at 1 and 2 rows (``example_feeds``' rows repeated or cut, or
            zeros).

    Raises:
        TypeError: ``session`` is not an :class:`ortcapture.InferenceSession` (without ``dim=``), or has no
            ``get_inputs``/``get_outputs``/``run`` (with it).
        CaptureError: the session has no ``buckets=`` (and no ``dim=`` is given) or buckets several dims; ``dim=``
            for a session with ``buckets=`` or with capture enabled (its plain runs need ``gpu_graph_id=-1``), or
            naming no dynamic input dim; an input carries the dim on two axes or has a type numpy cannot hold
            (strings); an output has no axis (or several) that follows the dim — named, since its value for a batch
            of several requests cannot be split back per request; what
            :meth:`~ortcapture.InferenceSession.bucket_output_axes` raises, or the probe runs' failure (``dim=``).
        ValueError: ``max_rows`` not an int >= 1, or missing with ``dim=``.

    Attributes:
        session: the session every batch runs on.
        inputs: ``[(name, numpy dtype, shape)]`` of the model's inputs, shapes with -1 for dynamic dims (the
            batched one included): the protocol's model metadata.
        outputs: ``[(name, numpy dtype, shape)]`` of the model's outputs, likewise.
        max_rows: the most rows one run gets.
        split: whether requests above ``max_rows`` are split.
        dim: the batched dim's label (:meth:`~ortcapture.InferenceSession.bucket_dims`; with ``dim=``: the
            ``dim_param``, or ``"input[axis]"``).
        sizes: the bucket sizes, ascending (``()`` with ``dim=``: no buckets).
        input_axes: ``{input name: axis}`` of the inputs that carry the batched dim.
        output_axes: ``{output name: axis}`` along which each output is split back.

    Thread-safe: :meth:`run` may be called from several threads at once (the session serialises its replays).
    """

    def __init__(self, session: InferenceSession, *, max_rows: int | None = None, split: bool = False,
                 example_feeds: Mapping[str, Any] | None = None, dim: Any = None):
        self.session = session
        if dim is None:
            label, sizes, sites = self._bucketed(session)
        else:
            if max_rows is None:
                raise ValueError("BatchRunner(dim=...) needs max_rows=: the session has no buckets to take it from")
            label, sizes, sites = self._unbucketed(session, dim)
        self.dim: str = label
        self.sizes: tuple[int, ...] = sizes
        self.input_axes: dict[str, int] = {}
        for name, axis in sites:
            if name in self.input_axes:
                raise CaptureError(f"BatchRunner: input {name!r} carries the batched dim {label!r} on two axes "
                                   f"({self.input_axes[name]} and {axis}); requests cannot be concatenated along it")
            self.input_axes[name] = axis
        self.inputs: list[TensorSpec] = [self._spec(m, "input") for m in session.get_inputs()]
        self.outputs: list[TensorSpec] = [self._spec(m, "output") for m in session.get_outputs()]
        if dim is None:
            relations = session.bucket_output_axes(example_feeds)
        else:
            relations = self._probe(example_feeds)
        self.output_axes: dict[str, int] = {}
        for name, _, _ in self.outputs:
            axes = relations.get(name, {}).get(label, ())
            if len(axes) != 1:
                how = (f"follows it on several axes {axes}" if axes else
                       "has no axis that follows it (a reduction over the batch, a constant, a length that is a "
                       f"function of the dim, or declared output_axes={{{name!r}: None}})")
                raise CaptureError(f"BatchRunner: output {name!r} {how}: its value for a batch of several "
                                   f"requests cannot be split back per request along {label!r}. Serve this model "
                                   "one request per run, or drop the output from the model.")
            self.output_axes[name] = axes[0]
        self.outputs = [(n, t, tuple(-1 if ax == self.output_axes[n] else d for ax, d in enumerate(s)))
                        for n, t, s in self.outputs]
        if max_rows is None:
            max_rows = self.sizes[-1]
        if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) or max_rows < 1:
            raise ValueError(f"max_rows must be an int >= 1, got {max_rows!r}")
        self.max_rows: int = int(max_rows)
        self.split: bool = bool(split)
        self._types = {n: t for n, t, _ in self.inputs}
        self._shapes = {n: s for n, _, s in self.inputs}
        self._names = [n for n, _, _ in self.inputs]
        self._output_names = [n for n, _, _ in self.outputs]
        self._lock = threading.Lock()
        # the value rules of the fixed buffers the feeds are copied into (int64 within int32 on WebGPU): the very
        # checks the copy applies, run on each request alone (rows()) so a bad value never reaches a batch
        info = getattr(session, "requested_capture", None) if isinstance(session, InferenceSession) else None
        self.check = RequestCheck(self.inputs, self.input_axes, self.max_rows,
                                  value_rules(info.device_type) if info is not None else {}, self.dim, self.split)
        self._counts = Counter({"requests": 0, "failed_requests": 0, "bad_requests": 0, "batches": 0,
                                "failed_batches": 0, "rows": 0, "isolation_runs": 0})
        self._histogram: Counter = Counter()

    @staticmethod
    def _bucketed(session) -> tuple[str, tuple[int, ...], tuple]:
        """``(label, sizes, sites)`` of a bucketed session's one bucketed dim."""
        if not isinstance(session, InferenceSession):
            raise TypeError(f"BatchRunner needs an ortcapture.InferenceSession made with buckets= (or dim= for a "
                            f"session without), got {type(session).__module__}.{type(session).__qualname__}")
        try:
            dims = session.bucket_dims()
        except CaptureError:
            raise CaptureError("BatchRunner needs a session made with buckets= (e.g. buckets={'batch': [1, 2, 4, "
                               "8]}), or dim= for a session without capture: it batches requests along that "
                               "dim") from None
        if len(dims) != 1:
            raise CaptureError(f"BatchRunner batches along one bucketed dim; this session buckets {list(dims)}")
        (label, d), = dims.items()
        return label, tuple(d["sizes"]), tuple(d["sites"])

    @staticmethod
    def _unbucketed(session, dim) -> tuple[str, tuple[int, ...], tuple]:
        """``(label, (), sites)`` of ``dim=`` on a session without buckets."""
        if not all(callable(getattr(session, a, None)) for a in ("get_inputs", "get_outputs", "run")):
            raise TypeError(f"BatchRunner needs an InferenceSession, got {type(session).__qualname__}")
        if isinstance(session, InferenceSession):
            try:
                session.bucket_dims()
            except CaptureError:
                pass
            else:
                raise CaptureError("BatchRunner: dim= is for a session without buckets=; this one batches along "
                                   "its bucketed dim already (leave dim= out)")
            if session.capture_enabled:
                raise CaptureError("BatchRunner: dim= needs a session without capture (a capturing session's plain "
                                   "runs need gpu_graph_id=-1); give it buckets= instead")
        dims = {m.name: list(m.shape) for m in session.get_inputs()}
        if isinstance(dim, str):
            label, param = dim, dim
        elif (isinstance(dim, tuple) and len(dim) == 2 and isinstance(dim[0], str) and isinstance(dim[1], int)
              and not isinstance(dim[1], bool)):
            name, axis = dim
            if name not in dims or not -len(dims[name]) <= axis < len(dims[name]):
                raise CaptureError(f"BatchRunner: dim={dim!r} names no input axis of the model ({dims})")
            axis %= len(dims[name])
            label, param = f"{name}[{axis}]", dims[name][axis]
            if isinstance(param, int):
                raise CaptureError(f"BatchRunner: dim={dim!r} is fixed at {param} in the model")
        else:
            raise CaptureError(f"BatchRunner: dim= is a dim_param (str) or (input name, axis), got {dim!r}")
        if isinstance(param, str):
            sites = tuple((n, a) for n, ds in dims.items() for a, d in enumerate(ds) if d == param)
        else:
            sites = ((name, axis),)
        if not sites:
            named = sorted({d for ds in dims.values() for d in ds if isinstance(d, str)})
            raise CaptureError(f"BatchRunner: no input dim is named {dim!r}; the model's dim_params are {named} (or "
                               "name the dim as (input name, axis))")
        return label, (), sites

    def _probe(self, example_feeds: Mapping[str, Any] | None) -> dict[str, dict[str, tuple[int, ...]]]:
        """``{output: {label: (axis, ...)}}``: the axes whose length is the batch's in runs at 1 and 2 rows."""
        base = {}
        for name, dtype, shape in self.inputs:
            if example_feeds is not None:
                if not isinstance(example_feeds, Mapping) or not isinstance(example_feeds.get(name), np.ndarray):
                    raise CaptureError(f"BatchRunner: example_feeds must map every input to a numpy array; "
                                       f"{name!r} is missing or not an array")
                base[name] = example_feeds[name]
                continue
            if any(d < 0 for ax, d in enumerate(shape) if ax != self.input_axes.get(name)):
                raise CaptureError(f"BatchRunner: input {name!r} has dynamic dims besides {self.dim!r} "
                                   f"(shape {list(shape)}); pass example_feeds= so the probe runs know them")
            base[name] = np.zeros([1 if d < 0 else d for d in shape], dtype)
        shapes = []
        for n in (1, 2):
            feeds = {}
            for name, v in base.items():
                axis = self.input_axes.get(name)
                if axis is not None:
                    v = np.take(v, np.arange(n) % max(v.shape[axis], 1), axis=axis) if v.shape[axis] else v
                feeds[name] = v
            try:
                outs = self.session.run(None, feeds)
            except Exception as exc:  # noqa: BLE001 - ORT's own types
                raise CaptureError(f"BatchRunner: the probe run at {n} row(s) along {self.dim!r} failed: "
                                   f"{str(exc).strip()[:300]}") from exc
            shapes.append([tuple(np.shape(o)) for o in outs])
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        for (name, _, _), a, b in zip(self.outputs, *shapes):
            axes = tuple(ax for ax, (x, y) in enumerate(zip(a, b)) if (x, y) == (1, 2)) if len(a) == len(b) else ()
            out[name] = {self.dim: axes} if axes else {}
        return out

    def _spec(self, meta, what: str) -> TensorSpec:
        dtype = ONNX_TO_NP.get(meta.type)
        if dtype is None:
            raise CaptureError(f"BatchRunner: {what} {meta.name!r} is {meta.type}, not a numeric tensor")
        shape = tuple(d if isinstance(d, int) and not isinstance(d, bool) and d >= 0 else -1 for d in meta.shape)
        if what == "input" and meta.name in self.input_axes:
            shape = tuple(-1 if ax == self.input_axes[meta.name] else d for ax, d in enumerate(shape))
        return meta.name, np.dtype(dtype), shape

    # -- one request ------------------------------------------------------------------------------------------
    def rows(self, request: Mapping[str, np.ndarray]) -> int:
        """Check one request alone and return its rows along the bucketed dim: :meth:`RequestCheck.rows
        <ortcapture.serving.requests.RequestCheck.rows>` with this session's inputs, :attr:`max_rows`, ``split``
        and the value rules of the session's device (raises :class:`RequestError`)."""
        return self.check.rows(request)

    # -- many requests ----------------------------------------------------------------------------------------
    def run(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray] | Exception]:
        """Run ``requests`` as few batched session runs.

        Args:
            requests: feeds dicts, each as :meth:`rows` takes it (host numpy arrays).

        Returns:
            One entry per request, in request order: ``{output name: numpy array}`` (host arrays, the request's
            rows along each output's :attr:`output_axes` axis; C-contiguous), or the exception for that request —
            a :class:`RequestError` for a bad request, or what the session's ``run`` raised when the request ran
            *alone* after its chunk failed (``CaptureError`` for a bucket whose capture or verification failed, ORT's
            own errors); a request whose solo run succeeds gets its answer although its chunk failed. Never raises
            for a request's content.
        """
        results: list[Any] = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for i, request in enumerate(requests):
            try:
                n = self.rows(request)
            except RequestError as exc:
                results[i] = exc
                continue
            groups.setdefault(group_key(request, self._names, self.input_axes), []).append((i, n))
        runs = bad = isolation_runs = 0
        histogram: Counter = Counter()
        failed_runs = 0
        for members in groups.values():
            for chunk in self._chunks(members):
                total = sum(stop - start for _, start, stop in chunk)
                runs += 1
                histogram[total] += 1
                try:
                    outs = self._run_chunk(requests, chunk, total)
                except Exception:  # noqa: BLE001 - each of the chunk's requests is run alone: only the faulty fails
                    failed_runs += 1
                    isolation_runs += self._isolate(requests, chunk, results)
                    continue
                offset = 0
                for i, start, stop in chunk:
                    rows = stop - start
                    if not isinstance(results[i], Exception):  # else an earlier chunk of a split request failed
                        _add_piece(results, i, {n: take(o, self.output_axes[n], offset, offset + rows)
                                                for n, o in outs.items()})
                    offset += rows
        for i, r in enumerate(results):
            if isinstance(r, Exception):
                bad += 1
            else:
                results[i] = {n: np.ascontiguousarray(r[0][n]) if len(r) == 1
                              else np.concatenate([p[n] for p in r], axis=self.output_axes[n]) for n in r[0]}
        with self._lock:
            c = self._counts
            c["requests"] += len(requests)
            c["failed_requests"] += bad
            c["bad_requests"] += sum(isinstance(r, RequestError) for r in results)
            c["batches"] += runs
            c["failed_batches"] += failed_runs
            c["isolation_runs"] += isolation_runs
            c["rows"] += sum(k * v for k, v in histogram.items())
            self._histogram.update(histogram)
        return results

    def _isolate(self, requests: Sequence[Mapping[str, np.ndarray]], chunk: list[tuple[int, int, int]],
                 results: list, prepare: Callable[[dict], dict] | None = None) -> int:
        """After ``chunk``'s run failed: run each of its pieces alone (at most :attr:`max_rows` runs, one per
        request piece), so the piece whose values the session refuses fails with the exception of its *own* run —
        never another request's values in its text — and its batchmates get their answers (``prepare``: as in
        :meth:`run_joined`, per piece). Returns the runs made."""
        made = 0
        for i, start, stop in chunk:
            if isinstance(results[i], Exception):  # an earlier chunk of a split request failed already
                continue
            made += 1
            try:
                outs = self._run_chunk(requests, [(i, start, stop)], stop - start, prepare)
            except Exception as exc:  # noqa: BLE001 - this request's own failure, whatever the session raised
                results[i] = exc
                continue
            _add_piece(results, i, outs)
        return made

    def _chunks(self, members: list[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
        """A group's runs: lists of ``(request index, first row, end row)`` of at most :attr:`max_rows` rows each,
        requests in order inside a run. Whole requests, first-fit decreasing (fewest runs, little padding); with
        ``split`` the group's rows in request order cut every ``max_rows`` rows."""
        cap = self.max_rows
        if self.split:
            chunks, cur, used = [], [], 0
            for i, n in members:
                start = 0
                while start < n:
                    piece = min(n - start, cap - used)
                    cur.append((i, start, start + piece))
                    start += piece
                    used += piece
                    if used == cap:
                        chunks.append(cur)
                        cur, used = [], 0
            if cur:
                chunks.append(cur)
            return chunks
        return pack(members, cap)

    def _run_chunk(self, requests: Sequence[Mapping[str, np.ndarray]], chunk: list[tuple[int, int, int]],
                   total: int, prepare: Callable[[dict], dict] | None = None) -> dict[str, np.ndarray]:
        """One session run of ``chunk``'s rows (``prepare``: applied to the joined feeds first); ``{output: array}``
        with ``total`` rows along each output's axis."""
        feeds = join(requests, chunk, self._names, self.input_axes)
        if prepare is not None:
            feeds = prepare(feeds)
        outs = dict(zip(self._output_names, self.session.run(None, feeds)))
        for name, o in outs.items():
            axis = self.output_axes[name]
            if o.ndim <= axis or o.shape[axis] != total:
                raise CaptureError(f"BatchRunner: output {name!r} came back with shape {list(o.shape)} for a run of "
                                   f"{total} rows, where axis {axis} should have {total}: it does not follow "
                                   f"{self.dim!r} as measured")
        return outs

    def run_joined(self, feeds: Mapping[str, Any], rows: Sequence[int], isolate: bool = True,
                   prepare: Callable[[dict], dict] | None = None) -> dict[str, np.ndarray] | list:
        """Run one batch that a batching tier has checked (:meth:`rows`, once per request), grouped and joined
        already (:func:`ortcapture.serving.requests.join`): one session run, no check again.

        Args:
            feeds: ``{input: numpy array}``, the requests' rows concatenated along the batched dim (``sum(rows)``
                rows, at most :attr:`max_rows`); inputs without the batched dim are the group's one value. A batched
                input's rows may also be references to CUDA shared memory
                (:class:`~ortcapture.serving.cuda_shm.DeviceRows`, one part per request), which ``prepare`` turns
                into a feed the session takes.
            rows: each request's rows, in the order they were joined.
            isolate: ``False``: a run that raises raises here.
            prepare: called with the feeds of each session run right before it — the batch's, then, if that run
                raised, each request's own (cut by :func:`~ortcapture.serving.requests.split_feeds`) — and returns
                the feeds to run (the session replica gathers :class:`~ortcapture.serving.cuda_shm.DeviceRows` on
                the device into a CUDA ``OrtValue`` here); what it raises is that run's failure.

        Returns:
            ``{output: array}`` with ``sum(rows)`` rows along each output's :attr:`output_axes` axis (the caller
            slices each request's rows back), or — when that run raised — a list with one entry per request, its
            own run alone (at most one each, counted as ``isolation_runs``): ``{output: array}`` or the exception
            its own run raised.
        """
        rows = [int(r) for r in rows]
        total = sum(rows)
        whole = [(0, 0, total)]
        try:
            outs = self._run_chunk([feeds], whole, total, prepare)
            failed = None
        except Exception:  # noqa: BLE001 - each request is run alone: only the faulty one fails
            if not isolate:
                raise
            parts = split_feeds(feeds, rows, self.input_axes)
            failed = [None] * len(rows)
            isolation = self._isolate(parts, [(i, 0, n) for i, n in enumerate(rows)], failed, prepare)
            failed = [r if isinstance(r, Exception) else r[0] for r in failed]
        with self._lock:
            c = self._counts
            c["requests"] += len(rows)
            c["batches"] += 1
            c["rows"] += total
            self._histogram[total] += 1
            if failed is not None:
                c["failed_batches"] += 1
                c["isolation_runs"] += isolation
                c["failed_requests"] += sum(isinstance(r, Exception) for r in failed)
        return outs if failed is None else failed

    def stats(self) -> dict:
        """Runner-level counters since the runner was made.

        Returns:
            ``{"requests", "failed_requests" (bad or in a failed run), "bad_requests" (:class:`RequestError`),
            "batches" (session runs), "failed_batches", "isolation_runs" (requests run alone after their chunk failed),
            "rows" (rows run), "batch_rows": {rows in a run: runs}}``;
            the session's own counters (graphs per bucket, padding) are ``session.bucket_stats()``.
        """
        with self._lock:
            return {**self._counts, "batch_rows": dict(sorted(self._histogram.items()))}


def _add_piece(results: list, i: int, piece: dict) -> None:
    """Append one run's outputs for request ``i`` (several pieces where a request was split across runs)."""
    if results[i] is None:
        results[i] = [piece]
    else:
        results[i].append(piece)
