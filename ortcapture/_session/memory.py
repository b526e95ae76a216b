"""Buffers, graph release and memory of ``InferenceSession``: ``allocate``, ``release_captured_graph``, ``compact``.

Moved out of :mod:`ortcapture.session` unchanged. The functions are methods of
:class:`ortcapture._session.session.InferenceSession` (assigned in its class body).
"""
from __future__ import annotations

from typing import Sequence

from ortcapture._core.run import check_graph_id
from ortcapture._memory import compact as _compact
from ortcapture._memory import ledger as _ledger
from ortcapture._ort import compat
from ortcapture._ort.sync import FORKED_DEVICES


def release_captured_graph(self, graph_annotation_id: int = 0) -> None:
    """Release a captured graph and unpin its IOBinding.

    WebGPU frees the graph and the id can be captured again. CUDA/TensorRT: ORT's release is a no-op (measured
    on onnxruntime-gpu 1.31.1: a new IOBinding run under the released id writes into the old buffers), so the
    id is retired — reusing it raises :class:`~ortcapture.errors.GraphReleasedError`; capture under a new id.
    A graph captured by :meth:`capture` on a shape-specialised sibling is released there.

    In an ``os.fork()`` child of the process that made the session it does nothing: ORT's release would reach
    the parent's device state, which does not survive fork (the session and its graphs are kept, unused).

    Raises:
        CaptureError: ``graph_annotation_id`` is not an int in [-1, 2**31-1].
    """
    gid = check_graph_id(graph_annotation_id)
    if FORKED_DEVICES and self._oc_origin.forked:
        return
    fam = self._oc_state.family
    with fam.guard:  # the family's lock first, then the member's (capture() takes them in that order)
        owner = fam.owner_of(gid) or self._oc_state
    owner.release(gid)


def compact(self) -> None:
    """Free the device memory of released graphs: rebuild the C session(s) and capture every live
    :class:`~ortcapture.graph.CapturedGraph` again (:mod:`ortcapture._memory.compact`).

    ORT never frees a captured CUDA/TensorRT graph (``release_captured_graph`` is a no-op there; measured on the
    H200: 0.13 MiB (a 64x64 two-node model) to 0.9 MiB (YOLOv8n) of device memory per capture -> run -> release
    cycle); the C session's destruction does. The CUDA driver keeps that memory for the next graphs rather than
    handing it back to the device, so device memory in use stops growing (a plateau) but does not fall. The
    session (and its shape-specialised siblings) is rebuilt with the same model, ``SessionOptions`` and
    providers; each live graph is captured again side-effect free — inputs, declared state and initial state
    keep their values, outputs keep theirs, and its ``gpu_graph_id`` stays. ``ReplayOutput`` s handed out
    before go stale (:class:`~ortcapture.errors.StaleOutputError`). CUDA graphs are per thread: every other
    thread captures again on its next ``run`` (once). Retired ids become free again. IOBindings from
    :meth:`io_binding` made before belong to the old C session: make new ones. Runs automatically once the
    released graphs' device memory passes :attr:`compact_threshold` (CUDA, measured with cuda-python; see
    :mod:`ortcapture._memory.ledger`).

    Raises:
        CaptureUnsupportedError: the session does not capture.
        CaptureError: raw IOBinding graphs are captured (their IOBinding belongs to the old C session; release
            them first), or on WebGPU, buffers from :meth:`allocate` are alive; or an external data file of the
            model changed or is gone since construction; or a graph failed to capture again (that graph is
            released; the rest are compacted); or (``kind`` ``"fork"``) in an ``os.fork()`` child of the process
            that made the session (ORT's device state does not survive fork).

    The C session is built from the model as it was loaded (the bytes read at construction; ORT's own
    ``_reset_session`` reads the model file again): a file replaced or deleted since changes nothing.
    """
    if FORKED_DEVICES:  # an os.fork() child: refused before any native call (ortcapture._ort.sync.Origin)
        self._oc_origin.check("compact()")
    st = self._oc_state
    if st.info is None and not st.deferred:
        self._oc_require_capture("compact()")
    _compact.compact(st.family)


@property
def compact_threshold(self) -> int | None:
    """Bytes of released-but-unfreed graph device memory (CUDA/TensorRT) above which the next ``capture()`` or
    ``CapturedGraph.release()`` compacts automatically (:meth:`compact`); ``None``: never. Default 256 MiB.
    Each retired graph is charged the larger of the ``cudaMemGetInfo`` change around its capture and the
    family's learned per-graph cost; with half the threshold retired, a compaction also runs once device memory
    in use passes its level at the previous compaction by ``max(2 MiB, threshold / 8)``
    (:mod:`ortcapture._memory.ledger`: the driver reuses freed graph memory, so captures after a compaction measure
    +0). On the H200 a 16 MiB threshold kept 1000 cycles of a small model and 300 of YOLOv8n within +20 MiB of
    the start. Automatic compaction does not run while raw IOBinding graphs are captured.

    Raises:
        CaptureError: (on set) not an int >= 0 or ``None``.
    """
    return self._oc_state.family.ledger.threshold


@compact_threshold.setter
def compact_threshold(self, value: int | None) -> None:
    self._oc_state.family.ledger.threshold = _ledger.check_threshold(value)


@property
def graph_memory(self) -> dict:
    """``{"retired_bytes", "live_bytes", "threshold", "compactions", "per_graph_bytes"}`` of this session
    family's captured graphs, in bytes (measured on CUDA only; 0 elsewhere, except ``retired_bytes``, which counts
    the pinned buffers of retired graphs where nothing is measured)."""
    return self._oc_state.family.ledger.describe()


def allocate(self, shape: Sequence[int], dtype) -> compat.OrtValue:
    """A fixed, uninitialised device OrtValue for the raw IOBinding path.

    The session tracks it but does not keep it alive: it lives while you, an IOBinding it is bound to, or a
    captured ``gpu_graph_id`` that pinned it (until released) hold it.

    Args:
        shape: concrete ints >= 0.
        dtype: a numpy dtype.

    Returns:
        An OrtValue on the capturing EP's device (``cuda:<device_id>`` or ``webgpu``).

    Raises:
        CaptureUnsupportedError: the session does not capture (nor defers capture).
        TransferError: a bad shape or dtype.
        CaptureError: (``kind`` ``"fork"``) in an ``os.fork()`` child of the process that made the session
            (ORT's device state does not survive fork: the allocation would hang or crash).
    """
    if FORKED_DEVICES:
        self._oc_origin.check("allocate()")
    st = self._oc_state
    if st.pool is None:
        self._oc_require_capture("allocate()")
    with st.guard:  # a device allocation must not happen while another thread captures (CUDA)
        return st.pool.allocate(shape, dtype)
