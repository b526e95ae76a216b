"""Memory that must not only grow (issue 18): raw-path buffers, compaction, WebGPU replay loops.

WebGPU runs on the software adapter (device memory is host memory there, so RSS shows it); CUDA parts carry
``@pytest.mark.cuda`` (device memory from cudaMemGetInfo through ortcapture._ort.cudart).
"""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import ortcapture
from ortcapture.session import run_options_for
from tests import tiny

MiB = 1 << 20


def rss() -> int:
    """Resident set size of this process in bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- item 1: the raw IOBinding path's buffers ----------------------------------------------------------------
def _raw_cycle(sess, gid, shape, x):
    """allocate -> bind -> capture -> replay -> release; returns the replay's output."""
    xb, yb = sess.allocate(shape, np.float32), sess.allocate(shape, np.float32)
    ortcapture.update_inplace(xb, x)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("X", xb)
    binding.bind_ortvalue_output("Y", yb)
    ro = run_options_for(gid)
    sess.run_with_iobinding(binding, ro)  # capture
    sess.run_with_iobinding(binding, ro)  # replay
    out = ortcapture.to_numpy(yb)
    sess.release_captured_graph(gid)
    return out


def test_raw_path_buffers_are_freed_after_release(backend):
    shape = (512, 1024)  # 2 MiB float32, as in the measurement
    sess = backend.session(tiny.affine_model(shape))
    x = np.linspace(-1, 1, 512 * 1024, dtype=np.float32).reshape(shape)
    pool = sess._oc_state.pool
    before = None
    for cycle in range(25):
        gid = cycle + 1  # CUDA/TensorRT retire released ids
        np.testing.assert_allclose(_raw_cycle(sess, gid, shape, x), x * 2 + 1, rtol=1e-6)
        gc.collect()
        assert len(pool) == 0, f"cycle {cycle}: {len(pool)} buffers still alive after release"
        if cycle == 4:
            before = rss()
    # device memory is host memory on the software adapter: 25 x 4 MiB before; ORT < 1.30 cannot release a WebGPU
    # graph at all (it keeps its buffers: compaction's job)
    if backend.name == "webgpu" and sess.capture_info.releases_natively:
        assert rss() - before < 24 * MiB, (rss() - before) / MiB


def test_pinned_raw_buffers_outlive_the_callers_references(backend):
    shape = (2, 4)
    sess = backend.session(tiny.affine_model(shape))
    binding = sess.io_binding()
    xb = sess.allocate(shape, np.float32)
    ortcapture.update_inplace(xb, np.ones(shape, np.float32))
    binding.bind_ortvalue_input("X", xb)
    binding.bind_ortvalue_output("Y", sess.allocate(shape, np.float32))
    ro = run_options_for(1)
    sess.run_with_iobinding(binding, ro)
    del xb
    gc.collect()
    assert len(sess._oc_state.pool) == 2  # the captured id pins both
    xb = binding.bound_inputs["X"].value
    ortcapture.update_inplace(xb, np.full(shape, 3, np.float32))
    sess.run_with_iobinding(binding, ro)
    np.testing.assert_array_equal(ortcapture.to_numpy(binding.bound_outputs["Y"].value), np.full(shape, 7))
    del xb
    sess.release_captured_graph(1)
    del binding
    gc.collect()
    assert len(sess._oc_state.pool) == 0


# -- item 3: WebGPU replay loops without a host readback ------------------------------------------------------
def test_replay_loop_without_readback_keeps_rss_flat(backend):
    from ortcapture.cli.soak import small_model

    sess = backend.session(small_model(64))
    state0 = np.zeros((64, 64), np.float32)
    x = np.full((64, 64), 2.0, np.float32)
    graph = sess.capture({"state": state0, "x": x}, state={"state_out": "state"})
    for _ in range(2000):  # warm-up
        graph.run(copy_outputs=False)
    gc.collect()
    start, peak = rss(), 0
    for i in range(30_000):
        graph.run(copy_outputs=False)
        if i % 1000 == 999:
            peak = max(peak, rss() - start)
    # measured on the software adapter before the queue drain: +155 MiB (5.3 KB a replay)
    assert peak < 8 * MiB, f"RSS grew {peak / MiB:.1f} MiB over 30,000 replays"
    np.testing.assert_allclose(graph.run()[0], np.full((64, 64), 4.0), rtol=1e-6)  # s -> 2x, results intact


