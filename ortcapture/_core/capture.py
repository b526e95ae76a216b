"""The capturing run: validate an IOBinding for capture, capture without side effects, pin it.

Kept apart from :mod:`ortcapture.session` so the rules for what may be captured live in one place.
"""
from __future__ import annotations

import warnings

import numpy as np

from ortcapture._ort import compat
from ortcapture._transfer import check as tcheck
from ortcapture._transfer import copy as tcopy
from ortcapture._core.binding import Bound, IOBinding
from ortcapture._memory.buffers import allocate
from ortcapture._core.run import run_bound, unsynchronised
from ortcapture._ort.specialize import host_read_inputs
from ortcapture._ort.sync import defer_sync
from ortcapture._ort.values import meta
from ortcapture.errors import BindingError, CaptureAbortedError, CaptureError, PointerLifetimeWarning

#: Byte written over every output before the verification replay; a buffer still all of it was not written.
SENTINEL_BYTE = 0xA5
#: The second pattern, for outputs whose real value happened to equal the first (e.g. int32 0xA5A5A5A5).
SENTINEL_BYTE_2 = 0x5A


def _overlaps(a: Bound, b: Bound) -> bool:
    if a.device != b.device or a.device_id != b.device_id:
        return False
    if a.value is not None and b.value is not None and (a.value is b.value or compat.c_value(a.value) is compat.c_value(b.value)):
        return True
    if a.address is None or b.address is None or not a.address or not b.address:
        return False
    na, nb = max(a.nbytes, 1), max(b.nbytes, 1)
    return a.address < b.address + nb and b.address < a.address + na


def validate_bindings(state, binding: IOBinding) -> list[tuple[str, str]]:
    """Raise :class:`BindingError` unless every model input and output is bound to a fixed buffer on the capturing
    device; return the declared (output, input) state pairs that share a buffer."""
    info, session = state.info, state.session
    ins, outs = binding.bound_inputs, binding.bound_outputs
    for node_arg in session.get_inputs():
        if node_arg.name not in ins:
            raise BindingError(f"input {node_arg.name!r} is not bound; capture needs every input bound to a fixed buffer")
    for node_arg in session.get_outputs():
        if node_arg.name not in outs:
            raise BindingError(
                f"output {node_arg.name!r} is not bound; ORT would allocate it per run, and replay would write into the "
                "buffer allocated at capture. Bind a fixed buffer (sess.allocate(shape, dtype))."
            )
    # inputs in host memory are "host-read" only next to a device EP (a CPU-only session has nothing else)
    host = host_read_inputs(session) if session.get_providers()[:1] != ["CPUExecutionProvider"] else frozenset()
    checked = getattr(binding, "host_values_checked", False)  # a CapturedGraph checks their values per run
    for role, bound in (("input", ins), ("output", outs)):
        for name, b in bound.items():
            if role == "input" and name in host:
                if b.kind == "cpu" or checked:
                    continue  # bind_cpu_input: ORT copies it at bind time, so it cannot change while pinned
                raise BindingError(
                    f"input {name!r} is read by ORT in host memory (get_input_memory_infos(): a Reshape shape, "
                    "Slice starts, Clip bounds, ...): its value at capture is a constant of the captured graph, and "
                    f"a buffer ({b.device}) suggests it can change — replays would silently keep the capture-time "
                    "value. Bind it with bind_cpu_input (ORT copies it once; capture another gpu_graph_id per "
                    "value). ORT's WebGPU EP accepts only device buffers under capture: use sess.capture(feeds) "
                    "there, which checks the value on every run."
                )
            if b.kind == "cpu":
                raise BindingError(
                    f"input {name!r} is bound with bind_cpu_input: ORT copies it once at capture and replay reads "
                    "that copy, so later changes to the array are silently stale. Bind a fixed device buffer "
                    "(sess.allocate) and update it in place (ortcapture.update_inplace)."
                )
            if b.kind == "allocate":
                raise BindingError(
                    f"output {name!r} is bound without a buffer (ORT allocates per run); replay would keep writing "
                    "into the capture-time allocation. Bind a fixed buffer (sess.allocate(shape, dtype))."
                )
            if b.kind == "pointer" and info.device_type == "webgpu":
                raise BindingError(
                    f"{role} {name!r} is bound with a raw pointer (bind_input/bind_output with buffer_ptr): WebGPU "
                    "buffers are WGPUBuffer handles, not addresses, and ORT's WebGPU kernels refuse them. Bind an "
                    "OrtValue from sess.allocate(shape, dtype) (bind_ortvalue_input/bind_ortvalue_output)."
                )
            if b.device != info.device_type or (info.device_type == "cuda" and b.device_id != info.device_id):
                raise BindingError(
                    f"{role} {name!r} lives on {b.device}:{b.device_id}, but this session captures on "
                    f"{info.device_type}:{info.device_id} ({info.ep.name}). Copy it to a buffer from "
                    "sess.allocate() with ortcapture.update_inplace."
                )
    onames = list(outs)
    for i, oname in enumerate(onames):
        for other in onames[i + 1:]:
            if _overlaps(outs[oname], outs[other]):
                raise BindingError(
                    f"outputs {oname!r} and {other!r} are bound to one buffer (or overlapping ones): every replay "
                    "writes both into it, and reading one gives the other's values. Bind each output to its own "
                    "buffer (sess.allocate(shape, dtype))."
                )
    declared = []
    for oname, ob in outs.items():
        for iname, ib in ins.items():
            if _overlaps(ob, ib):
                if binding.declared_state.get(oname) == iname:
                    declared.append((oname, iname))
                    continue
                raise BindingError(
                    f"output {oname!r} and input {iname!r} share one buffer. ORT's memory planner does not promise "
                    "every read of the input happens before the output is written, and the capture call's warm-up "
                    "runs would advance it several steps (ORT #32243). Use separate buffers (CapturedGraph's "
                    f"state=...), or declare it: binding.declare_state({oname!r}, {iname!r})."
                )
    return declared


