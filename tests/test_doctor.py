"""``ortcapture doctor``: verdicts and reasons on real models, through ``ortcapture.cli.main`` (no mocks of ORT).

Static tests use ``--provider none``; WebGPU tests really capture on the software adapter (they skip, or fail under
ORTCAPTURE_REQUIRE_WEBGPU=1, where WebGPU cannot run); CUDA tests carry ``@pytest.mark.cuda``.
"""
from __future__ import annotations

import json

import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortcapture import cli
from ortcapture.cli import doctor
from ortcapture.cli.doctor import _compare, _json_safe
from tests import tiny
from tests.conftest import cuda_available, webgpu_available


# -- models --------------------------------------------------------------------------------------------------------
def _save(tmp_path, name: str, model) -> str:
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    return str(path)


def _model(nodes, inputs, outputs, inits=()) -> bytes:
    graph = helper.make_graph(nodes, "doctor", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def nested_if_model() -> bytes:
    """Y = X + 1 with an If named 'inner_if' nested in the then-branch of an If named 'outer_if'."""
    vi = tiny.vi
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    leaf = lambda name, op: helper.make_graph(  # noqa: E731
        [helper.make_node(op, ["X", "one"], [name])], name, [], [vi(name, [2])], [one])
    inner = helper.make_node("If", ["cond"], ["t"], name="inner_if", then_branch=leaf("a", "Add"),
                             else_branch=leaf("b", "Sub"))
    then_g = helper.make_graph([inner], "then", [], [vi("t", [2])])
    outer = helper.make_node("If", ["cond"], ["Y"], name="outer_if", then_branch=then_g,
                             else_branch=leaf("e", "Mul"))
    return _model([outer], [vi("cond", [], TensorProto.BOOL), vi("X", [2])], [vi("Y", [2])])


shape_subgraph_model = tiny.shape_subgraph_model


def cpu_op_model() -> bytes:
    """Relu -> Round ('the_round') -> Relu: the WebGPU EP has no Round kernel (onnxruntime 1.32, plugin 0.4.0), so
    Round lands on the CPU EP between two WebGPU nodes (with Memcpy nodes around it)."""
    vi = tiny.vi
    nodes = [helper.make_node("Relu", ["X"], ["a"], name="relu_in"),
             helper.make_node("Round", ["a"], ["b"], name="the_round"),
             helper.make_node("Relu", ["b"], ["Y"], name="relu_out")]
    return _model(nodes, [vi("X", [4, 64])], [vi("Y", [4, 64])])


identity_alias_model = tiny.identity_alias_model
passthrough_model = tiny.passthrough_model
view_output_model = tiny.view_output_model


# -- helpers -------------------------------------------------------------------------------------------------------
def doctor_json(capsys, *argv) -> tuple[int, dict]:
    code = cli.main(["doctor", *map(str, argv), "--json"])
    out = capsys.readouterr().out
    report = json.loads(out)  # exactly one JSON object on stdout
    assert report["exit_code"] == code
    return code, report


def findings(report, kind, severity=None):
    return [f for f in report["findings"] if f["kind"] == kind and (severity is None or f["severity"] == severity)]


# -- static (--provider none) --------------------------------------------------------------------------------------
def test_if_model_is_not_capturable_statically(tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "if", tiny.if_model()), "--provider", "none")
    assert code == 1 and report["verdict"] == "not capturable" and report["basis"] == "static checks only"
    (f,) = findings(report, "control_flow", "error")
    assert f["details"]["op_type"] == "If" and f["details"]["outputs"] == ["Y"]
    assert "If (unnamed, output 'Y')" in f["message"] and f["fix"]
    assert report["capture"] == {"attempted": False, "outcome": "not_attempted",
                                 "reason": "--provider none: static checks only"}
    assert f["fix"] in report["what_to_change"]


def test_nested_if_is_found_in_subgraphs(tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "nested", nested_if_model()), "--provider", "none")
    assert code == 1
    by_name = {f["details"]["node"]: f for f in findings(report, "control_flow", "error")}
    assert set(by_name) == {"outer_if", "inner_if"}
    assert by_name["inner_if"]["details"]["where"] == "main graph > If 'outer_if'.then_branch"
    assert "'inner_if'" in by_name["inner_if"]["message"]


