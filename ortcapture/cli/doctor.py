"""``ortcapture doctor MODEL.onnx``: say whether a model can be captured, and what to change when it cannot.

It says so before anyone waits for a failed capture.

``ortcapture doctor MODEL.onnx [--provider auto|cuda|webgpu|none] [--shape NAME=1x3x320x320 ...]
[--provider-option KEY=VALUE ...] [--buckets DIM=1,2,4 ...] [--json]``. ``--provider-option`` gives every session doctor creates the EP options
you will run with (validated as ``ortcapture bench`` validates them): they can change the verdict — measured on
onnxruntime-gpu 1.31.1 (H200), the reference model with ``prefer_nhwc=1`` and its dims dynamic is refused capture
by the CUDA EP ("all compute graph nodes have not been partitioned"), so it captures only via shape specialization.

Static checks (the ``onnx`` library; no execution provider needed):

* **control flow** — ``If``/``Loop``/``Scan`` and every other node that carries a subgraph, nested subgraphs and
  model-local functions included. ORT refuses graph capture for such models when the session is created
  (measured, onnxruntime 1.32 WebGPU: "the model has control flow nodes which can't be supported by
  WebGpuExecutionProvider").
* **dynamic input dims** — named (``batch``) and unnamed (``?``) — and whether ``--shape`` fixes them. Shapes are
  validated against the model (known input, rank, dims the model already fixes): a bad ``--shape`` is exit 2.
  ORT's WebGPU EP refuses capture when a dynamic model's shape subgraph falls to the CPU EP; shape
  specialization (``InferenceSession(..., static_shapes=...)``, or ``capture(feeds)``) fixes the dims.
* **input and output types** — string/sequence/map inputs or outputs cannot live in a fixed device buffer: not
  capturable (no capture is attempted).
* **outputs that alias inputs** — a graph output that *is* a graph input, or is one only through ``Identity``.
  Measured on WebGPU (onnxruntime 1.32): replay never refreshes such an output (a pass-through output stays zero,
  an ``Identity`` output keeps its capture-time value), so captured results are silently wrong. CUDA copes.
* **outputs straight from a view op** (``Reshape``/``Squeeze``/``Unsqueeze``/``Flatten``) — measured on WebGPU
  (onnxruntime 1.32, raw ORT IOBinding capture as well): every replay returns the capture-time value.
* **carried state** (info) — output/input pairs like ``state_out``/``state_in``, ``present.*``/``past_key_values.*``
  with one type and shape: bind them to separate buffers and carry them with ``capture(feeds, state=...)``.
* **constant outputs** — a graph output computed from constants only (no input reaches it): ORT folds it into a
  constant, no kernel writes it on a replay, and ortcapture refuses the capture (measured on WebGPU, onnxruntime
  1.32); drop it from the graph.
* **data-dependent output shapes** (``NonZero``, ``Unique``, ``NonMaxSuppression``, ``Compress``): a replay keeps
  the shapes of the capture.

Nodes without a kernel on the EP cannot be known statically; the dynamic checks find them.

Dynamic checks, when a capture-capable EP is present (``auto``: the CUDA EP when onnxruntime-gpu offers it — one
that does not load is exit 2, below — else the WebGPU plugin EP when a child-process probe captures on it — Dawn
without an adapter ends the process — else none):

* **node placement** — an uncaptured session created with ``session.record_ep_graph_assignment_info=1`` lists
  the nodes ORT placed on the CPU EP (``get_provider_graph_assignment_info()``, where ORT has it), and the
  optimized model ORT writes lists the Memcpy nodes it inserted (ORT 1.32 leaves them out of the assignment info).
  For a model with dynamic dims a second session with the dims fixed tells the shape subgraph (gone once dims are
  fixed) from nodes that stay on CPU (no kernel on the EP: capture refused).
* **ORT's own warnings and errors** while sessions are made and the capture runs (``set_default_logger_callback``
  where ORT has it, else file descriptor 2 redirected): the refusal reason, "shape massaging nodes", Memcpy notes.
* **stable reference** — two uncaptured runs with the same feeds must agree, or no replay can be judged against
  them (random ops; or an EP option computing wrong results — measured, onnxruntime-gpu 1.31.1 on an H200: CUDA
  ``fuse_conv_bias=1`` gets the reference model right on the first run and wrong on every later one).
* **int64 beyond int32** (WebGPU) — int64 inputs fed ``2**32 + v`` to a capture-enabled session (uncaptured run)
  and to one without capture: ORT's WebGPU EP runs int64 as 32-bit under ``enableGraphCapture=1``, so a difference
  is reported (``int64_as_int32``; ortcapture refuses such feeds, and int64 arithmetic nodes at construction).
* **EP accuracy** (``ep_accuracy``, a warning) — the uncaptured EP run against ORT's CPU EP on the same feeds; where
  they differ beyond tolerance, the first node whose output differs (intermediate outputs added to a copy of the
  model, bisected in topological order; nodes inside ``If``/``Loop`` bodies and fusions an extra output changes are
  out of its reach, and it says so). Never a refusal: verification judges a capture against the same EP
  (:mod:`ortcapture.cli.doctor_accuracy`).
* **a real capture** — ``ortcapture.InferenceSession(MODEL, <capture on>).capture(feeds)`` with random feeds of
  the given (or derived) shapes, one replay with other random feeds, compared with an uncaptured run. Outcome:
  captured directly, captured via shape specialization, refused (with ORT's reason), or replay mismatch. A
  successful capture with a matching replay overrules static findings (downgraded, their fixes dropped). The
  capture verifies itself (``verify="full"``: the example and a varied input set against a reference run), and a
  refusal is reported by its kind, with the fix: ``int64_as_int32`` (nodes named), ``partly_written_output``
  (outputs named), ``copy_only_kernel`` (nodes named), ``varied``/``example`` (outputs named).

**padding neutrality** (``--buckets DIM=1,2,4``, :mod:`ortcapture.cli.doctor_buckets`): one bucket session capture
per bucket, each verified on its most padded request against the unpadded uncaptured run; a bucket whose padding
changes an output is an ``error`` naming the outputs (the model is then not capturable with those buckets).

Verdict and exit code (:data:`EXIT_CODES`): 0 capturable (a real capture and replay succeeded), 1 not capturable
(the capture attempt failed, or a static check found a blocker), 2 error (model unreadable, bad ``--shape`` or
``--provider-option``, requested provider missing, or onnxruntime-gpu's CUDA EP does not load — the report names the
cause and keeps the static findings, without the placement findings that would follow from it), 3 unknown (no capture was attempted — ``--provider none``, or no
capture-capable EP here, e.g. WebGPU without an adapter — and the static checks found no blocker), with "what to
change" lines. ``--json`` prints one JSON object instead of the report.

Layout: the static checks are in :mod:`ortcapture.cli.doctor_static`, the dynamic ones in :mod:`ortcapture.cli.doctor_live`
(the EP-accuracy search in :mod:`ortcapture.cli.doctor_accuracy`);
this module parses the command line, combines their findings into the verdict and prints the report.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import Any, Sequence

from ortcapture.cli.doctor_buckets import padding_checks, parse_bucket_items
from ortcapture.cli.doctor_live import (  # noqa: F401 - re-exported
    _EP_NAMES, RECORD_ASSIGNMENT_KEY, OrtLogCapture, _compare, choose_provider, dynamic_checks,
)
from ortcapture.cli.doctor_static import (  # noqa: F401 - the public names of ``ortcapture.cli.doctor``
    CONTROL_FLOW_OPS, DATA_DEPENDENT_OPS, SEVERITIES, VIEW_OPS, DoctorError, Finding, _fmt_dims, _fmt_shape, dims_fix,
    parse_shapes, static_checks,
)

EXIT_CAPTURABLE, EXIT_NOT_CAPTURABLE, EXIT_ERROR, EXIT_UNKNOWN = 0, 1, 2, 3
#: ``ortcapture doctor``'s exit codes and what they mean (also in ``ortcapture doctor --help``)
EXIT_CODES = {
    EXIT_CAPTURABLE: "capturable: a real capture on the EP succeeded and its replay matched an uncaptured run",
    EXIT_NOT_CAPTURABLE: "not capturable: the capture attempt failed, or a static check found a blocker",
    EXIT_ERROR: "error: unreadable model, bad --shape or --provider-option, requested provider unusable, or the "
                "CUDA EP of onnxruntime-gpu does not load (the cause is named)",
    EXIT_UNKNOWN: "unknown: no capture was attempted (--provider none, or no capture-capable EP here) and the "
                  "static checks found no blocker",
}


# ---------------------------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    import argparse as _argparse

    p.formatter_class = _argparse.RawDescriptionHelpFormatter
    p.epilog = "exit codes:\n" + "\n".join(f"  {code}  {what}" for code, what in EXIT_CODES.items())
    p.add_argument("model", nargs="?", help="ONNX model file (default: the reference YOLOv8n, as in `demo`)")
    p.add_argument("--provider", choices=["auto", "cuda", "webgpu", "none"], default="auto",
                   help="EP for the placement checks and the capture attempt (none: static checks only)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=1x3x320x320",
                   help="input shape to check and capture with (repeat per input); dynamic dims without one get "
                        "batch 1 and 320 for the other dims")
    p.add_argument("--provider-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an execution provider option for every session doctor creates (repeatable), e.g. "
                        "prefer_nhwc=1; check with the options you will run")
    p.add_argument("--buckets", action="append", default=[], metavar="DIM=1,2,4",
                   help="check padding neutrality for these batch buckets (DIM: a dim_param or INPUT:AXIS; repeat "
                        "per bucketed dim): one capture per bucket, each verified padded vs unpadded")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")



# ---------------------------------------------------------------------------------------------------------------
# verdict and report
# ---------------------------------------------------------------------------------------------------------------
def diagnose(model_path: str, provider: str = "auto", shape_items: Sequence[str] = (), progress=None,
             option_items: Sequence[str] = (), bucket_items: Sequence[str] = ()) -> dict:
    """Run the static checks, then (with a capture-capable EP) the dynamic ones; return the report (the object
    ``--json`` prints). ``option_items``: ``--provider-option`` strings (``KEY=VALUE``) for every session doctor
    creates, validated by :func:`ortcapture._ort.providers.parse_provider_options`. ``bucket_items``: ``--buckets``
    strings: padding neutrality per bucket (:mod:`ortcapture.cli.doctor_buckets`). Raises :class:`DoctorError`
    (exit 2) for an unreadable model, a bad ``--shape`` or ``--provider-option``, or an unusable requested
    provider."""
    import onnx
    import onnxruntime as ort

    from ortcapture._ort import specialize as shapes
    from ortcapture.cli import one_line
    from ortcapture.cli.demo import check_model_file, example_shapes
    from ortcapture.cli.options import parse_provider_options
    from ortcapture.errors import CaptureError

    try:
        ep_options = parse_provider_options(list(option_items))
    except CaptureError as exc:
        raise DoctorError(str(exc)) from None
    try:
        check_model_file(model_path)
    except CaptureError as exc:
        raise DoctorError(str(exc)) from None
    try:
        model = onnx.load(model_path, load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - DecodeError and friends
        raise DoctorError(f"cannot read {model_path} as an ONNX model: {one_line(exc)}") from None
    if not model.graph.output:
        raise DoctorError(f"{model_path} has no graph outputs: not a usable ONNX model")
    given = parse_shapes(shape_items)
    bucket_spec = parse_bucket_items(bucket_items)
    findings = static_checks(model, given)
    dims = shapes.input_dims(model)
    if bucket_spec:  # a dim the model does not have: refused now, not after the captures
        from ortcapture._buckets.spec import parse_buckets

        try:
            parse_buckets(bucket_spec, dims)
        except CaptureError as exc:
            raise DoctorError(f"--buckets: {one_line(exc)}") from None
    try:
        example = {n: tuple(s) for n, s in example_shapes(model_path, 1, list(shape_items)).items()}
    except CaptureError as exc:  # a --shape with a 0 dim (the static checks caught the rest)
        raise DoctorError(str(exc)) from None
    derived = [n for n, ds in dims.items() if n not in given and any(not isinstance(d, int) for d in ds)]
    if derived:
        findings.append(Finding(
            "shapes", "info",
            f"no --shape for {', '.join(derived)}: checking with "
            f"{', '.join(f'{n}={_fmt_shape(example[n])}' for n in derived)} (batch 1, other dynamic dims 320); "
            "pass --shape with the shapes you will run", None, {"derived": {n: list(example[n]) for n in derived}}))
    for f in findings:
        if f.kind == "dynamic_dims" and f.severity == "warning":
            f.fix = dims_fix(model, example, given=list(given))
    from ortcapture._ort import cuda_probe

    # onnxruntime-gpu's CUDA EP that does not load: ORT would place every node on the CPU EP, so placement findings
    # and a capture attempt would only restate that; the cause is the finding (exit 2), the static checks stand
    broken = cuda_probe.refusal() if provider in ("auto", "cuda") else None
    chosen, why_none = ("none", broken) if broken else choose_provider(provider)
    capture: dict[str, Any] = {"attempted": False, "outcome": "not_attempted", "reason": why_none}
    cuda = cuda_probe.status() if chosen == "cuda" or broken else None
    if cuda is not None and cuda.note:  # a cuda-python for another CUDA major than ORT's
        findings.append(Finding("cuda_python", "warning", cuda.note,
                                f"pip install 'cuda-python>={cuda.ort_cuda_major},<{cuda.ort_cuda_major + 1}'"))
    if broken:
        findings.append(Finding(
            "provider", "error", f"{broken}: no placement check or capture attempted",
            "make the CUDA EP load (docs/GPU.md) and run doctor again, or check on WebGPU: --provider webgpu",
            {"cuda_ep": cuda.as_dict()}))
    elif chosen != "none" and any(f.kind in ("input_type", "output_type") for f in findings):
        why_none = "some inputs or outputs cannot live in device buffers (see input_type/output_type)"
        capture["reason"] = why_none
        findings.append(Finding("provider", "info", f"no capture attempted on {_EP_NAMES[chosen]}: {why_none}"))
    elif chosen == "none":
        unused = f"; the --provider-option values {ep_options} were not used" if ep_options else ""
        findings.append(Finding("provider", "info", f"no capture attempted: {why_none}{unused}"))
    else:
        more, capture = dynamic_checks(model_path, model, chosen, example, findings, progress, ep_options,
                                       given=list(given))
        findings += more
        if capture["outcome"] == "captured":  # ORT captured with the dims dynamic: nothing to fix
            for f in findings:
                if f.kind == "dynamic_dims" and f.severity == "warning":
                    f.severity, f.fix = "info", None
                    at = _fmt_shape(example[f.details["input"]])
                    f.message += f" (here ORT captured the model as given, at {at})"
        if capture["outcome"] in ("captured", "captured_specialized"):
            for f in findings:
                # a real capture and a matching replay outrank a static rule
                if (f.severity == "error" or f.kind == "view_output") and f.kind not in ("ep_results", "int64_as_int32"):
                    f.severity = "warning" if f.severity == "error" else "info"
                    f.details["overruled_by_capture"] = True
                    f.message += " (yet the capture attempt succeeded and its replay matched: ORT copes here)"
    if bucket_spec:
        findings += _bucket_findings(model_path, model, chosen, capture, bucket_spec, example, ep_options, progress)
    errors = any(f.severity == "error" for f in findings)
    if broken:
        verdict, code, basis = "error", EXIT_ERROR, "the CUDA EP does not load"
    elif capture["attempted"]:
        ok = capture["outcome"] in ("captured", "captured_specialized") and not errors
        verdict, code = ("capturable", EXIT_CAPTURABLE) if ok else ("not capturable", EXIT_NOT_CAPTURABLE)
        basis = f"capture attempt on {_EP_NAMES[chosen]}"
    elif errors:  # a static blocker needs no capture attempt to be sure
        verdict, code, basis = "not capturable", EXIT_NOT_CAPTURABLE, "static checks only"
    else:  # nothing found, but nothing tried either: no "capturable" without a capture
        verdict, code, basis = "unknown", EXIT_UNKNOWN, "static checks only: no capture attempted"
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: order[f.severity])
    fixes = [f.fix for f in findings if f.fix and (f.severity in ("error", "warning") or f.kind == "capture")
             and not f.details.get("overruled_by_capture")]
    if code == EXIT_UNKNOWN:
        fixes.append("for a verdict, let doctor attempt a real capture: drop --provider none" if provider == "none"
                     else "for a verdict, make a capture-capable EP usable here (the provider line above says why "
                          "none is) and run doctor again")
    return {
        "model": model_path,
        "verdict": verdict,
        "exit_code": code,
        "basis": basis,
        "provider": chosen,
        "ep": _EP_NAMES.get(chosen),
        "onnxruntime": ort.__version__,
        "provider_options": ep_options,
        "inputs": {n: {"dims": ds, "shape": list(example.get(n, ())),
                       "source": "given" if n in given else ("derived" if n in derived else "model")}
                   for n, ds in dims.items()},
        "findings": [asdict(f) for f in findings],
        "capture": capture,
        "what_to_change": list(dict.fromkeys(fixes)),
    }


def _bucket_findings(model_path, model, chosen, capture, spec, example, ep_options, progress) -> list[Finding]:
    """``--buckets``: padding neutrality per bucket where the model captures here; one ``padding`` finding saying
    why not otherwise."""
    from ortcapture.cli.doctor_live import random_feeds

    if chosen == "none" or capture.get("outcome") not in ("captured", "captured_specialized"):
        why = "no capture-capable EP here" if chosen == "none" else "the model did not capture here (see above)"
        return [Finding("padding", "info", f"--buckets: padding neutrality not checked: {why}")]
    if progress:
        progress(f"buckets: one capture per bucket of {spec}")
    return padding_checks(model_path, chosen, spec, random_feeds(model, example, 2), ep_options)


_OUTCOME_WORDS = {"captured": "captured directly", "captured_specialized": "captured via shape specialization",
                  "refused": "refused", "mismatch": "captured, but the replay does not match the uncaptured run",
                  "replay_failed": "captured, but the replay failed", "not_attempted": "not attempted"}


def format_report(report: dict) -> str:
    """The human-readable report: inputs, findings (errors first), capture outcome, verdict, what to change."""
    lines = [f"ortcapture doctor: {report['model']}",
             f"  onnxruntime {report.get('onnxruntime')}, provider {report.get('ep') or report.get('provider')}"]
    for name, info in (report.get("inputs") or {}).items():
        lines.append(f"  input {name} {_fmt_dims(info['dims'])} -> {_fmt_shape(info['shape'])} ({info['source']})")
    lines.append("")
    for f in report.get("findings", []):
        lines.append(f"  [{f['severity']}] {f['kind']}: {f['message']}")
    cap = report.get("capture") or {}
    if cap.get("attempted"):
        took = f" ({cap['seconds']:.1f} s)" if cap.get("seconds") is not None else ""
        lines.append(f"\n  capture: {_OUTCOME_WORDS.get(cap['outcome'], cap['outcome'])}{took}")
    lines.append(f"\nverdict: {report['verdict']} (exit {report['exit_code']}; {report.get('basis', '')})")
    if report.get("what_to_change"):
        lines.append("what to change:")
        lines += [f"  - {fix}" for fix in report["what_to_change"]]
    return "\n".join(lines)


def _json_safe(obj):
    """``obj`` with non-finite floats (an infinite max abs diff: NaNs or shapes differ) as ``None``: strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def run(args) -> int:
    """Entry point of ``ortcapture doctor``: print the report (``--json``: one JSON object) and return the exit
    code (:data:`EXIT_CODES`): 0 capturable, 1 not capturable, 2 error, 3 unknown (no capture attempted)."""
    progress = None if args.json else (lambda msg: print(f"ortcapture doctor: {msg} ...", file=sys.stderr,
                                                         flush=True))
    from ortcapture.cli import models

    try:
        args.model = models.model_or_reference(args.model)
    except models.ModelUnavailable as exc:
        print(f"ortcapture doctor: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        report = diagnose(args.model, args.provider, args.shape, progress, getattr(args, "provider_option", ()),
                          getattr(args, "buckets", ()))
    except Exception as exc:  # noqa: BLE001 - DoctorError (the request) or anything unexpected: exit 2
        from ortcapture.cli import one_line

        why = one_line(exc) if isinstance(exc, DoctorError) else f"doctor failed: {type(exc).__name__}: {one_line(exc)}"
        if args.json:
            print(json.dumps({"model": args.model, "verdict": "error", "exit_code": EXIT_ERROR, "error": why,
                              "provider": args.provider, "findings": [], "capture": {"attempted": False},
                              "what_to_change": []}))
        else:
            print(f"ortcapture doctor: {why}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(_json_safe(report), default=str, allow_nan=False) if args.json else format_report(report))
    return int(report["exit_code"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="ortcapture doctor")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