def capture_bindings(state, binding: IOBinding, graph_id: int, run_options, owner=None):
    """Capture ``graph_id`` with ``binding``, verify the replay, and pin it; the caller holds the session lock.

    ORT runs the model several times inside the first capturing call (warm-up). Inputs that are not also outputs
    are never written, so only declared in-place state pairs can be affected: their inputs are snapshotted on the
    device before the call and restored after it.

    Then every output buffer is filled with a sentinel byte pattern and the graph is replayed once (on the same
    inputs, so the outputs end as the capture left them, and declared state advances exactly one step). An output
    the replay did not write is refused: measured on ORT 1.32 WebGPU, an output that is a view (Reshape, Flatten,
    Squeeze, Unsqueeze, Identity) of another tensor or a graph input is copied once at capture and never again, so
    every later replay would silently return the capture-time value (ortcapture's WebGPU sessions compute view
    outputs inside the graph, :mod:`ortcapture._verify.inspect`; what is left is e.g. an input passed through). Outputs
    that depend on no input (``state.constant_outputs()``) are left out: their capture-time value is right. An output
    the replay writes only in part is refused too (issue 15: ``ScatterND`` on a graph-input or ``state=`` ``data``
    replays the scatter but not the copy of ``data``; the rest keeps the capture-time fill). Element-wise: an element
    that held each of two patterns after a replay was written by neither. Raises :class:`CaptureError` (the graph is
    released) naming those outputs; its ``kind`` is ``"unwritten_output"`` or ``"partly_written_output"``,
    ``outputs`` the names.
    """
    session = state.session
    declared = validate_bindings(state, binding)
    _warn_pointer_lifetime(binding, graph_id)
    snapshots = _snapshot_state(state, binding, declared)
    run = _runner(state, binding, run_options)
    rec = None
    try:
        try:
            run()
        except (ValueError, TypeError):  # refused by ORT's Python guards before the native run: nothing to undo
            raise
        except Exception as exc:  # noqa: BLE001 - ORT's Fail/RuntimeException/EPFail are not all RuntimeErrors
            _abandon(state, graph_id, run_options, snapshots, exc)
        rec = state.registry.record(binding, graph_id, owner)
    except BaseException as exc:
        if rec is None and not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, ...: see _interrupted
            _interrupted(state, graph_id, snapshots)
        raise
    try:
        host = host_read_inputs(session)
        # bind_cpu_input may wrap the caller's array without a copy: a later in-place change would be read by an
        # uncaptured run but not by a replay (the host read happened at capture), so the values are checked per
        # replay
        rec.frozen = {n: np.array(b.value, copy=True) for n, b in binding.bound_inputs.items()
                      if n in host and b.kind == "cpu" and b.value is not None}
        if snapshots:
            tcopy.copy([t for t, _ in snapshots], [b for _, b in snapshots])
        # a declared in-place state output shares its input's buffer: a pattern there would be the state the check
        # replay steps from (the state came back as pattern + 1); the replay writes it in place, rightly in whole
        in_place = {o for o, _ in declared}
        sentinels = _fill_sentinels(binding, SENTINEL_BYTE, skip=set(state.constant_outputs()) | in_place)
        run()  # internal: not counted
        first = {name: _sentinel_mask(buf, pattern) for name, (buf, pattern) in sentinels.items()}
        suspect = [name for name, mask in first.items() if mask.any()]
        stale, partial = [], []
        if suspect:  # a real result may equal the pattern: confirm with a second one, state kept at one step
            again = _snapshot_state(state, binding, declared)
            second = _fill_sentinels(binding, SENTINEL_BYTE_2, only=suspect, skip=in_place)
            run()
            for name, (buf, pattern) in second.items():
                both = first[name] & _sentinel_mask(buf, pattern)  # held both patterns: written by no replay
                if both.all():
                    stale.append(name)
                elif both.any():
                    partial.append(name)
            if again:
                tcopy.copy([t for t, _ in again], [b for _, b in again])
    except BaseException as exc:
        interrupted = not isinstance(exc, Exception)  # an interrupt: state as before, and a retry of the id is told
        if interrupted and snapshots:
            try:
                tcopy.copy([t for t, _ in snapshots], [b for _, b in snapshots])
            except BaseException:  # noqa: BLE001 - best effort; the interrupt is what the caller sees
                pass
        state.release(graph_id, aborted=interrupted)
        raise
    if stale:
        state.release(graph_id)
        err = CaptureError(
            f"output(s) {stale} of gpu_graph_id={graph_id} are not written by the captured graph's replay: "
            f"{state.info.ep.name} copied them once at capture (an output that is a view — Reshape, "
            "Flatten, Squeeze, Unsqueeze, Identity — of another tensor or of a graph input), so every replay "
            "would return the capture-time value. The graph was released. Make those outputs real computations "
            "(or drop them), or run this model without capture; `ortcapture doctor MODEL` lists such outputs."
        )
        err.kind, err.outputs = "unwritten_output", stale
        raise err
    if partial:
        state.release(graph_id)
        err = CaptureError(
            f"output(s) {partial} of gpu_graph_id={graph_id} are written only in part by the captured graph's "
            f"replay: some elements keep whatever the buffer held before ({state.info.ep.name} did the rest once, "
            "at capture — e.g. ScatterND/ScatterElements whose `data` is a graph input or a state= input: the "
            "kernel's copy of `data` into the output is not replayed). The graph was released. Compute the "
            "unwritten part inside the graph from an op that is replayed (e.g. Where(mask, updates, data) instead "
            "of ScatterND), or run this model without capture."
        )
        err.kind, err.outputs = "partly_written_output", partial
        raise err
    return rec


