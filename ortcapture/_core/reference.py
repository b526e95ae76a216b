"""Capture-time verification of a :class:`~ortcapture.graph.CapturedGraph` (``verify=``), and the facts it needs.

:func:`verify_graph` feeds the graph's example (and, at level ``"full"``, a varied input set) to the replay and to a
reference run, through :func:`ortcapture._verify.compare.verify`, then restores the example exactly: the input buffers,
the ``state=`` inputs (their initial values) and the output buffers (the example replay's outputs). The reference
(:func:`reference_runner`):

* CUDA/TensorRT: the same session with ``gpu_graph_id=-1`` — the same kernels at the same shapes, no second copy of
  the weights; compared exactly (bit-equal).
* WebGPU: the judge is the same EP, never another one. A graph of a session that captures itself is compared with
  that session's own uncaptured run (``gpu_graph_id=-1``), exactly: the same kernels at the same shapes (the
  construction-time int64 refusal, ``allow_int64_as_int32``, covers that session's int64-as-32-bit handling). A graph on
  a shape-specialised sibling is compared with the shape-deferred base session (built without capture, same EP),
  within :data:`ortcapture._verify.compare.DEFAULT_RTOL` (other shapes, other kernels).

  Why not ORT's CPU EP: an EP may compute differently from the CPU EP without any capture (measured on the software
  adapter and through Vulkan on an NVIDIA GPU: a recurrent model's state differs by 0.43 after one step on the same
  inputs, while its captured replay equals the uncaptured WebGPU run bit for bit), and a CPU judge would then refuse a
  capture that changes nothing.

How any capturing EP compares with the CPU EP is reported apart: :func:`check_ep_accuracy` (one
:class:`~ortcapture.errors.EPAccuracyWarning` per session family at ``verify="full"``) and ``ortcapture doctor``'s
"EP accuracy" finding; never a refusal.

Inputs ORT reads in host memory (:func:`ortcapture._ort.specialize.host_read_inputs`) are never varied: they are capture-time constants.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ortcapture._ort import compat
from ortcapture._transfer import copy as tcopy
from ortcapture._transfer import targets as ttargets
from ortcapture._core.run import uncaptured_run_options
from ortcapture._verify.compare import DEFAULT_RTOL, Report, VerificationError, verify
from ortcapture.errors import CaptureError

def reference_runner(cs, model_source: Any, cache: dict) -> tuple[Callable[[dict], list], float | None]:
    """``(feeds -> outputs, rtol)`` for graphs captured on the member state ``cs`` (see the module docstring).

    Args:
        cs: the :class:`~ortcapture._core.state.CaptureState` the graph was captured on.
        model_source: unused (kept for callers; the reference is never another EP).
        cache: unused.
    """
    info, fam = cs.info, cs.family
    ro = uncaptured_run_options()  # gpu_graph_id=-1: never a replay, nor a bucket graph (buckets=)
    if info.device_type == "cuda":
        session = cs.session
        if _has_storage_dtype(session):  # bfloat16: ORT's numpy bridge cannot take or give it
            return (lambda feeds: _run_with_ort_values(cs, feeds, ro)), None
        return (lambda feeds: session.run(None, feeds, ro)), None
    if fam is not cs and fam.deferred:
        base = fam.session
        return (lambda feeds: base.run(None, feeds, ro)), DEFAULT_RTOL
    session = cs.session  # the graph's own session, uncaptured: same EP, same kernels, same shapes
    return (lambda feeds: session.run(None, feeds, ro)), None


def cpu_reference(model_source: Any, cache: dict):
    """ORT's CPU EP session of the model (built once per session family, kept in ``cache``), or ``None`` where the
    CPU EP cannot build it (a node without a CPU kernel, e.g. bf16). ORT's own class: under ``ortcapture.patched()``
    ``onnxruntime.InferenceSession`` is the drop-in."""
    ref = cache.get("cpu")
    if ref is None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        try:
            ref = _build_cpu(model_source, so)
        except Exception:  # noqa: BLE001 - no CPU kernel for some node (e.g. bf16), or the model cannot be read
            ref = False
        cache["cpu"] = ref
    return ref or None


def _build_cpu(model_source: Any, so):
    from ortcapture._ort.model import ModelSource, external_folder
    from ortcapture._ort.specialize import load_model

    if isinstance(model_source, ModelSource):  # the model as the session loaded it (issue 30.6)
        model_source.check_external("build the CPU EP session of the EP-accuracy check")
        model = model_source.model()
        if isinstance(model, onnx_proto()):
            model = model.SerializeToString()
        with external_folder(so, model_source.build_kwargs()["folder"]) as so:
            return compat.OrtInferenceSession(model, so, providers=["CPUExecutionProvider"])

    model = load_model(model_source).SerializeToString() if not isinstance(model_source, (str, bytes)) \
        else model_source
    return compat.OrtInferenceSession(model, so, providers=["CPUExecutionProvider"])


def onnx_proto():
    import onnx

    return onnx.ModelProto


def check_ep_accuracy(cs, graph, model_source: Any, cache: dict) -> None:
    """Once per session family (``cache``): compare the restored example of ``graph`` (its inputs and the example
    replay's outputs) with ORT's CPU EP on the same inputs, and warn :class:`~ortcapture.errors.EPAccuracyWarning`
    naming the outputs that differ beyond :data:`~ortcapture._verify.compare.DEFAULT_RTOL` (every capturing EP; the
    tolerance covers CUDA's TF32 default, measured 2.2e-3 on YOLOv8n). Skipped where the CPU EP cannot build the
    model (e.g. bf16). Never raises: an EP that computes differently from the CPU EP is the EP's accuracy, not a
    capture fault (``ortcapture doctor`` names the first node that differs)."""
    if cs.info is None or cache.get("ep_accuracy_checked"):
        return
    cache["ep_accuracy_checked"] = True
    try:
        ref = cpu_reference(model_source, cache)
        if ref is None:
            return
        feeds = {n: tcopy.to_numpy(v) for n, v in graph.inputs.items()}
        names = [o.name for o in graph.session.get_outputs()]
        got = [tcopy.to_numpy(graph.outputs[n]) for n in names]
        want = ref.run(names, feeds)
    except Exception:  # noqa: BLE001 - a report, never a refusal
        return
    from ortcapture._verify.compare import compare

    bad, errors = compare(names, got, want, DEFAULT_RTOL)
    if bad:
        import warnings

        from ortcapture.errors import EPAccuracyWarning

        worst = ", ".join(f"{n} ({errors[n]:.3g})" for n in bad[:8])
        warnings.warn(
            f"{cs.info.ep.name} computes output(s) {worst} differently from ORT's CPU EP beyond rtol {DEFAULT_RTOL:g} "
            "on the same inputs, without capture: the EP's own accuracy, not a capture fault (the captured graph "
            f"gpu_graph_id={graph.graph_id} was verified against the uncaptured {cs.info.ep.name} run). "
            "`ortcapture doctor MODEL` names the first node that differs. Reported once per session.",
            EPAccuracyWarning, stacklevel=4)


def _has_storage_dtype(session) -> bool:
    """Whether an input or output has a dtype ORT's numpy bridge refuses (bfloat16: ortcapture._ort.values.STORAGE)."""
    return any(m.type == "tensor(bfloat16)" for m in (*session.get_inputs(), *session.get_outputs()))


def _run_with_ort_values(cs, feeds: dict, ro) -> list:
    """The uncaptured run with feeds as device OrtValues and outputs read by :func:`ortcapture.transfer.to_numpy`
    (measured on onnxruntime-gpu 1.31.1: ``run(numpy bfloat16)`` raises "Numpy_type 256 can't be converted to
    MLDataType")."""
    vals = {}
    for name, x in feeds.items():
        x = np.asarray(x)
        buf = cs.new_buffer(x.shape, x.dtype)
        tcopy.update_inplace(buf, x)
        vals[name] = buf
    return [tcopy.to_numpy(v) for v in cs.session.run_with_ort_values(None, vals, ro)]


def verify_graph(graph, level: str, reference: Callable[[dict], list], rtol: float | None,
                 keep=(), model_source: Any = None) -> Report:
    """Verify ``graph`` at ``level`` against ``reference`` and restore its example (see the module docstring).

    Raises:
        VerificationError: outputs differ (named); for the varied set the copy-only kernels that feed them are
            named too (``nodes``; ``kind`` is ``"copy_only_kernel"`` when some were found, else ``"varied"``).
    """
    if level == "off":
        return Report(level)
    names = [o.name for o in graph.session.get_outputs()]
    example = {n: tcopy.to_numpy(v) for n, v in graph.inputs.items()}
    kept_outputs: list = []
    before = graph.replays

    def replay(feeds: Mapping[str, np.ndarray]) -> list:
        outs = graph.run(dict(feeds))
        if not kept_outputs:
            kept_outputs.extend(outs)
        return outs

    try:
        return verify(replay, reference, example, names, level=level, rtol=rtol, keep=sorted(keep),
                      what=f"the captured graph gpu_graph_id={graph.graph_id}")
    except VerificationError as exc:
        exc.kind, exc.nodes = ("example" if exc.input_set == "example" else "varied"), []
        if exc.input_set == "varied" and model_source is not None:
            _name_copy_only(exc, model_source, graph)
        raise
    finally:
        if not graph.released:
            graph.uncount_replays(graph.replays - before)
            ttargets.copy_feeds(graph.inputs, example)  # inputs and state= inputs: the example's initial values
            # the outputs as the example replay left them (a name listed twice: one buffer); no input rule applies
            # to them (an int64 output beyond int32 is what the EP computed)
            tcopy.restore(graph.outputs, dict(zip(names, kept_outputs)))


def _name_copy_only(exc: VerificationError, model_source: Any, graph) -> None:
    from ortcapture._verify.inspect import load_structure
    from ortcapture._verify.model_checks import copy_only_nodes

    try:  # the graph as the session loaded it, without external weights
        nodes = copy_only_nodes(load_structure(model_source), exc.outputs, list(graph.state_inputs))
    except Exception:  # noqa: BLE001 - naming is a help, the refusal stands without it
        return
    if nodes:
        exc.kind, exc.nodes = "copy_only_kernel", nodes
        exc.args = (f"{exc.args[0]} Copy-only kernel(s) feeding them: {', '.join(nodes)} — their copy of the "
                    "input is not replayed, so what they feed keeps the capture-time values. Replace each with a "
                    "computing op (e.g. drop a single-input Max/Min, use Where(mask, updates, data) for a "
                    "ScatterND on an input) or run this model without capture.",)


def check_frozen(frozen: Mapping[str, np.ndarray], feeds: Mapping[str, Any] | None,
                 buffers: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`CaptureError` naming a host-read input whose value in ``feeds`` — or, not fed, in its fixed
    buffer (``buffers``: written with ``update_inplace`` before a ``replay()``; a tester's ``Clip`` bound was
    silently kept at its capture-time value) — differs from the capture's. Non-numpy values (OrtValues, DLPack)
    are read to the host for the comparison (a host buffer as a view)."""
    for name, want in frozen.items():
        fed = feeds is not None and name in feeds
        if fed:
            got = feeds[name]
        elif buffers is not None and name in buffers:
            got = buffers[name]
            got = got.numpy() if got.device_name().lower() == "cpu" else got
        else:
            continue
        got = tcopy.to_numpy(got) if not isinstance(got, (np.ndarray, np.generic, list, tuple, int, float)) \
            else np.asarray(got)
        if got.shape != want.shape or not np.array_equal(got, want):
            err = CaptureError(
                f"input {name!r} is read by ORT in host memory (get_input_memory_infos()): its value is a constant "
                f"of the captured graph ({want.tolist()}), and this run "
                f"{'feeds' if fed else 'finds in its fixed buffer'} {got.tolist()}. A replay would "
                "silently use the capture-time value. Capture another graph for this value (or run with "
                "gpu_graph_id=-1).")
            err.kind, err.inputs = "host_read_input", [name]
            raise err
