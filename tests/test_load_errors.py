"""A model ORT itself refuses gives ORT's own exception, as a raw ``onnxruntime.InferenceSession`` gives it (type and
message), also where ortcapture reads the model first (capture, ``static_shapes=``, ``buckets=``)."""
from __future__ import annotations

import onnxruntime as ort
import pytest

import ortcapture


def _bad_models(tmp_path):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"garbage")
    return {
        "missing path": str(tmp_path / "nope.onnx"),
        "garbage file": str(garbage),
        "garbage bytes": b"garbage",
        "a directory": str(tmp_path),
    }


def _raw_error(model, args):
    with pytest.raises(Exception) as raw:
        ort.InferenceSession(model, **args)
    return raw.value


def _check_same(model, raw_args, oc_args, **kw):
    want = _raw_error(model, raw_args)
    with pytest.raises(Exception) as got:
        ortcapture.InferenceSession(model, **oc_args, **kw)
    assert type(got.value) is type(want), (type(got.value), type(want), got.value)
    assert str(got.value) == str(want)


@pytest.mark.parametrize("extra", [{}, {"static_shapes": {"A": [2, 4]}}, {"buckets": {"A": [2, 4]}}],
                         ids=["plain", "static_shapes", "buckets"])
def test_cpu_ep_load_errors_are_orts(tmp_path, extra):
    cpu = {"providers": ["CPUExecutionProvider"]}
    for name, model in _bad_models(tmp_path).items():
        _check_same(model, cpu, cpu, **extra)


def test_capture_load_errors_are_orts(tmp_path, backend):
    for name, model in _bad_models(tmp_path).items():
        # fresh options each time: the WebGPU EP is added to them
        _check_same(model, backend.session_args(True), backend.session_args(True))


def test_webgpu_session_options_load_errors_are_orts(tmp_path):
    from tests.conftest import webgpu_available

    webgpu_available()
    for name, model in _bad_models(tmp_path).items():
        _check_same(model, {"sess_options": ortcapture.webgpu.session_options(capture=True)},
                    {"sess_options": ortcapture.webgpu.session_options(capture=True)})


@pytest.mark.parametrize("capture", ["yes", 1, 0, None, "0"])
def test_session_options_capture_must_be_bool(capture):
    with pytest.raises(TypeError, match="capture must be True or False"):
        ortcapture.webgpu.session_options(capture=capture)


@pytest.mark.parametrize("capture", ["yes", 1])
def test_session_args_capture_must_be_bool(capture):
    from ortcapture._ort.providers import session_args

    with pytest.raises(TypeError, match="capture must be True or False"):
        session_args("cuda", capture)
