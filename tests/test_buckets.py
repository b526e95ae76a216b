"""Batch buckets (issue 16): plain sess.run() on varying batch sizes replays captured graphs, padded and sliced."""
from __future__ import annotations

import logging
import threading
import warnings

import numpy as np
import onnxruntime as ort
import pytest

from ortcapture import run_options_for
from ortcapture.errors import CaptureError
from tests import tiny
from tests.bucket_checks import TOL, close, cpu, run_threads

SIZES = [3, 1, 4, 7, 2, 3, 8, 5, 1, 6]




def test_mixed_sizes_equal_the_cpu_ep_and_replay(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [1, 2, 4, 8]})
    ref = cpu(model)
    rng = np.random.default_rng(0)
    fed = []
    for n in SIZES:
        x = rng.standard_normal((n, 4)).astype(np.float32)
        fed.append((x, x.copy()))
        got = sess.run(None, {"X": x})
        want = ref.run(None, {"X": x})
        assert [g.shape for g in got] == [(n, 3), (n, 3), (3, n)]  # each output sliced on its own batch axis
        for g, w in zip(got, want):
            close(g, w, TOL[backend.name])
    assert all(np.array_equal(x, saved) for x, saved in fed)  # the caller's arrays are never written
    stats = sess.bucket_stats()
    assert stats["replayed"] == len(SIZES) and stats["uncaptured"] == 0
    assert stats["captured"] == 4 and sorted(stats["buckets"]) == ["batch=1", "batch=2", "batch=4", "batch=8"]
    assert 0 < stats["padding_waste"] < 1
    assert all(b["device_bytes"] > 0 for b in stats["buckets"].values())


def test_output_names_and_run_with_ort_values(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={("X", 0): [2, 4]})
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    want = cpu(model).run(["feat", "scores"], {"X": x})
    got = sess.run(["feat", "scores"], {"X": x})
    for g, w in zip(got, want):
        close(g, w, TOL[backend.name])
    vals = sess.run_with_ort_values(["probs"], {"X": ort.OrtValue.ortvalue_from_numpy(x)})
    close(vals[0].numpy(), cpu(model).run(["probs"], {"X": x})[0], TOL[backend.name])
    assert sess.bucket_stats()["replayed"] == 2


