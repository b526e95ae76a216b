"""Compaction: a real release for captured graphs on EPs whose ``release_captured_graph`` frees nothing.

ORT never frees a captured CUDA/TensorRT graph: ``release_captured_graph`` is a no-op there, so ortcapture retires
released ids (:mod:`ortcapture._registry`) and the graph's device memory stays until the C session dies (measured on
the H200 with onnxruntime-gpu 1.31.1: 150 capture -> run -> release cycles of one ``CapturedGraph`` grew device
memory by 196 MiB, 1.3 MiB a cycle). :func:`compact` rebuilds each capturing C session of a session family (same
model, ``SessionOptions`` and providers: ORT's own re-creation, as ``set_providers``) and captures every live
:class:`~ortcapture.graph.CapturedGraph` again, side-effect free: inputs, declared state and the initial state keep
their values, outputs are restored to their values before (``ReplayOutput`` s handed out before go stale). CUDA
graphs are per thread in ORT: the compacting thread captures each graph; every other thread captures again on its
next run (``CaptureState.ensure_thread``).

:class:`DeviceLedger` (one per session family) measures each graph's device memory as the change of
``cudaMemGetInfo``'s free bytes around its capture (and around each per-thread capture), adds it to the retired
total when the graph is released on an EP that cannot free it, and :func:`maybe_compact` compacts automatically once
the retired total passes :attr:`DeviceLedger.threshold` bytes. Where nothing is measured (no cuda-python; WebGPU
before ORT 1.30, which cannot release either) a retired graph counts the bytes of the buffers it pinned. WebGPU frees
released graphs in ORT >= 1.30, so nothing is retired there and automatic compaction never runs; an explicit ``compact()`` still rebuilds (the graphs' buffers move to
the new C session's allocator: a WebGPU OrtValue from ``create_ortvalue_from_shape_and_type`` retains and may only
be bound through its own C session).

Raw-path graphs (``run_with_iobinding`` with a ``gpu_graph_id``) cannot survive a rebuild: their IOBinding belongs
to the old C session (ORT >= 1.30 ties it there) and only the caller can bind again. While any is captured,
:func:`compact` refuses (:class:`~ortcapture.errors.CaptureError`) and the automatic one does not run.
"""
from __future__ import annotations

import contextlib
import gc
import threading

from ortcapture import _compat as compat
from ortcapture._cudart import mem_get_info, trim_graph_memory
from ortcapture.errors import CaptureError

MiB = 1 << 20
#: bytes of retired (released but unfreeable) graph device memory that trigger an automatic compaction
DEFAULT_COMPACT_THRESHOLD = 256 * MiB


class DeviceLedger:
    """Device memory of one session family's captured graphs, in bytes (see the module docstring)."""

    def __init__(self, threshold: int | None = DEFAULT_COMPACT_THRESHOLD) -> None:
        #: retired bytes that trigger :func:`maybe_compact`; ``None`` turns automatic compaction off
        self.threshold = threshold
        #: bytes of released graphs still held by their C session
        self.retired = 0
        #: compactions so far
        self.compactions = 0
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def measure(self, graph_id: int, info):
        """Add the device-memory change around the block to ``graph_id`` (CUDA devices only; a no-op elsewhere)."""
        if info is None or info.device_type != "cuda":
            yield
            return
        before = mem_get_info(info.device_id)
        try:
            yield
        finally:
            after = mem_get_info(info.device_id)
            if before is not None and after is not None:
                with self._lock:
                    self._live[graph_id] = self._live.get(graph_id, 0) + max(0, before[0] - after[0])

    def released(self, graph_id: int, freed: bool, pinned_bytes: int = 0) -> None:
        """``graph_id`` was released; unless the EP ``freed`` it, its bytes count as retired: as measured around its
        capture, else (nothing measured: not CUDA, or no cuda-python) the ``pinned_bytes`` of its bound buffers, which
        the unfreed graph keeps alive (measured on ORT 1.27 WebGPU, no release there: ~4 MiB per cycle with two
        2 MiB buffers)."""
        with self._lock:
            nbytes = self._live.pop(graph_id, None)
            if not freed:
                self.retired += pinned_bytes if nbytes is None else nbytes

    def forget(self, graph_ids) -> None:
        with self._lock:
            for gid in graph_ids:
                self._live.pop(gid, None)

    @property
    def live(self) -> int:
        """Bytes measured for the graphs captured now."""
        with self._lock:
            return sum(self._live.values())

    def due(self) -> bool:
        return self.threshold is not None and self.retired > self.threshold

    def describe(self) -> dict:
        return {"retired_bytes": self.retired, "live_bytes": self.live, "threshold": self.threshold,
                "compactions": self.compactions}


def check_threshold(value) -> int | None:
    """A compaction threshold: bytes as an int >= 0, or ``None`` (automatic compaction off)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CaptureError(f"compact_threshold must be bytes as an int >= 0 or None, got {value!r}")
    return value


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
    raw = raw_path_graphs(family)
    if raw:
        return (f"raw IOBinding graph(s) {raw} are captured; their IOBinding belongs to the C session that "
                "compaction replaces (ORT >= 1.30 ties it there) and only you can bind them again. Release them "
                "(sess.release_captured_graph(id)) first, or use sess.capture(feeds), whose graphs survive it")
    for st in family.members():
        if (st.info is not None and st.info.device_type == "webgpu" and compat.has_session_ortvalues()
                and st.pool is not None and len(st.pool)):
            return (f"{len(st.pool)} buffer(s) from sess.allocate() are alive; on WebGPU they belong to the C "
                    "session that compaction replaces and could not be bound to the new one. Drop them first")
    return None


def compact(family, *, automatic: bool = False) -> bool:
    """Rebuild every capturing C session of ``family`` (a session's family :class:`~ortcapture._state.CaptureState`)
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
        for st in [m for m in family.members() if m.info is not None and m.rebuild_session is not None]:
            with st.capture_guard:
                failures += _rebuild(family, st)
        family.ledger.retired = 0
        family.ledger.compactions += 1
        devices = {m.info.device_id for m in family.members() if m.info is not None and m.info.device_type == "cuda"}
        if devices:
            gc.collect()  # the old C sessions, and with them their CUDA graphs, are gone before the trim
            for dev in sorted(devices):
                trim_graph_memory(dev)
    if failures:
        raise CaptureError("compact(): graph(s) failed to capture again on the rebuilt session and were released: "
                           + "; ".join(f"gpu_graph_id={gid}: {exc}" for gid, exc in failures))
    return True


def _rebuild(family, st) -> list:
    graphs = [g for g in family.graphs.graphs() if g.session is st.session and not g.released]
    move = st.info.device_type == "webgpu" and compat.has_session_ortvalues()
    saved = {id(g): g.snapshot(everything=move) for g in graphs}
    family.ledger.forget(st.registry.graph_ids)
    st.rebuild_session()
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


def maybe_compact(family) -> bool:
    """:func:`compact` when the family's retired graph memory passed its threshold and nothing forbids it (call
    outside any guard). True when it compacted."""
    if not family.ledger.due():
        return False
    return compact(family, automatic=True)
