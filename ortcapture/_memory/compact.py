"""Compaction: a real release for captured graphs on EPs whose ``release_captured_graph`` frees nothing.

ORT never frees a captured CUDA/TensorRT graph: ``release_captured_graph`` is a no-op there, so ortcapture retires
released ids (:mod:`ortcapture._core.registry`) and the graph's device memory stays until the C session dies (measured on
the H200 with onnxruntime-gpu 1.31.1: 150 capture -> run -> release cycles of one ``CapturedGraph`` grew device
memory by 196 MiB, 1.3 MiB a cycle). :func:`compact` rebuilds each capturing C session of a session family (same
model, ``SessionOptions`` and providers: ORT's own re-creation, as ``set_providers``) and captures every live
:class:`~ortcapture.graph.CapturedGraph` again, side-effect free: inputs, declared state and the initial state keep
their values, outputs are restored to their values before (``ReplayOutput`` s handed out before go stale). CUDA
graphs are per thread in ORT: the compacting thread captures each graph; every other thread captures again on its
next run (``CaptureState.ensure_thread``).

When: :class:`~ortcapture._memory.ledger.DeviceLedger` (one per session family) charges each graph released on an EP that
cannot free it and says when the retired total passes the family's threshold (:func:`maybe_compact`). WebGPU frees
released graphs in ORT >= 1.30, so nothing is retired there and automatic compaction never runs; an explicit
``compact()`` still rebuilds. Each graph's own buffers are bound again (references a caller holds stay valid): ORT
1.31/1.32 accept a session-scoped WebGPU OrtValue on any session of its WebGPU context; where ORT refuses, the graph
gets new buffers from the new C session's allocator, filled with the old values. Measured on the
software adapter (ORT 1.32): a WebGPU C session destroyed while another lives on the same WebGPU device keeps its
weights' memory (raw ORT too: +16 MiB per session of a 16 MiB MatMul), so an explicit WebGPU ``compact()`` costs
host/device memory rather than returning it.

What a compaction returns on CUDA: the driver keeps the destroyed graphs' memory and the next captures reuse it
(see :mod:`ortcapture._memory.ledger`), so device memory in use plateaus instead of growing; it is not handed back to the
device (``cudaDeviceGraphMemTrim`` and ``cudaMemPoolTrimTo`` return none of it either: measured 659 -> 659 MiB).

Raw-path graphs (``run_with_iobinding`` with a ``gpu_graph_id``) cannot survive a rebuild: their IOBinding belongs
to the old C session (ORT >= 1.30 ties it there) and only the caller can bind again. While any is captured,
:func:`compact` refuses (:class:`~ortcapture.errors.CaptureError`) and the automatic one does not run. It also
refuses when an external data file of the model changed or is gone since construction (the graph itself is rebuilt
from the bytes read then: a model file replaced or deleted since changes nothing). ORT destroys the old C session before it builds the
new one (as ``set_providers`` does; on CUDA the new one then reuses the old one's memory), so a build that fails
leaves no C session: the graphs are released and :class:`RebuildError` says so; an automatic compaction warns
instead and turns itself off (:func:`maybe_compact`).
"""
from __future__ import annotations

import gc
import warnings

from ortcapture._ort import compat
from ortcapture.errors import CaptureError


def raw_path_graphs(family) -> list[int]:
    """``gpu_graph_id`` s of the family captured through the raw IOBinding path (no CapturedGraph owns them)."""
    out = []
    for st in family.members():
        if st.registry is None:
            continue
        for gid in st.registry.graph_ids:
            rec = st.registry.get(gid)
            if rec is not None and rec.owner is None:
                out.append(gid)
    return out


def _refusal(family) -> str | None:
    for st in family.members():  # the model is rebuilt from the bytes read at construction; its weights from disk
        check = getattr(st, "check_model", None) if st.rebuild_session is not None else None
        if check is not None:
            try:
                check("rebuild the C session (compact())")
            except CaptureError as exc:
                return str(exc).rstrip(".")
    raw = raw_path_graphs(family)
    if raw:
        return (f"raw IOBinding graph(s) {raw} are captured; their IOBinding belongs to the C session that "
                "compaction replaces (ORT >= 1.30 ties it there) and only you can bind them again. Release them "
                "(sess.release_captured_graph(id)) first, or use sess.capture(feeds), whose graphs survive it")
    for st in family.members():
        if (st.info is not None and st.info.device_type == "webgpu" and compat.has_session_ortvalues()
                and st.pool is not None and len(st.pool)):
            return (f"{len(st.pool)} buffer(s) from sess.allocate() are alive; on WebGPU they belong to the C "
                    "session that compaction replaces (and keep it alive), and the IOBindings made with them belong "
                    "to it too. Drop them first")
    return None


