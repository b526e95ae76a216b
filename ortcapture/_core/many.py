"""``CapturedGraph.run_many``'s steps: a stream of requests overlapped with the replays (page-locked staging).

The functions taking ``self`` are methods of :class:`ortcapture._core.graph.CapturedGraph` (assigned in its class
body) or functions of one graph that ``run_many`` calls; the stream calls each graph of it (the graph and its
buffer-set copies) only through the graph's public-named steps (``ensure_thread``, ``many_begin``, ``many_feed``,
``many_replay``, ``many_end``, ``settle_queued``).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ortcapture._core.reference import check_frozen
from ortcapture._ort import compute_stream
from ortcapture._transfer import copy as tcopy
from ortcapture._transfer import staging as _staging
from ortcapture._transfer import targets as ttargets
from ortcapture.errors import CaptureError, TransferError


def refuse_inside_many(self) -> None:
    import threading

    if self._many == threading.get_ident():
        raise CaptureError("run() of a graph while a run_many() of it iterates in this thread: its buffers "
                           "belong to the iterator until it ends (finish or close() it first)")



def ensure_thread(self) -> None:
    """Give the calling thread its CUDA graph of this id now, as :meth:`run` does before its first replay there (once
    per thread; a no-op off CUDA). Raises :class:`GraphReleasedError` after ``release()``."""
    cs = self._cs
    while True:
        with cs.guard:
            if self._released:
                self._raise_released()
            # cs.thread_has(graph_id) inlined: off CUDA every thread may replay; on CUDA the thread's own set
            if not self._captured or not cs.per_thread or self.graph_id in (
                    getattr(cs.tls, "graphs", None) or ()):  # CaptureState's per-thread graphs
                return
        self._capture_for_thread()


# -- a graph's own steps of a run_many over it and its buffer-set copies: methods of CapturedGraph (:meta private:
# for users), called by the functions below on each graph of the stream (the caller holds the session guard)

def many_begin(self, ident: int):
    """run_many's step: take this graph for the iterating thread ``ident``; its host staging, or ``None`` when the
    thread has no CUDA graph of the id yet (:meth:`ensure_thread` outside the guard, then again). Raises
    :class:`GraphReleasedError` after ``release()``, :class:`CaptureError` when a run_many holds it already.

    :meta private:"""
    if self._released:
        self._raise_released()
    if self._many is not None:
        raise CaptureError("run_many() of a graph that a run_many() iterates already")
    if self._captured and not self._cs.thread_has(self.graph_id):
        return None
    self._many = ident
    return self.staging_now()


def many_end(self) -> None:
    """run_many's step: let go of this graph (:meth:`many_begin`).

    :meta private:"""
    self._many = None


def many_feed(self, staging, upload, rest: dict) -> None:
    """run_many's step, before a replay: raise :class:`GraphReleasedError` after ``release()``; send ``upload``
    (names of page-locked inputs the helper filled, or ``None``) and wait for ``staging``'s uploads; copy ``rest``
    (checked) into the fixed inputs.

    :meta private:"""
    if self._released:
        self._raise_released()
    if upload is not None:
        staging.upload_async({name: staging.host_inputs[name] for name in upload})
    staging.wait()
    if rest:
        ttargets.copy_feeds(self._targets, rest)


def many_replay(self, job, staging, names):
    """run_many's step: replay (declared state carried), then wait for the helper's ``job`` (its result is returned)
    and read the outputs into ``staging``'s page-locked buffers, the outputs marked as being rewritten throughout.

    :meta private:"""
    self._generation += 1
    try:
        self._replay()
        if self._state:
            tcopy.copy(self._state_src, self._state_dst)
        done = job.result() if job is not None else None  # before the readback: one buffer set reuses the buffers
        staging.read(dict.fromkeys(names))
    finally:
        self._generation += 1
    return done


def settle_queued(self) -> None:
    """After a failed or interrupted replay: wait for the feed copies queued on the session's compute stream
    (``FeedTargets.stream``), so none stays in flight while its source is reused; never raises.

    :meta private:"""
    targets = getattr(self, "_targets", None)
    stream = getattr(targets, "stream", None)
    if stream is not None:
        compute_stream.settle(stream[0])


# -- run_many over a graph and its copies: the stream (functions of the graph that run_many calls)

def many_iter(self, it, graphs, mode):
    n = len(graphs)
    if not self._pin_ok:  # no asynchronous copies to overlap: one run per request
        for k, feeds in enumerate(it):
            if n > 1:
                _check_complete(graphs[0], feeds)
            yield graphs[k % n].run(feeds, copy_outputs=mode)
        return
    import threading
    from concurrent.futures import ThreadPoolExecutor

    cs = self._cs
    probe = cs.capture_probe
    me = threading.get_ident()
    taken: list = []
    stagings: list = []
    ex = None
    while True:  # every graph captured for this thread, checked again under the guard
        for g in graphs:
            g.ensure_thread()
        cs.guard.__enter__()
        try:
            for g in graphs:
                st = g.many_begin(me)
                if st is None:
                    break
                taken.append(g)
                stagings.append(st)
        except BaseException:
            for g in taken:
                g.many_end()
            cs.guard.__exit__(None, None, None)
            raise
        if len(taken) == n:
            break
        for g in taken:
            g.many_end()
        taken, stagings = [], []
        cs.guard.__exit__(None, None, None)
    try:
        ex = ThreadPoolExecutor(1, thread_name_prefix="ortcapture-run-many")
        yield from pipeline(self, it, graphs, stagings, mode, ex, probe)
    finally:
        if ex is not None:
            ex.shutdown(wait=True)  # the helper's copies queued, then waited for: none in flight after the guard
            for st in stagings:
                st.wait()
        for g in taken:
            g.many_end()
        cs.guard.__exit__(None, None, None)


def pipeline(self, it, graphs, stagings, mode, ex, probe):
    """run_many's steps (:func:`pipeline_steps`); where they fail, the feed copies queued on each graph's
    compute stream are waited for before the error propagates."""
    try:
        yield from pipeline_steps(self, it, graphs, stagings, mode, ex, probe)
    except BaseException:
        for g in graphs:
            g.settle_queued()
        raise


def pipeline_steps(self, it, graphs, stagings, mode, ex, probe):
    """run_many's steps, the guard held (see there). Step k: wait for request k's copies; hand request k+1 to
    the helper (page-locked fill, and its upload into the other buffer set with copies >= 2; request k-1's
    outputs copied out); replay k; read k's outputs back; yield k-1's (``"pinned"``: k's)."""
    n = len(graphs)
    names = self._output_names
    cs = self._cs  # the copies are captured on the same session (capture(..., copies=N))
    end = object()
    feeds = next(it, end)
    if feeds is end:
        return
    host, rest = _split_request(graphs[0], stagings[0], feeds, n)
    if probe is not None and probe():  # before the first copy, as every step checks before its replay
        cs.check_foreign_capture()
    stagings[0].upload_async(host)
    pending = None  # request k-1's buffer set index, outputs not yet copied out (copy_outputs=True)
    k = 0
    while True:
        i = k % n
        g, st = graphs[i], stagings[i]
        if probe is not None and probe():
            cs.check_foreign_capture()
        # n == 1: the helper filled the page-locked buffers during the last replay: send them now
        g.many_feed(st, host if n == 1 and k else None, rest)
        nxt = next(it, end)
        error = None
        job = None
        if nxt is not end:
            j = (k + 1) % n
            try:
                host, rest = _split_request(graphs[j], stagings[j], nxt, n)
            except Exception as exc:  # noqa: BLE001 - raised once request k's outputs are out
                error, nxt = exc, end
        if nxt is not end:
            job = ex.submit(_stage_job, stagings[j], host, n > 1,
                            stagings[pending] if pending is not None else None, names)
        elif pending is not None:
            job = ex.submit(_stage_job, None, {}, False, stagings[pending], names)
        done = g.many_replay(job, st, names)
        if done is not None:
            yield done
        if mode == "pinned":
            yield [st.host_outputs[name] for name in names]
            pending = None
        else:
            pending = i
        if error is not None:
            if pending is not None:
                yield [_staging.host_copy(st.host_outputs[name]) for name in names]
            raise error
        if nxt is end:
            if pending is not None:
                yield [_staging.host_copy(st.host_outputs[name]) for name in names]
            return
        feeds = nxt
        k += 1


def _check_complete(graph, feeds) -> None:
    """run_many with several buffer sets: every request feeds every input."""
    if not isinstance(feeds, Mapping):
        raise TransferError(f"each request must be a mapping {{input name: value}}, got {type(feeds).__name__}")
    missing = [n for n in graph.inputs if n not in feeds]
    if missing:
        raise TransferError(f"run_many over {graph.copies} buffer sets needs every input in every request; "
                            f"missing {missing}")



def _split_request(graph, staging, feeds, n: int) -> tuple[dict, dict]:
    """A request checked in full before anything of it is copied: ``(numpy feeds the staging takes, the rest)``;
    the rest are checked as :meth:`CapturedGraph.run` checks them (host-read values included)."""
    if not isinstance(feeds, Mapping):
        raise TransferError(f"each request must be a mapping {{input name: value}}, got {type(feeds).__name__}")
    if n > 1:
        _check_complete(graph, feeds)
    frozen = graph.frozen_inputs
    if frozen:
        check_frozen(frozen, feeds)
    host, rest = {}, {}
    for name, v in feeds.items():
        dst = graph.inputs.get(name)
        if dst is None:
            raise TransferError(f"unknown input {name!r}; the inputs are {list(graph.inputs)}")
        if type(v) is np.ndarray and staging.takes(name, v):
            host[name] = v
        else:
            tcopy.check_source(dst, v)  # the checks of the copy made later
            rest[name] = v
    return host, rest



def _stage_job(staging, host, send: bool, previous, names):
    """run_many's helper thread (the iterating thread holds the guard, so the CUDA gate, and waits for this):
    request n+1's numpy feeds into ``staging``'s page-locked buffers (``send``: and their host-to-device copies
    queued), then ``previous``'s outputs copied out as new arrays (or ``None``)."""
    if staging is not None and host:
        from ortcapture._ort.cudart import current_device

        with current_device(staging.device_id):
            if send:
                staging.upload_async(host, settle_first=False)
            else:
                staging.fill(host)
    if previous is None:
        return None
    return [_staging.host_copy(previous.host_outputs[name]) for name in names]
