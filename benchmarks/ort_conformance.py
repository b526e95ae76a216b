"""Conformance with ORT's own Python tests (issue 24 item 3): run ORT's IOBinding and CUDA-graph test files once
with raw ORT and once per way of installing ortcapture, and check that every test passing on raw ORT passes with
ortcapture too, except the deliberate deviations listed in docs/USAGE.md ("Deliberate deviations from ORT").

ORT's test files are not part of this repository (upstream licence); fetch them yourself into a directory, e.g.
on a machine with network (pinned commits, see ``UPSTREAM``)::

    python benchmarks/ort_conformance.py --fetch .ort_tests          # download, then run
    python benchmarks/ort_conformance.py --tests .ort_tests [--install patch,class] [--json out.json]

(``.ort_tests/`` is git-ignored, so it travels to a machine without network as an untracked-ignored folder.)

What it does, in a temporary working directory (``--keep DIR`` to keep one):

* builds the models the tests load, with onnx.helper, under ``testdata/``: ``mul_1.onnx`` (ORT's: ``Y = X * W``,
  W = [[1, 2], [3, 4], [5, 6]], float [3, 2]), ``matmul_2.onnx`` (``Y = X @ [[1], [2]]``, X float [N, 2]) and
  ``squeezenet/model.onnx`` (a small stand-in with SqueezeNet's input/output names and shapes:
  ``data_0`` float [N, 3, 224, 224] -> ``softmaxout_1`` float [N, 1000, 1, 1]; the test only compares a replay
  with the capturing run);
* provides what the tests import and current packages lack: ``helper.get_name`` (finds ``testdata/NAME``) and
  ``onnx.mapping`` (removed from onnx 1.19);
* runs pytest on the unmodified test files in a subprocess per mode: ``raw``; ``patch`` =
  ``ortcapture.patch_onnxruntime(provider=None)`` (the documented drop-in: "ortcapture installed"); ``class`` =
  ``onnxruntime.InferenceSession = ortcapture.InferenceSession`` (the plain replacement);
* splits ``test_select_ep_to_run_cuda_graph`` into its two parts (``run_model_with_cuda_graph``, which must pass, and
  ``run_model_with_cuda_graph_annotation``, a listed deviation) at collection time (see ort_conformance_conftest.py);
* prints a table (test id, one result per mode, deviation notes) and exits 0 iff the comparison holds, 1 if a test
  passing on raw ORT fails (or crashes, or does not run) with ortcapture, 2 if the raw run itself collected nothing.

Without a CUDA EP the CUDA tests skip (or, where ORT's test guards with ``if "CUDAExecutionProvider" in ...``, pass
without running anything): the comparison means something on a GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: ORT's test files and the commits --fetch downloads them at
UPSTREAM = {
    "onnxruntime_test_python_iobinding.py": "6db7bd80fd5b467390211b6cc3593f0c0c36081b",
    "onnxruntime_test_python_cudagraph.py": "0281e570f9e3dd709a94d4d5f99604f905abc07e",
}
RAW_URL = "https://raw.githubusercontent.com/microsoft/onnxruntime/{commit}/onnxruntime/test/python/{name}"

CUDAGRAPH_TEST = "onnxruntime_test_python_cudagraph.py::TestInferenceSessionWithCudaGraph::test_select_ep_to_run_cuda_graph"
#: test methods run as one test per part (the file on disk is not changed)
SPLITS = {CUDAGRAPH_TEST: ["run_model_with_cuda_graph", "run_model_with_cuda_graph_annotation"]}
#: test id -> why ortcapture deliberately behaves differently (docs/USAGE.md, "Deliberate deviations from ORT")
DEVIATIONS = {
    f"{CUDAGRAPH_TEST}__run_model_with_cuda_graph_annotation":
        "rebinds one IOBinding for several gpu_graph_ids: ortcapture pins one IOBinding per gpu_graph_id and raises "
        "BindingError (a captured graph replays the addresses it captured)",
}
INSTALLS = ("patch", "class")
OK, FAIL, HARNESS = 0, 1, 2


# -- the models the tests load ------------------------------------------------------------------------------------
def _save(graph, path: Path, opset: int = 13) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, producer_name="ortcapture-conformance",
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def mul_1_model(path: Path) -> Path:
    """ORT's testdata/mul_1.onnx (also shipped as onnxruntime/datasets/mul_1.onnx): ``Y = X * W`` elementwise,
    X, Y float [3, 2], W = [[1, 2], [3, 4], [5, 6]] an initializer. (With X = W the output is X * X, hence the
    "squares" ORT's tests expect; their rebinding tests feed 2 * W and expect 2 * W * W.)"""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.arange(1, 7, dtype=np.float32).reshape(3, 2), "W")
    graph = helper.make_graph([helper.make_node("Mul", ["X", "W"], ["Y"], name="mul_1")], "mul test",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 2])], [w])
    return _save(graph, path)