def compact(family, *, automatic: bool = False) -> bool:
    """Rebuild every capturing C session of ``family`` (a session's family :class:`~ortcapture._core.state.CaptureState`)
    and capture its live CapturedGraphs again (see the module docstring). Returns True when it compacted; with
    ``automatic`` it returns False instead of raising when it must not run.

    Raises:
        CaptureError: raw-path graphs are captured (or, on WebGPU, ``allocate()`` buffers are alive); or a graph
            failed to capture again (it is then released; the others are fine).
    """
    family.release_collected()
    failures = []
    with family.capture_guard:
        if automatic and not family.ledger.due():
            return False  # another thread compacted meanwhile
        why = _refusal(family)
        if why is not None:
            if automatic:
                return False
            raise CaptureError(f"compact() refused: {why}.")
        family.ledger.compacting()
        for st in [m for m in family.members() if m.info is not None and m.rebuild_session is not None]:
            with st.capture_guard:
                failures += _rebuild(family, st)
        family.ledger.compacted()
        gc.collect()  # the old C sessions, and with them their CUDA graphs, are gone when compact() returns
    if failures:
        raise CaptureError("compact(): graph(s) failed to capture again on the rebuilt session and were released: "
                           + "; ".join(f"gpu_graph_id={gid}: {exc}" for gid, exc in failures))
    return True


def _rebuild(family, st) -> list:
    graphs = [g for g in family.graphs.graphs() if g.session is st.session and not g.released]
    move = st.info.device_type == "webgpu" and compat.has_session_ortvalues()
    saved = {id(g): g.snapshot(everything=move) for g in graphs}
    try:
        st.rebuild_session()
    except compat.RebuildFailed as exc:
        _rebuild_failed(family, st, graphs, exc)
    family.ledger.forget(st.registry.graph_ids)
    st.rebuilt()
    failures = []
    for g in graphs:
        try:
            g.recapture(saved[id(g)], move=move)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own types; reported together below
            family.graphs.pop(g.graph_id)
            g.detach()
            failures.append((g.graph_id, exc))
    return failures


class RebuildError(CaptureError):
    """compact() could not build the C session again (see :func:`_rebuild_failed`)."""


def _rebuild_failed(family, st, graphs, exc) -> None:
    """ORT could not build the new C session (e.g. out of device memory); it had destroyed the old one first, as
    in ``set_providers``. The member's graphs are released (their replays would reach no C session) and
    :class:`RebuildError` says so."""
    for g in graphs:
        family.graphs.pop(g.graph_id)
        g.detach()
    st.rebuilt()
    ids = [g.graph_id for g in graphs]
    raise RebuildError(
        f"compact(): ORT could not build the C session again ({exc}). ORT destroys the old C session first (as in "
        f"set_providers), so this session cannot run any more and its graph(s) {ids} were released; make a new "
        "session."
    ) from exc.cause


def maybe_compact(family) -> bool:
    """:func:`compact` when the family's retired graph memory passed its threshold and nothing forbids it (call
    outside any guard). True when it compacted. It never raises into the ``release()``/``capture()`` that triggered
    it: a failure is a ``RuntimeWarning`` instead, and where the C session could not be built again automatic compaction is turned off for the family (``compact_threshold`` becomes ``None``)."""
    if not family.ledger.due():
        return False
    try:
        return compact(family, automatic=True)
    except CaptureError as exc:
        if isinstance(exc, RebuildError):
            family.ledger.threshold = None
            exc = f"{exc} Automatic compaction is now off for this session (compact_threshold=None)."
        warnings.warn(f"ortcapture: automatic compaction failed: {exc}", RuntimeWarning, stacklevel=3)
        return False
