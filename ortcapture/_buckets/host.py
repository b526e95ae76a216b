"""What a bucket runner needs of the session it serves: :class:`BucketHost`, implemented by the session layer.

The bucket layer sits below the session layer (``.importlinter``), yet a bucket runner must run the session's own
model: uncaptured (output-axis probes, requests it cannot serve captured, the verification's reference) and captured
(one graph per bucket). It does so only through this interface, defined here and implemented above
(:class:`ortcapture._session.buckets.SessionBucketHost`): the dependency points down, and every call a bucket runner
makes into its session is one of these methods.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Mapping, Sequence


class BucketHost(abc.ABC):
    """The session as a :class:`~ortcapture._buckets.run.BucketRunner` sees it.

    Attributes:
        session: the session whose model the buckets serve, for ORT's read-only metadata only (``get_inputs``,
            ``get_outputs``, ``get_provider_options``, ``get_input_memory_infos``); never run through it directly.
        state: its :class:`~ortcapture._core.state.CaptureState` (what the session captures, or was asked to).
    """

    session: Any
    state: Any

    @abc.abstractmethod
    def run_uncaptured(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any], run_options,
                       ort_values: bool) -> list:
        """ORT's plain run of the session without buckets (``run_options`` set ``gpu_graph_id=-1``); ``ort_values``:
        ``run_with_ort_values``. Raises what ORT raises."""

    @abc.abstractmethod
    def capture(self, feeds: Mapping[str, Any]):
        """A new :class:`~ortcapture._core.graph.CapturedGraph` of the session for ``feeds``, not verified (the runner
        verifies it, padded against unpadded)."""

    @abc.abstractmethod
    def reference(self) -> Callable[[Mapping[str, Any]], list] | None:
        """The verification's reference, ``feeds -> outputs``, where the session's own uncaptured run is not one (a
        capture-enabled WebGPU session runs int64 as 32-bit even uncaptured; issue 15); ``None``: that run is one."""
