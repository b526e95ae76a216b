"""``ortcapture doctor``'s dynamic checks: sessions on a capture-capable EP and a real capture attempt.

Node placement, ORT's own log, two uncaptured reference runs and a real capture attempt (described in
:mod:`ortcapture.cli.doctor`).
"""
from __future__ import annotations

import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ortcapture._verify.inspect import RECORD_ASSIGNMENT_KEY  # the one definition, in the core
from ortcapture.cli.doctor_static import DoctorError, Finding, _fmt_shape, dims_fix

#: Models larger than this are not re-serialized by ORT to list Memcpy nodes (protobuf's 2 GiB limit, time).
_OPTIMIZED_MODEL_LIMIT = 1 << 30

# ---------------------------------------------------------------------------------------------------------------
# ORT log capture
# ---------------------------------------------------------------------------------------------------------------
_LOG_LINE = re.compile(r"\[([VIWEF]):onnxruntime:[^,\]]*, ([^\]]*)\] (.*)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SEVERITY = {"V": 0, "I": 1, "W": 2, "E": 3, "F": 4}


class OrtLogCapture:
    """Collect ORT's log messages while the block runs, as ``(severity, code location, message, phase)`` with
    severity >= ``min_severity`` (2: warnings); ``phase`` is whatever the caller set last (which session). Uses
    ``onnxruntime.set_default_logger_callback`` where ORT has it, else points file descriptor 2 (where ORT's default
    sink writes) at a temporary file and parses it afterwards. Not re-entrant; the callback is process-wide."""

    def __init__(self, min_severity: int = 2, use_callback: bool | None = None):
        import onnxruntime as ort

        self.min_severity = min_severity
        self.use_callback = hasattr(ort, "set_default_logger_callback") if use_callback is None else use_callback
        self.records: list[tuple[int, str, str, str]] = []
        self.phase = ""
        self._marks: list[tuple[int, str]] = []  # fd mode: (file offset, phase) — phases resolved on exit

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if not self.use_callback and hasattr(self, "_tmp"):
            sys.stderr.flush()
            self._marks.append((os.lseek(self._tmp.fileno(), 0, os.SEEK_CUR), phase))

    def _callback(self, severity, category, logid, code_location, message):
        if int(severity) >= self.min_severity:
            self.records.append((int(severity), str(code_location), str(message).strip(), self.phase))

    def __enter__(self) -> "OrtLogCapture":
        import onnxruntime as ort

        if self.use_callback:
            ort.set_default_logger_callback(self._callback, self.min_severity)
        else:
            sys.stderr.flush()
            self._tmp = tempfile.TemporaryFile()
            self._saved_fd = os.dup(2)
            os.dup2(self._tmp.fileno(), 2)
            self._marks = [(0, self.phase)]
        return self

    def __exit__(self, *exc) -> None:
        import onnxruntime as ort

        if self.use_callback:
            ort.set_default_logger_callback(None)
            return
        sys.stderr.flush()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._tmp.seek(0)
        raw = self._tmp.read()
        self._tmp.close()
        del self._tmp
        other = []
        marks = self._marks + [(len(raw) + 1, "")]
        for (start, phase), (stop, _) in zip(marks, marks[1:]):
            text = _ANSI.sub("", raw[start:stop].decode("utf-8", "replace"))
            for line in text.splitlines():
                m = _LOG_LINE.search(line)
                if m is None:
                    if line.strip():
                        other.append(line)
                elif _SEVERITY[m.group(1)] >= self.min_severity:
                    self.records.append((_SEVERITY[m.group(1)], m.group(2).strip(), m.group(3).strip(), phase))
        if other:  # not ORT's log: hand it back to stderr
            print("\n".join(other), file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------------
# dynamic checks
# ---------------------------------------------------------------------------------------------------------------
def choose_provider(requested: str) -> tuple[str, str | None]:
    """``(provider, why none)``: ``cuda``/``webgpu`` as :func:`ortcapture.cli.demo.pick_provider` picks them, or ``none``
    (requested, or ``auto`` found no capture-capable EP: the reason is returned). Raises :class:`DoctorError` when
    an explicitly requested EP is unusable."""
    if requested == "none":
        return "none", "--provider none: static checks only"
    from ortcapture.cli import pick_provider
    from ortcapture.errors import CaptureUnsupportedError

    try:
        return pick_provider(requested), None
    except CaptureUnsupportedError as exc:
        why = str(exc)
        if requested == "auto":
            return "none", why
        raise DoctorError(why) from None


_EP_NAMES = {"cuda": "CUDAExecutionProvider", "webgpu": "WebGpuExecutionProvider"}


def _session_args(provider: str, capture: bool, config: Mapping[str, str] = (), optimized_path: str | None = None,
                  ep_options: Mapping[str, str] | None = None):
    """InferenceSession kwargs for ``provider`` with capture on/off, ``config`` session entries, an optional
    optimized-model output path and the ``--provider-option`` values. Log severity stays at the default
    (warnings), so OrtLogCapture sees them."""
    import onnxruntime as ort

    from ortcapture._ort.providers import session_args

    so = ort.SessionOptions()
    for k, v in dict(config).items():
        so.add_session_config_entry(k, v)
    if optimized_path:
        so.optimized_model_filepath = optimized_path
    return session_args(provider, capture, so, ep_options=ep_options)


@dataclass
class Placement:
    """Where ORT put the nodes of one uncaptured session."""

    cpu_nodes: list[tuple[str, str]] | None  # (name, op_type); None: ORT cannot tell (no assignment info)
    memcpy_nodes: list[tuple[str, str, str]] | None  # (name, op_type, tensor copied); None: unknown

    def cpu_labels(self, limit: int = 12) -> str:
        items = [f"{op} '{name}'" if name else op for name, op in self.cpu_nodes or []]
        more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
        return ", ".join(items[:limit]) + more


def _assigned_cpu_nodes(sess) -> list[tuple[str, str]] | None:
    if not hasattr(sess, "get_provider_graph_assignment_info"):
        return None
    try:
        subgraphs = sess.get_provider_graph_assignment_info()
    except Exception:  # noqa: BLE001 - older ORT: recording not supported
        return None
    # an empty answer: nothing off the EP (measured on 1.27: a graph all on one EP gives [])
    return [(n.name, n.op_type) for sg in subgraphs if sg.ep_name == "CPUExecutionProvider" for n in sg.get_nodes()]


def _memcpy_nodes(path: str) -> list[tuple[str, str, str]] | None:
    import onnx

    try:
        opt = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - ORT did not write it
        return None
    return [(n.name, n.op_type, n.input[0] if n.input else "") for n in opt.graph.node
            if n.op_type in ("MemcpyToHost", "MemcpyFromHost")]


def placement_session(model, provider: str, tmpdir: str, tag: str, list_memcpy: bool,
                      ep_options: Mapping[str, str] | None = None, config: Mapping[str, str] = ()):
    """An uncaptured session on ``provider`` that records node placement; returns ``(session, Placement)``.
    ``config``: more session config entries (e.g. the external data folder of a model given as bytes)."""
    import onnxruntime as ort

    opt_path = os.path.join(tmpdir, f"optimized_{tag}.onnx") if list_memcpy else None
    config = {RECORD_ASSIGNMENT_KEY: "1", **dict(config)}
    try:
        sess = ort.InferenceSession(model, **_session_args(provider, False, config, opt_path, ep_options))
    except Exception:  # noqa: BLE001 - writing the optimized model can fail (compiled nodes): retry without it
        if opt_path is None:
            raise
        opt_path = None
        sess = ort.InferenceSession(model, **_session_args(provider, False, config, None, ep_options))
    memcpy = _memcpy_nodes(opt_path) if opt_path else None
    return sess, Placement(_assigned_cpu_nodes(sess), memcpy)


def random_feeds(model, example: Mapping[str, Sequence[int]], seed: int) -> dict:
    """Random numpy feeds of the example shapes and the model's input element types (numeric inputs only: see
    :func:`check_io_types`). Integers are 0 or 1, so index-like inputs stay in range."""
    import numpy as np
    import onnx

    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits or vi.name not in example:
            continue
        elem = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
        try:
            dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        except Exception:  # noqa: BLE001
            dt = None
        if dt is None or dt.kind not in "biuf":
            raise DoctorError(f"input {vi.name!r} has type {onnx.helper.printable_type(vi.type)}: not a numeric tensor")
        shape = tuple(example[vi.name])
        if dt.kind == "b":
            value = rng.random(shape) < 0.5
        elif dt.kind in "iu":
            value = rng.integers(0, 2, size=shape)
        else:
            value = rng.random(shape)
        out[vi.name] = np.asarray(value, dtype=dt)  # an ndarray for scalars too: ORT refuses numpy scalars
    return out


def _compare(got: Sequence[Any], want: Sequence[Any], tol: float) -> tuple[bool, float, str | None]:
    """(match, max abs diff, what differs) for replay outputs against the uncaptured run."""
    import numpy as np

    if len(got) != len(want):
        return False, float("inf"), f"{len(got)} outputs, expected {len(want)}"
    worst, scale = 0.0, 1.0
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return False, float("inf"), f"output {i} has shape {g.shape}, the uncaptured run {w.shape}"
        if g.size == 0:
            continue
        if g.dtype.kind not in "biuf" or w.dtype.kind not in "biuf":  # strings, objects: equal or not
            if not np.array_equal(g, w):
                return False, float("inf"), f"output {i} ({g.dtype}) differs"
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        if not np.array_equal(np.isnan(g64), np.isnan(w64)):
            return False, float("inf"), f"output {i}: NaNs differ"
        ok = ~np.isnan(w64)
        if ok.any():
            worst = max(worst, float(np.max(np.abs(g64[ok] - w64[ok]))))
            scale = max(scale, float(np.max(np.abs(w64[ok]))))
    return worst <= tol * scale, worst, None


def _ort_reason(text: str) -> str:
    """An error as doctor quotes it: one line, without ORT's error prefix and without sentences that point at
    ``ortcapture doctor`` (the user is running it)."""
    from ortcapture.cli import one_line

    text = one_line(text)
    text = re.sub(r"\s*Run `ortcapture doctor[^.]*\.", "", text)
    text = re.sub(r";?\s*`ortcapture doctor MODEL` lists such outputs\.?", ".", text)
    return re.sub(r"\.\.$", ".", text).strip()


#: ortcapture's refusal of a capture whose replay would never write some outputs (they keep the capture-time value)
_STALE_OUTPUTS = re.compile(r"output\(s\) (\[[^\]]*\]) of gpu_graph_id=\d+ are not written by the captured graph's replay")


def attempt_capture(model_path: str, provider: str, feeds0: Mapping, feeds1: Mapping, want: Sequence,
                    tol: float, ep_options: Mapping[str, str] | None = None) -> dict:
    """Capture ``model_path`` through ``ortcapture.InferenceSession(..., capture on).capture(feeds0)``, replay once
    with ``feeds1`` and compare with ``want`` (an uncaptured run on ``feeds1``). Returns the ``capture`` part of the
    report: ``outcome`` is ``captured``, ``captured_specialized`` (ORT refused the model as given, a session with
    the dims fixed captured), ``refused``, ``mismatch`` or ``replay_failed``."""
    import ortcapture

    res: dict[str, Any] = {"attempted": True, "outcome": None, "reason": None, "stage": None, "deferred": None,
                           "static_shapes": None, "max_abs_diff": None, "tolerance": tol, "seconds": None}
    t0 = time.perf_counter()
    try:
        sess = ortcapture.InferenceSession(
            model_path, **_session_args(provider, True, {RECORD_ASSIGNMENT_KEY: "1"}, None, ep_options))
    except Exception as exc:  # noqa: BLE001 - ORT's Fail/EPFail and ortcapture's errors alike
        res.update(outcome="refused", stage="session creation", reason=_ort_reason(exc),
                   error=f"{type(exc).__name__}: {_ort_reason(exc)}", seconds=time.perf_counter() - t0,
                   **_error_kind(exc))
        return res
    res["deferred"] = sess.capture_deferred
    if sess.capture_refusal:
        res["direct_refusal"] = sess.capture_refusal
    try:
        graph = sess.capture(feeds0)
    except Exception as exc:  # noqa: BLE001
        res.update(outcome="refused", stage="capture" + (" on a shape-specialised session" if sess.capture_deferred
                                                          else ""),
                   reason=_ort_reason(exc), error=f"{type(exc).__name__}: {_ort_reason(exc)}",
                   seconds=time.perf_counter() - t0, **_error_kind(exc))
        return res
    try:
        if sess.capture_deferred:
            res["static_shapes"] = {n: list(s) for n, s in (graph.session.static_shapes or {}).items()}
        cpu = _assigned_cpu_nodes(graph.session)
        res["cpu_nodes_captured"] = [list(n) for n in cpu] if cpu is not None else None
        got = graph.run(feeds1)
        res["seconds"] = time.perf_counter() - t0
        ok, worst, what = _compare(got, want, tol)
        res["max_abs_diff"] = worst
        if ok:
            res["outcome"] = "captured_specialized" if sess.capture_deferred else "captured"
        else:
            res["outcome"] = "mismatch"
            res["reason"] = what or f"max abs diff {worst:.3g} (tolerance {tol:g} x max(1, max |output|))"
    except Exception as exc:  # noqa: BLE001 - a replay that raises is a failed capture too
        res.update(outcome="replay_failed", stage="replay", reason=_ort_reason(exc),
                   error=f"{type(exc).__name__}: {_ort_reason(exc)}")
    finally:
        try:
            graph.release()
        except Exception:  # noqa: BLE001 - reporting matters more than the release
            pass
    if res["seconds"] is None:
        res["seconds"] = time.perf_counter() - t0
    return res


def _error_kind(exc: BaseException) -> dict:
    """What kind of silently-wrong result ortcapture refused (issue 15): ``kind`` (``int64_as_int32``,
    ``unwritten_output``, ``partly_written_output``, ``copy_only_kernel``, ``varied``, ``example``,
    ``host_read_input``) with the ``nodes``/``outputs``/``inputs`` it names; empty for other errors."""
    kind = getattr(exc, "kind", None)
    if kind is None:
        return {}
    return {"kind": kind, "nodes": list(getattr(exc, "nodes", []) or []),
            "outputs": list(getattr(exc, "outputs", []) or []), "inputs": list(getattr(exc, "inputs", []) or [])}


#: issue 15's kinds: (what it is, the fix)
WRONG_RESULT_KINDS = {
    "int64_as_int32": (
        "node(s) on WebGpuExecutionProvider produce int64 from int64 arithmetic, or read int64 constants beyond "
        "int32 as data, and ORT's WebGPU EP runs int64 as 32-bit under enableGraphCapture=1 (captured and "
        "uncaptured runs): values beyond int32 wrap",
        "compute those nodes in int32 or float, keep the constants within int32 (or the nodes on the host), or pass "
        "InferenceSession(..., allow_int64_as_int32=True) if every int64 value stays within int32"),
    "partly_written_output": (
        "the replay writes output(s) only in part (e.g. ScatterND/ScatterElements on a graph-input or state= "
        "`data`: the kernel's copy of `data` is not replayed, the rest keeps the capture-time fill)",
        "compute the whole output in replayed ops (e.g. Where(mask, updates, data) instead of ScatterND on an "
        "input), or run this model without capture"),
    "copy_only_kernel": (
        "copy-only kernel(s) feed other nodes (a single-input Max/Min/Sum/Mean, ScatterND on input data): their "
        "copy is not replayed, so a replay keeps the capture-time values — found with a varied input set",
        "drop the copy-only node (a single-input Max/Min is the identity) or make it compute; or run this model "
        "without capture"),
    "varied": (
        "a replay on a varied input set differs from the reference run: the replay kept values from the capture",
        "look for inputs read on the host, copy-only kernels or outputs written in part; or run without capture"),
    "example": (
        "the replay of the example inputs differs from the reference run",
        "check the EP's results uncaptured first (ep_results), then report the capture difference"),
    "host_read_input": (
        "an input ORT reads in host memory (get_input_memory_infos(): Reshape shape, Slice starts, Clip bounds, "
        "...) is a constant of the captured graph",
        "capture one graph per value of that input (ortcapture.patched() does), or make it an initializer"),
}


def _host_read(session, feeds: Mapping) -> list[str]:
    """The inputs of ``feeds`` that ORT reads in host memory (``get_input_memory_infos``)."""
    from ortcapture._ort.specialize import host_read_inputs

    try:
        return sorted(host_read_inputs(session) & set(feeds))
    except Exception:  # noqa: BLE001 - a session that cannot tell
        return []


def int64_probe(model_path: str, model, provider: str, feeds: Mapping, ep_options=None) -> Finding | None:
    """Feed the int64 inputs values beyond the int32 range (``2**32 + v``) to an uncaptured run of a
    capture-enabled session and of a session without capture; a difference is the ``int64_as_int32`` kind.
    ``None`` when the model has no int64 input or the probe cannot run (e.g. the values are indices)."""
    import numpy as np
    import onnxruntime as ort

    from ortcapture._verify.model_checks import int64_inputs
    from ortcapture._core.run import uncaptured_run_options

    names = [n for n in int64_inputs(model) if n in feeds]
    if provider != "webgpu" or not names:
        return None
    big = dict(feeds)
    for n in names:
        big[n] = np.asarray(feeds[n], np.int64) + np.int64(2**32)
    try:
        plain = ort.InferenceSession(model_path, **_session_args(provider, False, (), None, ep_options))
        want = plain.run(None, big)
        cap = ort.InferenceSession(model_path, **_session_args(provider, True, (), None, ep_options))
        got = cap.run(None, big, uncaptured_run_options())
    except Exception:  # noqa: BLE001 - values out of range for the model (indices), or capture refused
        return None
    ok, worst, what = _compare(got, want, 0.0)
    if ok:
        return Finding("int64_probe", "info", f"int64 input(s) {names} probed with values beyond the int32 range: "
                       "the capture-enabled session agrees with a session without capture")
    text, fix = WRONG_RESULT_KINDS["int64_as_int32"]
    return Finding("int64_as_int32", "warning",
                   f"int64 input(s) {names} fed values beyond the int32 range (2**32 + v): the capture-enabled "
                   f"{_EP_NAMES[provider]} session differs from one without capture "
                   f"({what or f'max abs diff {worst:.3g}'}): ORT's WebGPU EP runs int64 as 32-bit under capture",
                   "keep int64 inputs within int32 on WebGPU (ortcapture refuses feeds beyond it); " + fix,
                   {"inputs": names})


_CPU_PREFERRED = re.compile(r"Force fallback to CPU execution for node (\S+)")
_CAPTURE_LOG = re.compile(r"graph capture|shape massaging|Memcpy|CUDA Graph", re.IGNORECASE)
#: ORT log lines doctor itself causes (optimized-model dump, ortcapture's capture-off retry): not about the model.
_OWN_NOISE = ("Serializing optimized model", "already exists with value")
_PHASE_AS_GIVEN, _PHASE_FIXED, _PHASE_CAPTURE = "model as given", "dims fixed", "capture attempt"


def _placement_findings(model, ep: str, example, placement: Placement, fixed: Placement | None,
                        capture: dict, given: Sequence[str] = ()) -> list[Finding]:
    from ortcapture._ort import specialize as shapes

    out: list[Finding] = []
    outcome = capture["outcome"]
    captured = outcome in ("captured", "captured_specialized")
    dynamic = shapes.dynamic_inputs(model)
    if placement.cpu_nodes is None:
        out.append(Finding("placement", "info", "this onnxruntime does not report node placement "
                           "(get_provider_graph_assignment_info): nodes on the CPU EP are not listed"))
    stay = set(fixed.cpu_nodes) if fixed is not None and fixed.cpu_nodes is not None else None
    cpu = list(placement.cpu_nodes or [])
    if dynamic and stay is not None:
        shape_nodes, remaining = [n for n in cpu if n not in stay], [n for n in cpu if n in stay]
    else:
        shape_nodes, remaining = [], cpu
    if shape_nodes:
        others = " (the others stay: see cpu_nodes)" if remaining else ""
        if outcome == "captured":
            verdict = f"ORT captured on {ep} with them on the CPU EP (safe while intermediate shapes depend only on " \
                      "input shapes)"
        elif outcome == "captured_specialized":
            verdict = f"ORT refused {ep} capture of the graph split this way; ortcapture captured on a " \
                      "shape-specialised session"
        else:
            verdict = f"ORT's {ep} capture refuses a graph split this way"
        out.append(Finding(
            "shape_subgraph_cpu", "info" if outcome == "captured" else "warning",
            f"{len(shape_nodes)} node(s) of the model as given run on the CPU EP — the shape computation of its "
            f"dynamic dims: {Placement(shape_nodes, None).cpu_labels(8)}; with the dims fixed they go away{others}. "
            + verdict, None if outcome == "captured" else dims_fix(model, example, given=given),
            {"nodes": [list(n) for n in shape_nodes]}))
    if remaining:
        ops = sorted({op for _, op in remaining})
        tail = ("ORT accepted the capture anyway (host-side shape computation: safe while intermediate shapes "
                "depend only on input shapes)" if captured
                else f"ORT captures only a graph whose compute nodes all run on {ep}")
        out.append(Finding(
            "cpu_nodes", "warning" if captured else "error",
            f"{len(remaining)} node(s) run on the CPU EP, not {ep}"
            f"{' (even with the dims fixed)' if dynamic and stay is not None else ''}: "
            f"{Placement(remaining, None).cpu_labels()}; {tail}",
            None if captured else f"replace {', '.join(ops)} with ops {ep} has kernels for, or split the model "
            "there and run those nodes outside the captured graph",
            {"nodes": [list(n) for n in remaining], "op_types": ops}))
    for tag, plc in ((_PHASE_AS_GIVEN, placement), (_PHASE_FIXED, fixed)):
        if plc is None or not plc.memcpy_nodes:
            continue
        copies = ", ".join(f"{op}({t!r})" for _, op, t in plc.memcpy_nodes[:8])
        more = f", ... ({len(plc.memcpy_nodes) - 8} more)" if len(plc.memcpy_nodes) > 8 else ""
        blocking = not captured and (tag == _PHASE_FIXED or not dynamic)
        out.append(Finding(
            "memcpy", "warning" if blocking else "info",
            f"{len(plc.memcpy_nodes)} Memcpy node(s) copy between host and {ep} ({tag}): {copies}{more}",
            None, {"session": tag, "nodes": [list(n) for n in plc.memcpy_nodes]}))
    return out


def _log_findings(records) -> list[Finding]:
    out: list[Finding] = []
    preferred: dict[str, list[str]] = {}
    seen = set()
    for sev, where, msg, phase in records:
        m = _CPU_PREFERRED.search(msg)
        if m:
            preferred.setdefault(phase, [])
            if m.group(1) not in preferred[phase]:
                preferred[phase].append(m.group(1))
            continue
        if any(n in msg for n in _OWN_NOISE) or (sev >= 3 and "cannot use the graph capture" in msg):
            continue  # doctor's own doing / the refusal, which the capture finding quotes
        if (sev, msg) in seen:
            continue
        seen.add((sev, msg))
        out.append(Finding(
            "ort_log", "warning" if (sev >= 3 or _CAPTURE_LOG.search(msg)) else "info",
            f"onnxruntime {'error' if sev >= 3 else 'warning'}{f' ({phase})' if phase else ''}: {msg}", None,
            {"severity": sev, "location": where, "phase": phase}))
    for phase, names in preferred.items():
        out.append(Finding(
            "ort_log", "info",
            f"onnxruntime warning ({phase}): \"Force fallback to CPU execution ... because the CPU execution path is "
            f"deemed faster\" for {len(names)} node(s): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}",
            None,
            {"nodes": names, "phase": phase}))
    return out


def _unstable_finding(ep: str, stable: tuple[bool, float, str | None], ep_options: Mapping[str, str] | None) -> Finding:
    """Two uncaptured runs with the same feeds disagree: random ops, or an EP (option) computing wrong results.
    Measured on onnxruntime-gpu 1.31.1 (H200): CUDA ``fuse_conv_bias=1`` gives the reference model's first run
    right and every later run wrong (max abs diff ~700 against the CPU EP), captured or not."""
    _, worst, what = stable
    opts = f" with EP options {dict(ep_options)}" if ep_options else ""
    fix = ("a model with random ops (seeded or not: ORT's generator advances every run) cannot be checked this way; "
           "without them, ")
    fix += ("drop the EP options one at a time to find the one that changes results (onnxruntime-gpu 1.31.1: "
            "fuse_conv_bias=1 does)" if ep_options else "report the EP's changing results to onnxruntime")
    return Finding("ep_results", "error",
                   f"two uncaptured runs of the {ep} session{opts} with the same inputs disagree "
                   f"({what or f'max abs diff {worst:.3g}'}): random ops, or an EP computes wrong results; "
                   "a captured replay cannot be checked against them, and is not to be trusted either",
                   fix, {"max_abs_diff": worst if math.isfinite(worst) else None})


def _capture_finding(model, ep: str, example, capture: dict, findings: Sequence[Finding],
                     given: Sequence[str] = ()) -> Finding:
    from ortcapture._ort import specialize as shapes

    outcome = capture["outcome"]
    if outcome == "captured":
        return Finding("capture", "info", f"captured directly on {ep}; one replay matches the uncaptured run "
                       f"(max abs diff {capture['max_abs_diff']:.3g})")
    if outcome == "captured_specialized":
        fixed = ", ".join(f"{n}={_fmt_shape(s)}" for n, s in (capture["static_shapes"] or {}).items())
        why = capture.get("direct_refusal")
        return Finding(
            "capture", "info",
            f"captured via shape specialization on {ep} (dims fixed to {fixed}); one replay matches the "
            f"uncaptured run (max abs diff {capture['max_abs_diff']:.3g})"
            + (f". ORT refused the model as given: {why}" if why else ""), dims_fix(model, example, given=given))
    kind = capture.get("kind")
    if outcome == "refused" and kind in WRONG_RESULT_KINDS and kind != "host_read_input":
        text, fix = WRONG_RESULT_KINDS[kind]
        named = capture.get("nodes") or capture.get("outputs") or []
        return Finding(kind, "error", f"{ep}: {text}" + (f": {', '.join(map(str, named))}" if named else "")
                       + f" ({capture['reason']})", fix,
                       {"error": capture.get("error"), "nodes": capture.get("nodes"),
                        "outputs": capture.get("outputs")})
    stale = _STALE_OUTPUTS.search(capture.get("reason") or "") if outcome == "refused" else None
    if stale:
        import ast

        names = ast.literal_eval(stale.group(1))
        causes = {f.details.get("output"): f for f in findings
                  if f.kind in ("constant_output", "view_output", "alias") and f.details.get("output") in names}
        why = {"constant_output": "depends on no input (a constant)", "alias": "is an input passed through",
               "view_output": "comes straight from a view op"}
        known = "; ".join(f"{n!r} {why[causes[n].kind]}" for n in names if n in causes)
        fix = " / ".join(dict.fromkeys(causes[n].fix for n in names if n in causes and causes[n].fix)) or (
            f"make output(s) {names} real computations on the inputs (or drop them), or run this model without "
            "capture")
        return Finding("capture", "error",
                       f"{ep} capture refused by ortcapture: a replay would never write output(s) {names} (ORT "
                       "copies them once, at capture, so every replay would return the capture-time value)"
                       + (f": {known}" if known else ""), fix, {"error": capture.get("error"), "outputs": names})
    if outcome == "refused":
        fix = None
        if not any(f.severity == "error" and f.fix for f in findings):
            fix = (dims_fix(model, example, given=given) if shapes.dynamic_inputs(model) else
                   "ORT's reason above is all there is: check the nodes listed as off the EP")
        return Finding("capture", "error", f"{ep} refused graph capture ({capture['stage']}): {capture['reason']}",
                       fix, {"error": capture.get("error")})
    suspects = [f.details.get("output") for f in findings if f.kind in ("alias", "view_output")]
    fix = (f"fix the outputs flagged above ({', '.join(map(repr, suspects))}): they are the likely cause"
           if suspects else "look for outputs that alias inputs, data-dependent shapes or random ops")
    what = "the replay failed: " if outcome == "replay_failed" else "one replay differs from the uncaptured run: "
    return Finding("capture", "error", f"captured on {ep}, but {what}{capture['reason']}", fix,
                   {"error": capture.get("error")})


def dynamic_checks(model_path: str, model, provider: str, example: Mapping[str, Sequence[int]],
                   static: Sequence[Finding], progress=None,
                   ep_options: Mapping[str, str] | None = None, given: Sequence[str] = ()) -> tuple[list[Finding], dict]:
    """Placement, ORT's log and a real capture on ``provider``; returns (findings, capture result). ``given``: the
    inputs whose ``--shape`` the user passed (the advice does not ask for those again).

    Raises :class:`DoctorError` when ORT cannot even create an uncaptured session for the model."""
    from ortcapture._ort import specialize as shapes
    from ortcapture._ort.model import EXTERNAL_FOLDER_KEY, ModelSource
    from ortcapture.cli.doctor_accuracy import ep_accuracy

    say = progress or (lambda msg: None)
    ep = _EP_NAMES[provider]
    tol = 1e-3 if provider == "webgpu" else 1e-4
    feeds0, feeds1 = random_feeds(model, example, 0), random_feeds(model, example, 1)
    dynamic = shapes.dynamic_inputs(model)
    external = any(t.data_location == 1 for t in model.graph.initializer)  # TensorProto.EXTERNAL
    list_memcpy = not external and os.path.getsize(model_path) < _OPTIMIZED_MODEL_LIMIT
    fixed_placement = None
    with tempfile.TemporaryDirectory(prefix="ortcapture-doctor-") as tmp, OrtLogCapture() as log:
        say(f"placement: uncaptured {ep} session")
        log.set_phase(_PHASE_AS_GIVEN)
        try:
            plain, placement = placement_session(model_path, provider, tmp, "as_given", list_memcpy, ep_options)
        except Exception as exc:  # noqa: BLE001
            raise DoctorError(f"onnxruntime cannot create an uncaptured {ep} session for this model: "
                              f"{_ort_reason(exc)}") from None
        if dynamic and placement.cpu_nodes:
            say("placement: uncaptured session with the dims fixed")
            log.set_phase(_PHASE_FIXED)
            try:
                # the graph only (external weights stay on disk, found through their folder: past 2 GB protobuf
                # cannot serialise the model with them)
                source = ModelSource(model_path)
                fixed = shapes.fix_input_shapes(source, {n: example[n] for n in dynamic})
                folder = source.build_kwargs()["folder"]
                _, fixed_placement = placement_session(fixed, provider, tmp, "fixed", list_memcpy, ep_options,
                                                       {EXTERNAL_FOLDER_KEY: folder} if folder else {})
            except Exception:  # noqa: BLE001 - the capture attempt reports what ORT says
                fixed_placement = None
        host = _host_read(plain, feeds0)
        for n in host:  # capture-time constants: the replay is judged on the values it was captured with
            feeds1[n] = feeds0[n]
        say("reference: two uncaptured runs")
        try:
            want = plain.run(None, feeds1)
        except Exception as exc:  # noqa: BLE001 - the example feeds do not fit the model
            raise DoctorError(f"an uncaptured {ep} run with random feeds of shapes "
                              f"{ {n: _fmt_shape(s) for n, s in example.items()} } fails: {_ort_reason(exc)}; "
                              "pass --shape with shapes the model accepts") from None
        try:  # a replay can only be judged against a stable run
            stable = _compare(plain.run(None, feeds1), want, tol)
        except Exception:  # noqa: BLE001 - a second run that fails: the capture attempt reports what ORT says
            stable = (True, 0.0, None)
        del plain
        say(f"capture: one capture, its verification and one replay on {ep} (a big model's first capture can "
            "take a while)")
        log.set_phase(_PHASE_CAPTURE)
        capture = attempt_capture(model_path, provider, feeds0, feeds1, want, tol, ep_options)
        probe = int64_probe(model_path, model, provider, feeds1, ep_options)
    say("EP accuracy: the uncaptured run against the CPU EP")
    accuracy = ep_accuracy(model_path, provider, ep, feeds1, want, ep_options, progress)
    # ORT logs its refusal before raising: a more precise reason than the wrapped exception
    refusals = [m for sev, _, m, ph in log.records if ph == _PHASE_CAPTURE and sev >= 3 and "graph capture" in m]
    if refusals and capture["outcome"] == "refused":
        capture["reason"] = refusals[-1]
    if refusals and capture.get("deferred") and not capture.get("direct_refusal"):
        capture["direct_refusal"] = refusals[0]
    findings = _placement_findings(model, ep, example, placement, fixed_placement, capture, given)
    if host:
        text, fix = WRONG_RESULT_KINDS["host_read_input"]
        findings.append(Finding("host_read_input", "warning", f"input(s) {host}: {text}; a replay keeps the value "
                                "of the capture (ortcapture refuses another value in CapturedGraph.run)", fix,
                                {"inputs": host}))
    if not stable[0]:
        findings.append(_unstable_finding(ep, stable, ep_options))
    findings += _log_findings(log.records)
    if accuracy is not None:  # the EP's own results against the CPU EP: a warning, never a refusal
        findings.append(accuracy)
    if probe is not None and not (probe.kind == "int64_as_int32" and capture.get("kind") == "int64_as_int32"):
        findings.append(probe)
    findings.append(_capture_finding(model, ep, example, capture, list(static) + findings, given))
    return findings, capture
