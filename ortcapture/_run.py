"""The one call of ORT's ``run_with_iobinding`` in ortcapture's core (captures, replays, uncaptured probes)."""
from __future__ import annotations

from ortcapture import _compat as compat

GRAPH_ID_KEY = "gpu_graph_id"
SKIP_GRAPH_ID = -1  # ORT's kGraphAnnotationSkip: run without capture or replay


def run_bound(session, binding, run_options) -> None:
    """Run ``session`` on ``binding`` through ORT's own Python ``run_with_iobinding``.

    ORT's wrapper is taken at import (:data:`ortcapture._compat.ORT_RUN_WITH_IOBINDING`), so a replaced
    ``onnxruntime.InferenceSession`` never makes ortcapture call itself, and on ORT >= 1.30 ORT's own WebGPU capture
    guards (ORT PR #32074) stay in the path. Raises whatever ORT raises.
    """
    compat.ORT_RUN_WITH_IOBINDING(session, binding, run_options)


def uncaptured_run_options():
    """``RunOptions`` with ``gpu_graph_id=-1``: run without capture or replay."""
    import onnxruntime as ort

    ro = ort.RunOptions()
    ro.add_run_config_entry(GRAPH_ID_KEY, str(SKIP_GRAPH_ID))
    return ro
