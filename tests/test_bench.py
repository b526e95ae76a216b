"""``ortcapture bench``: end to end on real WebGPU capture (tiny models, few iterations), plus argument errors,
worker failures and the statistics, which need no GPU."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from ortcapture.cli import bench
from ortcapture.cli import main
from tests import tiny

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def webgpu():
    from tests.conftest import webgpu_available

    webgpu_available()


def _check_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    import matplotlib.image

    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def _check_result(res: dict, batches: list[int], procs: int, iters: int, capture: bool) -> None:
    assert res["provider"] == "webgpu" and res["graph_capture"] is capture and res["ok"] is True
    assert [e["batch"] for e in res["batches"]] == batches
    for entry in res["batches"]:
        assert entry["verified"] and set(entry["stats"]) == set(bench.ARMS)
        for arm, s in entry["stats"].items():
            assert s["n"] == procs * iters, arm
            assert 0 < s["min_us"] <= s["p50_us"] <= s["p90_us"], (arm, s)
            assert len(s["p50_per_process_us"]) == procs
            lo, hi = s["p50_spread_us"]
            assert lo <= hi
            assert [len(r) for r in entry["samples_us"][arm]] == [iters] * procs  # per process
            assert entry["max_abs_diff"][arm] <= entry["tolerance"]
        assert all(v > 0 for v in entry["speedup"].values())
        assert entry["overhead"]["ortcapture_over_raw"] > 0
        assert len(entry["overhead"]["ortcapture_over_raw_per_process"]) == procs
        paired = entry["overhead"]["paired"]  # the call-by-call raw/ortcapture alternation
        assert paired["ortcapture_over_raw"] > 0 and len(paired["ortcapture_minus_raw_per_process_us"]) == procs
        assert [len(w["raw_capture"]) for w in entry["paired_us"]] == [iters] * procs
        assert len(entry["processes"]) == procs
        assert all(p["ep"] == "WebGpuExecutionProvider" for p in entry["processes"])


@pytest.mark.webgpu
def test_bench_end_to_end_webgpu(webgpu, tmp_path, capsys):
    model = tmp_path / "dynamic.onnx"
    model.write_bytes(tiny.dynamic_model())  # dims [batch, n]: --batch 1,2 gives two fixed models
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", str(model), "--provider", "webgpu", "--batch", "1,2", "--procs", "2", "--iters", "5",
               "--json", str(out_json), "--plot", str(out_png)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out_json.read_text())
    _check_result(res, [1, 2], procs=2, iters=5, capture=True)
    assert [e["shapes"]["X"][0] for e in res["batches"]] == [1, 2]
    assert all(p["ortcapture_capture_s"] > 0 for e in res["batches"] for p in e["processes"])
    for label in bench.ARMS.values():
        assert label in text
    assert "ortcapture / raw capture" in text and "[capture off]" not in text
    _check_png(out_png)


@pytest.mark.webgpu
def test_bench_no_graph_capture_webgpu(webgpu, tmp_path, capsys):
    model = tmp_path / "affine.onnx"
    model.write_bytes(tiny.affine_model())  # fixed dims: a second batch size is skipped, not benchmarked twice
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    # with the host settings too: they reach every worker and are recorded
    rc = main(["bench", str(model), "--provider", "webgpu", "--batch", "1,4", "--procs", "1", "--iters", "4",
               "--no-graph-capture", "--json", str(out_json), "--plot", str(out_png), "--intra-op-threads", "1",
               "--session-config", "session.intra_op.allow_spinning=0", "--pin-thread"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    # X is 2x4, no batch dim: reported as fixed shapes (it was "batch 1", the size asked for), benchmarked once
    assert "--batch does not apply" in captured.err and "fixed shapes (X 2x4)" in captured.out
    res = json.loads(out_json.read_text())
    _check_result(res, [None], procs=1, iters=4, capture=False)
    assert "[capture off]" in captured.out
    assert res["intra_op_threads"] == 1 and res["pin_thread"] is True
    assert res["session_config"] == {"session.intra_op.allow_spinning": "0"}
    assert "intra_op_num_threads=1" in captured.out and "pinned" in captured.out
    for proc in res["batches"][0]["processes"]:
        assert proc["pinned_cpu"] in os.sched_getaffinity(0)
    _check_png(out_png)


@pytest.mark.webgpu
def test_bench_failed_worker_exit_2(webgpu, tmp_path, capsys):
    model = tmp_path / "if.onnx"
    model.write_bytes(tiny.if_model())  # control flow: ORT refuses graph capture when the worker builds sessions
    assert main(["bench", str(model), "--provider", "webgpu", "--procs", "2", "--iters", "2"]) == 2
    err = capsys.readouterr().err
    assert "worker for fixed shapes · process 1/2 failed" in err and "control flow" in err  # X is [2]: no batch


# ---------------------------------------------------------------------------------------------------------------
# no GPU needed
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--batch", "0"], "--batch"),
    (["--batch", "1,x"], "--batch"),
    (["--batch", "1,,2"], "empty entry"),
    (["--batch", "1,2,"], "empty entry"),
    (["--stream", "1-8", "--buckets", "1,,8"], "empty entry"),
    (["--stream", "1-99999999999999999999"], "--stream: wants LO-HI"),  # was numpy's raw ValueError, after loading
    (["--stream", "a-b"], "--stream: wants LO-HI"),
    (["--stream", "1-2-3"], "--stream: wants LO-HI"),
    (["--procs", "0"], "--procs"),
    (["--iters", "0"], "--iters"),
    (["--iters", "3", "--rounds", "4"], "--rounds"),
    (["--shape", "X"], "--shape"),
    (["--shape", "nope=2x4"], "model's inputs"),
    (["--provider-option", "prefer_nhwc"], "KEY=VALUE"),
    (["--provider-option", "=1"], "KEY=VALUE"),
    (["--provider-option", "enable_cuda_graph=0"], "--graph-capture"),
    (["--provider-option", "enableGraphCapture=1"], "--graph-capture"),
    (["--provider-option", "a=1", "--provider-option", "a=2"], "given twice"),
    (["--sync", "host"], None),
    (["--session-config", "session.intra_op.allow_spinning"], "KEY=VALUE"),
    (["--session-config", "=0"], "KEY=VALUE"),
    (["--intra-op-threads", "-1"], "--intra-op-threads"),
    (["--intra-op-threads", "2147483648"], "oversubscribes"),
    (["--session-config", "a=1", "--session-config", "a=2"], "given twice"),
    (["--session-config", "ep.webgpuexecutionprovider.enableGraphCapture=0"], "--provider-option"),
    (["--session-config", "session.intra_op.allow_spinning=maybe"], "takes 0 or 1"),
    (["--batch", "99999999999999999999"], "below 2**31"),
    (["--plot", "PLOT.xyz"], ".png"),
    (["--plot", "PLOT"], ".png"),
    (["--json", "TMPDIR"], "is a directory"),
    (["--plot", "TMPDIR"], "is a directory"),
    (["--json", "/proc/ortcapture-bench.json"], "cannot be written"),  # os.access says yes to root here
])
def test_bench_bad_arguments_exit_2(tmp_path, capsys, extra, message):
    model = tmp_path / "affine.onnx"
    model.write_bytes(tiny.affine_model())
    extra = [str(tmp_path) if e == "TMPDIR" else str(tmp_path / e) if e.startswith("PLOT") else e for e in extra]
    if message is None:  # argparse's own refusal (choices)
        with pytest.raises(SystemExit) as exc:
            main(["bench", str(model), *extra])
        assert exc.value.code == 2
        return
    assert main(["bench", str(model), *extra]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["affine.onnx"]  # the writability check left no file


@pytest.mark.webgpu
def test_bench_sync_device_is_cuda_only(webgpu, tmp_path, capsys):
    model = tmp_path / "affine.onnx"
    model.write_bytes(tiny.affine_model())
    assert main(["bench", str(model), "--provider", "webgpu", "--sync", "device"]) == 2
    assert "--sync device is CUDA-only" in capsys.readouterr().err


@pytest.mark.cuda
def test_bench_cuda_sync_device_with_provider_option(tmp_path, capsys):
    from tests.conftest import cuda_available

    if not cuda_available():
        pytest.skip("CUDA EP unavailable (onnxruntime-gpu on an NVIDIA GPU)")
    model = tmp_path / "dynamic.onnx"
    model.write_bytes(tiny.dynamic_model())
    out_json = tmp_path / "bench.json"
    rc = main(["bench", str(model), "--provider", "cuda", "--batch", "1,2", "--procs", "2", "--iters", "20",
               "--sync", "device", "--provider-option", "prefer_nhwc=1", "--json", str(out_json),
               "--intra-op-threads", "1", "--pin-thread"])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out_json.read_text())
    assert res["sync"] == "device" and res["provider_options"] == {"prefer_nhwc": "1"} and res["ok"]
    assert res["intra_op_threads"] == 1 and all(isinstance(p["pinned_cpu"], int)
                                                for e in res["batches"] for p in e["processes"])
    for entry in res["batches"]:
        assert entry["verified"] and all(p["ep"] == "CUDAExecutionProvider" for p in entry["processes"])
        assert all(d <= entry["tolerance"] for d in entry["max_abs_diff"].values())
    assert "cudaDeviceSynchronize" in text
    # an option ORT does not know fails in the worker with ORT's own message, exit 2
    assert main(["bench", str(model), "--provider", "cuda", "--procs", "1", "--iters", "2",
                 "--provider-option", "no_such_option=1"]) == 2


def test_bench_missing_model_exit_2(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "missing.onnx")]) == 2
    assert "no such model" in capsys.readouterr().err


def test_bench_no_cuda_exit_2(tmp_path, capsys):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("the CUDA EP is available here")
    model = tmp_path / "affine.onnx"
    model.write_bytes(tiny.affine_model())
    assert main(["bench", str(model), "--provider", "cuda"]) == 2
    assert "CUDA EP is not available" in capsys.readouterr().err


def test_worker_failure_is_reported():
    seen = []
    res, tail = bench._run_worker(
        [sys.executable, "-c", f"import sys; print({bench._PROGRESS!r}, 1, 3, 'warm-up', file=sys.stderr); "
                               "print('boom', file=sys.stderr); sys.exit(3)"],
        lambda done, phase: seen.append((done, phase)))
    assert res["ok"] is False and "exit code 3" in res["error"]
    assert seen == [(1, "warm-up")] and "boom" in tail
    res, _ = bench._run_worker([sys.executable, "-c", "import os; os.abort()"], lambda *a: None)
    assert res["ok"] is False and "signal" in res["error"]
    res, _ = bench._run_worker([sys.executable, "-c", "print('{\"ok\": false, \"error\": \"E\"}'); exit(1)"],
                               lambda *a: None)
    assert res == {"ok": False, "error": "E"}


def test_stats_speedups_and_overhead():
    def worker(scale):
        base = {"plain": 400.0, "iobinding": 300.0, "raw_capture": 100.0, "captured_ortvalue": 101.0,
                "captured_numpy": 200.0}
        return {"samples_us": {a: list(v * scale + np.arange(5.0)) for a, v in base.items()}}

    out = bench._stats([worker(1.0), worker(1.0)])
    st = out["stats"]
    assert st["raw_capture"]["p50_us"] == 102.0 and st["raw_capture"]["min_us"] == 100.0
    assert st["raw_capture"]["n"] == 10 and st["raw_capture"]["p50_per_process_us"] == [102.0, 102.0]
    assert out["speedup"]["captured_vs_iobinding"] == pytest.approx(302 / 103)
    assert out["speedup"]["captured_numpy_vs_plain"] == pytest.approx(402 / 202)
    assert out["overhead"]["ortcapture_over_raw"] == pytest.approx(103 / 102)
    assert out["overhead"]["ortcapture_minus_raw_us"] == pytest.approx(1.0)
    assert out["overhead"]["ortcapture_over_raw_per_process"] == pytest.approx([103 / 102] * 2)


def test_stats_paired_overhead():
    """Paired samples where the second call of a pair is 20 µs slower and ortcapture costs 3 µs more."""
    n = 41
    raw, ours = np.full(n, 100.0), np.full(n, 103.0)
    raw[1::2] += 20
    ours[0::2] += 20
    w = {"samples_us": {a: [100.0, 101.0] for a in bench.ARMS},
         "paired_us": {"raw_capture": list(raw), "captured_ortvalue": list(ours)}}
    pa = bench._stats([w, w])["overhead"]["paired"]
    assert pa["ortcapture_minus_raw_per_process_us"] == pytest.approx([3.0, 3.0])
    assert pa["ortcapture_minus_raw_us"] == pytest.approx(3.0)
    assert pa["raw_p50_us"] == pytest.approx(float(np.median(raw)))


def test_bench_writability_check_keeps_links_and_existing_files(tmp_path, capsys):
    """The --json/--plot check before the run never follows a link to make a file, never removes a link, and leaves
    an existing file as it was (a review's report)."""
    model = tmp_path / "affine.onnx"
    model.write_bytes(tiny.affine_model())
    target = tmp_path / "results" / "run.json"
    target.parent.mkdir()
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    for out in (link, kept):  # exit 2 at the --plot check, after the --json one
        assert main(["bench", str(model), "--json", str(out), "--plot", str(tmp_path / "x.txt")]) == 2
    assert link.is_symlink() and not target.exists() and kept.read_text() == "old"