def test_oversize_runs_uncaptured_or_splits(backend):
    model = tiny.bucket_model()
    ref = cpu(model)
    x = np.random.default_rng(1).standard_normal((11, 4)).astype(np.float32)
    plain = backend.session(model, buckets={"batch": [2, 4]})
    with pytest.warns(RuntimeWarning, match="beyond the largest bucket"):
        outs = plain.run(None, {"X": x})
    for g, w in zip(outs, ref.run(None, {"X": x})):
        close(g, w, TOL[backend.name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per session
        plain.run(None, {"X": x})
    assert plain.bucket_stats()["oversize"] == 2 and plain.bucket_stats()["uncaptured"] == 2
    split = backend.session(model, buckets={"batch": [2, 4]}, oversize="split")
    split.run(None, {"X": x[:3]})  # decides the output axes
    for g, w in zip(split.run(None, {"X": x}), ref.run(None, {"X": x})):
        close(g, w, TOL[backend.name])
    st = split.bucket_stats()
    assert st["split"] == 1 and st["uncaptured"] == 0 and st["replayed"] == 1 + 3  # 4 + 4 + 3 rows


def test_an_output_whose_relation_is_unclear_is_refused_until_declared(backend):
    model = tiny.batch_reshaped_model()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    sess = backend.session(model, buckets={"batch": [2, 4]})
    with pytest.raises(CaptureError, match=r"'Y'.*output_axes"):
        sess.run(None, {"X": x})
    calls = []
    real = sess._oc_buckets._decide_relations
    sess._oc_buckets._decide_relations = lambda *a: calls.append(a) or real(*a)
    with pytest.raises(CaptureError, match=r"'Y'.*output_axes"):  # remembered: no second probe for the same key
        sess.run(None, {"X": x})
    assert calls == [] and sess.bucket_stats()["refused"] == 1
    declared = backend.session(model, buckets={"batch": [2, 4]}, output_axes={"Y": {0: lambda n: 2 * n}})
    got = declared.run(None, {"X": x})[0]
    np.testing.assert_array_equal(got, -x.reshape(-1, 2))
    assert declared.bucket_stats()["replayed"] == 1


def test_padding_that_changes_an_output_is_refused_naming_it(backend):
    sess = backend.session(tiny.batch_pooled_model(), buckets={"batch": [4]})
    x = np.ones((3, 4), np.float32)
    with pytest.raises(CaptureError, match=r"\['Y'\]") as err:
        sess.run(None, {"X": x})
    assert getattr(err.value, "outputs", None) == ["Y"]
    with pytest.raises(CaptureError, match=r"\['Y'\]"):  # remembered: not captured again
        sess.run(None, {"X": x})
    assert sess.bucket_stats()["refused"] == 1
    exact = sess.run(None, {"X": x}, run_options_for(-1))[0]  # uncaptured on request
    np.testing.assert_allclose(exact, np.ones((1, 4)))


def test_explicit_graph_ids_are_refused_and_minus_one_runs_uncaptured(backend):
    sess = backend.session(tiny.bucket_model(), buckets={"batch": [2]})
    x = np.ones((2, 4), np.float32)
    with pytest.raises(CaptureError, match="gpu_graph_id=-1"):
        sess.run(None, {"X": x}, run_options_for(3))
    y = sess.run(None, {"X": x}, run_options_for(-1))[0]  # the caller's uncaptured run: not a fallback, not counted
    close(y, cpu(tiny.bucket_model()).run(None, {"X": x})[0], TOL[backend.name])
    assert sess.bucket_stats()["uncaptured"] == 0 and sess.bucket_stats()["captured"] == 0


def test_four_threads_with_mixed_sizes(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [1, 2, 4, 8]})
    ref = cpu(model)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(15):
                x = rng.standard_normal((int(rng.integers(1, 9)), 4)).astype(np.float32)
                for g, w in zip(sess.run(None, {"X": x}), ref.run(None, {"X": x})):
                    close(g, w, TOL[backend.name])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_threads(work, 4)
    assert not errors, errors
    assert sess.bucket_stats()["replayed"] == 60


def test_replay_thread_serves_other_threads(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [2, 4]}, replay_thread=True)
    x = np.ones((3, 4), np.float32)
    out = []
    t = threading.Thread(target=lambda: out.append(sess.run(None, {"X": x})))
    t.start()
    t.join()
    for g, w in zip(out[0], cpu(model).run(None, {"X": x})):
        close(g, w, TOL[backend.name])
    sess.run(None, {"X": x})
    assert sess.bucket_stats()["buckets"]["batch=4"]["threads"] == 1  # every replay on the session's thread


def test_run_on_replay_thread_runs_a_task_there_whole(backend):
    """A task on the replay thread replays its runs there (no hand-over, no deadlock on its own thread); tasks run in
    order; a session without a replay thread refuses it."""
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [2, 4]}, replay_thread=True)
    x = np.ones((3, 4), np.float32)
    sess.run(None, {"X": x})  # captures batch=4 on the replay thread

    def task(k):
        return threading.get_ident(), k, [sess.run(None, {"X": x * k}) for _ in range(2)]

    futures = [sess.run_on_replay_thread(task, k) for k in (1, 2, 3)]
    got = [f.result(timeout=60) for f in futures]
    assert len({ident for ident, _, _ in got}) == 1 and got[0][0] != threading.get_ident()
    assert [k for _, k, _ in got] == [1, 2, 3]
    ref = cpu(model)
    for _, k, outs in got:
        for out in outs:
            for g, w in zip(out, ref.run(None, {"X": x * k})):
                close(g, w, TOL[backend.name])
    assert sess.bucket_stats()["buckets"]["batch=4"]["threads"] == 1  # every replay on the session's thread
    with pytest.raises(ValueError, match="boom"):  # a task's exception comes back through its future
        sess.run_on_replay_thread(lambda: (_ for _ in ()).throw(ValueError("boom"))).result(timeout=60)
    # a task on the replay thread that hands another task to it, or warms up, runs it there (no deadlock)
    nested = sess.run_on_replay_thread(lambda: sess.run_on_replay_thread(task, 4).result(timeout=5)).result(timeout=60)
    assert nested[0] == got[0][0] and nested[1] == 4
    sess.run_on_replay_thread(sess.warmup, {"X": x}).result(timeout=60)
    plain = backend.session(model, buckets={"batch": [2, 4]})
    with pytest.raises(CaptureError, match="replay_thread=True"):
        plain.run_on_replay_thread(task, 1)