def matmul_2_model(path: Path) -> Path:
    """ORT's testdata/matmul_2.onnx: ``Y = X @ [[1], [2]]``, X float [N, 2], Y float [N, 1] (N dynamic)."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.array([[1.0], [2.0]], dtype=np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "matmul_2",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])], [w])
    return _save(graph, path)


def squeezenet_standin_model(path: Path) -> Path:
    """A small stand-in for ORT's testdata/squeezenet/model.onnx with its names and shapes: ``data_0`` float
    [N, 3, 224, 224] -> ``softmaxout_1`` float [N, 1000, 1, 1]: Conv 3x3/2 + Relu, MaxPool 3x3/2, Conv 1x1 to 1000
    channels + Relu, GlobalAveragePool, Softmax over the channels (SqueezeNet's head). Fixed random weights."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 3, 3, 3)) * 0.01).astype(np.float32), "w1"),
             numpy_helper.from_array(np.zeros(16, np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((1000, 16, 1, 1)) * 0.1).astype(np.float32), "w2"),
             numpy_helper.from_array(np.zeros(1000, np.float32), "b2")]
    nodes = [helper.make_node("Conv", ["data_0", "w1", "b1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
             helper.make_node("Softmax", ["g"], ["softmaxout_1"], axis=1)]
    graph = helper.make_graph(nodes, "squeezenet_standin",
                              [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, ["N", 3, 224, 224])],
                              [helper.make_tensor_value_info("softmaxout_1", TensorProto.FLOAT, ["N", 1000, 1, 1])],
                              inits)
    return _save(graph, path)


MODELS = {"mul_1.onnx": mul_1_model, "matmul_2.onnx": matmul_2_model,
          "squeezenet/model.onnx": squeezenet_standin_model}

HELPER_PY = '''"""get_name for ORT's Python tests (written by benchmarks/ort_conformance.py): NAME under testdata/."""
import os

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")


def get_name(name):
    for path in (name, os.path.join(TESTDATA, name)):
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{name} is not in {TESTDATA} (benchmarks/ort_conformance.py builds the models there)")
'''


def build_testdata(testdata: Path) -> list[Path]:
    """Write every model in MODELS under ``testdata`` (layout as ORT's tests expect); returns the paths."""
    return [build(testdata / name) for name, build in MODELS.items()]


# -- fetching and preparing ---------------------------------------------------------------------------------------
def fetch(dest: Path, upstream: dict[str, str] = UPSTREAM, url: str = RAW_URL) -> list[Path]:
    """Download ORT's test files at their pinned commits (``url`` formatted with ``commit`` and ``name``) into
    ``dest`` (needs network). Raises OSError (urllib's URLError) when a file cannot be fetched."""
    import urllib.request

    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name, commit in upstream.items():
        with urllib.request.urlopen(url.format(commit=commit, name=name), timeout=60) as resp:  # noqa: S310
            (dest / name).write_bytes(resp.read())
        out.append(dest / name)
    return out


def prepare(work: Path, tests_dir: Path, files: list[str]) -> None:
    """The working directory: unmodified copies of the test files, conftest.py, helper.py, testdata/, pytest.ini."""
    for name in files:
        src = tests_dir / name
        if not src.is_file():
            raise FileNotFoundError(f"{src} is missing: fetch ORT's test files into {tests_dir} (see --fetch)")
        shutil.copyfile(src, work / name)
    shutil.copyfile(HERE / "ort_conformance_conftest.py", work / "conftest.py")
    (work / "helper.py").write_text(HELPER_PY)
    (work / "pytest.ini").write_text("[pytest]\n")
    build_testdata(work / "testdata")


# -- running ------------------------------------------------------------------------------------------------------
def run_mode(work: Path, files: list[str], install: str, splits: dict, timeout: float,
             hide_eps: list[str] = ()) -> dict:
    """One pytest subprocess with ORT installed as ``install``. Returns ``{"rc", "meta", "collected", "results":
    {test id: {"outcome", "message"}}}``; outcomes: passed, failed, skipped, crashed (the process died in it)."""
    results_file = work / f"results-{install}.jsonl"
    results_file.unlink(missing_ok=True)
    env = dict(os.environ)
    env["ORTCAPTURE_CONFORMANCE"] = json.dumps({"install": install, "results": str(results_file), "splits": splits,
                                                     "hide_eps": list(hide_eps)})
    env["PYTHONPATH"] = os.pathsep.join([str(work), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                    else []))
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-c", "pytest.ini",
           "--rootdir", str(work), *files]
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        rc, log = "timeout", out.decode(errors="replace") if isinstance(out, bytes) else out
    (work / f"pytest-{install}.log").write_text(log)
    return {"rc": rc, **parse_results(results_file)}


