"""Merging the batches queued at a session replica into fuller runs (no Ray).

A session replica replays one run at a time on its session's replay thread. Under load the tier replicas' batches
queue behind the run in progress: on an H100 at 32 clients a batch's Ray round trip took 28 ms against 3.4 ms of
run, for batches of ~2.5 rows, and a replay costs nearly as much for 2 rows as for 8 (YOLOv8n: 1.6 ms at batch 1,
~3 ms at 8). So when the replay thread takes work it takes every batch queued, and :func:`merge_runs` joins their
runs into runs of at most ``max_rows`` rows, in arrival order: fewer, fuller replays. :func:`split_answer` cuts a
merged run's answer back into each original run's answer.

Runs are merged only when every model input carries the batched dim on axis 0 (:func:`mergeable`): then any two
checked runs agree on every other dim and can share a replay. A model with an input that is one value per run
(no batched dim) keeps its runs apart. Rows in CUDA shared memory (:class:`~ortcapture.serving.cuda_shm.DeviceRows`)
merge with rows in CUDA shared memory: their references are listed one after another (the session replica gathers
them on the device), never copied here. Host rows are joined into a :class:`MergeScratch` when one is given
(:func:`iter_merged_runs`): one buffer per input, reused run after run and, on CUDA, page-locked, so the joined rows
go to the graph's input buffer with one DMA instead of a second host copy into the graph's staging (measured on an
H100, 32 clients: joining and that second copy were a third of the replay thread's busy time). Where every part
already lies in page-locked memory (the CUDA session replica's batch slots; ``listed``), the parts are not joined
at all but listed (:class:`~ortcapture.serving.requests.HostRows`) and copied to the device one DMA each: joining
into the scratch was still 28 % of the replay thread's samples at 32 clients (py-spy, H100, 2026-12-07). With
:func:`prefetched` the next merged run is joined on another thread while the current one runs, into the scratch's
other set of buffers (``MergeScratch(sets=2)``; measured on an H100 before it, 32 clients: joining was still 21 % of
the replay thread's busy time).
"""
from __future__ import annotations

import math
import mmap
from concurrent.futures import Executor, Future
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ortcapture.serving.cuda_shm import DeviceRows
from ortcapture.serving.requests import HostRows, join_into, take
from ortcapture.transfer import pin_host_memory


def mergeable(input_names: Sequence[str], batch_axes: Mapping[str, int]) -> bool:
    """Whether runs of a model with these inputs may be merged: each input batched on axis 0."""
    return bool(input_names) and all(batch_axes.get(n) == 0 for n in input_names)


def _kind(feeds: Mapping[str, Any]) -> tuple | None:
    """What a run's feeds are, per input: ``True`` rows in CUDA regions, ``False`` a numpy array; ``None`` for any
    other value (e.g. a CUDA ``OrtValue``: such a run stays alone)."""
    kinds = []
    for name, v in feeds.items():
        if isinstance(v, DeviceRows):
            kinds.append((name, True))
        elif isinstance(v, np.ndarray):
            kinds.append((name, False))
        else:
            return None
    return tuple(kinds)


def merge_runs(runs: Sequence[tuple[Mapping[str, Any], Sequence[int]]], max_rows: int, merge: bool = True
               ) -> list[tuple[list[int], dict[str, Any], list[int]]]:
    """Group ``runs`` (``[(feeds, rows)]``, in order) into merged runs of at most ``max_rows`` rows.

    Returns:
        ``[(members, feeds, rows)]``: the indices of the runs merged (consecutive, in order), their feeds joined
        along axis 0 (one member: its own feeds, no copy; :class:`~ortcapture.serving.cuda_shm.DeviceRows`: their
        parts listed one after another), and their requests' rows one after another. With ``merge`` false every run
        stays alone; runs merge only with runs whose every input is of the same kind (numpy, or rows in CUDA
        regions); a run with a feed of any other kind stays alone.
    """
    return list(iter_merged_runs(runs, max_rows, merge))


