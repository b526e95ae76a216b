"""The ``ortcapture`` command as a new user meets it: every error is one line ``ortcapture <command>: ...`` with exit
code 2 (never a traceback), ``doctor`` says "unknown" (exit 3) when it attempted no capture, ``demo`` feeds every
numpy dtype and shows progress.

Each test runs ``python -m ortcapture ...`` in a subprocess on tiny models built with onnx.helper. Tests that need a
capture-capable EP use WebGPU on the software adapter (skipped where WebGPU cannot run, failed instead under
ORTCAPTURE_REQUIRE_WEBGPU=1).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests import tiny
from tests.conftest import cuda_available, webgpu_available

ROOT = Path(__file__).resolve().parents[1]
#: ORT's and Dawn's own log lines (not ortcapture's): allowed on stderr around ortcapture's one-line error
_FOREIGN = ("[W:onnxruntime", "[E:onnxruntime", "[I:onnxruntime", "Warning: maxDynamic", "XDG_RUNTIME_DIR")


def ortcapture(*argv, env: dict | None = None, drop_env: tuple[str, ...] = (), timeout: float = 300):
    """Run ``python -m ortcapture ARGV``; return (exit code, stdout, stderr)."""
    e = dict(os.environ)
    for k in drop_env:
        e.pop(k, None)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    e.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "ortcapture", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=str(ROOT))
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_line_error(rc, out, err, command: str, *words: str) -> str:
    """Exit 2, no traceback anywhere, and ortcapture's message is exactly one ``ortcapture <command>: ...`` line
    containing ``words``. Returns that line."""
    text = out + err
    assert rc == 2, text
    assert "Traceback" not in text and 'File "' not in text, text
    mine = [ln for ln in err.splitlines() if ln.strip() and not any(f in ln for f in _FOREIGN)
            and not ln.endswith(" ...")]  # progress lines end with "..."
    assert len(mine) == 1 and mine[0].startswith(f"ortcapture {command}: "), err
    for w in words:
        assert w in mine[0], mine[0]
    return mine[0]


def _model(nodes, inputs, outputs, inits=()) -> bytes:
    graph = helper.make_graph(nodes, "cli", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _save(tmp_path, name: str, data: bytes) -> Path:
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(data)
    return path


def typed_model(types: dict[str, int]) -> bytes:
    """Y = (f32 + Cast<float>(each other input))^2: one [2, 3] input per element type in ``types``."""
    vi = tiny.vi
    nodes, acc = [], "f32"
    for name in types:
        if name == "f32":
            continue
        nodes.append(helper.make_node("Cast", [name], [f"{name}_f"], to=TensorProto.FLOAT))
        nodes.append(helper.make_node("Add", [acc, f"{name}_f"], [f"{acc}_{name}"]))
        acc = f"{acc}_{name}"
    nodes.append(helper.make_node("Mul", [acc, acc], ["Y"]))
    return _model(nodes, [vi(n, [2, 3], t) for n, t in types.items()], [vi("Y", [2, 3])])


#: element types the WebGPU EP computes with (onnxruntime 1.32, plugin 0.4.0): such a model captures
WEBGPU_TYPES = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "i32": TensorProto.INT32,
                "i64": TensorProto.INT64, "u32": TensorProto.UINT32, "u8": TensorProto.UINT8, "b": TensorProto.BOOL}
#: every element type numpy holds
ALL_TYPES = {**WEBGPU_TYPES, "f64": TensorProto.DOUBLE, "i8": TensorProto.INT8, "i16": TensorProto.INT16,
             "u16": TensorProto.UINT16, "u64": TensorProto.UINT64}


def constant_model() -> bytes:
    """Y = Constant([1, 2]): no inputs, an output that depends on none."""
    node = helper.make_node("Constant", [], ["Y"], value=helper.make_tensor("v", TensorProto.FLOAT, [2], [1.0, 2.0]))
    return _model([node], [], [tiny.vi("Y", [2])])


@pytest.fixture
def webgpu():
    webgpu_available()


# -- error lines: every command, one form ---------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["demo", "doctor", "bench"])
def test_missing_model_and_directory_are_one_line(command, tmp_path):
    assert_one_line_error(*ortcapture(command, tmp_path / "missing.onnx"), command, "no such model file")
    assert_one_line_error(*ortcapture(command, tmp_path), command, "is a directory")


@pytest.mark.parametrize("command", ["demo", "doctor"])
@pytest.mark.parametrize("content, words", [(b"", ["empty"]), (b"\x07not a model\xff" * 8, ["cannot read"])])
def test_empty_or_unloadable_model_is_one_line(command, content, words, tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    assert_one_line_error(*ortcapture(command, path, "--provider", "webgpu" if command == "demo" else "none"),
                          command, *words)


def test_model_onnxruntime_cannot_load_is_one_line(tmp_path):
    """Valid protobuf that ORT refuses (an opset from the future): ORT's message, one line."""
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "g", [tiny.vi("X", [2])],
                                                [tiny.vi("Y", [2])]), opset_imports=[helper.make_opsetid("", 99)])
    model.ir_version = 8
    path = _save(tmp_path, "future", model.SerializeToString())
    rc, out, err = ortcapture("demo", path, "--iters", "1")
    if "not usable here" in err or "not available" in err:
        pytest.skip("no capture-capable EP here: the demo stops before loading the model in ORT")
    assert_one_line_error(rc, out, err, "demo", "onnxruntime cannot load")


