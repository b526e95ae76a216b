"""``ortcapture selftest``: does the installed ONNX Runtime carry the fixes ortcapture's patches add?

For people who apply ``patches/`` to an ORT source build. Each case runs in its own child process
(:mod:`ortcapture.cli.selftest_probe`), so an abort (no WebGPU adapter; an unfixed ORT terminating) is a result,
not a crash. Cases, and what decides them:

* ``copy-size-check`` (ortcapture patch 0003): ``onnxruntime.copy_tensors`` from a WebGPU float32[8] value into a
  CPU float32[2] value. present = refused with an error; missing = accepted (it writes past the destination).
* ``aliased-copy`` (ORT #32315, patch 0002): ``copy_tensors([v], [v])`` on a WebGPU value. present = the call
  returns (an error status or not); missing = the process dies. With the plugin EP (``onnxruntime-ep-webgpu``)
  the WebGPU data transfer is the plugin's own code, so this and ``copy-size-check`` judge the plugin + core pair
  that is installed (plugin 0.4.0 already carries #32315, even next to ORT 1.24).
* ``update-inplace`` (ORT #28256): ``OrtValue.update_inplace(OrtValue)`` copies between two values.
* ``webgpu-io-guards`` (ORT #32074): ORT's own Python WebGPU capture guards (``IOBinding._reject_if_pinned``,
  ``is_webgpu_graph_capture_enabled``) exist.
* ``cancopy-vendor-guard`` (ORT #32317, patch 0001): needs one build holding both the CUDA and the WebGPU EP;
  "not testable" elsewhere (released onnxruntime-gpu + the WebGPU plugin route no CUDA->CUDA copy_tensors at all:
  "Data transfer implementation ... not found").

WebGPU cases need ``onnxruntime-ep-webgpu`` and an adapter (on machines without a GPU: tools/setup_webgpu.sh's env
file); without them they are "not testable".

Exit codes: 0 every case present or not testable; 1 a case missing; 2 an error (a child failed unexpectedly, or a
usage error). ``--json`` prints ``{"ort": ..., "cases": [{"case", "fix", "result", "evidence"}], "exit": ...}``.
This module does not import onnxruntime (the children do).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

# case -> the fix it checks (name shown in the table)
CASES = {
    "copy-size-check": "ortcapture 0003 (CopyTensors size check)",
    "aliased-copy": "ORT #32315 (aliased copy returns a status)",
    "update-inplace": "ORT #28256 (OrtValue.update_inplace(OrtValue))",
    "webgpu-io-guards": "ORT #32074 (ORT's WebGPU I/O guards)",
    "cancopy-vendor-guard": "ORT #32317 (WebGPU CanCopy vendor guard)",
}
RESULTS = ("present", "missing", "not testable")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--case", action="append", choices=list(CASES), help="run only this case (repeatable)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per case (default 180)")


def run_case(case: str, timeout: float = 180.0, python: str | None = None) -> dict:
    """Run one case in a child process; return ``{"case", "fix", "result", "evidence", "ort"}``.

    ``result`` is "present", "missing", "not testable" or "error". Never raises for a child's failure.
    """
    cmd = [python or sys.executable, "-m", "ortcapture.cli.selftest_probe", case]
    out = {"case": case, "fix": CASES[case], "ort": None}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {**out, "result": "error", "evidence": f"the case did not finish within {timeout:.0f} s"}
    lines = []
    for ln in proc.stdout.splitlines():
        try:
            lines.append(json.loads(ln))
        except ValueError:
            continue
    out["ort"] = next((ln.get("ort") for ln in lines if "ort" in ln), None)
    final = [ln for ln in lines if "result" in ln]
    if final and final[-1]["result"] in RESULTS:
        return {**out, "result": final[-1]["result"], "evidence": final[-1]["evidence"]}
    stages = [ln["stage"] for ln in lines if "stage" in ln]
    why = f"exit code {proc.returncode}" if proc.returncode >= 0 else f"killed by signal {-proc.returncode}"
    tail = " | ".join(ln for ln in proc.stderr.strip().splitlines()[-2:])[:200]
    if stages and stages[-1] == "adapter":
        return {**out, "result": "not testable", "evidence": f"no usable WebGPU adapter (child {why}): {tail}"}
    if stages and stages[-1] == "copy":
        return {**out, "result": "missing", "evidence": f"the process died in the copy ({why}): {tail}"}
    return {**out, "result": "error", "evidence": f"child {why} after stage {stages[-1] if stages else 'none'}: "
                                                  f"{tail}"}


def exit_code(results: list[dict]) -> int:
    kinds = {r["result"] for r in results}
    return 2 if "error" in kinds else 1 if "missing" in kinds else 0


def table(results: list[dict]) -> str:
    rows = [("case", "fix", "result", "evidence")] + [(r["case"], r["fix"], r["result"], r["evidence"])
                                                      for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [" | ".join(row[i].ljust(widths[i]) for i in range(3)) + " | " + row[3] for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-" + "-" * 8)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    results = [run_case(case, args.timeout) for case in (args.case or CASES)]
    code = exit_code(results)
    ort_version = next((r["ort"] for r in results if r["ort"]), "unknown")
    if args.json:
        print(json.dumps({"ort": ort_version, "cases": [{k: r[k] for k in ("case", "fix", "result", "evidence")}
                                                        for r in results], "exit": code}, indent=2))
    else:
        print(f"onnxruntime {ort_version} ({sys.executable})")
        print(table(results))
        print({0: "every testable fix is present", 1: "a fix is missing", 2: "a case failed"}[code])
        missing = [r["case"] for r in results if r["result"] == "missing"]
        if missing == ["copy-size-check"]:  # what a released wheel gives: no build of yours is broken
            print("(released onnxruntime wheels lack patch 0003, the CopyTensors size check: expected unless you "
                  "built ORT with `ortcapture patch apply`; ortcapture checks sizes itself before every copy)")
    return code
