"""The bucket methods of ``InferenceSession``: ``warmup``, ``bucket_stats``, ``bucket_dims`` and the others.

Also ``bucket_output_axes`` and ``run_on_replay_thread``.

Moved out of :mod:`ortcapture.session` unchanged. The functions are methods of
:class:`ortcapture._session.session.InferenceSession` (assigned in its class body).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ortcapture._buckets.host import BucketHost
from ortcapture._buckets.run import BucketRunner
from ortcapture._core.reference import reference_runner
from ortcapture._ort.sync import FORKED_DEVICES
from ortcapture.errors import CaptureError


class SessionBucketHost(BucketHost):
    """:class:`ortcapture._buckets.host.BucketHost` for an :class:`~ortcapture.InferenceSession`: the one way its bucket
    runner reaches it (the session's plain run without buckets, its ``capture``, its bucket reference)."""

    def __init__(self, session, state, plain: Callable, reference: Callable):
        self.session = session
        self.state = state
        self._plain = plain  # InferenceSession._oc_plain_run
        self._reference = reference  # InferenceSession._oc_bucket_reference

    def run_uncaptured(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any], run_options,
                       ort_values: bool) -> list:
        """See :meth:`BucketHost.run_uncaptured`."""
        return self._plain(output_names, feeds, run_options, ort_values)

    def capture(self, feeds: Mapping[str, Any]):
        """See :meth:`BucketHost.capture`."""
        return self.session.capture(feeds, verify=False)

    def reference(self):
        """See :meth:`BucketHost.reference`."""
        return self._reference()


def oc_new_buckets(self, buckets) -> BucketRunner:
    """A :class:`BucketRunner` for this session's ``buckets=`` (at construction, and again after ``set_providers``
    replaced the C session); it reaches the session through a :class:`SessionBucketHost` only."""
    host = SessionBucketHost(self, self._oc_state, self._oc_plain_run, self._oc_bucket_reference)
    return BucketRunner(host, buckets, **self._oc_bucket_args)


def oc_bucket_reference(self):
    """The buckets' verification reference (``ortcapture._core.reference``: the session's own ``gpu_graph_id=-1``
    run, bfloat16 through OrtValues on CUDA); ``None`` (the
    plain uncaptured run) for a shape-deferred session, whose base session has no capture."""
    st = self._oc_state
    if st.info is None:
        return None
    return reference_runner(st, self._oc_args[0], self._oc_ref_cache)[0]


def warmup(self, example_feeds: Mapping[str, Any] | None = None) -> dict:
    """Capture (and verify) every bucket now, for the calling thread (CUDA graphs are per thread).

    Args:
        example_feeds: ``{input: value}`` whose non-bucketed dynamic dims (e.g. height, width) the graphs get;
            they are cut or zero-padded to each bucket size. ``None``: zeros, only when every dynamic dim is
            bucketed.

    Returns:
        :meth:`bucket_stats`.

    Raises:
        CaptureError: the session has no ``buckets=``; ``None`` with non-bucketed dynamic dims; a bucket whose
            capture or verification failed; (``kind`` ``"fork"``) in an ``os.fork()`` child of the process that
            made the session.
    """
    if self._oc_buckets is None:
        raise CaptureError("warmup() needs a session made with buckets=")
    if FORKED_DEVICES:  # an os.fork() child: refused before any native call (ortcapture._ort.sync.Origin)
        self._oc_origin.check("warmup()")
    return self._oc_buckets.warmup(example_feeds)


