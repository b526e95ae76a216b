"""The capturing run: validate an IOBinding for capture, capture without side effects, pin it.

Kept apart from :mod:`ortcapture.session` so the rules for what may be captured live in one place.
"""
from __future__ import annotations

import onnxruntime as ort

from ortcapture import transfer
from ortcapture.binding import Bound, IOBinding
from ortcapture.errors import BindingError


def _overlaps(a: Bound, b: Bound) -> bool:
    if a.device != b.device or a.device_id != b.device_id:
        return False
    if a.value is not None and b.value is not None and (a.value is b.value or a.value._ortvalue is b.value._ortvalue):
        return True
    if a.address is None or b.address is None or not a.address or not b.address:
        return False
    na, nb = max(a.nbytes, 1), max(b.nbytes, 1)
    return a.address < b.address + nb and b.address < a.address + na


def validate_bindings(session, binding: IOBinding) -> list[tuple[str, str]]:
    """Raise :class:`BindingError` unless every model input and output is bound to a fixed buffer on the capturing
    device; return the declared (output, input) state pairs that share a buffer."""
    info = session.capture_info
    ins, outs = binding.bound_inputs, binding.bound_outputs
    for meta in session.get_inputs():
        if meta.name not in ins:
            raise BindingError(f"input {meta.name!r} is not bound; capture needs every input bound to a fixed buffer")
    for meta in session.get_outputs():
        if meta.name not in outs:
            raise BindingError(
                f"output {meta.name!r} is not bound; ORT would allocate it per run, and replay would write into the "
                "buffer allocated at capture. Bind a fixed buffer (sess.allocate(shape, dtype))."
            )
    for role, bound in (("input", ins), ("output", outs)):
        for name, b in bound.items():
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
            if b.device != info.device_type or (info.device_type == "cuda" and b.device_id != info.device_id):
                raise BindingError(
                    f"{role} {name!r} lives on {b.device}:{b.device_id}, but this session captures on "
                    f"{info.device_type}:{info.device_id} ({info.ep.name}). Copy it to a buffer from "
                    "sess.allocate() with ortcapture.update_inplace."
                )
    declared = []
    for oname, ob in outs.items():
        for iname, ib in ins.items():
            if _overlaps(ob, ib):
                if binding._oc_state.get(oname) == iname:
                    declared.append((oname, iname))
                    continue
                raise BindingError(
                    f"output {oname!r} and input {iname!r} share one buffer. ORT's memory planner does not promise "
                    "every read of the input happens before the output is written, and the capture call's warm-up "
                    "runs would advance it several steps (ORT #32243). Use separate buffers (CapturedGraph's "
                    f"state=...), or declare it: binding.declare_state({oname!r}, {iname!r})."
                )
    return declared


def capture_bindings(session, binding: IOBinding, graph_id: int, run_options, owner=None):
    """Capture ``graph_id`` with ``binding`` and pin it; the caller holds the session lock.

    ORT runs the model several times inside the first capturing call (warm-up). Inputs that are not also outputs
    are never written, so only declared in-place state pairs can be affected: their inputs are snapshotted on the
    device before the call and restored after it, then the graph is replayed once — so the call advances the state
    exactly one step, as an uncaptured run would.
    """
    declared = validate_bindings(session, binding)
    ins = binding.bound_inputs
    snapshots = []
    for _, iname in declared:
        buf = ins[iname].value
        if buf is None:
            raise BindingError(f"state input {iname!r} must be bound as an OrtValue to be snapshotted")
        tmp = session.allocate(buf.shape(), transfer.np_dtype_of(buf))
        transfer.copy([buf], [tmp])
        snapshots.append((tmp, buf))
    ort.InferenceSession.run_with_iobinding(session, binding, run_options)
    rec = session._oc_registry.record(binding, graph_id, owner)
    if snapshots:
        transfer.copy([t for t, _ in snapshots], [b for _, b in snapshots])
        ort.InferenceSession.run_with_iobinding(session, binding, run_options)
        rec.replays += 1
    return rec
