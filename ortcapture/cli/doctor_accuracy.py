"""``ortcapture doctor``'s "EP accuracy" finding: the EP uncaptured against ORT's CPU EP, and the first node that differs.

Verification judges a capture against the same EP run uncaptured (:mod:`ortcapture._core.reference`), because an EP
may compute differently from the CPU EP without any capture (measured on WebGPU, software adapter and an NVIDIA GPU
through Vulkan: a recurrent model's state differed by 0.43 after one step, while its captured replay equalled the
uncaptured WebGPU run). Whether the EP's own results are acceptable is the user's call; this module reports it:

* :func:`ep_accuracy` compares the EP's uncaptured outputs with a CPU EP session on the same feeds
  (:data:`ortcapture._verify.compare.DEFAULT_RTOL`, relative to each output's scale) and, where they differ, names
  the first node whose output differs beyond that tolerance: intermediate outputs are added to a copy of the model
  (onnx; the graph only, external weights found through their folder) and the top-level nodes, in topological
  order, are searched by repeated k-ary bisection (:func:`first_differing_node`; a few EP + CPU session pairs), and
  before that node, the first whose output differs at all (where the difference starts, e.g. a transcendental
  function the EP rounds its own way, before a recurrence amplifies it).
* What it cannot reach, said in the finding: nodes inside ``If``/``Loop``/``Scan`` bodies (only top-level nodes get
  extra outputs), and fusions that an extra output changes (ORT does not fuse a node whose intermediate result is a
  graph output, so the copy may compute slightly differently from the model as given). The search assumes a
  difference, once it appears, persists downstream; a difference that vanishes and reappears may be found late.

Never a refusal: the finding is a ``warning`` and does not change the verdict.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ortcapture.cli.doctor_static import Finding

#: extra outputs per probe (one EP session and one CPU session each)
PROBE_WIDTH = 8
#: at most this many probes: the search stops there and says so
MAX_PROBES = 12


def _differs(got, want, rtol: float) -> bool:
    import numpy as np

    from ortcapture._verify.compare import compare

    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return True
    return bool(compare(["t"], [got], [want], rtol)[0])


def tensor_candidates(model) -> list[tuple[int, str, str, str]]:
    """``(node index, node name, op type, tensor)`` for the first output of every top-level node, in topological
    order (ONNX requires it), graph outputs included."""
    out = []
    for i, node in enumerate(model.graph.node):
        name = next((o for o in node.output if o), None)
        if name is not None:
            out.append((i, node.name, node.op_type, name))
    return out


def first_differing_node(probe: Callable[[Sequence[str]], dict[str, bool]], tensors: Sequence[str],
                         width: int = PROBE_WIDTH, max_probes: int = MAX_PROBES) -> tuple[int | None, int, bool]:
    """Index (into ``tensors``) of the first tensor that ``probe(names) -> {name: differs}`` reports as different,
    assuming a difference persists downstream: each probe checks up to ``width`` evenly spaced tensors of the range
    left, which shrinks to the gap before the first that differs. Returns ``(index or None, probes made,
    exhausted)``; ``exhausted``: ``max_probes`` ran out before the range was down to one tensor (the index is then
    the first differing tensor found so far)."""
    lo, hi = 0, len(tensors)  # the first differing tensor is in [lo, hi); hi == len: none seen yet
    found, probes = None, 0
    while lo < hi:
        if probes >= max_probes:
            return found, probes, True
        n = hi - lo
        if n <= width:
            picks = list(range(lo, hi))
        else:
            picks = sorted({lo + (k * n) // width for k in range(1, width)} | {hi - 1})
        result = probe([tensors[i] for i in picks])
        probes += 1
        bad = [i for i in picks if result.get(tensors[i])]
        if not bad:
            if found is None and hi == len(tensors):
                return None, probes, False  # nothing differs (where the probes looked: the last one included)
            lo = picks[-1] + 1
            if lo >= hi:
                break
            continue
        first = bad[0]
        found = first
        before = [i for i in picks if i < first]
        lo = before[-1] + 1 if before else lo
        hi = first
        if n <= width:
            break
    return found, probes, False


def _with_outputs(model, names: Sequence[str]):
    """A copy of ``model`` with ``names`` added as graph outputs (types left to ORT's inference)."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    have = {o.name for o in copy.graph.output}
    for name in names:
        if name not in have:
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
    return copy


def ep_accuracy(model_path: str, provider: str, ep: str, feeds: Mapping[str, Any], want: Sequence[Any],
                ep_options: Mapping[str, str] | None = None, progress=None) -> Finding | None:
    """The "EP accuracy" finding (see the module docstring), or ``None`` when the EP's uncaptured outputs ``want``
    (on ``feeds``) agree with the CPU EP within tolerance, or the CPU EP cannot run the model. ``provider``:
    ``cuda``/``webgpu`` (:func:`ortcapture._ort.providers.session_args`); ``ep``: its EP name, for the message."""
    import onnxruntime as ort

    from ortcapture._ort.model import ModelSource, external_folder
    from ortcapture._ort.providers import session_args
    from ortcapture._verify.compare import DEFAULT_RTOL, compare
    from ortcapture.cli.doctor_static import CONTROL_FLOW_OPS

    say = progress or (lambda msg: None)
    source = ModelSource(model_path)
    folder = source.build_kwargs()["folder"]

    def options():
        so = ort.SessionOptions()
        so.log_severity_level = 3
        return so

    def cpu_session(model):
        with external_folder(options(), folder) as so:
            return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])

    def ep_session(model):
        with external_folder(options(), folder) as so:
            return ort.InferenceSession(model, **session_args(provider, False, so, ep_options=ep_options))

    try:
        base = source.structure()
        names = [o.name for o in base.graph.output]
        cpu = cpu_session(source.model()).run(None, dict(feeds))
    except Exception:  # noqa: BLE001 - no CPU kernel for some node (e.g. bf16): nothing to compare with
        return None
    bad, errors = compare(names, list(want), cpu, DEFAULT_RTOL)
    if not bad:
        return None
    say(f"EP accuracy: {ep} and the CPU EP differ; searching the first node that differs")
    candidates = tensor_candidates(base)
    tensors = [c[3] for c in candidates]

    seen: dict[str, tuple[bool, bool]] = {}  # tensor -> (differs beyond rtol, differs at all)
    counted = [0]

    def probe(picked: Sequence[str], which: int) -> dict[str, bool]:
        missing = [n for n in picked if n not in seen]
        if missing:
            counted[0] += 1
            data = _with_outputs(base, missing).SerializeToString()  # the graph only: weights stay external
            got = dict(zip([*names, *missing], ep_session(data).run(None, dict(feeds))))
            ref = dict(zip([*names, *missing], cpu_session(data).run(None, dict(feeds))))
            for n in missing:
                seen[n] = (_differs(got[n], ref[n], DEFAULT_RTOL), _differs(got[n], ref[n], None))
        return {n: seen[n][which] for n in picked}

    first, origin, exhausted, failed = None, None, False, None
    try:
        index, _, exhausted = first_differing_node(lambda picked: probe(picked, 0), tensors)
        if index is not None:
            first = candidates[index]
            # where it starts: the first node whose output differs at all (searched before that one)
            start, _, _ = first_differing_node(lambda picked: probe(picked, 1), tensors[:index + 1])
            if start is not None and start != index:
                origin = candidates[start]
    except Exception as exc:  # noqa: BLE001 - a copy ORT cannot build (e.g. an output type it cannot infer)
        failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    probes = counted[0]
    limits = []
    flow = sorted({n.op_type for n in base.graph.node if n.op_type in CONTROL_FLOW_OPS})
    if flow:
        limits.append(f"nodes inside {'/'.join(flow)} bodies are not searched (only top-level nodes get extra "
                      "outputs)")
    limits.append("an extra output can change what ORT fuses, so the copy may compute slightly differently from "
                  "the model as given")
    limits.append("the search assumes a difference persists downstream")
    worst = ", ".join(f"{n} ({errors[n]:.3g})" for n in bad[:8])
    if first is not None:
        idx, node, op, tensor = first
        where = (f"the first node whose output differs beyond rtol {DEFAULT_RTOL:g}: {op} "
                 f"{node!r} (node {idx} in topological order, output {tensor!r})" if node else
                 f"the first node whose output differs beyond rtol {DEFAULT_RTOL:g}: {op} (node {idx} in "
                 f"topological order, output {tensor!r})")
        if exhausted:
            where += f" (the search stopped after {probes} probes: an earlier node may differ too)"
        if origin is not None:
            where += (f"; the difference starts, below tolerance, at {origin[2]} {origin[1] + ' ' if origin[1] else ''}"
                      f"(node {origin[0]}, output {origin[3]!r}: the EP rounds it differently from the CPU EP) and "
                      "grows from there")
    elif failed:
        where = f"the first differing node could not be searched ({failed})"
    else:
        where = "no top-level node's output differs beyond tolerance on its own (the difference builds up)"
    message = (f"EP accuracy: {ep} run without capture computes output(s) {worst} differently from ORT's CPU EP "
               f"beyond rtol {DEFAULT_RTOL:g} on the same inputs; {where}. This is the EP's own accuracy, not a "
               "capture fault: ortcapture verifies a capture against the same EP, so it captures. Not reached: "
               + "; ".join(limits) + ".")
    details = {"outputs": bad, "errors": {n: errors[n] for n in bad}, "rtol": DEFAULT_RTOL, "probes": probes,
               "first_node": _node(first), "first_node_any_difference": _node(origin or first),
               "not_reached": limits}
    # no fix: nothing in the model keeps it from capturing; whether the EP is accurate enough is the user's call
    return Finding("ep_accuracy", "warning", message, None, details)


def _node(candidate) -> dict | None:
    if candidate is None:
        return None
    index, name, op, output = candidate
    return {"index": index, "name": name, "op_type": op, "output": output}
