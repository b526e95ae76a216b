"""``CapturedGraph.run_many``'s steps: a stream of requests overlapped with the replays (page-locked staging).

Moved out of :mod:`ortcapture.graph` unchanged. The functions taking ``self`` are methods of
:class:`ortcapture._core.graph.CapturedGraph` (assigned in its class body); the others are their helpers.
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
    """Give the calling thread its CUDA graph of this id (as :meth:`run` does before its first replay)."""
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
    while True:  # every graph captured for this thread, checked again under the guard
        for g in graphs:
            g._ensure_thread()  # noqa: SLF001
        cs.guard.__enter__()
        if all(not g._captured or cs.thread_has(g.graph_id) for g in graphs if not g._released):  # noqa: SLF001
            break
        cs.guard.__exit__(None, None, None)
    ex = None
    stagings: list = []
    owned = False
    try:
        for g in graphs:
            if g._released:  # noqa: SLF001
                g._raise_released()  # noqa: SLF001
            if g._many is not None:  # noqa: SLF001
                raise CaptureError("run_many() of a graph that a run_many() iterates already")
        stagings = [g._staging_now() for g in graphs]  # noqa: SLF001
        for g in graphs:
            g._many = me  # noqa: SLF001
        owned = True
        ex = ThreadPoolExecutor(1, thread_name_prefix="ortcapture-run-many")
        yield from self._pipeline(it, graphs, stagings, mode, ex, probe)
    finally:
        if ex is not None:
            ex.shutdown(wait=True)  # the helper's copies queued, then waited for: none in flight after the guard
            for st in stagings:
                st.wait()
        if owned:
            for g in graphs:
                g._many = None  # noqa: SLF001
        cs.guard.__exit__(None, None, None)



def settle_queued(self) -> None:
    """After a failed or interrupted replay: wait for the feed copies queued on the session's compute stream
    (``FeedTargets.stream``), so none stays in flight while its source is reused; never raises."""
    targets = getattr(self, "_targets", None)
    stream = getattr(targets, "stream", None)
    if stream is not None:
        compute_stream.settle(stream[0])



def pipeline(self, it, graphs, stagings, mode, ex, probe):
    """run_many's steps (:meth:`_pipeline_steps`); where they fail, the feed copies queued on each graph's
    compute stream are waited for before the error propagates."""
    try:
        yield from self._pipeline_steps(it, graphs, stagings, mode, ex, probe)
    except BaseException:
        for g in graphs:
            g._settle_queued()  # noqa: SLF001 - run_many's own graphs
        raise



def pipeline_steps(self, it, graphs, stagings, mode, ex, probe):
    """run_many's steps, the guard held (see there). Step k: wait for request k's copies; hand request k+1 to
    the helper (page-locked fill, and its upload into the other buffer set with copies >= 2; request k-1's
    outputs copied out); replay k; read k's outputs back; yield k-1's (``"pinned"``: k's)."""
    n = len(graphs)
    names = self._output_names
    end = object()
    feeds = next(it, end)
    if feeds is end:
        return
    host, rest = _split_request(graphs[0], stagings[0], feeds, n)
    if probe is not None and probe():  # before the first copy, as every step checks before its replay
        self._cs.check_foreign_capture()
    stagings[0].upload_async(host)
    pending = None  # request k-1's buffer set index, outputs not yet copied out (copy_outputs=True)
    k = 0
    while True:
        i = k % n
        g, st = graphs[i], stagings[i]
        if probe is not None and probe():
            g._cs.check_foreign_capture()  # noqa: SLF001
        if g._released:  # noqa: SLF001
            g._raise_released()  # noqa: SLF001
        if n == 1 and k:  # the helper filled the page-locked buffers during the last replay: send them now
            st.upload_async({name: st.host_inputs[name] for name in host})
        st.wait()
        if rest:
            ttargets.copy_feeds(g._targets, rest)  # noqa: SLF001
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
        g._generation += 1  # noqa: SLF001
        try:
            g._replay()  # noqa: SLF001
            if g._state:  # noqa: SLF001
                tcopy.copy(g._state_src, g._state_dst)  # noqa: SLF001
            done = job.result() if job is not None else None  # before k's readback: n == 1 reuses the buffers
            st.read(dict.fromkeys(names))
        finally:
            g._generation += 1  # noqa: SLF001
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
    if graph._frozen:  # noqa: SLF001 - the graph module's own helper
        check_frozen(graph._frozen, feeds)  # noqa: SLF001
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