def _runner(state, binding: IOBinding, run_options):
    """The capture's one ORT call, repeated: ``run_bound``, and with ``disable_synchronize_execution_providers=1``
    the run is recorded so that the transfers between the calls wait for it (:func:`ortcapture._ort.sync.settle`)."""
    session = state.session
    if not unsynchronised(run_options):
        return lambda: run_bound(session, binding, run_options)
    kind = state.info.device_type

    def run():
        run_bound(session, binding, run_options)
        defer_sync(binding, kind)
    return run


def _warn_pointer_lifetime(binding: IOBinding, graph_id: int) -> None:
    """One :class:`PointerLifetimeWarning` per raw-pointer binding given without ``owner=`` (the capture is the one
    time it is seen: replays never warn)."""
    for role, bound in (("input", binding.bound_inputs), ("output", binding.bound_outputs)):
        for name, b in bound.items():
            if b.kind == "pointer" and b.owner is None:
                warnings.warn(
                    f"gpu_graph_id={graph_id}: {role} {name!r} is bound to the raw device pointer 0x{b.address:x}; "
                    "every replay reads/writes that address, so its memory must outlive the captured graph (a "
                    "freed torch tensor is silently replayed as garbage). Pass the owner "
                    f"(binding.bind_{role}(..., owner=tensor)) and ortcapture keeps it alive with the graph.",
                    PointerLifetimeWarning, stacklevel=6,
                )