@pytest.mark.parametrize("shape, words", [
    ("X=2x16x3", ["rank 2", "rank 3"]),
    ("X=2x0", ["dims must be >= 1"]),
    ("Z=2x16", ["the model's inputs are ['X']"]),
    ("X=2xa", ["integers"]),
])
def test_bad_shape_is_one_line(shape, words, tmp_path):
    path = _save(tmp_path, "dyn", tiny.dynamic_model())
    assert_one_line_error(*ortcapture("demo", path, "--shape", shape), "demo", *words)
    assert_one_line_error(*ortcapture("doctor", path, "--provider", "none", "--shape", shape), "doctor")


def test_shape_against_a_fixed_dim_is_one_line(tmp_path):
    path = _save(tmp_path, "add", tiny.add_model())
    assert_one_line_error(*ortcapture("demo", path, "--shape", "A=2x4x1"), "demo", "rank 2")
    assert_one_line_error(*ortcapture("demo", path, "--shape", "A=2x0"), "demo", "fixed to 4")


def test_json_into_a_missing_folder_fails_first(tmp_path):
    t0 = time.perf_counter()
    rc, out, err = ortcapture("demo", _save(tmp_path, "add", tiny.add_model()), "--json",
                              tmp_path / "nowhere" / "out.json")
    assert_one_line_error(rc, out, err, "demo", "does not exist")
    assert "capturing" not in err and "creating sessions" not in err  # checked before any work
    assert time.perf_counter() - t0 < 60


def test_bench_errors_use_the_common_prefix(tmp_path):
    rc, out, err = ortcapture("bench", _save(tmp_path, "add", tiny.add_model()), "--iters", "0")
    assert_one_line_error(rc, out, err, "bench", "--iters must be >= 1")


def test_string_input_is_one_line(tmp_path):
    vi = tiny.vi
    model = _model([helper.make_node("StringNormalizer", ["s"], ["t"], case_change_action="LOWER")],
                   [vi("s", [4], TensorProto.STRING)], [vi("t", [4], TensorProto.STRING)])
    assert_one_line_error(*ortcapture("demo", _save(tmp_path, "str", model)), "demo", "'s'", "numeric or bool")


