"""The device-memory ledger of a session family's captured graphs: when automatic compaction is due.

ORT never frees a captured CUDA/TensorRT graph (``release_captured_graph`` is a no-op there): a released graph's
device memory stays until its C session dies, and :mod:`ortcapture._memory.compact` rebuilds the C session to free it.
:class:`DeviceLedger` decides when, from ``cudaMemGetInfo`` (device bytes in use, ``total - free``, device-wide).

What the H200 showed (onnxruntime-gpu 1.31.1, CUDA 13), and why the ledger is not a plain sum per capture:

* A capture -> run -> release cycle holds ~0.13 MiB (a 64x64 two-node model) to ~0.9 MiB (YOLOv8n) until its C
  session dies, but ``cudaMemGetInfo`` moves in 2 MiB steps, so the change around one capture is 0 or 2+ MiB.
* Destroying the C session does not hand that memory back to the device: the driver keeps it, and the next captures
  reuse it (measured +0 around them). Raw ORT does the same (destroying a session after 100 captures of YOLOv8n left
  +370 MiB in use, reused by the next session).
* So after a compaction a per-capture measurement sees nothing; the retired total then grows too slowly and the
  intervals between compactions lengthen: 300 cycles of YOLOv8n at a 16 MiB threshold compacted after 25, 50, 75
  and 99 cycles and ended +76 MiB. With compaction every 40 cycles the same loop plateaus at +38 MiB for good.

The ledger therefore

1. charges each retired graph the larger of its own measurement and the family's **per-graph cost**: the growth of
   device memory in use per capture while the family is still growing (from the end of its first measured capture
   to its first compaction), frozen at that compaction once at least :data:`MIN_CAPTURES_TO_FREEZE` captures were
   measured (:meth:`DeviceLedger.per_graph`); and
2. is also due, once the retired graphs are charged at least half the threshold, when device memory in use passes the
   level it had when the previous compaction started by more than :meth:`DeviceLedger.slack`: the retired graphs
   no longer fit in what the driver kept (the per-graph cost was learned low). The half keeps another allocator's
   growth from compacting this family more than twice as often as its own releases warrant.

Both use device-wide numbers: memory another allocator (torch, another session) takes meanwhile counts too, which can
only bring a compaction forward. Where nothing is measured (no cuda-python; WebGPU before ORT 1.30, which cannot
release either) a retired graph counts the bytes of the buffers it pinned.
"""
from __future__ import annotations

import contextlib
import threading

from ortcapture._ort import cudart as _cudart

MiB = 1 << 20
#: bytes of retired (released but unfreeable) graph device memory that trigger an automatic compaction
DEFAULT_COMPACT_THRESHOLD = 256 * MiB
#: measured captures needed before the first compaction freezes the per-graph cost (fewer: it keeps learning)
MIN_CAPTURES_TO_FREEZE = 8


def device_in_use(device: int) -> int | None:
    """Bytes in use on CUDA ``device`` (``total - free`` from ``cudaMemGetInfo``, device-wide), or ``None``."""
    got = _cudart.mem_get_info(device)
    return None if got is None else got[1] - got[0]