def parse_results(path: Path) -> dict:
    """Fold the bootstrap's JSON lines into one outcome per test: ``failed`` if any phase or subtest failed;
    ``crashed`` if it started and never reported; ``passed`` if a subtest passed (the others skipped: ORT's tests
    loop over CUDA and DML) or, without subtests, its call passed; else ``skipped`` (pytest 9 reports a test whose
    subtests all skipped as passed). ``subtests`` counts how its subtests ended ({} without subtests)."""
    meta, collected, started, reports, subtests = {}, [], [], {}, {}
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        rec = json.loads(line)
        if "meta" in rec:
            meta = rec["meta"]
        elif "collected" in rec:
            collected = rec["collected"]
        elif "started" in rec:
            started.append(rec["started"])
        elif "subtest_end" in rec:
            c = subtests.setdefault(rec["subtest_end"], {})
            c[rec["outcome"]] = c.get(rec["outcome"], 0) + 1
        else:
            reports.setdefault(rec["id"], []).append(rec)
    results = {}
    for tid in started:
        recs, subs = reports.get(tid, []), subtests.get(tid, {})
        failed = [r for r in recs if r["outcome"] == "failed"]
        final = [r for r in recs if not r["subtest"] and (r["when"] == "call" or r["outcome"] == "skipped")]
        if failed or subs.get("failed"):
            outcome, message = "failed", failed[0]["message"] if failed else "a subtest failed"
        elif not final:
            outcome, message = "crashed", "the pytest process ended inside this test"
        elif subs.get("passed"):  # pytest before 9 reports a test whose last subtest skipped as skipped
            outcome = "passed"
            message = f"{subs['skipped']} of {sum(subs.values())} subtests skipped" if subs.get("skipped") else ""
        elif subs.get("skipped") or final[0]["outcome"] == "skipped":
            skips = [r for r in recs if r["outcome"] == "skipped"]
            outcome, message = "skipped", skips[0]["message"] if skips else "every subtest skipped"
        else:
            outcome, message = "passed", ""
        results[tid] = {"outcome": outcome, "message": message, "subtests": subs}
    return {"meta": meta, "collected": collected, "results": results}


# -- the verdict --------------------------------------------------------------------------------------------------
def verdict(runs: dict[str, dict], deviations: dict[str, str]) -> tuple[list[dict], int]:
    """Compare each ortcapture mode with ``runs["raw"]``. Returns (rows, exit code): one row per test id
    ``{"id", mode: outcome..., "note"}``; exit code OK, FAIL (a test passing raw is not passing in some mode and is
    not a listed deviation) or HARNESS (the raw run collected nothing)."""
    modes = [m for m in runs if m != "raw"]
    ids = list(dict.fromkeys(t for run in runs.values() for t in run["collected"] + list(run["results"])))
    code = OK if runs["raw"]["collected"] else HARNESS
    rows = []
    for tid in ids:
        row = {"id": tid}
        for mode, run in runs.items():
            row[mode] = run["results"].get(tid, {}).get("outcome", "not run")
        notes = []
        if row["raw"] == "passed":
            bad = [m for m in modes if row[m] != "passed"]
            if bad and tid in deviations:
                notes.append("deliberate deviation: " + deviations[tid])
            elif bad:
                notes.append("REGRESSION in " + ", ".join(bad))
                code = max(code, FAIL)
            elif tid in deviations:
                notes.append("listed deviation, passes anyway")
        elif row["raw"] == "failed":
            notes.append("fails on raw ORT too: " + runs["raw"]["results"][tid]["message"])
        row["note"] = "; ".join(notes)
        rows.append(row)
    return rows, code


def table(rows: list[dict], modes: list[str]) -> str:
    width = max([len("test")] + [len(r["id"]) for r in rows])
    head = f"{'test':<{width}}  " + "  ".join(f"{m:<8}" for m in modes) + "  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['id']:<{width}}  " + "  ".join(f"{r[m]:<8}" for m in modes) + f"  {r['note']}")
    return "\n".join(lines)


