"""Capture-time verification of a :class:`~ortcapture.graph.CapturedGraph` (``verify=``), and the facts it needs.

:func:`verify_graph` feeds the graph's example (and, at level ``"full"``, a varied input set) to the replay and to a
reference run, through :func:`ortcapture._verify.compare.verify`, then restores the example exactly: the input buffers,
the ``state=`` inputs (their initial values) and the output buffers (the example replay's outputs). The reference
(:func:`reference_runner`):

* CUDA/TensorRT: the same session with ``gpu_graph_id=-1`` — the same kernels at the same shapes, no second copy of
  the weights; compared exactly (bit-equal).
* WebGPU: not the capture-enabled session itself (it runs int64 as 32-bit even uncaptured): the shape-deferred
  base session (built without capture) where the graph lives on a shape-specialised sibling, else a CPU EP session
  of the same model built once per session family; compared within :data:`ortcapture._verify.compare.DEFAULT_RTOL`. Only
  where the CPU EP cannot build the model (a node without a CPU kernel, e.g. bf16) the capture-enabled session
  runs uncaptured (``gpu_graph_id=-1``) as the reference.

Inputs ORT reads in host memory (:func:`ortcapture._ort.specialize.host_read_inputs`) are never varied: they are capture-time constants.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ortcapture._ort import compat
from ortcapture import transfer
from ortcapture._core.run import uncaptured_run_options
from ortcapture._verify.compare import DEFAULT_RTOL, Report, VerificationError, verify
from ortcapture.errors import CaptureError

def reference_runner(cs, model_source: Any, cache: dict) -> tuple[Callable[[dict], list], float | None]:
    """``(feeds -> outputs, rtol)`` for graphs captured on the member state ``cs`` (see the module docstring).

    Args:
        cs: the :class:`~ortcapture._core.state.CaptureState` the graph was captured on.
        model_source: the model (path, bytes or ModelProto) the family was built from (for the CPU EP reference).
        cache: a dict owned by the family's session: holds the CPU EP reference session once built.
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
    ref = cache.get("cpu")
    if ref is None:
        import onnxruntime as ort

        from ortcapture._ort.specialize import load_model

        so = ort.SessionOptions()
        so.log_severity_level = 3
        model = load_model(model_source).SerializeToString() if not isinstance(model_source, (str, bytes)) \
            else model_source
        try:  # ORT's own class: under ortcapture.patched() onnxruntime.InferenceSession is the drop-in (buckets=...)
            ref = compat.OrtInferenceSession(model, so, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - no CPU kernel for some node (e.g. bf16): the next best reference
            ref = False
        cache["cpu"] = ref
    if ref is False:
        # the capture-enabled session uncaptured: same kernels, but it shares the WebGPU EP's int64-as-int32
        # handling (refused at construction / range-checked at run), so it is still a fair judge of the replay
        session = cs.session
        return (lambda feeds: session.run(None, feeds, ro)), DEFAULT_RTOL
    return (lambda feeds: ref.run(None, feeds)), DEFAULT_RTOL


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
        transfer.update_inplace(buf, x)
        vals[name] = buf
    return [transfer.to_numpy(v) for v in cs.session.run_with_ort_values(None, vals, ro)]


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
    example = {n: transfer.to_numpy(v) for n, v in graph.inputs.items()}
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
            transfer.copy_feeds(graph.inputs, example)  # inputs and state= inputs: the example's initial values
            for name, value in dict(zip(names, kept_outputs)).items():  # a name listed twice: one buffer
                transfer.update_inplace(graph.outputs[name], value)


def _name_copy_only(exc: VerificationError, model_source: Any, graph) -> None:
    from ortcapture._verify.model_checks import copy_only_nodes
    from ortcapture._ort.specialize import load_model

    try:
        nodes = copy_only_nodes(load_model(model_source), exc.outputs, list(graph.state_inputs))
    except Exception:  # noqa: BLE001 - naming is a help, the refusal stands without it
        return
    if nodes:
        exc.kind, exc.nodes = "copy_only_kernel", nodes
        exc.args = (f"{exc.args[0]} Copy-only kernel(s) feeding them: {', '.join(nodes)} — their copy of the "
                    "input is not replayed, so what they feed keeps the capture-time values. Replace each with a "
                    "computing op (e.g. drop a single-input Max/Min, use Where(mask, updates, data) for a "
                    "ScatterND on an input) or run this model without capture.",)


def check_frozen(frozen: Mapping[str, np.ndarray], feeds: Mapping[str, Any]) -> None:
    """Raise :class:`CaptureError` naming a host-read input whose value in ``feeds`` differs from the capture's.
    Non-numpy feeds (OrtValues, DLPack) are read to the host for the comparison."""
    for name, want in frozen.items():
        if name not in feeds:
            continue
        got = feeds[name]
        got = transfer.to_numpy(got) if not isinstance(got, (np.ndarray, np.generic, list, tuple, int, float)) \
            else np.asarray(got)
        if got.shape != want.shape or not np.array_equal(got, want):
            err = CaptureError(
                f"input {name!r} is read by ORT in host memory (get_input_memory_infos()): its value is a constant "
                f"of the captured graph ({want.tolist()}), and this run feeds {got.tolist()}. A replay would "
                "silently use the capture-time value. Capture another graph for this value (or run with "
                "gpu_graph_id=-1).")
            err.kind, err.inputs = "host_read_input", [name]
            raise err