# -- item 2: compaction -----------------------------------------------------------------------------------------
def _recurrent(backend):
    sess = backend.session(tiny.recurrent_model(8))
    x0, s0 = np.full((1, 8), 0.1, np.float32), np.zeros((1, 8), np.float32)
    graph = sess.capture({"x": x0, "state_in": s0}, state={"state_out": "state_in"})
    return sess, graph


def test_compact_keeps_state_outputs_and_ids(backend):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((12, 1, 8)).astype(np.float32)
    sess, graph = _recurrent(backend)
    _, ref = _recurrent(backend)
    for k in range(5):
        np.testing.assert_allclose(graph.run({"x": xs[k]})[0], ref.run({"x": xs[k]})[0], rtol=1e-5, atol=1e-6)
    stale = graph.run({"x": xs[5]}, copy_outputs=False)
    ref.run({"x": xs[5]})
    before = [ortcapture.to_numpy(v) for v in graph.outputs.values()]
    gid, replays = graph.graph_id, graph.replays
    sess.compact()
    assert sess.graph_memory["compactions"] == 1
    assert graph.graph_id == gid and not graph.released and graph.replays == replays
    assert list(sess.captured_graphs) == [gid]
    for b, v in zip(before, graph.outputs.values()):  # outputs as they were
        np.testing.assert_array_equal(ortcapture.to_numpy(v), b)
    with pytest.raises(ortcapture.StaleOutputError):
        stale[0].numpy()
    for k in range(6, 12):  # state carried on exactly as without the compaction
        np.testing.assert_allclose(graph.run({"x": xs[k]})[0], ref.run({"x": xs[k]})[0], rtol=1e-5, atol=1e-6)
    graph.reset_state()
    ref.reset_state()
    np.testing.assert_allclose(graph.run({"x": xs[0]})[0], ref.run({"x": xs[0]})[0], rtol=1e-5, atol=1e-6)
    graph.release()
    sess.compact()  # nothing live: still fine
    assert sess.captured_graphs == {}


def test_compact_refuses_while_raw_path_graphs_exist(backend):
    sess, graph = _recurrent(backend)
    shape = (1, 8)
    binding = sess.io_binding()
    for name in ("x", "state_in"):
        buf = sess.allocate(shape, np.float32)
        ortcapture.update_inplace(buf, np.zeros(shape, np.float32))
        binding.bind_ortvalue_input(name, buf)
    for name in ("y", "state_out"):
        binding.bind_ortvalue_output(name, sess.allocate(shape, np.float32))
    sess.run_with_iobinding(binding, run_options_for(7))
    sess.compact_threshold = 0
    with pytest.raises(ortcapture.CaptureError, match=r"raw IOBinding graph\(s\) \[7\]"):
        sess.compact()
    sess._oc_state.ledger.released(-5, freed=False, pinned_bytes=1)  # past the threshold: the automatic one must not run either
    graph.run()
    graph2 = sess.capture({"x": np.ones(shape, np.float32), "state_in": np.zeros(shape, np.float32)})
    assert sess.graph_memory["compactions"] == 0
    sess.run_with_iobinding(binding, run_options_for(7))  # the raw graph still replays
    sess.release_captured_graph(7)
    del binding, buf
    gc.collect()
    sess.compact_threshold = None
    sess.compact()
    assert sess.graph_memory["compactions"] == 1
    np.testing.assert_allclose(graph2.run()[1], np.tanh(np.ones(shape)), rtol=1e-5)


