"""Captured-graph registry: ``gpu_graph_id`` -> the IOBinding and buffers it pinned.

An explicit key -> graph pool (as ORT-GenAI's ``captured_graph_pool.h``) instead of hidden state. It enforces, for
every capture-capable EP and ORT version, what ORT >= 1.30 enforces for WebGPU only (ORT PR #32074):

* the first capturing ``run_with_iobinding`` of an id pins that IOBinding and the identity, shape, dtype and device
  of every bound value; another IOBinding or a changed binding under that id raises;
* a released id on an EP whose release is a no-op inside ORT (CUDA, TensorRT — measured on onnxruntime-gpu 1.31.1:
  a new IOBinding replayed under a released id writes into the old buffers) is retired for good;
* ``reset()`` (on ``set_providers``) forgets everything, since the captured graphs die with the old C session.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

from ortcapture._core.binding import Bound, IOBinding
from ortcapture.errors import BindingError, GraphReleasedError
from ortcapture._ort.providers import CaptureInfo

from ortcapture._core.run import SKIP_GRAPH_ID  # noqa: F401 - re-exported
#: ids ortcapture picks start at 1: 0 is the id a raw run without a ``gpu_graph_id`` entry uses (ORT's default),
#: so a user's plain IOBinding run never collides with a graph ortcapture captured (as ORT-GenAI's graph pool)
FIRST_AUTO_ID = 1


@dataclass
class CapturedGraphRecord:
    """What one ``gpu_graph_id`` pinned at capture."""

    graph_id: int
    binding: "weakref.ReferenceType[IOBinding]"
    signature: tuple
    inputs: dict[str, Bound]
    outputs: dict[str, Bound]
    replays: int = 0
    owner: "weakref.ReferenceType | None" = field(default=None, repr=False)  # weakref to the CapturedGraph that made it
    #: host-read inputs bound with bind_cpu_input -> their values at capture (checked before each replay)
    frozen: dict = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of device memory the pinned inputs and outputs occupy."""
        return sum(b.nbytes for b in (*self.inputs.values(), *self.outputs.values()))

    def describe(self) -> dict:
        return {
            "gpu_graph_id": self.graph_id,
            "inputs": {n: (b.device, b.shape, b.element_type) for n, b in self.inputs.items()},
            "outputs": {n: (b.device, b.shape, b.element_type) for n, b in self.outputs.items()},
            "bytes": self.nbytes,
            "replays": self.replays,
        }


