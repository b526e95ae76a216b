"""benchmarks/ort_conformance.py (issue 24 item 3) without ORT's test files: its model builders against ORT's own
models and expected values, and its machinery (pytest subprocess per install mode, the test-method split, subtest
counting, crash attribution, the verdict and exit code) on a small fake test file."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("ort_conformance", ROOT / "benchmarks" / "ort_conformance.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


conf = _load()


def _cpu_run(path: Path, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_mul_1_is_orts_model(tmp_path):
    """Y = X * W (W = [[1, 2], [3, 4], [5, 6]]), as ORT's IOBinding tests expect: X = W gives the squares, the
    rebinding tests' X = 2W gives 2 * W * W. Same outputs as the mul_1.onnx onnxruntime ships."""
    path = conf.mul_1_model(tmp_path / "testdata" / "mul_1.onnx")
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)
    np.testing.assert_array_equal(_cpu_run(path, {"X": x})[0], [[1, 4], [9, 16], [25, 36]])
    np.testing.assert_array_equal(_cpu_run(path, {"X": 2 * x})[0], [[2, 8], [18, 32], [50, 72]])
    model = onnx.load(str(path))
    assert [(i.name, [d.dim_value for d in i.type.tensor_type.shape.dim]) for i in model.graph.input] == [
        ("X", [3, 2])]
    shipped = Path(__import__("onnxruntime").__file__).parent / "datasets" / "mul_1.onnx"
    if shipped.exists():
        r = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
        np.testing.assert_array_equal(_cpu_run(path, {"X": r})[0], _cpu_run(shipped, {"X": r})[0])


def test_matmul_2_and_squeezenet_standin(tmp_path):
    paths = conf.build_testdata(tmp_path / "testdata")
    assert sorted(p.relative_to(tmp_path / "testdata").as_posix() for p in paths) == [
        "matmul_2.onnx", "mul_1.onnx", "squeezenet/model.onnx"]
    matmul = tmp_path / "testdata" / "matmul_2.onnx"
    for n in (3, 7):  # N is dynamic: ORT's CUDA-graph test binds [1280, 2], [2560, 2] and [3840, 2]
        x = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
        (y,) = _cpu_run(matmul, {"X": x})
        np.testing.assert_array_equal(y, x @ np.array([[1.0], [2.0]], np.float32))
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]] * 4, dtype=np.float32)
    np.testing.assert_array_equal(_cpu_run(matmul, {"X": x})[0], [[5.0], [11.0], [17.0]] * 4)
    sq = tmp_path / "testdata" / "squeezenet" / "model.onnx"
    g = onnx.load(str(sq)).graph
    assert [i.name for i in g.input] == ["data_0"] and [o.name for o in g.output] == ["softmaxout_1"]
    data = np.random.default_rng(0).integers(0, 256, (2, 3, 224, 224)).astype(np.float32)
    (out,) = _cpu_run(sq, {"data_0": data})
    assert out.shape == (2, 1000, 1, 1)
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-5)
    assert float(out.std()) > 0  # not a constant