def test_warmup_captures_every_bucket_and_logs(backend, caplog):
    sess = backend.session(tiny.bucket_model(), buckets={"batch": [1, 2, 4]})
    with caplog.at_level(logging.INFO, logger="ortcapture"):
        stats = sess.warmup()
    assert stats["captured"] == 3 and stats["replayed"] == 0  # warmup's own replays are not requests
    assert sum("captured bucket" in r.getMessage() for r in caplog.records) == 3
    sess.run(None, {"X": np.ones((2, 4), np.float32)})
    assert sess.bucket_stats()["captured"] == 3


def test_warmup_needs_examples_for_dims_that_are_not_bucketed(backend):
    sess = backend.session(tiny.dynamic_model(), buckets={"batch": [1, 2]})
    with pytest.raises(CaptureError, match="'n'"):
        sess.warmup()
    stats = sess.warmup({"X": np.ones((1, 5), np.float32)})
    assert stats["captured"] == 2
    got = sess.run(None, {"X": np.full((2, 5), 2.0, np.float32)})[0]
    np.testing.assert_array_equal(got, np.full((2, 5), 6.0, np.float32))
    sess.run(None, {"X": np.ones((2, 6), np.float32)})  # another n: its own graph
    assert sess.bucket_stats()["captured"] == 3


def test_a_bucket_on_a_non_leading_axis(backend):
    model = tiny.batch_last_model()
    sess = backend.session(model, buckets={("X", 1): [4, 8]})
    rng = np.random.default_rng(3)
    t = rng.standard_normal((4, 1)).astype(np.float32)
    for n in (3, 6, 2):
        x = rng.standard_normal((4, n)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"X": x, "T": t})[0], x * 2 + t, rtol=1e-6)
    assert sess.bucket_stats()["replayed"] == 3


def test_max_graphs_evicts_the_least_recently_used(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [1, 2, 4]}, max_graphs=2)
    ref = cpu(model)
    for n in (1, 2, 4, 1, 3, 2):
        x = np.full((n, 4), 0.5, np.float32) * n
        for g, w in zip(sess.run(None, {"X": x}), ref.run(None, {"X": x})):
            close(g, w, TOL[backend.name])
    st = sess.bucket_stats()
    assert st["evicted"] == 3 and sorted(st["buckets"]) == ["batch=2", "batch=4"] and st["replayed"] == 6
    with pytest.raises(CaptureError, match="max_graphs"):
        backend.session(model, buckets={"batch": [1]}, max_graphs=0)


@pytest.mark.parametrize("spec, match", [
    ({"nope": [1]}, "no input dim is named 'nope'"),
    ({("X", 1): [1]}, "fixed at 4"),
    ({"batch": [4, 2]}, "ascending"),
    ({"batch": [0, 2]}, "ints from 1 to"),
    ({"batch": [1, 2**40]}, "ints from 1 to 2147483647"),  # every request failed later with MemoryError (a tester)
    ({("Z", 0): [1]}, "not an input"),
    ([1, 2], "mapping"),
])
def test_bad_bucket_specs(backend, spec, match):
    with pytest.raises(CaptureError, match=match):
        backend.session(tiny.bucket_model(), buckets=spec)


def test_replay_thread_takes_a_bool_only(backend):
    """``replay_thread="yes"`` (and "no") were taken as their truth value (a tester)."""
    with pytest.raises(CaptureError, match="replay_thread must be True or False, got 'no'"):
        backend.session(tiny.bucket_model(), buckets={"batch": [1]}, replay_thread="no")


def test_buckets_need_capture(backend):
    with pytest.raises(CaptureError, match="request graph capture"):
        backend.session(tiny.bucket_model(), capture=False, buckets={"batch": [1]})
    with pytest.raises(CaptureError, match="go with buckets"):
        backend.session(tiny.bucket_model(), oversize="split")