def test_compact_threshold_is_checked(backend):
    sess, _ = _recurrent(backend)
    assert sess.compact_threshold == 256 * MiB
    for bad in (-1, 1.5, "1", True, np.float64(2.0), np.int64(-3)):
        with pytest.raises(ortcapture.CaptureError, match="compact_threshold"):
            sess.compact_threshold = bad
    sess.compact_threshold = np.int64(5)  # a numpy integer is bytes too
    assert sess.compact_threshold == 5 and type(sess.compact_threshold) is int
    sess.compact_threshold = None
    assert sess.graph_memory["threshold"] is None


def test_compact_rebuilds_shape_specialised_siblings(backend):
    sess = backend.session(tiny.shape_subgraph_model())
    if not sess.capture_deferred:
        pytest.skip(f"{backend} captures this model without shape specialisation")  # CUDA: shape nodes on CPU
    graphs = {b: sess.capture({"X": np.full((b, 4), b, np.float32)}) for b in (1, 2)}
    sibs = list(sess._oc_state.siblings.values())
    old = [s.session._sess for s in sibs]
    sess.compact()
    assert all(s.session._sess is not o for s, o in zip(sibs, old))
    for b, g in graphs.items():
        np.testing.assert_array_equal(g.run({"X": np.full((b, 4), 2 * b, np.float32)})[0], np.full((b, 4), 2 * b + 1))


# -- item 4: the soak tool --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,count", [("replay", 5000), ("cycles", 200)])
def test_bench_soak_writes_json_and_png(backend, tmp_path, capsys, mode, count):
    import json

    from ortcapture.cli import main

    out_json, out_png = tmp_path / "soak.json", tmp_path / "soak.png"
    rc = main(["bench", "small", "--provider", backend.name, "--soak", "60", "--soak-count", str(count),
               "--soak-mode", mode, "--soak-sample", "0.2", "--warmup-replays", "500", "--json", str(out_json),
               "--plot", str(out_png)])
    assert rc == 0, capsys.readouterr()
    result = json.loads(out_json.read_text())
    s = result["summary"]
    assert result["mode"] == mode and s["count"] == count and len(result["samples"]) >= 2
    from ortcapture._ort import compat

    assert s["rate_per_s"] > 0
    if mode == "replay" or backend.name == "webgpu":  # CUDA cycles: retired graphs' host side until a compaction
        assert s["rss_bytes"]["peak_above_start"] < 16 * MiB
    assert (s["device_bytes"] is None) == (backend.name == "webgpu" or not compat.has_cuda_python())
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "compactions" in capsys.readouterr().out


def test_soak_cycles_keep_rss_flat_on_webgpu(backend):
    """WebGPU frees a released graph in ORT (>= 1.30): capture -> run -> release cycles need no compaction."""
    from ortcapture._ort import compat
    from ortcapture.cli.soak import small_model, soak

    if backend.name != "webgpu" or not compat.has_release_captured_graph():
        pytest.skip("WebGPU with ORT's release_captured_graph (ORT >= 1.30)")
    sess = backend.session(small_model(64))
    feeds = {"state": np.zeros((64, 64), np.float32), "x": np.ones((64, 64), np.float32)}
    soak(sess, feeds, mode="cycles", count=200, state={"state_out": "state"})  # warm-up
    result = soak(sess, feeds, mode="cycles", count=1500, state={"state_out": "state"}, sample_s=0.0)
    assert result["summary"]["rss_bytes"]["peak_above_start"] < 8 * MiB
    assert result["summary"]["compactions"] == 0


def test_automatic_compaction_where_webgpu_cannot_release(backend):
    """ORT < 1.30 has no WebGPU release (ids retired, buffers kept by the graph): retired graphs count their pinned
    bytes, and automatic compaction bounds memory (RSS on the software adapter)."""
    from ortcapture.cli.soak import small_model, soak

    sess = backend.session(small_model(256))  # 256 KiB buffers: 768 KiB pinned per graph
    if backend.name != "webgpu" or sess.capture_info.releases_natively:
        pytest.skip("WebGPU before ORT 1.30 (no release_captured_graph)")
    sess.compact_threshold = 8 * MiB
    feeds = {"state": np.zeros((256, 256), np.float32), "x": np.ones((256, 256), np.float32)}
    soak(sess, feeds, mode="cycles", count=30, state={"state_out": "state"})  # warm-up
    result = soak(sess, feeds, mode="cycles", count=200, state={"state_out": "state"}, sample_s=0.0)
    s = result["summary"]
    assert s["compactions"] >= 10
    assert s["rss_bytes"]["peak_above_start"] < 8 * MiB + 32 * MiB