def iter_merged_runs(runs: Sequence[tuple[Mapping[str, Any], Sequence[int]]], max_rows: int, merge: bool = True,
                     into: Callable[[str, tuple, np.dtype], np.ndarray | None] | None = None,
                     listed: Callable[[np.ndarray], bool] | None = None
                     ) -> Iterator[tuple[list[int], dict[str, Any], list[int]]]:
    """:func:`merge_runs`, each merged run joined only when it is taken. ``into(name, shape, dtype)``: where input
    ``name``'s joined host rows are written (an array of exactly that shape and dtype, e.g. a :class:`MergeScratch`
    view that the next merged run overwrites), or ``None`` for a new array — so finish with each merged run, the
    copies from its feeds included, before taking the next (the session replica does: one run at a time on its
    replay thread, finished when its run returns). ``listed(part)``: an input whose every part it says yes to is not
    joined but listed as :class:`~ortcapture.serving.requests.HostRows` where ``HostRows.of`` takes them (the CUDA
    session replica's parts in page-locked batch slots: it copies each to the device, no host copy). A merged run
    whose join raised comes as ``(members, exception, rows)``: its calls get that exception, the next merged runs
    are still joined."""
    groups: list[list[int]] = []
    used, last = 0, None
    for i, (feeds, rows) in enumerate(runs):
        n = sum(int(r) for r in rows)
        kind = _kind(feeds)
        if merge and kind is not None and kind == last and used + n <= max_rows:
            groups[-1].append(i)
            used += n
        else:
            groups.append([i])
            used, last = n, kind
    for members in groups:
        if len(members) == 1:
            feeds, rows = runs[members[0]]
            yield members, dict(feeds), [int(r) for r in rows]
            continue
        rows = [int(r) for i in members for r in runs[i][1]]
        if isinstance(into, MergeScratch):  # each joined run in the scratch's next set of buffers
            into.begin()
        try:
            joined = _join(runs, members, into, listed)
        except Exception as exc:  # noqa: BLE001 - this merged run's calls get it, the round goes on
            yield members, exc, rows
            continue
        yield members, joined, rows


def _join(runs, members: list[int], into, listed=None) -> dict[str, Any]:
    """The feeds of the runs ``members`` joined along axis 0 (see :func:`iter_merged_runs`)."""
    joined = {}
    for name, v in runs[members[0]][0].items():
        if isinstance(v, DeviceRows):
            joined[name] = DeviceRows.of([p for i in members for p in runs[i][0][name].parts])
            continue
        parts = [runs[i][0][name] for i in members]
        if listed is not None and all(listed(p) for p in parts):
            try:
                joined[name] = HostRows.of(parts)  # each part copied to the device on its own
                continue
            except ValueError:  # parts HostRows cannot list (other dtypes, not C-contiguous): joined below
                pass
        dst = into(name, (sum(p.shape[0] for p in parts), *parts[0].shape[1:]), np.result_type(*parts)) \
            if into is not None else None
        # the staging threads' copies (the replay thread's time), or numpy's own join
        joined[name] = join_into(parts, 0, dst) if dst is not None else np.concatenate(parts, axis=0)
    return joined


_END = object()


def _ahead(items: Iterator, executor: Executor) -> Future:
    """The next of ``items`` (or ``_END``) taken on ``executor`` — or here, at once, when the executor was shut down
    (a replica closing mid-round): the round goes on, only without the overlap."""
    try:
        return executor.submit(next, items, _END)
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        fut: Future = Future()
        try:
            fut.set_result(next(items, _END))
        except Exception as exc:  # noqa: BLE001 - raised at its item, as from the executor
            fut.set_exception(exc)
        return fut


def prefetched(items: Iterator, executor: Executor) -> Iterator:
    """``items`` in order, each next one taken on ``executor`` while the caller works on the current one — so
    :func:`iter_merged_runs` joins merged run k + 1 while run k replays. Taking item k + 1 starts only once the caller
    asks for item k, i.e. after it finished with item k − 1: with ``MergeScratch(sets=2)`` as ``into``, a run's
    buffers are never rejoined under it. An exception raised while taking an item is raised here at that item.
    Closing the generator (or leaving a ``for`` over it) waits for an item being taken, so nothing writes into the
    scratch afterwards. When ``executor`` has been shut down, the next items are taken on the caller's thread."""
    pending = _ahead(items, executor)
    try:
        while True:
            item = pending.result()
            if item is _END:
                pending = None
                return
            pending = _ahead(items, executor)
            yield item
    finally:
        if pending is not None:
            try:
                pending.result()  # an item being taken: finished before the caller goes on
            except BaseException:  # noqa: BLE001 - its exception belongs to an item nobody asked for
                pass


