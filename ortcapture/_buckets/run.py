"""Plain ``sess.run()`` served from captured graphs, one per bucket (issue 16): pad up, replay, slice back.

A session made with ``buckets=`` hands its plain runs here. A request picks the smallest bucket >= each bucketed dim;
its feeds go through the graph's own feed path (issue 42): a request that fills the bucket is ``graph.run(feeds)``,
a smaller one is written into the leading rows of the fixed buffers with the rest padded and only its rows read back
(``CapturedGraph.feed_rows`` / ``read_rows``, :mod:`ortcapture._core.rows`: the graph's staging, page-locked on CUDA),
sliced along the axes that follow the bucketed dims (:mod:`ortcapture._buckets.spec`). Each
graph is captured on first use (or by ``warmup``) and checked once by :mod:`ortcapture._verify.compare` against the
uncaptured run of the unpadded feeds. Runs it cannot serve captured (oversize, inconsistent dims, feeds ORT would
refuse) run uncaptured (``gpu_graph_id=-1``) and are counted. The runner reaches its session only through
:class:`ortcapture._buckets.host.BucketHost` (the session layer implements it).
"""
from __future__ import annotations

import itertools
import logging
import math
import re
import shlex
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ortcapture._buckets import feeds as _bucket_feeds
from ortcapture._buckets import messages as _messages
from ortcapture._buckets import neutral as _neutral
from ortcapture._buckets.feeds import requested_outputs
from ortcapture._buckets.host import BucketHost
from ortcapture._ort import compat
from ortcapture._transfer.arena import suspend_tap
from ortcapture._transfer.check import check_feed_values
from ortcapture._verify import compare as _verify
from ortcapture._buckets.values import dtype_of, input_dtype, np_dtype, shape_of, wrap_outputs
from ortcapture._buckets.spec import (BucketDim, check_output_axes, check_pad_values, output_relations, parse_buckets,
                                     sliced_lengths)
from ortcapture._core.rows import cut as cut_rows
from ortcapture._core.rows import to_host
from ortcapture._core.dispatch import GraphDispatcher, Refused
from ortcapture._core.run import SKIP_GRAPH_ID, explicit_graph_id, graph_id_of, replay_cannot_honour, uncaptured
from ortcapture._ort.specialize import host_read_inputs
from ortcapture.errors import CaptureAbortedError, CaptureError, GraphReleasedError

log = logging.getLogger("ortcapture")

OVERSIZE = ("uncaptured", "split")
#: numpy dtype -> its name in a pool key (``str(dtype)`` costs ~1 µs a call; torch's dtype names are the same strings)
_DTYPE_NAMES = {np.dtype(t): str(np.dtype(t)) for t in (np.float32, np.float16, np.float64, np.int64, np.int32,
                                                         np.int8, np.uint8, np.bool_, np.int16, np.uint16)}


class _Entry:
    """One captured bucket: the graph and the region the last request wrote into its fixed inputs."""

    def __init__(self, graph, bucket: dict[str, int], label: str):
        self.graph = graph
        self.bucket = bucket
        self.label = label
        #: {input: the shape of the region the last request wrote}; missing: every row (a full request, capture)
        self.filled: dict[str, tuple] = {}
        #: {output: {axis: length}} the relations keep of each output of a request that fills the bucket
        self.full_cut: dict[str, dict[int, int]] | None = None
        self.whole = False  # ... and it keeps every output whole
        self.lock = threading.Lock()
        self.evicted = False  # released by max_graphs: a thread that looked it up before looks again
        self.threads: set[int] = set()
        self.replayed = 0
        self.rows = 0
        self.padded_rows = 0
        self.capacity = math.prod(bucket.values())  # rows (the product of the bucketed sizes) of each replay
        self.device_bytes = sum(int(np.prod(v.shape())) * np.dtype(np_dtype(v)).itemsize
                                for v in itertools.chain(graph.inputs.values(), graph.outputs.values()))