class DeviceLedger:
    """Device memory of one session family's captured graphs, in bytes (see the module docstring)."""

    def __init__(self, threshold: int | None = DEFAULT_COMPACT_THRESHOLD) -> None:
        #: retired bytes that trigger an automatic compaction; ``None`` turns it off
        self.threshold = threshold
        #: compactions so far
        self.compactions = 0
        self._live: dict[int, int] = {}
        self._measured = 0  # own measurements (or pinned bytes) of the graphs retired since the last compaction
        self._count = 0  # graphs retired since the last compaction that were measured on a CUDA device
        self._device: int | None = None
        self._origin: int | None = None  # bytes in use after the family's first measured capture
        self._peak: int | None = None  # most bytes in use seen since then (while still learning)
        self._captures = 0  # measured captures after the first, while still learning
        self._frozen: int | None = None  # the per-graph cost, once frozen
        self._ceiling: int | None = None  # bytes in use when the previous compaction started
        self._now: int | None = None  # bytes in use at the last capture or release
        self._lock = threading.Lock()

    # -- measuring ------------------------------------------------------------------------------------------
    def _seen(self, used: int) -> None:
        self._now = used
        if self._frozen is None:
            if self._origin is None:
                self._origin = self._peak = used
            else:
                self._peak = max(self._peak, used)

    @contextlib.contextmanager
    def measure(self, graph_id: int, info):
        """Add the change of device memory in use around the block to ``graph_id`` (CUDA devices only; a no-op
        elsewhere) and learn the family's per-graph cost from it."""
        if info is None or info.device_type != "cuda":
            yield
            return
        before = device_in_use(info.device_id)
        try:
            yield
        finally:
            after = device_in_use(info.device_id)
            if before is not None and after is not None:
                with self._lock:
                    self._device = info.device_id
                    self._live[graph_id] = self._live.get(graph_id, 0) + max(0, after - before)
                    if self._frozen is None and self._origin is not None:
                        self._captures += 1
                    self._seen(after)

    def released(self, graph_id: int, freed: bool, pinned_bytes: int = 0) -> None:
        """``graph_id`` was released; unless the EP ``freed`` it, it is retired: charged as the module docstring says,
        or, nothing measured (not CUDA, or no cuda-python), the ``pinned_bytes`` of its bound buffers, which the
        unfreed graph keeps alive (measured on ORT 1.27 WebGPU, no release there: ~4 MiB a cycle with two 2 MiB
        buffers)."""
        with self._lock:
            nbytes = self._live.pop(graph_id, None)
            if freed:
                return
            if nbytes is None:
                self._measured += pinned_bytes
                return
            self._measured += nbytes
            self._count += 1
            device = self._device
        used = device_in_use(device) if device is not None else None
        if used is not None:
            with self._lock:
                self._seen(used)

    def forget(self, graph_ids) -> None:
        """Drop the live measurements of ``graph_ids`` (their C session is being rebuilt)."""
        with self._lock:
            for gid in graph_ids:
                self._live.pop(gid, None)

    # -- deciding -------------------------------------------------------------------------------------------
    def per_graph(self) -> int:
        """Bytes a captured graph holds until its C session dies, as learned (see the module docstring); 0 before
        two captures were measured."""
        if self._frozen is not None:
            return self._frozen
        if self._captures == 0 or self._origin is None:
            return 0
        return max(0, self._peak - self._origin) // self._captures

    @property
    def retired(self) -> int:
        """Bytes charged to the graphs retired since the last compaction."""
        with self._lock:
            return max(self._measured, self._count * self.per_graph())

    @property
    def live(self) -> int:
        """Bytes measured for the graphs captured now."""
        with self._lock:
            return sum(self._live.values())

    def slack(self) -> int:
        """How far device memory in use may pass the level of the previous compaction's start: ``threshold / 8``,
        at least the driver's 2 MiB step."""
        return max(2 * MiB, (self.threshold or 0) // 8)

    def due(self) -> bool:
        """Whether an automatic compaction should run now (see the module docstring)."""
        if self.threshold is None:
            return False
        retired = self.retired
        if retired > self.threshold:
            return True
        with self._lock:
            return (self._count > 0 and 2 * retired >= self.threshold and self._ceiling is not None
                    and self._now is not None and self._now > self._ceiling + self.slack())

    # -- compaction -----------------------------------------------------------------------------------------
    def compacting(self) -> None:
        """A compaction starts: remember device memory in use now, and freeze the per-graph cost if learned."""
        used = device_in_use(self._device) if self._device is not None else None
        with self._lock:
            if used is not None:
                self._seen(used)
                self._ceiling = used
            if self._frozen is None and self._captures >= MIN_CAPTURES_TO_FREEZE:
                self._frozen = self.per_graph()

    def compacted(self) -> None:
        """The compaction ran: nothing is retired any more."""
        with self._lock:
            self._measured = self._count = 0
            self.compactions += 1

    def describe(self) -> dict:
        return {"retired_bytes": self.retired, "live_bytes": self.live, "threshold": self.threshold,
                "compactions": self.compactions, "per_graph_bytes": self.per_graph()}


def check_threshold(value) -> int | None:
    """A compaction threshold: bytes as an integer >= 0 (``int`` or a numpy integer), or ``None`` (automatic
    compaction off). Raises :class:`~ortcapture.errors.CaptureError` otherwise (bools and floats included)."""
    import operator

    from ortcapture.errors import CaptureError

    if value is None:
        return None
    try:
        nbytes = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        nbytes = None
    if nbytes is None or nbytes < 0:
        raise CaptureError(f"compact_threshold must be bytes as an int >= 0 or None (off), got {value!r}")
    return nbytes
