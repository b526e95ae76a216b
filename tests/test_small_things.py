"""Small things a new user met (issue 30 item 8), each with its test: VerificationError exported, shape-deferred
capture feeds checked by name and type, the bucket VerificationError's doctor command and ``doctor --buckets``,
batch 0 with buckets as plain ORT does it, ``copy_outputs`` a bool, ``webgpu.session_options()`` without ORT, the
harmless log lines listed (``patch check``'s "missing" is in tests/test_patch.py; the ``webgpu`` marker in
tests/conftest.py is checked here)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ortcapture
from ortcapture.errors import CaptureError, TransferError
from tests import tiny
from tests.conftest import Backend, webgpu_available
from tests.test_packaging import run_without_ort

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def webgpu() -> Backend:
    webgpu_available()
    return Backend("webgpu")


def test_verification_error_is_exported():
    from ortcapture._verify.compare import VerificationError

    assert ortcapture.VerificationError is VerificationError and "VerificationError" in ortcapture.__all__
    assert issubclass(ortcapture.VerificationError, CaptureError)
    assert "VerificationError" in dir(ortcapture)


def test_a_shape_deferred_capture_names_missing_inputs_and_wrong_types(backend):
    sess = backend.session(tiny.shape_subgraph_model())
    if not sess.capture_deferred:
        pytest.skip(f"{backend.name} captures this model as given (no shape-deferred session)")
    with pytest.raises(TransferError, match=r"miss input\(s\) \['X'\]"):
        sess.capture({})
    for bad, word in (("abc", "str"), (None, "NoneType"), (np.float32(1.0), "numpy scalar")):
        with pytest.raises(TransferError, match=rf"'X'.*{word}"):
            sess.capture({"X": bad})
    assert not sess.captured_graphs  # nothing was built for them


def test_a_wrong_feed_type_in_capture_names_the_type(backend):
    sess = backend.session(tiny.add_model())
    a = np.ones((2, 4), np.float32)
    for bad, word in (("abc", "str"), (None, "NoneType"), ([[1.0] * 4] * 2, "list")):
        with pytest.raises(TransferError, match=rf"'B'.*unsupported source type {word}"):
            sess.capture({"A": a, "B": bad})


def test_copy_outputs_takes_only_a_bool_or_pinned(backend):
    sess = backend.session(tiny.add_model())
    a = np.ones((2, 4), np.float32)
    g = sess.capture({"A": a, "B": a})
    replays = g.replays
    for bad in (1, 0, None, np.bool_(True), b"pinned"):
        with pytest.raises(TypeError, match="copy_outputs must be True, False or 'pinned'"):
            g.run(copy_outputs=bad)
    with pytest.raises(TransferError, match="copy_outputs must be"):  # a string names a mode: an unknown one
        g.run(copy_outputs="no")
    assert g.replays == replays  # refused before any replay
    assert isinstance(g.run(copy_outputs=False)[0], ortcapture.ReplayOutput)
    np.testing.assert_array_equal(g.run(copy_outputs=True)[0], a + a)


def test_batch_zero_with_buckets_does_what_plain_ort_does(backend):
    model = tiny.bucket_model()
    raw = backend.plain(model)
    x0 = np.zeros((0, 4), np.float32)

    def outcome(run):
        try:
            return [o.shape for o in run()]
        except Exception as exc:  # noqa: BLE001 - ORT's own type, compared below
            return type(exc)

    want = outcome(lambda: raw.run(None, {"X": x0}))
    sess = backend.session(model, buckets={"batch": [1, 2]})
    assert outcome(lambda: sess.run(None, {"X": x0})) == want  # a fresh session
    sess.run(None, {"X": np.ones((1, 4), np.float32)})  # bucket 1 exists now
    assert outcome(lambda: sess.run(None, {"X": x0})) == want
    assert sess.bucket_stats()["replayed"] == 1


def test_the_bucket_verification_error_names_doctor_buckets(backend):
    sess = backend.session(tiny.batch_pooled_model(), buckets={"batch": [1, 2, 4]})
    with pytest.raises(ortcapture.VerificationError, match=r"ortcapture doctor MODEL --buckets batch=1,2,4"):
        sess.run(None, {"X": np.ones((4, 4), np.float32)})


def _doctor(*argv):
    proc = subprocess.run([sys.executable, "-m", "ortcapture", "doctor", *map(str, argv), "--json"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.webgpu
def test_doctor_buckets_reports_padding_neutrality(webgpu, tmp_path):
    pooled, neutral = tmp_path / "pooled.onnx", tmp_path / "neutral.onnx"
    pooled.write_bytes(tiny.batch_pooled_model())
    neutral.write_bytes(tiny.bucket_model())
    rc, report = _doctor(pooled, "--provider", "webgpu", "--buckets", "batch=1,2,4")
    padding = {json.dumps(f["details"]["bucket"]): f for f in report["findings"] if f["kind"] == "padding"}
    assert rc == 1 and report["verdict"] == "not capturable"
    assert padding['{"batch": 4}']["severity"] == "error" and padding['{"batch": 4}']["details"]["outputs"] == ["Y"]
    assert padding['{"batch": 2}']["severity"] == "info"  # its most padded request is the full bucket
    rc, report = _doctor(neutral, "--provider", "webgpu", "--buckets", "X:0=1,2,4")
    padding = [f for f in report["findings"] if f["kind"] == "padding"]
    assert rc == 0 and report["verdict"] == "capturable"
    assert len(padding) == 3 and all(f["severity"] == "info" and f["details"]["neutral"] for f in padding)


def test_doctor_buckets_syntax():
    from ortcapture.cli.doctor_buckets import parse_bucket_items
    from ortcapture.cli.doctor_static import DoctorError

    assert parse_bucket_items(["batch=1,2,4", "X:1=8", "t+m:1=2,4"]) == {
        "batch": [1, 2, 4], ("X", 1): [8], ("t", ("m", 1)): [2, 4]}
    for bad in ("batch", "batch=", "X:one=2", "batch=1,two", "batch=1,,2", "batch=1,2,", "batch=0", "batch=2,-1"):
        with pytest.raises(DoctorError, match="--buckets"):
            parse_bucket_items([bad])


def test_webgpu_session_options_without_ort_names_the_extras():
    proc = run_without_ort(__import__("tests.test_packaging", fromlist=["NO_ORT"]).NO_ORT + """
import ortcapture.webgpu
try:
    ortcapture.webgpu.session_options()
except ModuleNotFoundError as exc:
    print("name:", exc.name)
    print("error:", exc)
""")
    assert proc.returncode == 0, proc.stderr
    name, error = proc.stdout.splitlines()
    assert name == "name: onnxruntime" and "ortcapture[cpu]" in error and "ortcapture[cuda]" in error


def test_the_harmless_lines_are_listed():
    """Every foreign log line the CLI tests allow on stderr is in the install guide's "all harmless" list."""
    from tests.test_cli import _FOREIGN

    text = (ROOT / "docs" / "INSTALL.md").read_text()
    harmless = text[text.index("all harmless"):].split("\n\n", 1)[0]
    for line in _FOREIGN:
        key = "[W:…]" if line.startswith("[") else line.replace("Warning: maxDynamic", "maxDynamic")
        assert key in harmless, line


def test_backend_webgpu_tests_carry_the_webgpu_marker():
    """``-m "not webgpu"`` deselects the backend-parametrised WebGPU tests too (tests/conftest.py)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "-m", "webgpu", "tests/test_scalars.py"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    collected = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert any("[webgpu]" in ln for ln in collected), proc.stdout[-2000:]
    assert not any("[cuda]" in ln for ln in collected)