def test_compact_needs_a_capturing_session(backend):
    sess = backend.session(tiny.add_model(), capture=False)
    with pytest.raises(ortcapture.CaptureUnsupportedError, match="compact"):
        sess.compact()


def test_an_iobinding_from_before_compact_or_set_providers_is_refused(backend):
    """ORT runs an IOBinding only on the C session it was made from (before ORT 1.30 it holds a raw pointer into
    it): a binding made before compact()/set_providers() replaced the C session, or made for another session, gets
    a BindingError instead of reaching the old session."""
    sess, _ = _recurrent(backend)
    dev = backend.device_type
    x = np.full((1, 8), 0.5, np.float32)

    def binding(s):
        b = s.io_binding()
        b.bind_cpu_input("x", x)
        b.bind_cpu_input("state_in", np.zeros((1, 8), np.float32))
        for name in ("y", "state_out"):
            b.bind_output(name, dev)
        return b

    old = binding(sess)
    sess.run_with_iobinding(old, run_options_for(-1))
    expect = old.copy_outputs_to_cpu()[0]
    sess.compact()
    with pytest.raises(ortcapture.BindingError, match="sess.io_binding"):
        sess.run_with_iobinding(old, run_options_for(-1))
    fresh = binding(sess)
    sess.run_with_iobinding(fresh, run_options_for(-1))
    np.testing.assert_allclose(fresh.copy_outputs_to_cpu()[0], expect, rtol=1e-6)
    other, _ = _recurrent(backend)
    with pytest.raises(ortcapture.BindingError, match="another session"):
        other.run_with_iobinding(fresh, run_options_for(-1))
    plain = ortcapture._ort.compat.OrtIOBinding(sess)  # ORT's own class, made before set_providers
    sess.set_providers(["CPUExecutionProvider"])  # another C session (without capture: refused all the same)
    # ORT's own IOBinding says which C session it was made for from ORT 1.30 (``_session``); before, only ours does
    checked = [fresh] + ([plain] if ortcapture._ort.compat.binding_c_session(plain) is not None else [])
    for b in checked:
        with pytest.raises(ortcapture.BindingError, match="set_providers"):
            sess.run_with_iobinding(b, run_options_for(-1))


def test_compact_keeps_repeated_output_positions_and_caller_buffer_references(backend):
    """A value listed twice as a graph output stays at both positions after compact(), and references to
    graph.inputs / graph.outputs taken before it still feed and show the graph (the same buffers are bound again)."""
    sess = backend.session(tiny.repeated_output_model(("Y", "Y", "Z")))
    g = sess.capture({"X": np.ones((2, 4), np.float32)})
    assert [o[0, 0] for o in g.run()] == [2.0, 2.0, 3.0]
    xin, yout = g.inputs["X"], g.outputs["Y"]
    sess.compact()
    assert [o[0, 0] for o in g.run()] == [2.0, 2.0, 3.0]
    ortcapture.update_inplace(xin, np.full((2, 4), 5, np.float32))
    g.replay()
    assert ortcapture.to_numpy(yout)[0, 0] == 10.0 and ortcapture.to_numpy(g.outputs["Z"])[0, 0] == 7.0


