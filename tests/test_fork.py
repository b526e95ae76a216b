"""``os.fork()`` after a device session exists: ORT and Dawn hang in the child on its first run, without a word
(measured, onnxruntime 1.32 + WebGPU plugin EP 0.4.0 on the software adapter: the inherited session's run, a WebGPU
session the child makes itself, and the inherited session's destruction all hang or crash). ortcapture raises
``CaptureError`` (``kind`` ``"fork"``) before any native call instead, never destroys inherited sessions in the
child, and leaves ORT's CPU EP (which survives fork) alone.

Each test forks the test process itself; the child reports through a pipe and always ends with ``os._exit``, and the
parent waits with a deadline, so a hang fails the test instead of hanging the suite. WebGPU runs on the software
adapter; the CUDA variants carry ``@pytest.mark.cuda`` (through the ``backend`` fixture) and skip without the CUDA EP.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import time
import warnings

import numpy as np
import onnxruntime as ort
import pytest

import ortcapture
from ortcapture import transfer
from ortcapture._core.run import run_options_for
from ortcapture.errors import CaptureError
from tests import tiny

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX only")

SHAPE = (2, 4)
#: seconds the parent waits for a child: every call in it either raises at once or is ORT's CPU EP on a tiny model
DEADLINE_S = 60


def _outcome(call) -> str:
    """``"ok"``, ``"fork"`` (ortcapture's fork refusal) or ``"<type>: <message>"`` for anything else."""
    try:
        call()
    except CaptureError as exc:
        if getattr(exc, "kind", None) == "fork":
            return "fork"
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which asserts on it
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _message(call) -> str:
    try:
        call()
    except CaptureError as exc:
        return str(exc)
    return ""


def _in_child(body) -> dict:
    """Run ``body()`` (returning a JSON-able dict) in an ``os.fork()`` child and return its result. The child never
    returns into pytest (``os._exit``); a child that does not answer and exit within :data:`DEADLINE_S` is killed
    and fails the test.

    Garbage of earlier tests is collected first and the rest frozen (``gc.freeze``, as Python's docs advise before a
    fork): otherwise the child's garbage collector may destroy an unreachable ORT session of an earlier test, whose
    destructor joins intra-op pool threads that do not exist in the child, and the child hangs (seen with ORT 1.24.4
    whenever the suite's imports moved the collector's timing)."""
    r, w = os.pipe()
    gc.collect()
    gc.freeze()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python >= 3.12: fork() of a multi-threaded process
        pid = os.fork()
    if pid != 0:
        gc.unfreeze()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(r)
            try:
                data = json.dumps(body()).encode()
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                data = json.dumps({"__error__": f"{type(exc).__name__}: {exc}"}).encode()
                code = 1
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + DEADLINE_S
    chunks = []
    try:
        while True:
            left = deadline - time.monotonic()
            ready = select.select([r], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the forked child hung (no answer within {DEADLINE_S} s; killed); it said: "
                            f"{b''.join(chunks)!r}")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child answered but did not exit (killed)")
        time.sleep(0.02)
    code = os.waitstatus_to_exitcode(status)
    if not chunks:
        pytest.fail(f"the forked child ended without an answer (exit code {code}; negative: killed by that signal)")
    result = json.loads(b"".join(chunks))
    assert "__error__" not in result, result["__error__"]
    assert code == 0
    return result


def _cpu_session(model) -> ortcapture.InferenceSession:
    return ortcapture.InferenceSession(model, providers=["CPUExecutionProvider"])


def test_device_session_made_before_fork_raises_in_the_child(backend):
    model = tiny.affine_model(SHAPE)
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    sess = backend.session(model)
    g = sess.capture({"X": x})
    np.testing.assert_allclose(g.run({"X": x})[0], x * 2 + 1)
    X, Y = sess.allocate(SHAPE, np.float32), sess.allocate(SHAPE, np.float32)
    io = sess.io_binding()
    io.bind_ortvalue_input("X", X)
    io.bind_ortvalue_output("Y", Y)
    sess.run_with_iobinding(io, run_options_for(-1))
    plain = backend.session(model, capture=False)  # a device session without capture: refused alike
    ep = sess.get_providers()[0]
    parent = os.getpid()

    def child():
        uncaptured = run_options_for(-1)
        calls = {
            "run": lambda: sess.run(None, {"X": x}, uncaptured),
            "run without options": lambda: sess.run(None, {"X": x}),
            "run_with_ort_values": lambda: sess.run_with_ort_values(
                None, {"X": ort.OrtValue.ortvalue_from_numpy(x)}, uncaptured),
            "run_async": lambda: sess.run_async(None, {"X": x}, lambda *a: None, None, uncaptured),
            "run_with_iobinding": lambda: sess.run_with_iobinding(io, uncaptured),
            "run_with_iobinding capture": lambda: sess.run_with_iobinding(io, run_options_for(9)),
            "io.copy_outputs_to_cpu": io.copy_outputs_to_cpu,
            "io.synchronize_outputs": io.synchronize_outputs,
            "io_binding": sess.io_binding,
            "allocate": lambda: sess.allocate(SHAPE, np.float32),
            "capture": lambda: sess.capture({"X": x}),
            "uncaptured_graph": lambda: sess.uncaptured_graph({"X": x}),
            "g.run": lambda: g.run({"X": x}),
            "g.run no feeds": lambda: g.run(copy_outputs=False),
            "g.replay": g.replay,
            "g.run_many": lambda: g.run_many([{"X": x}]),
            "to_numpy": lambda: transfer.to_numpy(g.outputs["Y"]),
            "update_inplace": lambda: ortcapture.update_inplace(g.inputs["X"], x),
            "copy": lambda: ortcapture.copy([X], [g.inputs["X"]]),
            "compact": sess.compact,
            "set_providers": lambda: sess.set_providers(["CPUExecutionProvider"]),
            "plain.run": lambda: plain.run(None, {"X": x}),
        }
        out = {name: _outcome(call) for name, call in calls.items()}
        out["message"] = _message(lambda: sess.run(None, {"X": x}, uncaptured))
        # the release paths touch nothing and raise nothing; the inherited objects are never destroyed here
        out["g.release"] = _outcome(g.release)
        out["g.released"] = g.released
        out["release_captured_graph"] = _outcome(lambda: sess.release_captured_graph(g.graph_id))
        out["after release"] = _outcome(lambda: g.run({"X": x}))
        out["del"] = _outcome(lambda: (calls.clear(), gc.collect()))
        return out

    got = _in_child(child)
    message = got.pop("message")
    assert got.pop("g.released") is True
    assert {k: v for k, v in got.items() if v != "fork"} == {
        "g.release": "ok", "release_captured_graph": "ok", "del": "ok"}
    assert ep in message and f"process {parent} before os.fork()" in message
    assert "spawn" in message and "forkserver" in message
    # the parent's session and graph are untouched
    np.testing.assert_allclose(g.run({"X": x + 1})[0], (x + 1) * 2 + 1)
    np.testing.assert_allclose(sess.run(None, {"X": x}, run_options_for(-1))[0], x * 2 + 1)


def test_inherited_sessions_dropped_in_the_child_do_not_hang_its_end(backend):
    """The inherited session's destruction hangs or crashes in ORT (measured on WebGPU: a raw session's ``del`` in the
    child hangs; a captured ortcapture session and graph, once unkept, end the child with SIGSEGV); ortcapture keeps
    them alive in the child, so dropping every reference and collecting returns."""
    model = tiny.affine_model(SHAPE)
    x = np.ones(SHAPE, np.float32)
    holder = {"sess": backend.session(model)}
    holder["g"] = holder["sess"].capture({"X": x})
    holder["g"].run({"X": x})

    def child():
        holder.clear()
        gc.collect()
        return {"collected": True}

    assert _in_child(child) == {"collected": True}
    assert holder["g"].run({"X": x})[0].shape == SHAPE  # the parent's are untouched


def test_cpu_sessions_run_in_the_child_and_device_sessions_made_there_are_refused(backend):
    """ORT's CPU EP survives fork: a CPU session made before the fork, and one made in the child, run there. A
    device session the child makes on a device its parent used hangs on its first run in ORT (measured on WebGPU:
    made, then its first run hangs), so ortcapture refuses it when it is made."""
    model = tiny.affine_model(SHAPE)
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    device = backend.session(model)
    device.capture({"X": x}).run({"X": x})
    cpu = _cpu_session(model)
    cpu.run(None, {"X": x})

    def child():
        made = _cpu_session(model)
        return {
            "inherited cpu": cpu.run(None, {"X": x})[0].tolist(),
            "made in child": made.run(None, {"X": x})[0].tolist(),
            "made in child graph-free runs": made.run(None, {"X": x + 1})[0].tolist(),
            "new device session": _outcome(lambda: backend.session(model)),
            "new device session message": _message(lambda: backend.session(model)),
            "device": _outcome(lambda: device.run(None, {"X": x}, run_options_for(-1))),
        }

    got = _in_child(child)
    np.testing.assert_allclose(got["inherited cpu"], x * 2 + 1)
    np.testing.assert_allclose(got["made in child"], x * 2 + 1)
    np.testing.assert_allclose(got["made in child graph-free runs"], (x + 1) * 2 + 1)
    assert got["device"] == "fork"
    assert got["new device session"] == "fork"
    assert "made in process" in got["new device session message"] and "spawn" in got["new device session message"]


def test_cpu_only_sessions_are_not_marked_by_a_fork():
    """No device EP, nothing to refuse: a CPU-only ortcapture session made before the fork runs in the child (needs
    no GPU and no WebGPU)."""
    model = tiny.affine_model(SHAPE)
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    cpu = _cpu_session(model)
    cpu.run(None, {"X": x})

    def child():
        return {"run": cpu.run(None, {"X": x})[0].tolist(),
                "io": _outcome(lambda: cpu.io_binding()),
                "new": _cpu_session(model).run(None, {"X": x})[0].tolist()}

    got = _in_child(child)
    np.testing.assert_allclose(got["run"], x * 2 + 1)
    np.testing.assert_allclose(got["new"], x * 2 + 1)
    assert got["io"] == "ok"


def test_bucketed_run_raises_in_the_child_even_with_a_replay_thread(backend):
    """Plain ``run()`` of a session with ``buckets=`` replays captured graphs; with ``replay_thread=True`` it hands
    them to a thread that does not exist in the child (waiting on it would hang): refused first."""
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [1, 2]}, replay_thread=True, verify=False)
    feeds = {"X": np.ones((2, 4), np.float32)}
    sess.run(None, feeds)

    def child():
        return {"run": _outcome(lambda: sess.run(None, feeds)),
                "warmup": _outcome(sess.warmup),
                "uncaptured": _outcome(lambda: sess.run(None, feeds, run_options_for(-1)))}

    assert _in_child(child) == {"run": "fork", "warmup": "fork", "uncaptured": "fork"}
    assert sess.bucket_stats()["replayed"] >= 1