FAKE = '''
import os
import unittest

import numpy as np
import onnxruntime as onnxrt
from helper import get_name
from onnx import TensorProto
from onnx.mapping import NP_TYPE_TO_TENSOR_TYPE, TENSOR_TYPE_TO_NP_TYPE

RAW = onnxrt.InferenceSession.__module__.startswith("onnxruntime")


class TestFake(unittest.TestCase):
    def test_passes(self):
        self.assertEqual(NP_TYPE_TO_TENSOR_TYPE[np.dtype(np.uint16)], TensorProto.UINT16)
        self.assertEqual(NP_TYPE_TO_TENSOR_TYPE[np.arange(3).astype(np.float16).dtype], TensorProto.FLOAT16)
        self.assertEqual(TENSOR_TYPE_TO_NP_TYPE[TensorProto.BOOL], np.dtype(bool))
        sess = onnxrt.InferenceSession(get_name("mul_1.onnx"), providers=["CPUExecutionProvider"])
        x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)
        np.testing.assert_array_equal(sess.run(None, {"X": x})[0], x * x)

    def test_fails_on_both(self):
        self.fail("fails everywhere")

    def test_installed_only_raw(self):
        self.assertTrue(RAW, "ortcapture is installed")

    def test_parts(self):
        self.part_a()
        self.part_b()
        if not RAW:
            self.part_c()

    def part_a(self):
        pass

    def part_b(self):
        self.assertTrue(RAW, "part b deviates")

    def part_c(self):
        pass

    def test_subtests_all_skip(self):
        for ep in ("CUDA", "DML"):
            with self.subTest(ep):
                self.skipTest(f"no {ep}")

    def test_subtests_some_pass(self):
        for ep in ("CPU", "DML"):
            with self.subTest(ep):
                if ep == "DML":
                    self.skipTest("no DML")

    def test_y_crash_when_installed(self):
        if not RAW:
            os._exit(3)

    def test_z_after_crash(self):
        pass
'''
SPLIT = "fake_test.py::TestFake::test_parts=part_a,part_b,part_c"
T = "fake_test.py::TestFake::"


@pytest.fixture(scope="module")
def fake_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ort-tests")
    (d / "fake_test.py").write_text(FAKE)
    return d


def _main(fake_dir, tmp_path, *extra) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = conf.main(["--tests", str(fake_dir), "--files", "fake_test.py", "--split", SPLIT, "--json", str(out),
                      *extra])
    return code, json.loads(out.read_text())


def test_script_compares_raw_with_ortcapture(fake_dir, tmp_path, capsys):
    code, rep = _main(fake_dir, tmp_path, "--install", "patch,class",
                      "--deviation", f"{T}test_parts__part_b=part b is deliberate")
    rows = {r["id"]: r for r in rep["rows"]}
    assert code == conf.FAIL and rep["ok"] is False
    assert rep["runs"]["raw"]["meta"]["session_class"].startswith("onnxruntime.")
    assert rep["runs"]["patch"]["meta"]["session_class"] == "ortcapture._session.dropin.InferenceSession"
    assert rep["runs"]["class"]["meta"]["session_class"] == "ortcapture._session.session.InferenceSession"
    assert "CPUExecutionProvider" in rep["runs"]["raw"]["meta"]["providers"]
    # the split: the original method is gone, one test per part; part_c is not reached on raw ORT
    assert f"{T}test_parts" not in rows
    assert [rows[f"{T}test_parts__part_{p}"]["raw"] for p in "abc"] == ["passed", "passed", "skipped"]
    assert [rows[f"{T}test_parts__part_{p}"]["patch"] for p in "abc"] == ["passed", "failed", "passed"]
    assert rows[f"{T}test_parts__part_b"]["note"] == "deliberate deviation: part b is deliberate"
    assert rows[f"{T}test_passes"]["raw"] == rows[f"{T}test_passes"]["patch"] == "passed"
    assert rows[f"{T}test_fails_on_both"]["note"].startswith("fails on raw ORT too: AssertionError: fails everywhere")
    assert rows[f"{T}test_installed_only_raw"]["note"] == "REGRESSION in patch, class"
    # subtests: all skipped -> skipped (pytest itself says passed); some passed -> passed
    assert {m: rows[f"{T}test_subtests_all_skip"][m] for m in ("raw", "patch")} == {"raw": "skipped",
                                                                                    "patch": "skipped"}
    assert rows[f"{T}test_subtests_some_pass"]["raw"] == "passed"
    assert rep["runs"]["raw"]["results"][f"{T}test_subtests_some_pass"]["subtests"] == {"passed": 1, "skipped": 1}
    # a process that dies: the test it died in is "crashed", the rest "not run"; both are regressions
    assert [rows[f"{T}test_y_crash_when_installed"][m] for m in ("raw", "patch")] == ["passed", "crashed"]
    assert rows[f"{T}test_z_after_crash"]["patch"] == "not run"
    assert "REGRESSION in patch, class" in rows[f"{T}test_z_after_crash"]["note"]
    printed = capsys.readouterr().out
    assert "FAIL: a test passing on raw ORT does not pass with ortcapture" in printed
    assert "deliberate deviation: part b is deliberate" in printed


