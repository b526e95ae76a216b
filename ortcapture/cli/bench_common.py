"""What ``ortcapture bench``'s modules share: the user-facing error, the worker's progress prefix, the sessions' recipe."""
from __future__ import annotations

_PROGRESS = "@@ortcapture-bench-progress"  # worker -> parent progress lines on stderr


class BenchError(Exception):
    """A user-facing error: printed as ``ortcapture bench: ...``, exit code 2."""


def session_args(provider: str, capture: bool, ep_options: dict | None = None, intra_op_threads: int | None = None,
                 config: dict | None = None) -> dict:
    """``InferenceSession`` keyword arguments for ``provider`` with the capture option on or off, the
    ``--provider-option`` values, ``--intra-op-threads`` and ``--session-config`` entries (a fresh
    ``SessionOptions`` each call: the WebGPU EP is added to it)."""
    import onnxruntime as ort

    from ortcapture._ort import providers

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if intra_op_threads is not None:
        so.intra_op_num_threads = int(intra_op_threads)
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    return providers.session_args(provider, capture, so, ep_options=ep_options)
