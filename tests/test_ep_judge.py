"""Verification judges the capture, not the execution provider (issue 30, item 1).

A chaotic recurrence (:func:`tests.tiny.chaotic_model`, the logistic map at r = 3.99) amplifies every rounding
difference between EPs until their results are unrelated, while captured and uncaptured runs on one EP stay
bit-identical. Before the fix, WebGPU's capture was judged against ORT's CPU EP and refused
(``VerificationError``) although the capture changed nothing.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest

from ortcapture.errors import EPAccuracyWarning  # noqa
from ortcapture.session import run_options_for
from tests import tiny


def _cpu(model):
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def _start(shape, seed=3):
    return np.random.default_rng(seed).uniform(0.05, 0.95, shape).astype(np.float32)


@pytest.mark.parametrize("dims", [None, ["batch", 64]], ids=["static", "shape_deferred"])
def test_chaotic_recurrence_captures_on_its_ep_and_reports_cpu_difference_once(backend, dims):
    model = tiny.chaotic_model(dims=dims)
    x0 = _start((64,) if dims is None else (2, 64))
    sess = backend.session(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        graph = sess.capture({"state_in": x0}, state={"state_out": "state_in"}, verify="full")
    ep_warnings = [w for w in seen if issubclass(w.category, EPAccuracyWarning)]
    cpu_state = _cpu(model).run(["state_out"], {"state_in": x0})[0]
    ep_state = sess.run(["state_out"], {"state_in": x0}, run_options_for(-1))[0]
    differs = np.abs(cpu_state - ep_state).max() > 1e-2
    if backend.device_type == "webgpu":
        assert differs  # the model does what it is for: the EPs disagree after one run of 32 steps (measured)
    assert len(ep_warnings) == int(differs)  # reported apart, once, exactly where the EP differs from the CPU EP
    if differs:
        assert "not a capture fault" in str(ep_warnings[0].message)
    # many steps carried as state=: the replay equals the uncaptured run of the same EP bit for bit
    state = x0
    for _ in range(20):
        got = graph.run({})
        (y, state) = sess.run(None, {"state_in": state}, run_options_for(-1))
        np.testing.assert_array_equal(got[1], state)
        np.testing.assert_array_equal(got[0], y)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        sess.capture({"state_in": x0}, verify="full").release()
    assert not [w for w in again if issubclass(w.category, EPAccuracyWarning)]  # once per session
    graph.release()


def test_example_level_does_not_compare_with_the_cpu_ep(backend):
    sess = backend.session(tiny.chaotic_model())
    with warnings.catch_warnings():
        warnings.simplefilter("error", EPAccuracyWarning)
        sess.capture({"state_in": _start((64,))}, verify="example").release()


# -- doctor: the "EP accuracy" finding ------------------------------------------------------------------------------
def test_first_differing_node_bisection():
    """The k-ary search finds the first differing tensor with few probes (a difference persists downstream)."""
    from ortcapture.cli.doctor_accuracy import first_differing_node

    tensors = [f"t{i}" for i in range(300)]
    for first in (0, 1, 7, 8, 9, 150, 298, 299):
        probes = []

        def probe(names, first=first):
            probes.append(list(names))
            return {n: int(n[1:]) >= first for n in names}
        index, count, exhausted = first_differing_node(probe, tensors)
        assert (index, exhausted) == (first, False) and count == len(probes) <= 5
    assert first_differing_node(lambda names: {n: False for n in names}, tensors)[0] is None
    found, count, exhausted = first_differing_node(lambda names: {n: True for n in names}, tensors, max_probes=1)
    assert exhausted and count == 1 and found is not None


def test_doctor_reports_ep_accuracy_and_the_first_differing_node(tmp_path, capsys):
    """The chaotic model captures on WebGPU (the capture is judged against WebGPU) and doctor reports, apart, how
    WebGPU compares with the CPU EP: a warning naming the first node whose output differs beyond tolerance."""
    from tests.conftest import webgpu_available

    webgpu_available()
    import json

    import onnx

    from ortcapture import cli
    from ortcapture._verify.compare import DEFAULT_RTOL, compare

    model = tiny.chaotic_model(steps=24)
    path = tmp_path / "chaotic.onnx"
    path.write_bytes(model)
    code = cli.main(["doctor", str(path), "--provider", "webgpu", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["verdict"] == "capturable"  # before: the capture's VerificationError
    (f,) = [f for f in report["findings"] if f["kind"] == "ep_accuracy"]
    assert f["severity"] == "warning" and f["message"].startswith("EP accuracy:")
    assert "not a capture fault" in f["message"] and "fuses" in f["message"]
    first = f["details"]["first_node"]
    assert first is not None and 0 < f["details"]["probes"] <= 8
    start = f["details"]["first_node_any_difference"]  # where the rounding difference starts: Log or Exp
    assert start["op_type"] in ("Log", "Exp") and start["index"] <= 1 and "starts, below tolerance" in f["message"]
    # brute force: every node's output at once, WebGPU against the CPU EP on the same feeds
    proto = onnx.load_from_string(model)
    names = [n.output[0] for n in proto.graph.node]
    have = {o.name for o in proto.graph.output}
    proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in have)
    data = proto.SerializeToString()
    feeds = {"state_in": np.random.default_rng(1).random((64,)).astype(np.float32)}  # doctor's feeds1 (seed 1)
    from tests.conftest import Backend

    outs = [o.name for o in proto.graph.output]
    ep = dict(zip(outs, Backend("webgpu").session(data, capture=False).run(None, feeds)))
    cpu = dict(zip(outs, _cpu(data).run(None, feeds)))
    differing = [i for i, n in enumerate(names) if compare([n], [ep[n]], [cpu[n]], DEFAULT_RTOL)[0]]
    assert differing and first["index"] in differing and first["index"] >= differing[0]
    assert first["output"] == names[first["index"]]


def test_doctor_has_no_ep_accuracy_finding_where_the_eps_agree(tmp_path, capsys):
    from tests.conftest import webgpu_available

    webgpu_available()
    import json

    from ortcapture import cli

    path = tmp_path / "affine.onnx"
    path.write_bytes(tiny.affine_model())
    cli.main(["doctor", str(path), "--provider", "webgpu", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert not [f for f in report["findings"] if f["kind"] == "ep_accuracy"]