class BucketRunner:
    """The bucket machinery of one session (see the module docstring); built by ``InferenceSession(buckets=...)``."""

    def __init__(self, host: BucketHost, buckets: Mapping, *, output_axes=None, oversize: str = "uncaptured",
                 verify: Any = True, max_graphs: int | None = None, replay_thread: bool = False,
                 pad_values: Mapping[str, Any] | None = None):
        st = host.state
        session = host.session
        if st.info is None and not st.deferred:
            raise CaptureError("buckets= needs a session whose providers request graph capture (CUDA "
                               "enable_cuda_graph=1, TensorRT trt_cuda_graph_enable=1, or WebGPU enableGraphCapture=1: "
                               "ortcapture.webgpu.session_options(capture=True))")
        #: the session, reached through this interface only (ortcapture._buckets.host)
        self.host = host
        self._s = session  # ORT's metadata of the session (get_inputs, get_outputs)
        self._reference = None  # feeds -> outputs, made on first use (BucketHost.reference)
        metas = session.get_inputs()
        self.input_names = [m.name for m in metas]
        self.output_names = [o.name for o in session.get_outputs()]
        self._specs = _bucket_feeds.specs(session)  # what ORT's plain run takes per input
        self.dims: list[BucketDim] = parse_buckets(buckets, {m.name: list(m.shape) for m in metas})
        self._declared = check_output_axes(output_axes, self.output_names, self.dims)
        #: {input: numpy scalar} padded rows hold (default 0)
        self._pad = check_pad_values(pad_values, {m.name: input_dtype(m.type) for m in metas}, self.dims)
        if oversize not in OVERSIZE:
            raise CaptureError(f"oversize must be one of {OVERSIZE}, got {oversize!r}")
        self.oversize = oversize
        self.level = _verify.level_of(verify)
        requested = st.requested or st.info
        self.device_type = requested.device_type
        if max_graphs is not None and (isinstance(max_graphs, bool) or not isinstance(max_graphs, int)
                                       or max_graphs < 1):
            raise CaptureError(f"max_graphs must be an int >= 1, got {max_graphs!r}")
        self.max_graphs = max_graphs
        self._sites = {}  # input -> [(axis, label)]
        for d in self.dims:
            for name, axis in d.sites:
                self._sites.setdefault(name, []).append((axis, d.label))
        self._host_read = host_read_inputs(session)
        self._rel: dict[str, dict] | None = None
        #: {signature: (sizes, pool key)} of numpy feeds served before (see _signature); at most 1024, then cleared
        self._known: dict[tuple, tuple] = {}
        self._lock = threading.RLock()
        #: request key (_key) -> _Entry or Refused: the one key -> graph map (ortcapture._core.dispatch), under _lock
        self._graphs = GraphDispatcher(max_graphs, full="evict", lock=self._lock)
        self._counts = {"replayed": 0, "uncaptured": 0, "captured": 0, "oversize": 0, "split": 0, "evicted": 0}
        self._rows = self._padded_rows = 0  # request rows and padded rows of every counted replay (padding_waste)
        self._exact = False
        if self.device_type == "cuda":
            opts = session.get_provider_options().get("CUDAExecutionProvider", {})
            self._exact = str(opts.get("use_tf32", "1")) == "0"
        #: {input: bucketed axes}: the axes along which a request's feed may be shorter than its bucket's buffer
        self._per_thread = self.device_type == "cuda"  # CUDA graphs are per thread: the first replay captures
        self._axes = {name: tuple(a for a, _ in sites) for name, sites in self._sites.items()}
        if not isinstance(replay_thread, bool):  # "yes" / "no" were taken as their truth value (a tester)
            raise CaptureError(f"replay_thread must be True or False, got {replay_thread!r}")
        self._worker = ThreadPoolExecutor(1, "ortcapture-replay") if replay_thread else None
        self._worker_ident: int | None = None
        self._warned_oversize = False

    # -- the plain-run entry points ---------------------------------------------------------------------------
    def run(self, output_names, input_feed, run_options=None, *, ort_values: bool = False):
        """``InferenceSession.run`` with buckets. Returns one numpy array (``ort_values``: OrtValue) per requested
        output. Raises :class:`CaptureError` for an explicit ``gpu_graph_id`` other than -1, or a bucket whose
        capture or verification failed; otherwise what ORT raises for the uncaptured run."""
        if explicit_graph_id(run_options):
            if graph_id_of(run_options) == SKIP_GRAPH_ID:  # the caller's choice: not counted
                return self._plain(output_names, input_feed, run_options, ort_values, count=False)
            raise CaptureError("a session with buckets= picks its own gpu_graph_ids; run_options may only set "
                               "gpu_graph_id=-1 (run uncaptured)")
        if replay_cannot_honour(run_options):
            # a replay would ignore it: the uncaptured run raises ORT's "Exiting due to terminate flag"
            return self._plain(output_names, input_feed, run_options, ort_values)
        if self._worker is not None and threading.get_ident() != self._worker_ident:
            return self._worker.submit(self._run_here, output_names, input_feed, run_options, ort_values).result()
        return self._run_here(output_names, input_feed, run_options, ort_values)

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` on the replay thread (``replay_thread=True``); its runs there replay without
        a hand-over. Raises :class:`CaptureError` without a replay thread."""
        if self._worker is None:
            raise CaptureError("run_on_replay_thread() needs a session made with buckets= and replay_thread=True")
        if threading.get_ident() == self._worker_ident:  # on the replay thread already: run it here (no deadlock)
            done: Future = Future()
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed back through the future, as submit() does
                done.set_exception(exc)
            return done

        def call():
            self._worker_ident = threading.get_ident()
            return fn(*args, **kwargs)

        try:
            return self._worker.submit(call)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            raise CaptureError("run_on_replay_thread(): the session's replay thread is closed") from None

    def _run_here(self, output_names, input_feed, run_options, ort_values, count: bool = True):
        if self._worker is not None:
            self._worker_ident = threading.get_ident()
        sig = self._signature(input_feed)
        if sig is not None:  # numpy feeds of shapes and dtypes served before: straight to their graph
            hit = self._known.get(sig)
            if hit is not None:
                sizes, key = hit
                # least recently used order matters only under max_graphs (peek: one dict read, no lock)
                entry = self._graphs.peek(key) if self.max_graphs is None else self._graphs.get(key)
                names = self._names(output_names)
                if type(entry) is _Entry and names is not None:
                    outs = self._replay(entry, input_feed, sizes, names, count=count)
                    if outs is not None:
                        return outs if not ort_values else wrap_outputs(outs, ort_values)
        feeds = self._host_feeds(input_feed, ort_values)
        names = self._names(output_names)
        if feeds is None or names is None:
            return self._plain(output_names, input_feed, run_options, ort_values)
        sizes = self._request_sizes(feeds)
        if sizes is None or 0 in sizes.values():
            # an empty request (batch 0): what plain ORT does with it, always — padded into bucket 1 it came back
            # empty where ORT raises (measured, WebGPU: Softmax "Invalid dispatch group size (0, 1, 1)"), and a
            # fresh session's first probe raised ORT's error instead
            return self._plain(output_names, input_feed, run_options, ort_values)
        bucket = {d.label: d.bucket_for(sizes[d.label]) for d in self.dims}
        if any(b is None for b in bucket.values()):
            with self._lock:
                self._counts["oversize"] += 1
            if self.oversize == "split":
                outs = self._split(feeds, sizes, names)
                if outs is not None:
                    return wrap_outputs(outs, ort_values)
            self._warn_oversize(sizes)
            return self._plain(output_names, input_feed, run_options, ort_values)
        for _ in range(4):  # again when another thread evicted or released the graph between look-up and replay
            key = self._key(feeds, bucket)
            entry = self._entry(feeds, sizes, bucket, key)
            if entry is None:
                break
            outs = self._replay(entry, feeds, sizes, names, count=count)
            if outs is not None:
                break
        if entry is None or outs is None:  # not captured, or released under it again and again: as ORT runs it
            return self._plain(output_names, input_feed, run_options, ort_values)
        if sig is not None:  # checked (every feed ORT takes, consistent sizes, in a bucket): known from now on
            known = self._known
            if len(known) >= 1024:
                known.clear()
            known[sig] = (sizes, key)
        return outs if not ort_values else wrap_outputs(outs, ort_values)

    def _names(self, output_names) -> list[str] | None:
        """:meth:`_output_names`; ``None``: :attr:`output_names` itself (the graph's outputs as they come)."""
        return self.output_names if output_names is None else self._output_names(output_names)

    def _signature(self, input_feed) -> tuple | None:
        """``((shape, dtype), ...)`` of the feeds in input order where every feed is a numpy array and no input is
        read on the host (its values are part of a graph's key), else ``None``. A signature seen before was checked
        then (:meth:`_convert_feeds`: the same shapes and dtypes pass the same checks) and maps to its sizes and pool
        key: :attr:`_known` (shapes and dtypes, never array identities)."""
        if type(input_feed) is not dict or self._host_read or len(input_feed) != len(self.input_names):
            return None
        sig = []
        for name in self.input_names:
            v = input_feed.get(name)
            if type(v) is not np.ndarray:
                return None
            sig.append((v.shape, v.dtype))
        return tuple(sig)

    def note_uncaptured(self) -> None:
        """Count a request the caller ran uncaptured in this runner's place (the drop-in's fallback for a refused
        bucket): ``bucket_stats()["uncaptured"]``."""
        with self._lock:
            self._counts["uncaptured"] += 1

    def _warn_oversize(self, sizes: Mapping[str, int]) -> None:
        """One ``RuntimeWarning`` per session for requests beyond the largest bucket (they run uncaptured, on CUDA
        with every batch-size change's cost: ~0.6 s a call for YOLOv8n with ORT's default cuDNN search)."""
        with self._lock:
            if self._warned_oversize:
                return
            self._warned_oversize = True
        largest = {d.label: d.sizes[-1] for d in self.dims}
        warnings.warn(f"ortcapture: a request of {dict(sizes)} is beyond the largest bucket(s) {largest}: it runs "
                      "uncaptured (counted as 'oversize' in bucket_stats()); add a larger bucket or pass "
                      "oversize='split'. Warned once per session.", RuntimeWarning, stacklevel=4)

    def _plain(self, output_names, input_feed, run_options, ort_values, count: bool = True):
        if count:
            with self._lock:
                self._counts["uncaptured"] += 1
        return self.host.run_uncaptured(output_names, input_feed, uncaptured(run_options), ort_values)

    # -- feeds ------------------------------------------------------------------------------------------------
    def _host_feeds(self, input_feed, ort_values: bool) -> dict | None:
        """``{input: value}`` with host values as numpy arrays and device values (CUDA OrtValues, DLPack) kept;
        ``None`` when the feeds are not ones ORT's plain run takes (see :meth:`_feed_problem`; the uncaptured run
        then says what ORT says)."""
        out = self._convert_feeds(input_feed)
        return out if isinstance(out, dict) else None

    def _convert_feeds(self, input_feed) -> dict | str:
        """:meth:`_host_feeds`, or why not (a sentence): not every input exactly once, or a feed of another element
        type, rank or fixed dim than the model's input (:mod:`ortcapture._buckets.feeds`)."""
        if not isinstance(input_feed, Mapping) or set(input_feed) != set(self.input_names):
            return f"feeds must give every input exactly once ({self.input_names})"
        out = {}
        for name, v in input_feed.items():
            spec = self._specs[name]
            if isinstance(v, compat.OrtValue):
                v = v.numpy() if v.device_name().lower() == "cpu" else v
            elif hasattr(v, "__dlpack_device__") and not isinstance(v, np.ndarray):
                v = np.from_dlpack(v) if int(v.__dlpack_device__()[0]) == 1 else v
            elif isinstance(v, list):  # ORT converts lists to the input's element type
                v = _bucket_feeds.from_list(spec, v)
                if v is None:
                    return f"input {name!r}: a list ORT cannot convert to {spec.dtype}"
            elif not isinstance(v, np.ndarray):  # scalars, tuples, ...: ORT's own message
                return f"input {name!r}: a {type(v).__name__}, not an array"
            problem = spec.problem(shape_of(v), dtype_of(v))
            if problem is not None:
                return problem
            out[name] = v
        return out

    def _output_names(self, output_names) -> list[str] | None:
        """The requested output names; ``None`` for anything ORT's run refuses (an unknown name, a string instead
        of a list of names): the uncaptured run then raises ORT's own error."""
        return requested_outputs(output_names, self.output_names)

    def _request_sizes(self, feeds: dict) -> dict[str, int] | None:
        sizes = {}
        for d in self.dims:
            vals = set()
            for name, axis in d.sites:
                shape = shape_of(feeds[name])
                if axis >= len(shape):
                    return None
                vals.add(int(shape[axis]))
            if len(vals) != 1:
                return None  # inconsistent: ORT says what is wrong
            sizes[d.label] = vals.pop()
        return sizes

    def _key(self, feeds: dict, bucket: dict) -> tuple:
        parts = []
        for name in self.input_names:
            v = feeds[name]
            shape = list(shape_of(v))
            for axis, _ in self._sites.get(name, ()):
                shape[axis] = -1
            host = v.tobytes() if name in self._host_read and isinstance(v, np.ndarray) else None
            dt = v.dtype if type(v) is np.ndarray else dtype_of(v)
            parts.append((name, tuple(shape), _DTYPE_NAMES.get(dt) or str(dt), host))
        return tuple(bucket[d.label] for d in self.dims), tuple(parts)

    def _resized(self, feeds: dict, sizes: Mapping[str, int]) -> dict:
        """Host copies of ``feeds`` padded with their pad value (``pad_values=``, default 0) or cut along the
        bucketed axes to ``sizes``."""
        out = {}
        for name, v in feeds.items():
            x = v if isinstance(v, np.ndarray) else to_host(v)
            for axis, label in self._sites.get(name, ()):
                n, want = x.shape[axis], sizes[label]
                if want < n:
                    x = np.take(x, np.arange(want), axis=axis)
                elif want > n:
                    pad = [(0, 0)] * x.ndim
                    pad[axis] = (0, want - n)
                    x = np.pad(x, pad, constant_values=self._pad.get(name, 0))
            out[name] = np.require(x, requirements="C")  # ascontiguousarray: 0-d -> (1,)
        return out

    # -- graphs -----------------------------------------------------------------------------------------------
    def _entry(self, feeds: dict, sizes: dict, bucket: dict, key: tuple | None = None) -> _Entry | None:
        key = self._key(feeds, bucket) if key is None else key
        with self._lock:
            entry = self._graphs.get(key)
            if isinstance(entry, Refused):
                raise entry.error
            if entry is not None and not entry.graph.released:
                return entry
            if entry is not None:  # released from outside (release_captured_graph): captured again below
                self._retire(entry)
                self._graphs.discard(key, entry)
            with suspend_tap():  # a capture's, its probes' and its verification's reads are no answer
                check_feed_values(self.device_type, feeds, self._host_read)  # this request's own values: not the key's
                if self._rel is None:
                    try:
                        self._rel = self._decide_relations(feeds, bucket)
                    except CaptureError as exc:  # remembered for this key: the same request does not probe again
                        self._graphs.refuse(key, exc)
                        raise
                # at max_graphs: WebGPU frees a released graph; CUDA keeps it until the session's automatic compaction
                # (sess.compact_threshold) rebuilds the C session
                self._evict()
                label = ", ".join(f"{k}={v}" for k, v in bucket.items())
                t0 = time.perf_counter()
                padded = self._resized(feeds, bucket)
                state = self.host.state
                mark = state.release_mark()  # another thread releasing graphs from here on: see _passing
                try:
                    graph = self.host.capture(padded)  # checked below, padded against unpadded
                except Exception as exc:  # noqa: BLE001 - ORT's own types too: valid feeds, padding that is not
                    if not (isinstance(exc, CaptureError) or _from_ort(exc)):
                        raise
                    if _passing(exc, state, mark):
                        return None  # this request uncaptured; the next one captures the bucket again
                    err = _messages.padding_failed(exc, label, self._host_read) if _from_ort(exc) else exc
                    self._graphs.refuse(key, err)
                    if err is exc:
                        raise
                    raise err from exc
                entry = _Entry(graph, dict(bucket), label)  # captured on the padded feeds: every row written
                entry.threads.add(threading.get_ident())
                try:
                    self._verify(entry, feeds, sizes)
                except BaseException as exc:  # an interrupt too: no graph is left behind, and only a refusal is kept
                    passing = _passing(exc, state, mark)
                    graph.release()
                    if passing:
                        return None
                    if isinstance(exc, CaptureError):
                        self._graphs.refuse(key, exc)
                    raise
                self._graphs.add(key, entry)
                self._counts["captured"] += 1
                log.info("ortcapture: captured bucket %s (gpu_graph_id=%d) for thread %s in %.3f s", label,
                         graph.graph_id, threading.current_thread().name, time.perf_counter() - t0)
                return entry

    def _evict(self) -> None:
        """Room for one more graph under ``max_graphs``: the least recently used released (the lock held)."""
        for e in self._graphs.make_room():
            self._retire(e)
            self._counts["evicted"] += 1
            log.info("ortcapture: evicted bucket %s (least recently used)", e.label)

    def _retire(self, e: _Entry) -> None:
        """``e``'s graph released (evicted, or released from outside); its totals kept (the caller holds the lock)."""
        with e.lock:  # after a replay in flight; a thread that looked it up before retries (_replay: None)
            e.evicted = True
            e.graph.release()
            self._counts["replayed"] += e.replayed
            self._rows += e.rows
            self._padded_rows += e.padded_rows

    def _decide_relations(self, feeds: dict, bucket: dict) -> dict[str, dict]:
        probes = {}
        for d in self.dims:
            first = bucket[d.label]
            others = [s for s in d.sizes if s != first]
            probes[d.label] = (first, others[0] if others else first + 1)

        def run(sizes):
            try:
                outs = self.host.run_uncaptured(None, self._resized(feeds, sizes), uncaptured(None), False)
            except Exception as exc:  # noqa: BLE001 - ORT's own types: the feeds were valid, resized they are not
                if not _from_ort(exc):
                    raise
                raise CaptureError(_messages.probe_failure(self.dims, self._sites, self._s.get_inputs(), feeds,
                                                         self._request_sizes(feeds), sizes, exc)
                                   + _messages.host_read_hint(self._host_read)) from exc
            return {n: tuple(o.shape) for n, o in zip(self.output_names, outs)}

        return output_relations(run, self.dims, probes, self._declared)

    def _verify(self, entry: _Entry, feeds: dict, sizes: dict) -> None:
        """Check ``entry``'s graph on the request that captured it and, where that request filled the bucket, also
        on the most padded request the bucket serves (each dim cut to one more than the bucket below): a request
        that needs no padding cannot show that padding changes an output (a mean over the batch), and ``warmup()``
        captures every bucket with such requests. Raises :class:`VerificationError` naming the outputs."""
        host = {n: (v if isinstance(v, np.ndarray) else to_host(v)) for n, v in feeds.items()}

        def replay(fs):
            outs = self._replay(entry, fs, self._request_sizes(fs), self.output_names, count=False)
            if outs is None:
                raise GraphReleasedError(f"bucket {entry.label}: its graph was released during its check")
            return outs

        if self._reference is None:
            to = self.host
            self._reference = to.reference() or (lambda fs: to.run_uncaptured(None, fs, uncaptured(None), False))
        reference = self._reference
        checks = [(host, sizes)]
        worst = self._most_padded(entry.bucket, sizes)
        if worst != sizes:
            checks.append((self._resized(host, worst), worst))
        for fs, fsizes in checks:
            padded = {k: f"{v}->{entry.bucket[k]}" for k, v in fsizes.items() if v != entry.bucket[k]}
            exact = self._exact and not padded
            _verify.verify(replay, reference, fs, self.output_names, level=self.level,
                           rtol=None if exact else _verify.DEFAULT_RTOL, keep=sorted(self._host_read),
                           what=f"bucket {entry.label} (the replay of a request padded {padded or 'not at all'} vs "
                                "the uncaptured run of the unpadded request; where padding changes outputs the model "
                                "is not padding-neutral for this dim: mask the padded positions, choose neutral "
                                "pad_values=, or drop this bucket — see docs/BUCKETS.md; verify=False would return "
                                "those outputs wrong)", doctor=self.doctor_command())
        if self.level != "off":  # outputs without rows along a batch dim: do the padded rows' values change them?
            _neutral.check_bucket(reference, self._resized, host, worst, entry, self._sites, self._rel,
                                  self.output_names, self.level)

    def doctor_command(self) -> str:
        """The ``ortcapture doctor`` command line that reports these buckets' padding neutrality: ``--buckets
        DIM=SIZES`` per bucketed dim (a dim_param, ``INPUT:AXIS``, or several joined by ``+``)."""
        items = [re.sub(r"\[(\d+)\]", r":\1", d.label) + "=" + ",".join(map(str, d.sizes)) for d in self.dims]
        return "ortcapture doctor MODEL " + " ".join(f"--buckets {shlex.quote(i)}" for i in items)

    def _most_padded(self, bucket: Mapping[str, int], sizes: Mapping[str, int]) -> dict[str, int]:
        """Per bucketed dim, the smallest request size ``bucket`` serves (one more than the next smaller bucket, or
        1), never above the request's own."""
        out = {}
        for d in self.dims:
            b = bucket[d.label]
            below = [s for s in d.sizes if s < b]
            out[d.label] = min(sizes[d.label], (below[-1] + 1) if below else 1)
        return out

    # -- replay -----------------------------------------------------------------------------------------------
    def _replay(self, entry: _Entry, feeds: dict, sizes: dict, names: Sequence[str],
                count: bool = True) -> list | None:
        """The request's outputs from ``entry``'s graph (new arrays, one per name, never views of each other or of
        ortcapture's buffers); ``None`` when the graph was evicted or released meanwhile (look it up again)."""
        with entry.lock:
            if entry.evicted or entry.graph.released:  # released from outside: _entry captures it again
                return None
            try:
                return self._replay_held(entry, feeds, sizes, names, count)
            except Exception:
                if entry.graph.released:  # by another thread mid-request (release_captured_graph): look it up again
                    return None
                raise

    def _replay_held(self, entry: _Entry, feeds: dict, sizes: dict, names: Sequence[str], count: bool) -> list:
        """:meth:`_replay` with ``entry.lock`` held."""
        tid = threading.get_ident()
        first_here = self._per_thread and tid not in entry.threads
        t0 = time.perf_counter() if first_here else 0.0
        graph = entry.graph
        if sizes == entry.bucket:  # the request fills the bucket: the graph's own run, as g.run(feeds)
            if entry.filled:  # every row written (or, should the run fail, maybe some: re-pad all next)
                entry.filled.clear()
            outs = graph.run(feeds)
            cut = entry.full_cut
            if cut is None:  # what the relations keep of each output at the bucket's own sizes (once)
                cut = entry.full_cut = {n: {a: k for a, k in self._lengths(n, sizes, graph).items()
                                            if k != o.shape[a]} for n, o in zip(self.output_names, outs)}
                entry.whole = not any(cut.values())
            if entry.whole and names is self.output_names:
                result = outs
            else:
                by_name = dict(zip(self.output_names, outs))
                result = [cut_rows(by_name[n], cut[n]) if cut[n] else by_name[n] for n in names]
        else:  # its rows into the fixed buffers, the rest padded; only its rows back (ortcapture._core.rows)
            outs = None
            try:
                graph.feed_rows(feeds, self._axes, pad=self._pad, last=entry.filled)
            except BaseException:
                entry.filled.clear()  # written in part, maybe: the next request re-pads every row
                raise
            for name in self._axes:
                entry.filled[name] = shape_of(feeds[name])
            graph.run(None, copy_outputs=False)
            result = graph.read_rows(names, {n: self._lengths(n, sizes, graph) for n in set(names)})
        if result is not outs and len(set(names)) < len(names):  # a name asked twice: separate arrays, as ORT
            seen: set[str] = set()
            result = [r.copy() if n in seen or seen.add(n) else r for n, r in zip(names, result)]
        if first_here:
            entry.threads.add(tid)
            log.info("ortcapture: bucket %s captured for thread %s in %.3f s (CUDA graphs are per thread)",
                     entry.label, threading.current_thread().name, time.perf_counter() - t0)
        if count:  # the entry's counts; stats() adds them up, _evict() folds them into the session's totals
            entry.replayed += 1
            req = entry.capacity if result is outs else math.prod(sizes.values())
            entry.rows += req
            entry.padded_rows += entry.capacity - req
        return result

    def _lengths(self, name: str, sizes: Mapping[str, int], graph) -> dict[int, int]:
        """``{axis: length}`` of output ``name`` for a request of ``sizes``; raises :class:`CaptureError` where that is
        beyond the bucket graph's output (the relation does not hold there)."""
        rel = self._rel[name]
        return sliced_lengths(rel, sizes, tuple(graph.outputs[name].shape()), name) if rel else {}

    def _split(self, feeds: dict, sizes: dict, names: Sequence[str]) -> list | None:
        """Oversize along one bucketed dim: chunks of the largest bucket, outputs joined along the following axes;
        ``None`` (run uncaptured) unless every requested output follows the dim on exactly one axis. An output
        without such an axis (a reduction over the batch, a constant, ``output_axes={name: None}``) has no rows to
        join: the first chunk's value would be a silently wrong answer for the whole batch."""
        if len(self.dims) != 1:
            return None
        d = self.dims[0]
        step, total = d.sizes[-1], sizes[d.label]
        chunks = []
        for start in range(0, total, step):
            chunk = {}
            for name, v in feeds.items():
                x = v if isinstance(v, np.ndarray) else to_host(v)
                for axis, _ in self._sites.get(name, ()):
                    x = np.take(x, np.arange(start, min(start + step, total)), axis=axis)
                chunk[name] = x
            chunks.append((chunk, {d.label: min(step, total - start)}))
        if self._rel is None:  # the first request of the session: the largest bucket decides the output axes
            self._entry(chunks[0][0], chunks[0][1], {d.label: d.sizes[-1]})
        rels = {n: self._rel[n] for n in names}
        if any(len(r) != 1 or any(x[0] != "follow" for x in r.values()) for r in rels.values()):
            return None
        parts = []
        for chunk, csizes in chunks:
            part = None
            while part is None:  # None: evicted by another thread meanwhile (max_graphs), look it up again
                entry = self._entry(chunk, csizes, {d.label: d.bucket_for(csizes[d.label])})
                if entry is None:
                    return None
                part = self._replay(entry, chunk, csizes, names)
            parts.append(part)
        with self._lock:  # each part's replay was counted by _replay
            self._counts["split"] += 1
        return [np.concatenate([p[i] for p in parts], axis=next(iter(rels[n]))) for i, n in enumerate(names)]

    # -- public helpers ---------------------------------------------------------------------------------------
    def warmup(self, example_feeds: Mapping[str, Any] | None = None) -> dict:
        """Capture every bucket (every combination of bucketed sizes) for the calling thread; see
        ``InferenceSession.warmup``."""
        if example_feeds is None:
            example_feeds = self._zeros_example()
        feeds = self._convert_feeds(example_feeds)
        if not isinstance(feeds, dict):
            raise CaptureError(f"warmup: {feeds}")
        for combo in itertools.product(*[d.sizes for d in self.dims]):
            sizes = {d.label: s for d, s in zip(self.dims, combo)}
            resized = self._resized(feeds, sizes)
            if self._worker is None or threading.get_ident() == self._worker_ident:
                self._run_here(None, resized, None, False, False)
            else:  # the session's replay thread captures for itself
                self._worker.submit(self._run_here, None, resized, None, False, False).result()
        return self.stats()

    def dim_layout(self) -> dict[str, dict]:
        """See ``InferenceSession.bucket_dims``."""
        return {d.label: {"sizes": d.sizes, "sites": d.sites} for d in self.dims}

    def output_axes(self, example_feeds: Mapping[str, Any] | None = None) -> dict[str, dict[str, tuple[int, ...]]]:
        """See ``InferenceSession.bucket_output_axes``: the relations decided by the first request (or now, by two
        uncaptured runs on ``example_feeds`` or zeros), as ``{output: {label: (axis, ...)}}``."""
        with self._lock:
            if self._rel is None:
                if example_feeds is None:
                    example_feeds = self._zeros_example("bucket_output_axes")
                feeds = self._convert_feeds(example_feeds)
                if not isinstance(feeds, dict):
                    raise CaptureError(f"bucket_output_axes: {feeds}")
                self._rel = self._decide_relations(feeds, {d.label: d.sizes[0] for d in self.dims})
            rel = self._rel
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        for name in self.output_names:
            axes: dict[str, list[int]] = {}
            for axis, r in sorted(rel.get(name, {}).items()):
                if r[0] == "follow":
                    axes.setdefault(r[1], []).append(axis)
            out[name] = {label: tuple(a) for label, a in axes.items()}
        return out

    def _zeros_example(self, what: str = "warmup") -> dict:
        out = {}
        for m in self._s.get_inputs():
            shape = []
            for ax, d in enumerate(m.shape):
                if isinstance(d, int):
                    shape.append(d)
                elif any(ax == a for a, _ in self._sites.get(m.name, ())):
                    shape.append(1)
                else:
                    raise CaptureError(
                        f"{what}: input {m.name!r} axis {ax} ({d!r}) is dynamic and not bucketed; pass example feeds "
                        f"({what}(feeds)) so its size is known")
            out[m.name] = np.zeros(shape, self._specs[m.name].dtype or input_dtype(m.type) or np.float32)
        return out

    def stats(self) -> dict:
        """See ``InferenceSession.bucket_stats``."""
        with self._lock:
            per: dict[str, dict] = {}  # a bucket may hold several graphs: one per value of the non-bucketed dims
            for e in self._graphs.entries():
                b = per.setdefault(e.label, {"replayed": 0, "device_bytes": 0, "rows": 0, "padded_rows": 0,
                                             "threads": 0, "gpu_graph_ids": []})
                b["replayed"] += e.replayed
                b["device_bytes"] += e.device_bytes
                b["rows"] += e.rows
                b["padded_rows"] += e.padded_rows
                b["threads"] = max(b["threads"], len(e.threads))
                b["gpu_graph_ids"].append(e.graph.graph_id)
            for b in per.values():
                rows, padded_rows = b.pop("rows"), b.pop("padded_rows")
                b["padding_waste"] = padded_rows / max(rows + padded_rows, 1)
            live = self._graphs.entries()
            rows = self._rows + sum(e.rows for e in live)  # every replay, evicted graphs' too
            padded = self._padded_rows + sum(e.padded_rows for e in live)
            counts = {**self._counts, "replayed": self._counts["replayed"] + sum(e.replayed for e in live)}
            return {**counts, "padding_waste": padded / max(rows + padded, 1), "buckets": per,
                    "refused": self._graphs.refused()}

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False)


def _passing(exc: BaseException, state, mark: tuple[int, int]) -> bool:
    """Whether a capture or check that raised ``exc`` may have failed because another thread released graphs
    meanwhile (``release_captured_graph``, ``set_providers``; ``state.released_elsewhere(mark)``): not a refusal to
    remember, the bucket is captured again on its next request."""
    if not isinstance(exc, Exception):  # an interrupt (KeyboardInterrupt), SystemExit: never swallowed
        return False
    return isinstance(exc, GraphReleasedError) or state.released_elsewhere(mark)


def _from_ort(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure inside ORT: its own exception types, the plain ``RuntimeError`` its Python
    ``run_with_iobinding`` raises ("Error in execution: ..."), or a capture ORT aborted."""
    return (isinstance(exc, CaptureAbortedError) or type(exc) is RuntimeError
            or type(exc).__module__.startswith("onnxruntime"))