def _abandon(state, graph_id: int, run_options, snapshots, exc: BaseException):
    """After a failed capturing run: undo what ORT's warm-up runs did to declared state, free ``graph_id`` in ORT
    where ORT can (else retire it), and raise :class:`CaptureAbortedError` naming the aborted capture.

    Measured on WebGPU (ORT 1.32, plugin 0.4.0): a capturing run aborted by ``RunOptions.terminate`` leaves an empty
    graph under the id; every later run of the id "replays" it and never writes the outputs, until
    ``release_captured_graph(id)``."""
    terminate = bool(getattr(run_options, "terminate", False))
    if snapshots:
        try:
            tcopy.copy([t for t, _ in snapshots], [b for _, b in snapshots])
        except Exception:  # noqa: BLE001 - best effort; the capture error below is what the caller needs
            pass
    if state.info.releases_natively:
        compat.OrtInferenceSession.release_captured_graph(state.session, graph_id)
        after = f"ortcapture released gpu_graph_id={graph_id} in ORT; capturing it again works"
    else:
        state.registry.retire(graph_id)
        after = (f"this onnxruntime cannot release a captured {state.info.ep.name} graph, so ortcapture retired "
                 f"gpu_graph_id={graph_id}: capture under another id (e.g. {state.registry.free_id(graph_id)})")
    why = "by RunOptions.terminate" if terminate else "by an error inside ORT"
    raise CaptureAbortedError(
        f"the capturing run of gpu_graph_id={graph_id} was aborted {why}: {exc}. ORT may keep what the aborted "
        f"capture left under that id (WebGPU: an empty graph that never writes the outputs); {after}."
    ) from exc


def _interrupted(state, graph_id: int, snapshots) -> None:
    """Bookkeeping after an interrupt of the capturing run (a ``BaseException`` that is not an ``Exception``:
    ``KeyboardInterrupt``, ``SystemExit``; the caller re-raises it unchanged — nothing blames the model).

    CPython delivers a signal only when ORT's native ``run_with_iobinding`` returns, so ORT may hold a complete
    graph under ``graph_id`` that no record pins (ORT >= 1.30's own WebGPU pin is skipped too: its wrapper is
    interrupted before it pins), and a later run of the id would replay that graph on the old buffers. Declared
    state is restored from its snapshot (the warm-up runs advanced it); the id is freed in ORT where ORT can
    (WebGPU, ORT >= 1.30: a retry under the id captures again), else retired as aborted (CUDA/TensorRT, whose
    release is a no-op: a retry of the id raises :class:`~ortcapture.errors.GraphReleasedError` saying the capture
    was aborted and which id captures). Never raises: the interrupt is what the caller sees."""
    try:
        if snapshots:
            tcopy.copy([t for t, _ in snapshots], [b for _, b in snapshots])
    except BaseException:  # noqa: BLE001 - best effort; the interrupt is re-raised by the caller
        pass
    try:
        if state.info.releases_natively:
            compat.OrtInferenceSession.release_captured_graph(state.session, graph_id)
        else:
            state.registry.retire(graph_id, aborted=True)
    except BaseException:  # noqa: BLE001 - a second interrupt: retire at least
        if state.registry is not None and not state.info.releases_natively:
            state.registry.retire(graph_id, aborted=True)