def counts(runs: dict[str, dict]) -> dict[str, dict[str, int]]:
    out = {}
    for mode, run in runs.items():
        c: dict[str, int] = {}
        for res in run["results"].values():
            c[res["outcome"]] = c.get(res["outcome"], 0) + 1
        out[mode] = c
    return out


def compare(tests_dir: Path, files: list[str], installs: list[str], splits: dict, deviations: dict, *,
            timeout: float = 600, keep: Path | None = None, hide_eps: list[str] = ()) -> dict:
    """Prepare, run raw and each install mode, compare. Returns the report (see ``--json``)."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        ctx = None
        work = keep
    else:
        ctx = tempfile.TemporaryDirectory(prefix="ort-conformance-")
        work = Path(ctx.name)
    try:
        prepare(work, tests_dir, files)
        runs = {mode: run_mode(work, files, mode, splits, timeout, hide_eps) for mode in ["raw", *installs]}
        rows, code = verdict(runs, deviations)
        logs = {mode: (work / f"pytest-{mode}.log").read_text() for mode in runs}
    finally:
        if ctx is not None:
            ctx.cleanup()
    return {"ok": code == OK, "exit_code": code, "files": files, "installs": installs, "rows": rows,
            "counts": counts(runs), "runs": {m: {"rc": r["rc"], "meta": r["meta"], "results": r["results"]}
                                             for m, r in runs.items()},
            "log_tails": {m: log[-4000:] for m, log in logs.items()}}


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        key, sep, val = v.partition("=")
        if not sep:
            raise SystemExit(f"--{what} wants ID=VALUE, got {v!r}")
        out[key] = val
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tests", type=Path, help="directory holding ORT's test files (fetched by you)")
    src.add_argument("--fetch", type=Path, metavar="DIR",
                     help="download ORT's test files at the pinned commits into DIR (needs network), then run")
    ap.add_argument("--files", default=",".join(UPSTREAM), help="test files in the directory (comma-separated)")
    ap.add_argument("--install", default=",".join(INSTALLS),
                    help="ortcapture install modes compared with raw ORT: patch, class (comma-separated)")
    ap.add_argument("--split", action="append", default=[], metavar="FILE::CLASS::METHOD=PART,PART",
                    help="run a test method as one test per part (added to the built-in split)")
    ap.add_argument("--deviation", action="append", default=[], metavar="TEST_ID=REASON",
                    help="a further deliberate deviation (added to the list in docs/USAGE.md)")
    ap.add_argument("--without-ep", action="append", default=[], metavar="EP",
                    help="leave EP out of onnxruntime.get_available_providers() in every mode, e.g. "
                         "TensorrtExecutionProvider where the wheel lists it but TensorRT is not installed")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    ap.add_argument("--keep", type=Path, help="use (and keep) this working directory")
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args(argv)

    installs = [m for m in args.install.split(",") if m]
    if not set(installs) <= set(INSTALLS):
        ap.error(f"--install: choose from {', '.join(INSTALLS)}")
    tests_dir = args.tests
    if args.fetch is not None:
        try:
            fetch(args.fetch)
        except OSError as exc:
            print(f"ort_conformance: cannot fetch ORT's test files ({exc}); fetch them elsewhere and use --tests DIR",
                  file=sys.stderr)
            return HARNESS
        tests_dir = args.fetch
    splits = dict(SPLITS)
    splits.update({k: v.split(",") for k, v in _pairs(args.split, "split").items()})
    deviations = dict(DEVIATIONS)
    deviations.update(_pairs(args.deviation, "deviation"))
    files = [f for f in args.files.split(",") if f]

    report = compare(tests_dir, files, installs, splits, deviations, timeout=args.timeout, keep=args.keep,
                     hide_eps=args.without_ep)
    modes = ["raw", *installs]
    for mode in modes:
        run = report["runs"][mode]
        meta = run["meta"]
        print(f"{mode:>5}: pytest rc={run['rc']}  session class {meta.get('session_class', '?')}  "
              f"onnxruntime {meta.get('onnxruntime', '?')} {meta.get('providers', '')}"
              + (f" (hidden: {meta['hidden_eps']})" if meta.get("hidden_eps") else "") + f"  {report['counts'][mode]}")
    print(table(report["rows"], modes))
    print({OK: "OK: every test passing on raw ORT passes with ortcapture (listed deviations aside)",
           FAIL: "FAIL: a test passing on raw ORT does not pass with ortcapture",
           HARNESS: "HARNESS: the raw run collected no tests; log tail:\n" + report["log_tails"]["raw"]}
          [report["exit_code"]])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