def run_on_replay_thread(self, fn: Callable, /, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` on this session's replay thread and return a
    :class:`concurrent.futures.Future` of its result.

    A session made with ``buckets=`` and ``replay_thread=True`` captures and replays every bucket on one thread of
    its own (ORT's CUDA EP keeps a captured graph per thread); a plain ``run()`` from any other thread is handed to
    that thread and waited for. Code that calls ``run()`` several times per task (a serving replica's batch: run,
    retry one request at a time, health check) saves those hand-overs, each a GIL hand-off under load, by running
    on the replay thread itself: its ``run()`` calls there replay directly. Tasks run one at a time, in order.

    Raises:
        CaptureError: the session has no ``buckets=`` with ``replay_thread=True``.
    """
    if self._oc_buckets is None:
        raise CaptureError("run_on_replay_thread() needs a session made with buckets= and replay_thread=True")
    return self._oc_buckets.submit(fn, *args, **kwargs)


def bucket_stats(self) -> dict:
    """Counts of plain runs with ``buckets=`` since the session was made.

    Returns:
        A dict (the same one :meth:`warmup` returns), for example after ``warmup()`` and runs of batch 3 and 5
        with ``buckets={"batch": [1, 2, 4, 8]}``::

            {"replayed": 2, "uncaptured": 0, "captured": 4, "oversize": 0, "split": 0, "evicted": 0,
             "refused": 0, "padding_waste": 0.333,
             "buckets": {"batch=4": {"replayed": 1, "device_bytes": 208, "padding_waste": 0.25,
                                     "threads": 1, "gpu_graph_ids": [3]}, ...}}

        ``replayed``: requests served by a captured graph (``warmup()``'s own replays not counted);
        ``uncaptured``: requests ortcapture could not serve captured and ran uncaptured (oversize without
        ``oversize="split"``, feeds ORT refuses — ORT then raises its own error; an explicit
        ``gpu_graph_id=-1`` is the caller's choice and not counted); ``captured``: graphs captured and
        verified, one per (bucket, value of the other dynamic dims; on CUDA/TensorRT a graph's capture for
        another thread is not counted again: see ``threads``); ``oversize``: requests beyond the largest bucket; ``split``: requests cut into chunks;
        ``evicted``: graphs released by ``max_graphs=``; ``refused``: buckets whose capture or verification
        failed; ``padding_waste``: padded rows / (rows + padded rows) replayed, 0..1, where a row is one index
        of the bucketed dim (a sequence position for a sequence bucket; several bucketed dims count their
        product). ``buckets``: per bucket, keyed ``"label=size"`` with labels as :meth:`bucket_dims` spells
        them, joined by ``", "`` for several bucketed dims (``"batch=4, seq=32"``), summed over the bucket's
        graphs: ``replayed`` (int), ``device_bytes`` (the fixed input and output device buffers, bytes, int),
        ``padding_waste`` (0..1), ``threads`` (how many threads its busiest graph served, int: CUDA graphs are
        per thread) and ``gpu_graph_ids`` (list of int).

    Raises:
        CaptureError: the session has no ``buckets=``.
    """
    if self._oc_buckets is None:
        raise CaptureError("bucket_stats() needs a session made with buckets=")
    return self._oc_buckets.stats()


def bucket_dims(self) -> dict[str, dict]:
    """The bucketed dims of a session made with ``buckets=``, in the order given there.

    Returns:
        ``{label: {"sizes": (1, 2, 4, 8), "sites": (("images", 0), ...)}}``: ``label`` is the dim's name as
        :meth:`bucket_stats` and :meth:`bucket_output_axes` spell it (the ``dim_param``, ``"input[axis]"`` for a
        key ``(input, axis)``, parts joined by ``+`` for a tuple key); ``sizes`` the ascending bucket sizes
        (ints); ``sites`` every ``(input name, axis)`` padded along that dim (every input axis sharing the
        ``dim_param``).

    Raises:
        CaptureError: the session has no ``buckets=``.
    """
    if self._oc_buckets is None:
        raise CaptureError("bucket_dims() needs a session made with buckets=")
    return self._oc_buckets.dim_layout()


def bucket_output_axes(self, example_feeds: Mapping[str, Any] | None = None) -> dict[str, dict[str, tuple]]:
    """Which axes of each output follow each bucketed dim: the axes plain :meth:`run` slices back to the
    request's size (e.g. to split a batch of several requests back per request).

    Decided from the model's behaviour, not its dim names: by the first bucketed run, or, if none ran yet, now
    by two uncaptured runs with the bucketed dims at their two smallest sizes (on the host inputs
    ``example_feeds``, cut or zero-padded along the bucketed axes; ``None``: zeros), or as declared in
    ``output_axes=``.

    Args:
        example_feeds: ``{input: numpy array}`` whose non-bucketed dynamic dims the probe runs use; only read
            when the relations are not decided yet. ``None``: zeros, only when every dynamic dim is bucketed.

    Returns:
        ``{output name: {dim label (see :meth:`bucket_dims`): (axis, ...)}}`` for every output, axes ascending.
        A dim an output does not follow is absent: ``{"scores": {"batch": (0,)}, "feat": {"batch": (1,)},
        "pooled": {}}``. Axes declared with a size function in ``output_axes=`` (their length is a function of
        the dim, not the dim) and outputs declared ``None`` are not listed.

    Raises:
        CaptureError: the session has no ``buckets=``; ``example_feeds`` do not fit the model's inputs, or are
            ``None`` with non-bucketed dynamic dims; an output whose relation cannot be measured (declare it in
            ``output_axes=``); the model fails on the padded probe feeds; (``kind`` ``"fork"``) in an
            ``os.fork()`` child of the process that made the session.
    """
    if self._oc_buckets is None:
        raise CaptureError("bucket_output_axes() needs a session made with buckets=")
    if FORKED_DEVICES:  # its probe runs: refused in an os.fork() child (ortcapture._ort.sync.Origin)
        self._oc_origin.check("bucket_output_axes()")
    return self._oc_buckets.output_axes(example_feeds)