def _snapshot_state(state, binding: IOBinding, declared) -> list:
    """Device copies of the declared in-place state inputs: [(scratch copy, bound buffer)] (the scratch copies are
    the caller's: freed when it drops the list)."""
    ins = binding.bound_inputs
    snapshots = []
    for _, iname in declared:
        buf = ins[iname].value
        if buf is None:
            raise BindingError(f"state input {iname!r} must be bound as an OrtValue to be snapshotted")
        tmp = allocate(state.session, state.device, buf.shape(), tcheck.np_dtype_of(buf))
        tcopy.copy([buf], [tmp])
        snapshots.append((tmp, buf))
    return snapshots


def capture_in_this_thread(state, binding: IOBinding, run_options) -> None:
    """Give the calling thread its own copy of an already captured CUDA/TensorRT graph, side-effect free.

    ORT's CUDA and TensorRT EPs keep captured graphs in a per-thread context (``CUDAExecutionProvider::
    PerThreadContext``): the first run of a captured ``gpu_graph_id`` from another thread does not replay — ORT
    runs the model uncaptured (warm-up; in-place state advances) and captures a new graph in that thread. Done here
    once per thread under the process-wide capture gate, with the declared state inputs snapshotted and restored,
    so the caller's following replay advances state exactly one step. When ORT hands the thread a retired
    context that already holds the graph, the call is a plain replay and is undone the same way. The caller holds
    the session's capture guard.
    """
    declared = validate_bindings(state, binding)
    snapshots = _snapshot_state(state, binding, declared)
    try:
        _runner(state, binding, run_options)()
    finally:  # an interrupt too: the warm-up runs' steps are undone (the thread captures again on its next run)
        if snapshots:
            tcopy.copy([t for t, _ in snapshots], [b for _, b in snapshots])


def _fill_sentinels(binding: IOBinding, byte: int, only=None, skip=()) -> dict:
    """Overwrite every bound output OrtValue (or those named in ``only``) with ``byte``, except the constant outputs
    named in ``skip`` (ORT folds them and never writes them again; their capture-time value is right); return
    name -> (buffer, the pattern array). int64 outputs get the int32 pattern sign-extended (in the range the
    WebGPU EP keeps of an int64, and accepted by the int64 range check of :mod:`ortcapture.transfer`)."""
    out = {}
    for name, b in binding.bound_outputs.items():
        if (only is not None and name not in only) or name in skip:
            continue
        if b.value is None:
            continue  # raw-pointer outputs: not ours to fill
        m = meta(b.value)
        if m.dtype is None or m.nbytes == 0:
            continue
        if np.dtype(m.dtype) == np.int64:
            pattern = np.full(m.shape, np.full(1, byte, np.uint8).repeat(4).view(np.int32)[0], np.int64)
        else:
            pattern = np.full(m.nbytes, byte, np.uint8).view(m.dtype).reshape(m.shape)
        tcopy.update_inplace(b.value, pattern)
        out[name] = (b.value, pattern)
    return out


def _sentinel_mask(buf, pattern: np.ndarray) -> np.ndarray:
    """Per element (flattened): True where ``buf`` still holds ``pattern``'s bytes."""
    got = tcopy.to_numpy(buf)
    item = pattern.dtype.itemsize
    a = np.ascontiguousarray(got).view(np.uint8).reshape(-1, item)
    b = np.ascontiguousarray(pattern).view(np.uint8).reshape(-1, item)
    return np.all(a == b, axis=1)