def test_dynamic_dims_named_and_unnamed(tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "dyn", tiny.dynamic_model()), "--provider", "none")
    assert code == 3 and report["verdict"] == "unknown"  # no capture attempted: no "capturable"
    (f,) = findings(report, "dynamic_dims", "warning")
    assert f["details"]["dynamic"] == ["batch", "n"]
    assert report["inputs"]["X"] == {"dims": ["batch", "n"], "shape": [1, 320], "source": "derived"}
    assert any("fix dims batch, n" in fix and "--shape X=1x320" in fix and "static_shapes={'X': (1, 320)}" in fix
               for fix in report["what_to_change"])

    code, report = doctor_json(capsys, _save(tmp_path, "dynu", tiny.dynamic_model(named=False)), "--provider",
                               "none")
    assert code == 3
    (f,) = findings(report, "dynamic_dims", "warning")
    assert f["details"]["dynamic"] == ["X[0] (unnamed)", "X[1] (unnamed)"]
    assert report["inputs"]["X"]["dims"] == [None, None]


def test_shape_fixes_dynamic_dims(tmp_path, capsys):
    path = _save(tmp_path, "dyn", tiny.dynamic_model())
    code, report = doctor_json(capsys, path, "--provider", "none", "--shape", "X=2x16")
    assert code == 3
    assert not findings(report, "dynamic_dims", "warning")
    (f,) = findings(report, "dynamic_dims", "info")
    assert "fixed by --shape X=2x16" in f["message"] and f["details"]["shape"] == [2, 16]
    assert report["inputs"]["X"] == {"dims": ["batch", "n"], "shape": [2, 16], "source": "given"}
    assert not findings(report, "shapes")


@pytest.mark.parametrize("shape, why", [
    ("X=2x16x3", "rank 2"),
    ("Y=2x16", "the model's inputs are ['X']"),
    ("X=2xa", "integers"),
    ("X", "expected NAME="),
    ("X=-1x4", "negative"),
])
def test_bad_shape_is_exit_2(tmp_path, capsys, shape, why):
    code, report = doctor_json(capsys, _save(tmp_path, "dyn", tiny.dynamic_model()), "--provider", "none",
                               "--shape", shape)
    assert code == 2 and report["verdict"] == "error" and why in report["error"]


@pytest.mark.parametrize("bucket", ["nope=1,2", "Y:0=1,2", "X:5=1,2"])
def test_a_bucket_dim_the_model_lacks_is_exit_2_before_any_capture(tmp_path, capsys, bucket):
    """Refused with the model read, not after the capture checks (a CPU-only provider would capture nothing)."""
    code, report = doctor_json(capsys, _save(tmp_path, "dyn", tiny.dynamic_model()), "--provider", "none",
                               "--buckets", bucket)
    assert code == 2 and report["error"].startswith("--buckets: ") and not report["capture"]["attempted"]


def test_shape_contradicting_a_fixed_dim_is_exit_2(tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "add", tiny.add_model()), "--provider", "none",
                               "--shape", "A=3x4")
    assert code == 2 and "dim 0 of 'A' is fixed to 2" in report["error"]


def test_bad_model_is_exit_2(tmp_path, capsys):
    code, report = doctor_json(capsys, tmp_path / "missing.onnx", "--provider", "none")
    assert code == 2 and "no such model file" in report["error"]
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x07not a model at all\xff" * 8)
    code, report = doctor_json(capsys, junk, "--provider", "none")
    assert code == 2 and "cannot read" in report["error"]


def test_aliased_outputs_are_flagged(tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "ident", identity_alias_model()), "--provider", "none")
    assert code == 3  # through Identity: a view output, computed inside the graph by ortcapture on WebGPU
    (f,) = findings(report, "alias", "info")
    assert f["details"] == {"output": "Z", "input": "X", "via": ["copy_x"]}
    code, report = doctor_json(capsys, _save(tmp_path, "pass", passthrough_model()), "--provider", "none")
    assert code == 1
    (f,) = findings(report, "alias", "error")
    assert f["details"] == {"output": "X", "input": "X", "via": []} and "same name" in f["message"]


