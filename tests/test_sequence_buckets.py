"""Sequence buckets (issue 23): padded sequence dims with pad values and masks, padding neutrality, state inputs."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import ortcapture
from ortcapture.errors import CaptureError
from tests import tiny
from tests.bucket_checks import TOL, close, cpu

VOCAB = 64




def text_batch(rng, batch, seq, pad_tail=True):
    """ids in [1, VOCAB) and a mask of ones; with ``pad_tail`` each row but the first ends in 0-3 masked steps (the
    caller's own padding inside the request, as tokenizers produce)."""
    ids = rng.integers(1, VOCAB, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    if pad_tail:
        for r in range(1, batch):
            k = int(rng.integers(0, min(4, seq - 1)))
            if k:
                mask[r, -k:] = 0
                ids[r, -k:] = 0
    return {"ids": ids, "attention_mask": mask}


def test_masked_attention_mixed_lengths_equal_the_cpu_ep(backend):
    model = tiny.masked_attention_model()
    sess = backend.session(model, buckets={"seq": [8, 16, 32]}, pad_values={"attention_mask": 0, "ids": 0})
    ref = cpu(model)
    rng = np.random.default_rng(0)
    for seq in (5, 13, 8, 27, 16, 9, 3):
        feeds = text_batch(rng, 2, seq)
        saved = {k: v.copy() for k, v in feeds.items()}
        got = sess.run(None, feeds)
        want = ref.run(None, feeds)
        assert [g.shape for g in got] == [(2, seq, 32), (2, 32)]  # hidden sliced back on seq; pooled has no seq
        for g, w in zip(got, want):
            close(g, w, TOL[backend.name])
        assert all(np.array_equal(feeds[k], saved[k]) for k in feeds)
    st = sess.bucket_stats()
    assert st["replayed"] == 7 and st["uncaptured"] == 0 and st["captured"] == 3
    assert sorted(st["buckets"]) == ["seq=16", "seq=32", "seq=8"] and 0 < st["padding_waste"] < 1


def test_the_verification_pads_with_pad_values(backend):
    """Padding the mask with 1 unmasks the padded keys: the same model, refused, outputs named."""
    model = tiny.masked_attention_model()
    sess = backend.session(model, buckets={"seq": [16]}, pad_values={"attention_mask": 1})
    feeds = text_batch(np.random.default_rng(1), 2, 11, pad_tail=False)
    with pytest.raises(CaptureError, match=r"\['hidden', 'pooled'\]") as err:
        sess.run(None, feeds)
    assert err.value.outputs == ["hidden", "pooled"]
    ok = backend.session(model, buckets={"seq": [16]})  # default 0: neutral
    close(ok.run(None, feeds)[1], cpu(model).run(None, feeds)[1], TOL[backend.name])


def test_probes_and_staging_pad_with_pad_values(backend):
    """Every run the session makes on padded feeds (output-axis probes, capture, replays) holds the pad value in
    the padded region, and a shrinking request re-pads what the previous one wrote."""
    model = tiny.masked_attention_model()
    sess = backend.session(model, buckets={"seq": [8, 16]}, pad_values={"ids": VOCAB - 1})
    runner = sess._oc_buckets
    seen = []
    plain = runner.host.run_uncaptured

    def spy(names, feeds, opts, ort_values):
        seen.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return plain(names, feeds, opts, ort_values)

    runner.host.run_uncaptured = spy
    rng = np.random.default_rng(2)
    for seq in (6, 3, 12, 7):
        feeds = text_batch(rng, 1, seq, pad_tail=False)
        close(sess.run(None, feeds)[0], cpu(model).run(None, feeds)[0], TOL[backend.name])
    probes = [f for f in seen if f["ids"].shape[1] > 6 and f["ids"].shape[1] in (8, 16)]
    assert probes, "the output-axis probes ran on padded feeds"
    assert all((f["ids"][:, 6:] == VOCAB - 1).all() and (f["attention_mask"][:, 6:] == 0).all() for f in probes)
    checked = 0
    for entry in runner._graphs.entries():  # the graph's fixed input: the rows beyond the last request hold the pad
        last = entry.filled.get("ids")
        if last is not None:
            ids = ortcapture.to_numpy(entry.graph.inputs["ids"])
            assert (ids[:, last[1]:] == VOCAB - 1).all()
            checked += 1
    assert checked, "a bucket served a request shorter than itself"


def test_padding_that_changes_results_is_refused_naming_the_outputs(backend):
    sess = backend.session(tiny.time_mean_model(), buckets={"seq": [8]})
    x = np.random.default_rng(3).standard_normal((2, 5, 4)).astype(np.float32)
    with pytest.raises(CaptureError, match=r"\['Y'\]") as err:
        sess.run(None, {"X": x})
    assert err.value.outputs == ["Y"]  # Z = 2X follows seq and pads neutrally
    with pytest.raises(CaptureError, match=r"\['Y'\]"):
        sess.run(None, {"X": x})
    assert sess.bucket_stats()["refused"] == 1
    uncaptured = sess.run(None, {"X": x}, ortcapture.run_options_for(-1))[0]  # still served uncaptured on request
    np.testing.assert_allclose(uncaptured, x.mean(axis=1), rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_causal_convolutions_pad_safely_and_centred_ones_do_not(backend, causal):
    model = tiny.conv1d_model(causal=causal)
    sess = backend.session(model, buckets={"seq": [16]})
    x = np.random.default_rng(5).standard_normal((2, 3, 11)).astype(np.float32)
    if causal:
        close(sess.run(None, {"X": x})[0], cpu(model).run(None, {"X": x})[0], TOL[backend.name])
        assert sess.bucket_stats()["replayed"] == 1
    else:  # the last step's window reaches into the padding
        with pytest.raises(CaptureError, match=r"\['Y'\]"):
            sess.run(None, {"X": x})


def test_batch_and_sequence_buckets_together(backend):
    model = tiny.masked_attention_model()
    sess = backend.session(model, buckets={"batch": [1, 2, 4], "seq": [8, 16]})
    ref = cpu(model)
    rng = np.random.default_rng(6)
    requests = [(1, 5), (3, 12), (2, 8), (4, 16), (3, 7), (1, 14), (2, 3)]
    for batch, seq in requests:
        feeds = text_batch(rng, batch, seq)
        got = sess.run(None, feeds)
        assert [g.shape for g in got] == [(batch, seq, 32), (batch, 32)]
        for g, w in zip(got, ref.run(None, feeds)):
            close(g, w, TOL[backend.name])
    st = sess.bucket_stats()
    assert st["replayed"] == len(requests) and st["uncaptured"] == 0
    assert sorted(st["buckets"]) == sorted({"batch=1, seq=8", "batch=4, seq=16", "batch=2, seq=8",
                                            "batch=1, seq=16", "batch=4, seq=8"})
    assert sess.run(None, text_batch(rng, 2, 20))[0].shape == (2, 20, 32)  # seq beyond 16: uncaptured
    assert sess.bucket_stats()["oversize"] == 1


@pytest.mark.parametrize("spec, match", [
    ({"nope": 0}, "not an input"),
    ({"ids": 1.5}, "does not fit"),
    ({"ids": [0]}, "scalar"),
    ([0], "mapping"),
])
def test_bad_pad_values(backend, spec, match):
    with pytest.raises(CaptureError, match=match):
        backend.session(tiny.masked_attention_model(), buckets={"seq": [8]}, pad_values=spec)


def test_pad_values_for_an_input_without_a_bucketed_dim_or_without_buckets(backend):
    with pytest.raises(CaptureError, match="'T' carries no bucketed dim"):
        backend.session(tiny.batch_last_model(), buckets={("X", 1): [4]}, pad_values={"T": 1.0})
    with pytest.raises(CaptureError, match="go with buckets"):
        backend.session(tiny.masked_attention_model(), pad_values={"ids": 0})


def test_a_state_input_whose_unnamed_axis_follows_the_bucket_is_refused_then_keyed(backend):
    model = tiny.batch_state_model()
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    h = rng.standard_normal((1, 3, 4)).astype(np.float32)
    refused = backend.session(model, buckets={"batch": [2, 4]})
    with pytest.raises(CaptureError, match=r"input 'h' axis 1 \(length 3, as batch\).*\('batch', \('h', 1\)\)"):
        refused.run(None, {"x": x, "h": h})
    sess = backend.session(model, buckets={("batch", ("h", 1)): [2, 4]})
    ref = cpu(model)
    for n in (3, 1, 4, 2):  # the state is fed every call, padded and sliced like the batch
        xs = rng.standard_normal((n, 4)).astype(np.float32)
        hs = rng.standard_normal((1, n, 4)).astype(np.float32)
        got = sess.run(None, {"x": xs, "h": hs})
        assert [g.shape for g in got] == [(1, n, 4), (1, n, 4)]
        for g, w in zip(got, ref.run(None, {"x": xs, "h": hs})):
            close(g, w, TOL[backend.name])
    st = sess.bucket_stats()
    assert st["replayed"] == 4 and sorted(st["buckets"]) == ["batch+h[1]=2", "batch+h[1]=4"]


def test_group_keys_are_checked():
    from ortcapture._buckets import spec as _buckets

    dims = {"x": ["batch", 4], "h": [1, None, 4]}
    (d,) = _buckets.parse_buckets({("batch", ("h", 1)): [2]}, dims)
    assert d.label == "batch+h[1]" and d.sites == (("x", 0), ("h", 1))
    with pytest.raises(CaptureError, match="a tuple of these"):
        _buckets.parse_buckets({(("h", 1), 7): [2]}, dims)
    with pytest.raises(CaptureError, match="already bucketed"):
        _buckets.parse_buckets({"batch": [2], (("h", 1), ("x", 0)): [2]}, dims)


def test_pad_value_bytes():
    from ortcapture._core.rows import _repeated_byte  # noqa: PLC2701 - the padding's byte rule, tested alone

    assert _repeated_byte(np.int64(0), np.int64) == 0 and _repeated_byte(-1, np.int64) == 0xFF
    assert _repeated_byte(np.float32(-1e9), np.float32) is None and _repeated_byte(True, np.bool_) == 1


@pytest.fixture(scope="module")
def recognizer_path() -> str:
    from ortcapture.cli import models

    try:
        return str(models.sequence_model())
    except RuntimeError as exc:  # no network here: the pinned wheel cannot be fetched
        pytest.skip(f"sequence model unavailable: {exc}")


def test_a_real_text_recognizer_whose_output_length_follows_the_width(backend, recognizer_path):
    """PP-OCRv4's recognizer (rapidocr-onnxruntime 1.4.4): x [batch, 3, 48, W] -> [batch, W // 8, 6625]. The width
    relation must be declared; padding the width is not neutral (global mixing over the steps) and is refused;
    batch padding at a bucket width is served."""
    from ortcapture.cli.models import sequence_steps

    batch, out = "p2o.DynamicDimension.0", "softmax_11.tmp_0"
    rng = np.random.default_rng(10)

    def crop(n, w):
        return ((rng.random((n, 3, 48, w), dtype=np.float32) - 0.5) / 0.5).astype(np.float32)

    undeclared = backend.session(recognizer_path, buckets={("x", 3): [64, 128]})
    with pytest.raises(CaptureError, match=r"'softmax_11.tmp_0'.*axis 1 is 16 at x\[3\]=128 and 8 at x\[3\]=64"):
        undeclared.run(None, {"x": crop(1, 100)})
    sess = backend.session(recognizer_path, buckets={batch: [1, 2, 4], ("x", 3): [64, 128]},
                           output_axes={out: {0: batch, 1: ("x[3]", sequence_steps)}})
    with pytest.raises(CaptureError, match=r"\['softmax_11.tmp_0'\]") as err:
        sess.run(None, {"x": crop(1, 100)})  # width 100 padded to 128
    assert err.value.outputs == [out]
    with pytest.raises(CaptureError, match=r"\['softmax_11.tmp_0'\]"):  # a full-width request: the bucket still
        sess.run(None, {"x": crop(3, 128)})  # serves widths 65-127, whose padding is not neutral: refused too
    # batch buckets only: each width is its own graph (a non-bucketed dim joins the key), batch padding is neutral
    by_batch = backend.session(recognizer_path, buckets={batch: [1, 2, 4]}, output_axes={out: {0: batch}})
    ref = cpu(recognizer_path)
    for n, w in ((3, 128), (1, 64), (2, 128)):
        x = crop(n, w)
        got = by_batch.run(None, {"x": x})[0]
        assert got.shape == (n, w // 8, 6625)
        close(got, ref.run(None, {"x": x})[0], TOL[backend.name])
    st = by_batch.bucket_stats()
    assert st["replayed"] == 3 and st["captured"] == 3 and st["refused"] == 0


def test_bench_stream_sequence_mode(tmp_path):
    import json

    from ortcapture.cli import main
    from tests.conftest import webgpu_available

    webgpu_available()
    out = tmp_path / "seq.json"
    rc = main(["bench", "attention", "--provider", "webgpu", "--stream", "3-20", "--axis", "ids:1", "--buckets",
               "8,16", "--shape", "ids=2x8", "--shape", "attention_mask=2x8", "--pad-value", "attention_mask=0",
               "--requests", "10", "--single-requests", "4", "--passes", "2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["arms"]) == {"single", "per-bucket", "buckets"} and res["bucket_key"] == "seq"
    assert res["arms"]["buckets"]["requests_timed"] == 20 and res["arms"]["single"]["requests_timed"] == 8
    assert res["max_rel_diff_buckets_vs_single"] < 1e-4 and res["pad_values"] == {"attention_mask": 0.0}
    st = res["bucket_stats"]
    assert st["captured"] >= 1 and st["uncaptured"] == st["oversize"]  # sizes above 16 run uncaptured
    assert main(["bench", "attention", "--provider", "webgpu", "--stream", "3-20", "--axis", "ids:5"]) == 2
    assert main(["bench", "attention", "--provider", "webgpu", "--stream", "3-20", "--axis", "nope:1"]) == 2


def test_the_fixed_buffers_hold_the_pad_values_after_a_shrinking_request(backend):
    """ids padded with -1 (one repeated byte: cudaMemset2D on CUDA's direct path), a float input with -1e9 (bytes
    differ: the host staging path on CUDA too); after a longer request a shorter one re-pads the tail. On CUDA the
    feeds are also CUDA OrtValues (copied on the device)."""
    from ortcapture.transfer import to_numpy

    attn = tiny.masked_attention_model()
    conv = tiny.conv1d_model(causal=True)
    s_attn = backend.session(attn, buckets={"seq": [16]}, pad_values={"ids": -1, "attention_mask": 0})
    s_conv = backend.session(conv, buckets={"seq": [16]}, pad_values={"X": -1e9})
    rng = np.random.default_rng(11)
    sources = ["host"] + (["cuda"] if backend.name == "cuda" else [])
    for source in sources:
        for seq in (12, 5, 9):
            feeds = text_batch(rng, 2, seq, pad_tail=False)
            x = rng.standard_normal((2, 3, seq)).astype(np.float32)
            want_a, want_c = cpu(attn).run(None, feeds), cpu(conv).run(None, {"X": x})[0]
            if source == "cuda":
                feeds = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feeds.items()}
                x = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
            for g, w in zip(s_attn.run(None, feeds), want_a):
                close(g, w, TOL[backend.name])
            close(s_conv.run(None, {"X": x})[0], want_c, TOL[backend.name])
            (e_attn,) = s_attn._oc_buckets._graphs.entries()
            (e_conv,) = s_conv._oc_buckets._graphs.entries()
            ids, mask = to_numpy(e_attn.graph.inputs["ids"]), to_numpy(e_attn.graph.inputs["attention_mask"])
            assert (ids[:, seq:] == -1).all() and (mask[:, seq:] == 0).all()
            assert (to_numpy(e_conv.graph.inputs["X"])[..., seq:] == np.float32(-1e9)).all()
    assert s_attn.bucket_stats()["replayed"] == 3 * len(sources)