def test_script_passes_when_only_listed_deviations_differ(fake_dir, tmp_path):
    code, rep = _main(fake_dir, tmp_path, "--install", "patch",
                      "--deviation", f"{T}test_parts__part_b=b", "--deviation", f"{T}test_installed_only_raw=i",
                      "--deviation", f"{T}test_y_crash_when_installed=y", "--deviation", f"{T}test_z_after_crash=z",
                      "--without-ep", "CPUExecutionProvider")
    assert code == conf.OK and rep["ok"] is True
    for mode in ("raw", "patch"):  # what ORT's tests see from onnxruntime.get_available_providers()
        meta = rep["runs"][mode]["meta"]
        assert meta["hidden_eps"] == ["CPUExecutionProvider"] and "CPUExecutionProvider" not in meta["providers"]
    assert rep["counts"]["raw"] == {"passed": 7, "failed": 1, "skipped": 2}
    assert rep["counts"]["patch"] == {"passed": 4, "failed": 3, "skipped": 1, "crashed": 1}


def test_script_reports_a_raw_run_that_collects_nothing(tmp_path):
    (tmp_path / "broken_test.py").write_text("import unittest\nthis is not python\n")
    code = conf.main(["--tests", str(tmp_path), "--files", "broken_test.py", "--install", "patch"])
    assert code == conf.HARNESS


def test_missing_test_file_names_fetch(tmp_path):
    with pytest.raises(FileNotFoundError, match="--fetch"):
        conf.main(["--tests", str(tmp_path), "--install", "patch"])


def test_fetch_downloads_each_pinned_file(tmp_path):
    src = tmp_path / "src"
    (src / "abc123").mkdir(parents=True)
    (src / "abc123" / "x_test.py").write_text("# upstream\n")
    got = conf.fetch(tmp_path / "dest", {"x_test.py": "abc123"}, url=(src.as_uri() + "/{commit}/{name}"))
    assert got == [tmp_path / "dest" / "x_test.py"] and got[0].read_text() == "# upstream\n"
    with pytest.raises(OSError):  # what main() turns into exit 2 with "fetch them elsewhere"
        conf.fetch(tmp_path / "dest", {"x_test.py": "nope"}, url=(src.as_uri() + "/{commit}/{name}"))
    assert set(conf.UPSTREAM) == {"onnxruntime_test_python_iobinding.py", "onnxruntime_test_python_cudagraph.py"}
    assert all(len(c) == 40 for c in conf.UPSTREAM.values())


def test_verdict_rules():
    def run(collected, **outcomes):
        return {"collected": collected, "results": {t: {"outcome": o, "message": "m"} for t, o in outcomes.items()}}

    ids = ["a", "b", "c", "d"]
    runs = {"raw": run(ids, a="passed", b="failed", c="passed", d="skipped"),
            "patch": run(ids, a="passed", b="passed", c="failed", d="failed")}
    rows, code = conf.verdict(runs, {"c": "by design"})
    assert code == conf.OK
    assert [r["note"] for r in rows] == ["", "fails on raw ORT too: m", "deliberate deviation: by design", ""]
    runs["patch"]["results"].pop("a")
    assert conf.verdict(runs, {"c": "by design"})[1] == conf.FAIL
    assert conf.verdict({"raw": run([]), "patch": run([])}, {})[1] == conf.HARNESS
    assert os.path.basename(conf.CUDAGRAPH_TEST.split("::")[0]) in conf.UPSTREAM
    assert set(conf.SPLITS[conf.CUDAGRAPH_TEST]) == {"run_model_with_cuda_graph",
                                                     "run_model_with_cuda_graph_annotation"}
    assert list(conf.DEVIATIONS) == [f"{conf.CUDAGRAPH_TEST}__run_model_with_cuda_graph_annotation"]
