"""Interrupts and aborts leave the session consistent (issue 30, item 4).

CPython delivers a ``KeyboardInterrupt`` only when ORT's native ``run_with_iobinding`` returns, so ORT may then
hold a complete graph under the id that no record pins. Injected here by wrapping the one ORT run call
(``compat.ORT_RUN_WITH_IOBINDING``, used by ``ortcapture._core.run.run_bound``): run, then raise. Before the fix the
id stayed unknown to ortcapture while ORT kept the graph, so the next ``capture()`` took the same id and ORT replayed
the orphaned graph on freed buffers (outputs never written).
"""
from __future__ import annotations

import numpy as np
import pytest

import ortcapture
from ortcapture._core import run as _run
from ortcapture._ort import compat
from ortcapture.errors import GraphReleasedError
from ortcapture.session import run_options_for
from tests import tiny

SHAPE = (2, 4)


@pytest.fixture
def interrupt_at(monkeypatch):
    """``interrupt_at(k)``: the k-th capturing/replaying ORT run call from now (1-based; ``gpu_graph_id=-1`` runs
    are not counted) runs, then raises ``KeyboardInterrupt``, once."""
    real = compat.ORT_RUN_WITH_IOBINDING
    plan = {"left": None}

    def run(session, binding, run_options):
        real(session, binding, run_options)
        if plan["left"] is not None and _run.graph_id_of(run_options) != _run.SKIP_GRAPH_ID:
            plan["left"] -= 1
            if plan["left"] == 0:
                plan["left"] = None
                raise KeyboardInterrupt

    monkeypatch.setattr(compat, "ORT_RUN_WITH_IOBINDING", run)

    def arm(k: int) -> None:
        plan["left"] = k
    return arm


def _expect_affine(graph, x):
    for k in range(3):
        np.testing.assert_array_equal(graph.run({"X": x + k})[0], (x + k) * 2 + 1)


@pytest.mark.parametrize("at", [1, 2, 3], ids=["capturing_run", "sentinel_replay", "verification_replay"])
def test_interrupted_capture_releases_and_the_next_capture_works(backend, interrupt_at, at):
    sess = backend.session(tiny.affine_model())
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    interrupt_at(at)
    with pytest.raises(KeyboardInterrupt) as info:
        sess.capture({"X": x})
    assert type(info.value) is KeyboardInterrupt  # re-raised as it came: nothing blames the model
    assert sess.captured_graphs == {}
    g = sess.capture({"X": x + 10})  # graph_id=None: a free id (the same one where ORT released it)
    _expect_affine(g, x)
    assert list(sess.captured_graphs) == [g.graph_id]
    g.release()


def test_interrupted_capture_on_a_shape_deferred_session(backend, interrupt_at):
    sess = backend.session(tiny.dynamic_model())
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    names = [m.name for m in sess.get_inputs()]
    feeds = {n: x for n in names}
    interrupt_at(1)
    with pytest.raises(KeyboardInterrupt):
        sess.capture(feeds)
    g = sess.capture(feeds)
    want = sess.run(None, {n: x + 1 for n in names}, run_options_for(-1))
    for got, w in zip(g.run({n: x + 1 for n in names}), want):
        np.testing.assert_array_equal(got, w)


def test_interrupted_raw_capture_is_released_or_retired_as_aborted(backend, interrupt_at):
    sess = backend.session(tiny.affine_model())
    x = np.arange(8, dtype=np.float32).reshape(SHAPE)
    X, Y = sess.allocate(SHAPE, np.float32), sess.allocate(SHAPE, np.float32)
    ortcapture.update_inplace(X, x)
    io = sess.io_binding()
    io.bind_ortvalue_input("X", X)
    io.bind_ortvalue_output("Y", Y)
    interrupt_at(1)
    with pytest.raises(KeyboardInterrupt):
        sess.run_with_iobinding(io, run_options_for(1))
    assert sess.captured_graphs == {} and not io.pinned_ids
    if sess.capture_info.releases_natively:  # WebGPU, ORT >= 1.30: ORT freed the id, a retry captures again
        retry_id = 1
    else:  # CUDA: ORT cannot free it; the retry is told the capture was aborted and which id captures
        with pytest.raises(GraphReleasedError, match=r"capture of gpu_graph_id=1 was aborted.*another id \(e\.g\. 2"):
            sess.run_with_iobinding(io, run_options_for(1))
        with pytest.raises(GraphReleasedError, match="was aborted"):
            sess.capture({"X": x}, graph_id=1)
        retry_id = 2
    for k in range(3):  # the retry captures for real: replays follow the input
        ortcapture.update_inplace(X, x + k)
        sess.run_with_iobinding(io, run_options_for(retry_id))
        np.testing.assert_array_equal(ortcapture.to_numpy(Y), (x + k) * 2 + 1)
    g = sess.capture({"X": x})
    assert g.graph_id != retry_id
    _expect_affine(g, x)


def test_interrupted_raw_capture_leaves_declared_state_untouched(backend, interrupt_at):
    """ORT's warm-up runs inside the interrupted call advanced the in-place state: restored from its snapshot."""
    sess = backend.session(tiny.counter_model())
    S = sess.allocate((4,), np.float32)
    ortcapture.update_inplace(S, np.zeros(4, np.float32))
    io = sess.io_binding()
    io.bind_ortvalue_input("state_in", S)
    io.bind_ortvalue_output("state_out", S)
    io.declare_state("state_out", "state_in")
    interrupt_at(1)
    with pytest.raises(KeyboardInterrupt):
        sess.run_with_iobinding(io, run_options_for(1))
    np.testing.assert_array_equal(ortcapture.to_numpy(S), np.zeros(4, np.float32))


def test_interrupted_state_graph_capture_keeps_initial_state(backend, interrupt_at):
    sess = backend.session(tiny.counter_model())
    s0 = np.zeros(4, np.float32)
    interrupt_at(2)
    with pytest.raises(KeyboardInterrupt):
        sess.capture({"state_in": s0}, state={"state_out": "state_in"})
    g = sess.capture({"state_in": s0}, state={"state_out": "state_in"})
    for k in range(1, 4):
        np.testing.assert_array_equal(g.run({})[0], s0 + k)


@pytest.mark.parametrize("at", [1, 3], ids=["capturing_run", "bucket_verification"])
def test_interrupted_bucket_capture_keeps_no_graph_and_blames_nothing(backend, interrupt_at, at):
    """A bucket's capture or verification interrupted: the graph is released, the bucket is not marked refused,
    and the next run captures it."""
    sess = backend.session(tiny.dynamic_model(), buckets={"batch": [4]})
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    sess.run(None, {"X": x[:1]}, run_options_for(-1))  # warm, uncaptured
    interrupt_at(at)
    with pytest.raises(KeyboardInterrupt):
        sess.run(None, {"X": x})
    assert sess.captured_graphs == {} and sess.bucket_stats()["refused"] == 0
    np.testing.assert_array_equal(sess.run(None, {"X": x})[0], x * 3)
    assert sess.bucket_stats()["replayed"] == 1 and len(sess.captured_graphs) == 1