class MergeScratch:
    """The buffers :func:`iter_merged_runs` joins host rows into (its ``into``): one per input, made for ``max_rows``
    rows on first use (grown if a later run's other dims need more) and reused by every later merged run. Each is its
    own anonymous memory mapping (page-aligned: no page shared with other memory). With ``pin`` (the session replica
    on CUDA, where it page-locks the batch slots too) each is page-locked (:func:`ortcapture.transfer.
    pin_host_memory`), so a merged run's rows reach the graph's input buffer with one DMA; when the driver will not
    lock one, the scratch turns off (``error`` says why; rows are joined into new arrays as without it). For one
    thread at a time: an array it handed out is overwritten by the next merged run of its input — with ``sets=2`` by
    the one after next (:meth:`begin` moves on to the next set at each merged run, so :func:`prefetched` can join
    one run while the one before runs). :meth:`close` (between runs, with nothing being joined) unpins and drops
    them; after it, nothing is handed out."""

    def __init__(self, pin: bool, max_rows: int = 1, sets: int = 1) -> None:
        self.pin = pin
        self.max_rows = max(1, int(max_rows))
        self.sets = max(1, int(sets))
        self._turn = 0
        self._bufs: dict[tuple[int, str], tuple[np.ndarray, Any]] = {}
        #: why page-locking a buffer failed (the scratch is then off), or ``None``
        self.error: str | None = None
        #: merged inputs joined here
        self.used = 0
        #: :meth:`close` ran
        self.closed = False

    def begin(self) -> None:
        """A new merged run: its inputs go into the next set of buffers."""
        self._turn = (self._turn + 1) % self.sets

    def __call__(self, name: str, shape: tuple, dtype) -> np.ndarray | None:
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        if self.closed or self.error is not None or n == 0:
            return None
        key = (self._turn, name)
        held = self._bufs.get(key)
        if held is None or held[0].nbytes < n:
            self._drop(key)
            row = n // max(1, int(shape[0])) if shape else n
            size = -(-max(n, row * self.max_rows) // mmap.PAGESIZE) * mmap.PAGESIZE
            buf = np.frombuffer(mmap.mmap(-1, size), np.uint8)  # unmapped when the last array of it is gone
            pin = None
            if self.pin:
                try:
                    pin = pin_host_memory(buf)
                except (RuntimeError, ValueError) as exc:  # not lockable here: joined into new arrays from now on
                    self.error = f"{type(exc).__name__}: {exc}"[:300]
                    return None
            self._bufs[key] = held = (buf, pin)
        self.used += 1
        return held[0][:n].view(dtype).reshape(shape)

    def _drop(self, key: tuple[int, str]) -> None:
        held = self._bufs.get(key)
        if held is not None and held[1] is not None:
            held[1].close()  # raises: kept (still page-locked)
        self._bufs.pop(key, None)

    def close(self) -> None:
        """Unpin and drop every buffer; hand out nothing from now on (each buffer whose unpinning fails is kept, and
        the first error raised). Call it where no run reads from them (the replay thread, between runs)."""
        self.closed = True
        first = None
        for key in list(self._bufs):
            try:
                self._drop(key)
            except Exception as exc:  # noqa: BLE001
                first = first or exc
        if first is not None:
            raise first


def split_answer(answer: Mapping[str, Any], member_rows: Sequence[Sequence[int]]) -> list[dict]:
    """A merged run's answer (``{"outputs", "axes"}`` or ``{"answers": [...]}``, per request) cut back into one
    answer per member run (``member_rows``: each member's requests' rows, in order). Outputs are views of the merged
    run's arrays."""
    if "answers" in answer:
        out, k = [], 0
        for rows in member_rows:
            out.append({"answers": list(answer["answers"][k:k + len(rows)])})
            k += len(rows)
        return out
    outs, axes = answer["outputs"], answer["axes"]
    out, offset = [], 0
    for rows in member_rows:
        n = sum(int(r) for r in rows)
        out.append({"outputs": {name: take(o, axes[name], offset, offset + n) for name, o in outs.items()},
                    "axes": axes})
        offset += n
    return out