def test_the_reference_model_at_two_batch_sizes(backend, reference_model_path):
    sess = backend.session(reference_model_path, buckets={"batch": [2, 4]})
    ref = backend.plain(reference_model_path)
    rng = np.random.default_rng(5)
    for n in (1, 3, 2):
        x = rng.random((n, 3, 160, 160), dtype=np.float32)
        got = sess.run(None, {"images": x})[0]
        want = ref.run(None, {"images": x})[0]
        assert got.shape == want.shape == (n, 22, 525)
        close(got, want, rtol=1e-2 if backend.name == "cuda" else 1e-3)
    st = sess.bucket_stats()
    assert st["replayed"] == 3 and st["captured"] == 2


@pytest.mark.cuda
@pytest.mark.parametrize("source", ["ortvalue", "torch"])
def test_cuda_device_feeds_are_copied_on_the_device(backend, source, no_host_path):
    if backend.name != "cuda":
        pytest.skip("CUDA device feeds")
    lead = backend.session(tiny.bucket_model(), buckets={"batch": [4, 8]})
    last = backend.session(tiny.batch_last_model(), buckets={("X", 1): [4, 8]})
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((n, 4)).astype(np.float32) for n in (3, 6, 2)]
    ts = rng.standard_normal((4, 1)).astype(np.float32)
    # capture every bucket first (host feeds are fine there), then forbid host round trips
    lead.warmup()
    last.warmup({"X": xs[0].T.copy(), "T": ts})

    def dev(a):
        if source == "torch":
            torch = pytest.importorskip("torch")
            return torch.from_numpy(np.ascontiguousarray(a)).cuda()
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), "cuda", 0)

    want_lead = [cpu(tiny.bucket_model()).run(None, {"X": x}) for x in xs]
    tdev = dev(ts)
    no_host_path()
    for x, want in zip(xs, want_lead):
        for g, w in zip(lead.run(None, {"X": dev(x)}), want):
            close(g, w, rtol=1e-2)
        got = last.run(None, {"X": dev(x.T), "T": tdev})[0]
        close(got, x.T * 2 + ts, rtol=1e-6)
    assert lead.bucket_stats()["uncaptured"] == 0 and last.bucket_stats()["replayed"] == 3  # warmup not counted


def test_bench_stream_reports_every_arm(tmp_path):
    from tests.conftest import webgpu_available

    from ortcapture.cli import main

    webgpu_available()
    model = tmp_path / "bucket.onnx"
    model.write_bytes(tiny.bucket_model())
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    rc = main(["bench", str(model), "--provider", "webgpu", "--stream", "1-5", "--buckets", "2,4", "--shape",
               "X=1x4", "--requests", "12", "--single-requests", "4", "--passes", "2", "--json", str(out),
               "--plot", str(png)])
    assert rc == 0
    import json

    res = json.loads(out.read_text())
    assert set(res["arms"]) == {"single", "per-size", "buckets"}
    assert res["arms"]["buckets"]["requests_timed"] == 24 and res["arms"]["single"]["requests_timed"] == 8
    st = res["bucket_stats"]
    assert st["uncaptured"] == st["oversize"] and st["oversize"] > 0  # size 5 is beyond bucket 4
    assert res["max_rel_diff_buckets_vs_per_size"] < 1e-5
    assert png.stat().st_size > 1000
    assert main(["bench", str(model), "--provider", "webgpu", "--stream", "3-1"]) == 2


def test_tensorrt_profiles_cover_the_buckets():
    from ortcapture._buckets import spec as _buckets

    dims = {"X": ["batch", 4], "T": [4, 1]}
    bd = _buckets.parse_buckets({"batch": [2, 4, 8]}, dims)
    prof = _buckets.trt_profile_options(bd, dims)
    assert prof == {"trt_profile_min_shapes": "X:2x4,T:4x1", "trt_profile_max_shapes": "X:8x4,T:4x1",
                    "trt_profile_opt_shapes": "X:8x4,T:4x1"}
    assert _buckets.trt_profile_options(bd, {"X": ["batch", "n"]}) is None
    provs, _ = _buckets.with_trt_profiles([("TensorrtExecutionProvider", {"trt_cuda_graph_enable": "1"}), "CPU"],
                                          None, prof)
    assert provs[0][1]["trt_profile_max_shapes"] == "X:8x4,T:4x1" and provs[1] == "CPU"
    mine = {"trt_profile_min_shapes": "X:1x4"}
    provs, _ = _buckets.with_trt_profiles([("TensorrtExecutionProvider", dict(mine))], None, prof)
    assert provs[0][1] == mine  # the caller's own profiles win


