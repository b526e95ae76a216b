"""The one call of ORT's ``run_with_iobinding`` in ortcapture's core, and the ``gpu_graph_id`` run option.

Captures, replays and uncaptured probes all run through :func:`run_bound`.
"""
from __future__ import annotations

import functools
import operator

import onnxruntime as ort

from ortcapture._ort import compat
from ortcapture.errors import CaptureError

GRAPH_ID_KEY = "gpu_graph_id"
SKIP_GRAPH_ID = -1  # ORT's kGraphAnnotationSkip: run without capture or replay


def run_bound(session, binding, run_options) -> None:
    """Run ``session`` on ``binding`` through ORT's own Python ``run_with_iobinding``.

    ORT's wrapper is taken at import (:data:`ortcapture._ort.compat.ORT_RUN_WITH_IOBINDING`), so a replaced
    ``onnxruntime.InferenceSession`` never makes ortcapture call itself, and on ORT >= 1.30 ORT's own WebGPU capture
    guards (ORT PR #32074) stay in the path. Raises whatever ORT raises.
    """
    compat.ORT_RUN_WITH_IOBINDING(session, binding, run_options)


def bound_runner(session, binding, run_options):
    """:func:`run_bound` with its arguments bound once: a callable ``run()`` (a replay plan's one ORT call, with no
    Python frame of ortcapture's between the caller and ORT's ``run_with_iobinding``)."""
    return functools.partial(compat.ORT_RUN_WITH_IOBINDING, session, binding, run_options)


#: ORT's run config key (``kOrtRunOptionsConfigDisableSynchronizeExecutionProviders``): "1" makes a run return before
#: its device work is done
DISABLE_SYNC_KEY = "disable_synchronize_execution_providers"


def unsynchronised(run_options: ort.RunOptions | None) -> bool:
    """Whether ``run_options`` set ``disable_synchronize_execution_providers=1`` (the run returns before the device
    finished it)."""
    if run_options is None:
        return False
    try:
        return run_options.get_run_config_entry(DISABLE_SYNC_KEY).strip() == "1"
    except RuntimeError:  # not set
        return False


def uncaptured_run_options() -> ort.RunOptions:
    """``RunOptions`` with ``gpu_graph_id=-1``: run without capture or replay."""
    return run_options_for(SKIP_GRAPH_ID)


def graph_id_of(run_options: ort.RunOptions | None) -> int:
    """The ``gpu_graph_id`` a run uses: the run config entry, default 0. Raises :class:`CaptureError` if not an int."""
    if run_options is None:
        return 0
    _check_run_options(run_options)
    try:
        entry = run_options.get_run_config_entry(GRAPH_ID_KEY)
    except RuntimeError:
        return 0
    if not entry:
        return 0
    if not entry.isascii() or not (entry[1:] if entry[:1] == "-" else entry).isdigit():  # " 0", "+0", "1_0": int()
        # takes them, ORT's parse does not (its run then fails inside the capture, the id retired; a tester)
        raise CaptureError(f"run option {GRAPH_ID_KEY!r} must be an integer (digits, an optional '-'), got {entry!r}")
    return check_graph_id(int(entry))  # its range message (-2, past 2**31-1)


def _check_run_options(run_options) -> None:
    """``TypeError`` (the type ORT's ``run`` raises for it) for run options that are no ``onnxruntime.RunOptions``,
    before ortcapture reads them (a builtin ``AttributeError`` otherwise)."""
    if not isinstance(run_options, ort.RunOptions):
        raise TypeError(f"run_options must be an onnxruntime.RunOptions or None, got {type(run_options).__name__}")


#: ORT parses gpu_graph_id as a 32-bit int ("Failed to parse the cuda graph annotation id" beyond that).
MAX_GRAPH_ID = 2**31 - 1


def check_graph_id(graph_id) -> int:
    """``graph_id`` as an int in [-1, 2**31-1]; raises :class:`CaptureError` otherwise (bools and floats too)."""
    if isinstance(graph_id, bool):
        raise CaptureError(f"gpu_graph_id must be an int, got {graph_id!r}")
    try:
        gid = operator.index(graph_id)
    except TypeError:
        raise CaptureError(f"gpu_graph_id must be an int, got {graph_id!r}") from None
    if not -1 <= gid <= MAX_GRAPH_ID:
        raise CaptureError(f"gpu_graph_id must be -1 (no capture) or in [0, {MAX_GRAPH_ID}], got {gid}")
    return gid


def run_options_for(graph_id: int, base: ort.RunOptions | None = None) -> ort.RunOptions:
    """``RunOptions`` (``base`` or new) with ``gpu_graph_id`` set to ``graph_id`` (-1: run without capture).
    Raises :class:`CaptureError` for anything but an int in [-1, 2**31-1]."""
    gid = check_graph_id(graph_id)
    ro = base if base is not None else ort.RunOptions()
    ro.add_run_config_entry(GRAPH_ID_KEY, str(gid))
    return ro


def explicit_graph_id(run_options) -> bool:
    """Whether ``run_options`` names a ``gpu_graph_id`` at all (ORT's default, 0, is then not what the caller meant)."""
    if run_options is None:
        return False
    _check_run_options(run_options)
    try:
        return bool(run_options.get_run_config_entry(GRAPH_ID_KEY))
    except RuntimeError:
        return False


def replay_cannot_honour(run_options) -> bool:
    """Whether ``run_options`` ask for something ORT's own ``run`` honours and a replay of a captured graph would
    silently skip: ``terminate`` (ORT raises "Exiting due to terminate flag being set to true"; a replay would return
    outputs). Such runs go to ORT uncaptured (the drop-in, ``buckets=``). One attribute read."""
    return run_options is not None and bool(getattr(run_options, "terminate", False))


def uncaptured(run_options) -> ort.RunOptions:
    """Fresh ``RunOptions`` with ``gpu_graph_id=-1`` and the caller's settings (the caller's object is not changed)."""
    ro = ort.RunOptions()
    if run_options is not None:
        for attr in ("log_severity_level", "log_verbosity_level", "logid", "terminate",
                     "only_execute_path_to_fetches"):
            if hasattr(run_options, attr):
                setattr(ro, attr, getattr(run_options, attr))
    ro.add_run_config_entry(GRAPH_ID_KEY, str(SKIP_GRAPH_ID))
    return ro