def test_string_input_is_not_capturable(tmp_path, capsys):
    vi = tiny.vi
    model = _model([helper.make_node("StringNormalizer", ["s"], ["t"], case_change_action="LOWER")],
                   [vi("s", [4], TensorProto.STRING)], [vi("t", [4], TensorProto.STRING)])
    code, report = doctor_json(capsys, _save(tmp_path, "str", model), "--provider", "none")
    assert code == 1
    (f,) = findings(report, "input_type", "error")
    assert f["details"] == {"input": "s"} and "STRING" in f["message"]


def test_state_pair_and_view_output_are_reported(tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "rec", tiny.recurrent_model()), "--provider", "none")
    assert code == 3
    (f,) = findings(report, "state", "info")
    assert f["details"] == {"output": "state_out", "input": "state_in"}
    assert "state={'state_out': 'state_in'}" in f["fix"]
    code, report = doctor_json(capsys, _save(tmp_path, "view", view_output_model()), "--provider", "none")
    assert code == 3  # no capture attempt: unknown
    (f,) = findings(report, "view_output", "info")
    assert "compute it inside the graph" in f["message"]
    assert f["details"] == {"output": "Y", "op_type": "Reshape", "node": "flatten_out"}


def test_human_report(tmp_path, capsys):
    code = cli.main(["doctor", _save(tmp_path, "if", tiny.if_model()), "--provider", "none"])
    out = capsys.readouterr().out
    assert code == 1
    assert "[error] control_flow: control-flow node If (unnamed, output 'Y') in main graph" in out
    assert "verdict: not capturable (exit 1; static checks only)" in out
    assert "what to change:\n  - remove If" in out
    assert "input cond [] -> scalar (model)" in out


@pytest.mark.parametrize("option, why", [
    ("prefer_nhwc", "must be KEY=VALUE"),
    ("=1", "must be KEY=VALUE"),
    ("enable_cuda_graph=1", "switches graph capture"),
    ("device_id=one", "device ordinal"),
])
def test_bad_provider_option_is_exit_2(tmp_path, capsys, option, why):
    code, report = doctor_json(capsys, _save(tmp_path, "add", tiny.add_model()), "--provider", "none",
                               "--provider-option", option)
    assert code == 2 and report["verdict"] == "error" and why in report["error"], report


def test_provider_option_given_twice_is_exit_2(tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "add", tiny.add_model()), "--provider", "none",
                               "--provider-option", "prefer_nhwc=1", "--provider-option", "prefer_nhwc=0")
    assert code == 2 and "given twice" in report["error"]


def test_provider_options_are_reported(tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "add", tiny.add_model()), "--provider", "none",
                               "--provider-option", "prefer_nhwc = 1")
    assert code == 3 and report["provider_options"] == {"prefer_nhwc": "1"}
    (f,) = findings(report, "provider")
    assert "--provider-option values {'prefer_nhwc': '1'} were not used" in f["message"]


def test_requested_cuda_without_cuda_is_exit_2(tmp_path, capsys):
    if cuda_available():
        pytest.skip("the CUDA EP is available here")
    code, report = doctor_json(capsys, _save(tmp_path, "add", tiny.add_model()), "--provider", "cuda")
    assert code == 2 and "CUDA EP is not available" in report["error"]


@pytest.mark.parametrize("use_callback", [True, False])
def test_ort_log_capture(tmp_path, use_callback):
    """Both ways of catching ORT's log (callback where ORT has it; fd 2 otherwise) see a real ORT warning."""
    if use_callback and not hasattr(ort, "set_default_logger_callback"):
        pytest.skip("this onnxruntime has no set_default_logger_callback")
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")  # ORT warns when it serializes an optimized model
    with doctor.OrtLogCapture(use_callback=use_callback) as log:
        log.set_phase("cpu session")
        ort.InferenceSession(tiny.affine_model(), so, providers=["CPUExecutionProvider"])
    assert any(sev == 2 and "Serializing optimized model" in msg and phase == "cpu session"
               for sev, _, msg, phase in log.records), log.records