def test_a_bucket_captured_by_a_request_that_fills_it_is_checked_with_padding_too(backend):
    """A request of exactly the bucket's size pads nothing; the bucket also serves smaller requests, so its check
    includes the most padded one it serves (warmup captures with exact sizes only)."""
    x = np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)
    sess = backend.session(tiny.batch_pooled_model(), buckets={"batch": [2, 4]})
    with pytest.raises(CaptureError, match=r"\['Y'\]") as err:
        sess.run(None, {"X": x})  # bucket 4 also serves 3 rows: padded 3 -> 4 changes the mean
    assert "3->4" in str(err.value)
    with pytest.raises(CaptureError, match=r"\['Y'\]"):
        backend.session(tiny.batch_pooled_model(), buckets={"batch": [2, 4]}).warmup()
    exact = backend.session(tiny.batch_pooled_model(), buckets={"batch": [1, 2]})  # every size its own bucket:
    np.testing.assert_allclose(exact.run(None, {"X": x[:2]})[0], x[:2].mean(axis=0, keepdims=True), rtol=1e-5)
    assert exact.bucket_stats()["replayed"] == 1  # nothing is ever padded, so nothing to refuse
    neutral = backend.session(tiny.bucket_model(), buckets={"batch": [2, 4]})
    assert neutral.warmup()["captured"] == 2  # row-wise models pass the padded check


def test_a_reduction_over_the_batch_that_the_example_cannot_show_is_refused(backend):
    """ReduceMax over the batch with zero padding equals the unpadded max for positive rows: the bucket used to pass
    its check on such a request and then answer [0, 0, 0, 0] for a batch of negative rows. An output with no axis
    along a batch dim is now also run with the padded rows holding other values; it changes, so it is refused."""
    rng = np.random.default_rng(5)
    sess = backend.session(tiny.batch_max_model(), buckets={"batch": [1, 2, 4]})
    with pytest.raises(CaptureError, match=r"\['M'\] have no axis along 'batch'") as err:
        sess.run(None, {"X": rng.uniform(0.5, 1, (3, 4)).astype(np.float32)})
    assert err.value.outputs == ["M"] and err.value.input_set == "padding"
    neg = -rng.uniform(0.5, 1, (3, 4)).astype(np.float32)
    with pytest.raises(CaptureError, match=r"\['M'\]"):  # never an answer from the padded replay
        sess.run(None, {"X": neg})
    np.testing.assert_allclose(sess.run(None, {"X": neg}, run_options_for(-1))[0], neg.max(axis=0))
    neutral = backend.session(tiny.bucket_model(), buckets={"batch": [1, 2, 4]})  # rows only: unaffected
    assert neutral.warmup()["captured"] == 3
    # a 0/1 row mask is what keeps the padded rows out: it is not moved, and such a model is accepted
    masked = backend.session(tiny.masked_batch_max_model(), buckets={"batch": [1, 2, 4]})
    x = rng.uniform(0.5, 1, (3, 4)).astype(np.float32)
    v = np.array([[1.0], [0.0], [1.0]], np.float32)
    np.testing.assert_allclose(masked.run(None, {"X": x, "V": v})[0], x[[0, 2]].max(axis=0), rtol=1e-6)
    np.testing.assert_allclose(masked.run(None, {"X": -x, "V": v})[0], (-x)[[0, 2]].max(axis=0), rtol=1e-6)
    assert masked.bucket_stats()["replayed"] == 2


def test_split_works_on_the_first_request_of_a_session(backend):
    model = tiny.bucket_model()
    sess = backend.session(model, buckets={"batch": [1, 2]}, oversize="split")
    x = np.random.default_rng(4).standard_normal((5, 4)).astype(np.float32)
    for g, w in zip(sess.run(None, {"X": x}), cpu(model).run(None, {"X": x})):
        close(g, w, TOL[backend.name])
    st = sess.bucket_stats()
    assert st["split"] == 1 and st["uncaptured"] == 0