def test_webgpu_unusable_is_one_line_without_traceback_fragments(tmp_path):
    """Without the software adapter's settings (and without a GPU) the WebGPU probe fails in its child process:
    the message is the child's reason, not its traceback tail."""
    path = _save(tmp_path, "add", tiny.add_model())
    rc, out, err = ortcapture("demo", path, "--provider", "webgpu", "--iters", "1",
                              drop_env=("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "VK_ICD_FILENAMES"))
    if rc == 0:
        pytest.skip("WebGPU works here without the software adapter's settings (a GPU)")
    assert_one_line_error(rc, out, err, "demo", "WebGPU")
    assert "CaptureUnsupportedError" not in err and " | " not in err


# -- doctor verdicts ------------------------------------------------------------------------------------------------
def test_doctor_without_a_capture_says_unknown(tmp_path):
    path = _save(tmp_path, "add", tiny.add_model())
    rc, out, err = ortcapture("doctor", path, "--provider", "none")
    assert rc == 3 and "Traceback" not in out + err, out + err
    assert "verdict: unknown (exit 3; static checks only: no capture attempted)" in out
    assert "capturable (exit 0" not in out
    rc, out, err = ortcapture("doctor", path, "--provider", "none", "--json")
    report = json.loads(out)
    assert rc == 3 and report["verdict"] == "unknown" and report["exit_code"] == 3
    # a static blocker is still "not capturable", capture or not
    rc, out, err = ortcapture("doctor", _save(tmp_path, "if", tiny.if_model()), "--provider", "none")
    assert rc == 1 and "verdict: not capturable (exit 1; static checks only)" in out


def test_doctor_with_no_adapter_says_unknown(tmp_path):
    if cuda_available():
        pytest.skip("the CUDA EP is available here: auto picks it")
    rc, out, err = ortcapture("doctor", _save(tmp_path, "add", tiny.add_model()),
                              drop_env=("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "VK_ICD_FILENAMES"))
    if rc == 0:
        pytest.skip("WebGPU works here without the software adapter's settings (a GPU)")
    assert rc == 3, out + err
    assert "verdict: unknown (exit 3" in out and "no capture attempted" in out
    assert "Traceback" not in out + err and 'File "' not in out + err and "CaptureUnsupportedError" not in out


def test_doctor_help_documents_exit_codes():
    rc, out, _ = ortcapture("doctor", "--help")
    assert rc == 0
    for code, word in (("0", "capturable"), ("1", "not capturable"), ("2", "error"), ("3", "unknown")):
        assert f"  {code}  {word}" in out, out


def test_doctor_constant_output_on_webgpu(webgpu, tmp_path):
    """A Constant-only model: ORT folds the output into a constant that no replay writes; its value never changes,
    so ortcapture keeps it (issue 17): capturable, and the finding says why, not that it is a view."""
    rc, out, err = ortcapture("doctor", _save(tmp_path, "const", constant_model()), "--provider", "webgpu")
    assert "Traceback" not in out + err, out + err
    if "refused graph capture (session creation)" in out:  # onnxruntime 1.27: a graph with no node left is refused
        assert rc == 1
    else:
        assert rc == 0, out
    assert "depends on no input" in out and "keeps the capture-time value" in out and " view " not in out
    rc, out, err = ortcapture("doctor", _save(tmp_path, "const", constant_model()), "--provider", "none")
    assert rc == 3 and "[info] constant_output" in out


# -- demo on WebGPU ---------------------------------------------------------------------------------------------
def test_demo_feeds_every_webgpu_dtype_and_shows_progress(webgpu, tmp_path):
    path = _save(tmp_path, "typed", typed_model(WEBGPU_TYPES))
    out_json = tmp_path / "demo.json"
    rc, out, err = ortcapture("demo", path, "--iters", "1", "--json", out_json)
    assert rc == 0 and "Traceback" not in out + err, out + err
    assert "(OK)" in out
    for phase in ("creating sessions", "capturing", "timing captured replay", "verifying"):
        assert f"ortcapture demo: {phase}" in err, err
    assert json.loads(out_json.read_text())["ok"] is True


def test_demo_with_every_numpy_dtype_never_tracebacks(webgpu, tmp_path):
    """float64, int8, int16, uint16, uint64 have no WebGPU kernels here: ORT refuses capture, one line; no dtype is
    unknown to the demo (formerly ``KeyError: 'tensor(bool)'``)."""
    rc, out, err = ortcapture("demo", _save(tmp_path, "all", typed_model(ALL_TYPES)), "--iters", "1")
    assert rc in (0, 2) and "Traceback" not in out + err and "KeyError" not in out + err, out + err
    if rc == 2:
        assert_one_line_error(rc, out, err, "demo")


# -- in-process helpers ---------------------------------------------------------------------------------------------
def test_random_feeds_vary_integers_and_bools():
    from ortcapture.cli.demo import INT_HIGH, random_feeds

    dtypes = {"i": np.dtype(np.int64), "u": np.dtype(np.uint8), "b": np.dtype(bool), "f": np.dtype(np.float16),
              "s": np.dtype(np.int32)}
    shapes = {"i": (3, 5), "u": (7,), "b": (2, 2), "f": (4,), "s": ()}
    feeds = random_feeds(dtypes, shapes, np.random.default_rng(0), 4)
    for prev, cur in zip(feeds, feeds[1:]):
        for name in dtypes:
            assert cur[name].dtype == dtypes[name] and cur[name].shape == shapes[name]
            assert not np.array_equal(prev[name], cur[name]), name  # every replay sees new values
    ints = np.concatenate([f[n].ravel() for f in feeds for n in ("i", "u", "s")])
    assert ints.min() >= 0 and ints.max() < INT_HIGH and len(set(ints.tolist())) > 1


def test_one_line_reduces_child_tracebacks_and_ort_prefixes():
    from ortcapture.cli import one_line

    probe = ('WebGPU is not usable here: WebGPU probe exit code 1:   File "/x/webgpu.py", line 61, in ep_device |'
             '     raise CaptureUnsupportedError( | ortcapture.errors.CaptureUnsupportedError: no WebGPU EP device')
    assert one_line(probe) == "WebGPU is not usable here: no WebGPU EP device"
    ort_err = "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions\n index: 1 Got: 0\n Please fix"
    assert one_line(ort_err) == "Got invalid dimensions index: 1 Got: 0 Please fix"


def test_doctor_without_a_model_examines_the_reference_model():
    rc, out, err = ortcapture("doctor", "--provider", "none")
    assert rc == 3, (out, err)  # unknown: no capture attempted with --provider none
    assert "320n.onnx" in out + err


def test_the_software_adapter_hint_is_given_once(tmp_path, monkeypatch):
    """A provider refusal gets the "source webgpu.env" hint unless its own text names webgpu.env already (a new
    user read the same advice twice on one line)."""
    from ortcapture import cli as _cli
    from ortcapture._ort import providers
    from ortcapture.errors import CaptureUnsupportedError

    (tmp_path / "webgpu.env").write_text("export ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1\n")
    monkeypatch.setenv("ORTCAPTURE_CACHE", str(tmp_path))
    monkeypatch.delenv("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", raising=False)
    for said, count in (("WebGPU is not usable here: no adapter", 1),
                        ('WebGPU is not usable here: source ".../webgpu.env" (it sets both)', 1)):
        def refuse(requested, said=said):
            raise CaptureUnsupportedError(said)
        monkeypatch.setattr(providers, "pick_provider", refuse)
        with pytest.raises(CaptureUnsupportedError) as info:
            _cli.pick_provider("webgpu")
        assert str(info.value).count("webgpu.env") == count, str(info.value)