# -- WebGPU: real capture attempts -----------------------------------------------------------------------------------
@pytest.fixture
def webgpu():
    webgpu_available()


def test_if_model_on_webgpu_is_refused(webgpu, tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "if", tiny.if_model()), "--provider", "webgpu")
    assert code == 1 and report["basis"] == "capture attempt on WebGpuExecutionProvider"
    cap = report["capture"]
    assert cap["attempted"] and cap["outcome"] == "refused"
    assert "control flow nodes" in cap["reason"]
    assert findings(report, "control_flow", "error")[0]["details"]["op_type"] == "If"


def test_dynamic_dims_capture_via_specialization_on_webgpu(webgpu, tmp_path, capsys):
    path = _save(tmp_path, "shapesub", shape_subgraph_model())
    code, report = doctor_json(capsys, path, "--provider", "webgpu")
    assert code == 0 and report["verdict"] == "capturable"
    cap = report["capture"]
    assert cap["outcome"] == "captured_specialized" and cap["static_shapes"] == {"X": [1, 320]}
    assert "have not been partitioned to the WebGpuExecutionProvider" in cap["direct_refusal"]
    (f,) = findings(report, "shape_subgraph_cpu")
    assert {name for name, _ in f["details"]["nodes"]} >= {"gather_batch", "concat_shape", "ones"}
    assert "fix dims batch, n: pass --shape X=1x320" in f["fix"]
    assert not findings(report, "cpu_nodes")  # nothing stays on CPU once the dims are fixed
    assert not findings(report, "ep_results")  # a deterministic model: the two uncaptured runs agree
    assert any("--shape X=1x320" in fix for fix in report["what_to_change"])

    code, report = doctor_json(capsys, path, "--provider", "webgpu", "--shape", "X=2x16")
    assert code == 0 and report["capture"]["static_shapes"] == {"X": [2, 16]}
    # --shape passed already: the advice does not ask for it again (a new user was told to pass what they had)
    fixes = [f for f in report["what_to_change"] if f.startswith("fix dims")]
    assert fixes and all("--shape" not in f and "static_shapes={'X': (2, 16)}" in f for f in fixes)
    assert report["capture"]["max_abs_diff"] <= 1e-3 * 2


def test_cpu_only_op_on_webgpu_is_refused(webgpu, tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "round", cpu_op_model()), "--provider", "webgpu")
    assert code == 1 and report["verdict"] == "not capturable"
    (f,) = findings(report, "cpu_nodes", "error")
    assert f["details"]["nodes"] == [["the_round", "Round"]] and "Round 'the_round'" in f["message"]
    assert "replace Round" in f["fix"]
    cap = report["capture"]
    assert cap["outcome"] == "refused"
    assert "have not been partitioned to the WebGpuExecutionProvider" in cap["reason"]
    memcpy = findings(report, "memcpy")
    assert memcpy and {op for _, op, _ in memcpy[0]["details"]["nodes"]} == {"MemcpyToHost", "MemcpyFromHost"}


def test_aliased_output_on_webgpu(webgpu, tmp_path, capsys):
    """Measured on onnxruntime 1.32 WebGPU: raw ORT's replay never refreshes an output that is an input via
    Identity; ortcapture computes it inside the graph (issue 17), so the capture succeeds and its replay matches.
    A pass-through output (the input itself) is still refused, naming the output."""
    code, report = doctor_json(capsys, _save(tmp_path, "ident", identity_alias_model()), "--provider", "webgpu")
    assert code == 0 and report["capture"]["outcome"] == "captured"
    code, report = doctor_json(capsys, _save(tmp_path, "pass", passthrough_model()), "--provider", "webgpu")
    assert code == 1
    cap = report["capture"]
    assert cap["outcome"] == "refused" and "not written by the captured graph's replay" in cap["reason"]
    assert "'X'" in cap["reason"]
    assert (alias := findings(report, "alias", "error")) and "'X'" in alias[0]["message"] + str(alias[0]["fix"])


