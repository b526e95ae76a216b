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
them on the device), never copied here.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ortcapture.serving.cuda_shm import DeviceRows
from ortcapture.serving.requests import take


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
    out = []
    for members in groups:
        if len(members) == 1:
            feeds, rows = runs[members[0]]
            out.append((members, dict(feeds), [int(r) for r in rows]))
            continue
        joined = {}
        for name, v in runs[members[0]][0].items():
            if isinstance(v, DeviceRows):
                joined[name] = DeviceRows.of([p for i in members for p in runs[i][0][name].parts])
            else:
                joined[name] = np.concatenate([runs[i][0][name] for i in members], axis=0)
        out.append((members, joined, [int(r) for i in members for r in runs[i][1]]))
    return out


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