class GraphRegistry:
    """Per-session map of ``gpu_graph_id`` to :class:`CapturedGraphRecord`, plus retired ids."""

    def __init__(self, info: CaptureInfo):
        self.info = info
        self._graphs: dict[int, CapturedGraphRecord] = {}
        self._retired: set[int] = set()
        #: retired ids whose capturing run was aborted (an error inside ORT, or an interrupt such as KeyboardInterrupt
        #: when ORT's native call returned): ORT may hold a whole graph under them and cannot free it
        self._aborted: set[int] = set()
        self._lock = threading.RLock()

    # -- queries --------------------------------------------------------------------------------------------
    def __contains__(self, graph_id: int) -> bool:
        return graph_id in self._graphs

    def get(self, graph_id: int) -> CapturedGraphRecord | None:
        return self._graphs.get(graph_id)

    @property
    def graph_ids(self) -> list[int]:
        return sorted(self._graphs)

    @property
    def retired_ids(self) -> list[int]:
        return sorted(self._retired)

    def was_aborted(self, graph_id: int) -> bool:
        """Whether ``graph_id`` is retired because its capture was aborted (not released by the caller)."""
        return graph_id in self._aborted

    def retired_text(self, graph_id: int) -> str:
        """Why ``graph_id`` cannot be captured or replayed again, and which id can (for the errors that refuse it)."""
        ep = self.info.ep.name
        if graph_id in self._aborted:
            return (f"the capture of gpu_graph_id={graph_id} was aborted (an error inside ORT or an interrupt such as "
                    f"KeyboardInterrupt), and this onnxruntime cannot free what ORT may hold under that id for "
                    f"{ep} (release_captured_graph is a no-op there), so the id is retired: capture under another "
                    f"id (e.g. {self.free_id(graph_id)}; graph_id=None picks one)")
        return (f"gpu_graph_id={graph_id} was released, but this onnxruntime cannot free a captured {ep} graph "
                "(release_captured_graph is a no-op for CUDA/TensorRT, and WebGPU gains it in ORT 1.30): replaying "
                "it would write into the old buffers and ignore the new binding. Capture under a new gpu_graph_id "
                f"(a new id, e.g. {self.free_id(graph_id)}; graph_id=None picks one), or create a new session")

    def free_id(self, start: int = FIRST_AUTO_ID) -> int:
        """The smallest id >= ``start`` neither captured nor retired."""
        with self._lock:
            gid = max(FIRST_AUTO_ID, start)
            while gid in self._graphs or gid in self._retired:
                gid += 1
            return gid

    # -- the run path ---------------------------------------------------------------------------------------
    def check(self, binding: IOBinding, graph_id: int) -> CapturedGraphRecord | None:
        """Validate a capturing run of ``graph_id``; return its record when this is a replay, ``None`` for a capture.

        Raises :class:`GraphReleasedError` for a retired id and :class:`BindingError` when the binding differs
        from the one the id pinned.
        """
        if graph_id in self._retired:
            raise GraphReleasedError(self.retired_text(graph_id) + ".")
        rec = self._graphs.get(graph_id)
        if rec is None:
            return None
        pinned = rec.binding()
        if pinned is not binding:
            raise BindingError(
                f"gpu_graph_id={graph_id} was captured with a different IOBinding. Replay re-issues the buffers "
                "recorded at capture and would silently ignore this binding. Reuse the original IOBinding and "
                "update its buffers in place, or capture under a new gpu_graph_id."
            )
        if binding.capture_signature() != rec.signature:
            raise BindingError(
                f"gpu_graph_id={graph_id}: the IOBinding's buffers changed since capture; replay would not read or "
                "write the new ones. Update the original buffers in place instead."
            )
        return rec

    def record(self, binding: IOBinding, graph_id: int, owner: object = None) -> CapturedGraphRecord:
        """Pin ``binding`` under ``graph_id`` after its capturing run succeeded."""
        with self._lock:
            rec = CapturedGraphRecord(
                graph_id, weakref.ref(binding), binding.capture_signature(),
                binding.bound_inputs, binding.bound_outputs, 0, weakref.ref(owner) if owner is not None else None,
            )
            self._graphs[graph_id] = rec
            binding.pin(graph_id)
            return rec

    def release(self, graph_id: int, aborted: bool = False) -> CapturedGraphRecord | None:
        """Forget ``graph_id``, unpin its binding; retire the id where ORT cannot really release it (``aborted``: its
        capture was interrupted, and the errors for the id say so)."""
        with self._lock:
            if aborted and not self.info.releases_natively:
                self._aborted.add(graph_id)
            rec = self._graphs.pop(graph_id, None)
            if rec is not None:
                binding = rec.binding()
                if binding is not None:
                    binding.unpin(graph_id)
                if not self.info.releases_natively:
                    self._retired.add(graph_id)
            return rec

    def retire(self, graph_id: int, aborted: bool = True) -> None:
        """Retire ``graph_id`` without a record (a capturing run that failed or was interrupted where ORT cannot
        release the id)."""
        with self._lock:
            self._retired.add(graph_id)
            if aborted:
                self._aborted.add(graph_id)

    def reset(self) -> list[CapturedGraphRecord]:
        """Forget every graph and retired id (the C session that held them is gone); return the old records."""
        with self._lock:
            old = list(self._graphs.values())
            for rec in old:
                binding = rec.binding()
                if binding is not None:
                    binding.unpin(rec.graph_id)
            self._graphs.clear()
            self._retired.clear()
            self._aborted.clear()
            return old