def test_unstable_uncaptured_runs_are_reported_on_webgpu(webgpu, tmp_path, capsys):
    """Y = X + RandomUniformLike(X), unseeded: two uncaptured runs disagree, so no replay can be judged."""
    vi = tiny.vi
    nodes = [helper.make_node("RandomUniformLike", ["X"], ["r"], name="noise"),
             helper.make_node("Add", ["X", "r"], ["Y"], name="add")]
    code, report = doctor_json(capsys, _save(tmp_path, "noise", _model(nodes, [vi("X", [4, 8])], [vi("Y", [4, 8])])),
                               "--provider", "webgpu")
    assert code == 1 and report["verdict"] == "not capturable"
    (f,) = findings(report, "ep_results", "error")
    assert "two uncaptured runs of the WebGpuExecutionProvider session with the same inputs disagree" in f["message"]
    assert f["details"]["max_abs_diff"] > 0 and "random ops (seeded or not" in f["fix"]


def test_nan_mismatch_prints_strict_json_on_webgpu(webgpu, tmp_path, capsys):
    """Y = Log(RandomUniformLike(X) - 0.5): NaNs in different places (an infinite difference) must still print strict
    JSON (no Infinity)."""
    vi = tiny.vi
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    nodes = [helper.make_node("RandomUniformLike", ["X"], ["r"]), helper.make_node("Sub", ["r", "half"], ["d"]),
             helper.make_node("Log", ["d"], ["Y"])]
    path = _save(tmp_path, "nan", _model(nodes, [vi("X", [64])], [vi("Y", [64])], [half]))
    code = cli.main(["doctor", path, "--provider", "webgpu", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert code == 1 and report["verdict"] == "not capturable"
    (f,) = findings(report, "ep_results", "error")
    assert f["details"]["max_abs_diff"] is None and "NaNs differ" in f["message"]


def test_string_outputs_give_a_verdict_on_webgpu(webgpu, tmp_path, capsys):
    vi = tiny.vi
    abc = helper.make_tensor("abc", TensorProto.STRING, [1], [b"abc"])
    nodes = [helper.make_node("Relu", ["X"], ["Y"]), helper.make_node("Shape", ["X"], ["shp"]),
             helper.make_node("Expand", ["abc", "shp"], ["S"])]
    path = _save(tmp_path, "str", _model(nodes, [vi("X", [4])], [vi("Y", [4]), vi("S", [4], TensorProto.STRING)],
                                         [abc]))
    code, report = doctor_json(capsys, path, "--provider", "webgpu")
    assert code == 1 and report["verdict"] == "not capturable", report
    (f,) = findings(report, "output_type", "error")
    assert f["details"] == {"output": "S"} and "map it to strings outside" in f["fix"]
    assert report["capture"]["attempted"] is False and "output_type" in report["capture"]["reason"]


def test_provider_options_reach_every_session_on_webgpu(webgpu, tmp_path, capsys, monkeypatch):
    """Every session doctor creates (placement as given, dims fixed, the capture attempt) gets the options."""
    from ortcapture._ort import providers

    seen = []
    real = providers.session_args

    def spy(provider, capture, sess_options=None, device_id=0, ep_options=None):
        seen.append((capture, dict(ep_options or {})))
        return real(provider, capture, sess_options, device_id, ep_options)

    monkeypatch.setattr(providers, "session_args", spy)
    path = _save(tmp_path, "shapesub", shape_subgraph_model())
    code, report = doctor_json(capsys, path, "--provider", "webgpu", "--provider-option", "forceCpuNodeNames=none")
    assert code == 0 and report["capture"]["outcome"] == "captured_specialized", report
    assert report["provider_options"] == {"forceCpuNodeNames": "none"}
    assert {c for c, _ in seen} == {False, True} and len(seen) >= 3  # as given, dims fixed, capture attempt
    assert all(opts == {"forceCpuNodeNames": "none"} for _, opts in seen), seen


@pytest.mark.slow
def test_reference_model_on_webgpu(webgpu, reference_model_path, capsys):
    code, report = doctor_json(capsys, reference_model_path, "--provider", "webgpu")
    assert code == 0 and report["verdict"] == "capturable", report
    cap = report["capture"]
    assert cap["outcome"] == "captured_specialized"
    assert cap["static_shapes"] == {"images": [1, 3, 320, 320]}
    assert cap["max_abs_diff"] <= 1e-3 * 100
    (f,) = findings(report, "dynamic_dims", "warning")
    assert f["details"]["dynamic"] == ["batch", "height", "width"]
    assert findings(report, "shape_subgraph_cpu")
    assert not findings(report, "control_flow") and not findings(report, "alias")
    assert any(fix.startswith("fix dims batch, height, width: pass --shape images=1x3x320x320")
               and "static_shapes={'images': (1, 3, 320, 320)}" in fix for fix in report["what_to_change"])


# -- CUDA ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def cuda():
    if not cuda_available():
        pytest.skip("CUDA EP unavailable (onnxruntime-gpu on an NVIDIA GPU)")


@pytest.mark.cuda
def test_cuda_verdicts(cuda, tmp_path, capsys):
    code, report = doctor_json(capsys, _save(tmp_path, "affine", tiny.affine_model()), "--provider", "cuda")
    assert code == 0 and report["capture"]["outcome"] == "captured", report
    code, report = doctor_json(capsys, _save(tmp_path, "if", tiny.if_model()), "--provider", "cuda")
    assert code == 1 and report["capture"]["outcome"] == "refused", report
    assert "control flow" in report["capture"]["reason"]


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_prefer_nhwc_needs_fixed_dims(cuda, reference_model_path, capsys):
    """Measured on onnxruntime-gpu 1.31.1 (H200): with prefer_nhwc=1 and the reference model's dims dynamic, the CUDA
    EP refuses capture at session creation; without the option it captures the model as given. Doctor, given the
    option, says so and captures via shape specialization."""
    code, report = doctor_json(capsys, reference_model_path, "--provider", "cuda")
    assert code == 0 and report["capture"]["outcome"] == "captured", report["capture"]
    code, report = doctor_json(capsys, reference_model_path, "--provider", "cuda", "--provider-option",
                               "prefer_nhwc=1")
    assert code == 0 and report["provider_options"] == {"prefer_nhwc": "1"}
    cap = report["capture"]
    assert cap["outcome"] == "captured_specialized", cap
    assert "have not been partitioned to the CUDAExecutionProvider" in cap["direct_refusal"]
    assert cap["static_shapes"] == {"images": [1, 3, 320, 320]}


def test_compare_handles_non_numeric_and_nan_outputs():
    import numpy as np

    assert _compare([np.array(["a", "b"])], [np.array(["a", "b"])], 1e-4) == (True, 0.0, None)
    ok, worst, what = _compare([np.array(["a", "c"])], [np.array(["a", "b"])], 1e-4)
    assert not ok and worst == float("inf") and "differs" in what
    ok, _, what = _compare([np.array([np.nan, 1.0])], [np.array([1.0, np.nan])], 1e-4)
    assert not ok and what == "output 0: NaNs differ"
    assert _json_safe({"a": [float("inf"), 1.5, float("nan")]}) == {"a": [None, 1.5, None]}


def test_a_named_dim_given_for_one_input_holds_for_the_others(tmp_path):
    """--shape X=2x16 on X[batch, 16], Y[batch, seq]: Y is checked at batch 2, not 1 (the advice told a user to pass
    --shape Y=1x320, which the model refuses beside X's batch 2)."""
    import onnx
    from onnx import TensorProto, helper

    from ortcapture.cli.demo import example_shapes

    g = helper.make_graph([helper.make_node("Concat", ["X", "Y"], ["Z"], axis=1)], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 16]),
                           helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "seq"])],
                          [helper.make_tensor_value_info("Z", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = str(tmp_path / "xy.onnx")
    onnx.save(model, path)
    assert example_shapes(path, 1, ["X=2x16"]) == {"X": (2, 16), "Y": (2, 320)}
    assert example_shapes(path, 1, ["Y=3x5"]) == {"X": (3, 16), "Y": (3, 5)}
    assert example_shapes(path, 1, []) == {"X": (1, 16), "Y": (1, 320)}