def test_capture_while_another_thread_compacts(backend):
    """ORT's own re-creation sets get_inputs() to None while it builds the new C session; compaction keeps the old
    one in place until the new one is built, so a capture in another thread never sees that. The compactor is
    bounded and pauses between compactions: a thread compacting back to back would starve the others of the
    capture gate (its lock is not fair), and on CUDA, where graphs are per thread, a replaying thread would capture
    again after every compaction without end (seen on the H200 with an unbounded loop)."""
    import threading
    import time

    sess = backend.session(tiny.affine_model())
    errors = []

    def compactor():
        try:
            for _ in range(8):
                sess.compact()
                time.sleep(0.02)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=compactor)
    t.start()
    k = 0
    try:
        while t.is_alive() or k < 10:
            x = np.full((2, 4), k, np.float32)
            g = sess.capture({"X": x})
            np.testing.assert_allclose(g.run({"X": x})[0], x * 2 + 1)
            g.release()
            k += 1
    finally:
        t.join(120)
    assert not t.is_alive() and not errors, errors
    assert sess.graph_memory["compactions"] == 8


def test_compact_without_its_model_file_or_with_a_failed_build(backend, tmp_path, monkeypatch):
    """compact() builds the C session again from the bytes read at construction (issue 30.6): a model file that is
    gone or no longer loads changes nothing. Where ORT's build itself fails (after ORT destroyed the old C session,
    as in set_providers), compact() says so and the graphs are released (instead of failing later with ORT's
    AttributeError/ValueError); automatic compaction then warns instead of raising into release() and turns itself
    off."""
    from ortcapture._ort import compat

    x = np.full((2, 4), 3, np.float32)
    sessions = []
    for name in ("gone", "corrupt", "failing", "automatic"):
        path = tmp_path / f"{name}.onnx"
        path.write_bytes(tiny.affine_model())
        sess = backend.session(str(path))
        sessions.append((sess, sess.capture({"X": x}), path))
    (gone, g_gone, p_gone), (bad, g_bad, p_bad), (fail, g_fail, _), (auto, g_auto, _) = sessions
    p_gone.unlink()
    gone.compact()
    np.testing.assert_allclose(g_gone.run({"X": x})[0], x * 2 + 1)
    p_bad.write_bytes(b"not an onnx model")
    bad.compact()
    np.testing.assert_allclose(g_bad.run({"X": x})[0], x * 2 + 1)

    real = compat.rebuild_c_session

    def failing(session, *args, **kwargs):
        real(session, *args, **kwargs)
        raise compat.RebuildFailed(RuntimeError("injected build failure"), False)

    monkeypatch.setattr(compat, "rebuild_c_session", failing)
    with pytest.raises(ortcapture.CaptureError, match="could not build the C session again"):
        fail.compact()
    assert g_fail.released
    with pytest.raises(ortcapture.GraphReleasedError):
        g_fail.run()
    np.testing.assert_allclose(g_auto.run({"X": x})[0], x * 2 + 1)  # another session: untouched
    auto.compact_threshold = 0
    auto._oc_state.ledger.released(-9, freed=False, pinned_bytes=1)  # a retired graph past the threshold
    with pytest.warns(RuntimeWarning, match="automatic compaction failed"):
        g_auto.release()
    assert auto.compact_threshold is None


def test_uncaptured_graph_survives_compact(backend):
    """uncaptured_graph()'s IOBinding is bound again on the rebuilt C session at its next run."""
    sess = backend.session(tiny.affine_model())
    sess.capture({"X": np.zeros((2, 4), np.float32)})  # something to compact
    u = sess.uncaptured_graph({"X": np.ones((2, 4), np.float32)})
    np.testing.assert_allclose(u.run()[0], np.full((2, 4), 3, np.float32))
    sess.compact()
    np.testing.assert_allclose(u.run({"X": np.full((2, 4), 2, np.float32)})[0], np.full((2, 4), 5, np.float32))


def test_uncaptured_graph_runs_past_the_webgpu_queue_drain(backend):
    """Every 256th run of a WebGPU graph reads an output back to drain ORT's queue; for uncaptured_graph() (whose
    registry record pins no outputs) that run raised AttributeError (the path of ``bench --no-graph-capture``): it
    reads its binding's output instead. 600 runs, each answer right."""
    sess = backend.session(tiny.affine_model())
    u = sess.uncaptured_graph({"X": np.zeros((2, 4), np.float32)})
    for i in range(600):
        (y,) = u.run({"X": np.full((2, 4), i, np.float32)})
        assert y[0, 0] == 2 * i + 1, i
