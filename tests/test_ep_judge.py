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
        assert differs  # the model does what it is for: the EPs disagree after one run of 32 steps
        assert len(ep_warnings) == 1 and "not a capture fault" in str(ep_warnings[0].message)
    else:
        assert not ep_warnings  # CUDA's judge was always the same session; no CPU comparison there
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
