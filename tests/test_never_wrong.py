"""Issue 15: never silently wrong — verify= at capture, int64 on WebGPU, host-read inputs, partly written outputs,
copy-only kernels, and doctor naming each kind. WebGPU runs here (software adapter); CUDA parts are marked cuda.

"Never silently wrong" on a backend where a kind may or may not show (CUDA): the capture is refused with the kind,
or its replays are right on fresh inputs — both are asserted as alternatives, never skipped.
"""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortcapture
from ortcapture._verify import model_checks as _model_checks
from ortcapture._verify.compare import VerificationError
from ortcapture.errors import BindingError, CaptureError, CaptureUnsupportedError, TransferError
from tests.conftest import Backend, webgpu_available
from tests.tiny import _model, recurrent_model, recurrent_step, vi


@pytest.fixture
def webgpu() -> Backend:
    webgpu_available()
    return Backend("webgpu")


# -- models ---------------------------------------------------------------------------------------------------
def max1_model() -> bytes:
    """m = Max(X) (single input: a copy); Y = m + 1."""
    one = numpy_helper.from_array(np.ones((2, 4), np.float32), "one")
    return _model([helper.make_node("Max", ["X"], ["m"], name="copy_max"), helper.make_node("Add", ["m", "one"], ["Y"])],
                  [vi("X", [2, 4])], [vi("Y", [2, 4])], [one])


def scatter_model(then_add: bool = False) -> bytes:
    """Y = ScatterND(D, [[0]], U) (data a graph input); ``then_add``: Y = that + 1 (the scatter feeds a node)."""
    idx = numpy_helper.from_array(np.array([[0]], np.int64), "idx")
    one = numpy_helper.from_array(np.ones((3, 4), np.float32), "one")
    nodes = [helper.make_node("ScatterND", ["D", "idx", "U"], ["s" if then_add else "Y"], name="scatter")]
    if then_add:
        nodes.append(helper.make_node("Add", ["s", "one"], ["Y"]))
    return _model(nodes, [vi("D", [3, 4]), vi("U", [1, 4])], [vi("Y", [3, 4])], [idx, one])


def kv_cache_model() -> bytes:
    """A static KV cache: cache_out = ScatterND(cache_in, pos, row); y = row * 2."""
    two = numpy_helper.from_array(np.full((1, 4), 2.0, np.float32), "two")
    nodes = [helper.make_node("ScatterND", ["cache_in", "pos", "row"], ["cache_out"], name="kv_write"),
             helper.make_node("Mul", ["row", "two"], ["y"])]
    return _model(nodes, [vi("cache_in", [3, 4]), vi("pos", [1, 1], TensorProto.INT64), vi("row", [1, 4])],
                  [vi("cache_out", [3, 4]), vi("y", [1, 4])], [two])


def int64_sub_model(dims=(4,)) -> bytes:
    """Y = X - 1 on int64 (int64 arithmetic)."""
    one = numpy_helper.from_array(np.array(1, np.int64), "one")
    return _model([helper.make_node("Sub", ["X", "one"], ["Y"], name="minus_one")], [vi("X", list(dims), TensorProto.INT64)],
                  [vi("Y", list(dims), TensorProto.INT64)], [one])


def gather_model() -> bytes:
    """Y = Gather(table, ids): int64 ids only read."""
    table = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table")
    return _model([helper.make_node("Gather", ["table", "ids"], ["Y"])], [vi("ids", [3], TensorProto.INT64)],
                  [vi("Y", [3, 4])], [table])


def reshape_model() -> bytes:
    """Y = Relu(Reshape(X, shp)): ``shp`` is read on the host."""
    return _model([helper.make_node("Reshape", ["X", "shp"], ["r"]), helper.make_node("Relu", ["r"], ["Y"])],
                  [vi("X", [2, 4]), vi("shp", [2], TensorProto.INT64)], [vi("Y", ["a", "b"])])


# -- item 1: verify= ------------------------------------------------------------------------------------------
def test_verify_restores_example_inputs_state_and_outputs(backend, rng):
    sess = backend.session(recurrent_model())
    x0, s0 = rng.random((1, 8), np.float32), rng.random((1, 8), np.float32)
    g = sess.capture({"x": x0, "state_in": s0}, state={"state_out": "state_in"})  # verify="full" by default
    assert g.replays == 0  # verification replays are not counted
    rep = g.verification
    assert rep.level == "full" and rep.input_sets == ["example", "varied"] and rep.not_varied == []
    assert set(rep.max_error) == {"y", "state_out"} and rep.seconds > 0
    np.testing.assert_array_equal(ortcapture.to_numpy(g.inputs["x"]), x0)
    np.testing.assert_array_equal(ortcapture.to_numpy(g.inputs["state_in"]), s0)
    y0, st0 = recurrent_step(x0, s0)
    np.testing.assert_allclose(ortcapture.to_numpy(g.outputs["y"]), y0, rtol=1e-5, atol=1e-6)  # no sentinel
    np.testing.assert_allclose(ortcapture.to_numpy(g.outputs["state_out"]), st0, rtol=1e-5, atol=1e-6)
    state = s0
    for _ in range(3):  # state starts at the example, not at a verification input
        y, _ = g.run({"x": x0})
        want, state = recurrent_step(x0, state)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    g.release()


def test_verify_false_skips_and_full_refuses_copy_only_max(webgpu):
    x0 = np.zeros((2, 4), np.float32)
    with pytest.raises(VerificationError) as ei:
        webgpu.session(max1_model()).capture({"X": x0})
    assert ei.value.kind == "copy_only_kernel" and ei.value.input_set == "varied"
    assert "Max 'copy_max'" in str(ei.value) and ei.value.nodes == ["Max 'copy_max'"]
    # example level: the same example matches, so it passes — and is wrong on other inputs (why "full" is default)
    g = webgpu.session(max1_model()).capture({"X": x0}, verify="example")
    (y,) = g.run({"X": np.full((2, 4), 5, np.float32)})
    assert np.all(y == 1.0)  # ORT's copy-only kernel is not replayed: the capture-time value
    g.release()
    # the session-level default
    g = webgpu.session(max1_model(), verify=False).capture({"X": x0})
    g.release()
    with pytest.raises(CaptureError, match="verify must be"):
        webgpu.session(max1_model(), verify="sometimes")


@pytest.mark.cuda
def test_cuda_copy_only_max_refused_or_right(backend, rng):
    if backend.name != "cuda":
        pytest.skip("the CUDA half of the copy-only test")
    sess = backend.session(max1_model())
    try:
        g = sess.capture({"X": np.zeros((2, 4), np.float32)})
    except VerificationError as exc:
        assert exc.kind == "copy_only_kernel" and "copy_max" in str(exc)
        return
    x = rng.random((2, 4), np.float32)
    np.testing.assert_array_equal(g.run({"X": x})[0], x + 1)
    g.release()


def test_scatter_feeding_a_node_is_named(webgpu, rng):
    sess = webgpu.session(scatter_model(then_add=True))
    with pytest.raises(VerificationError) as ei:
        sess.capture({"D": rng.random((3, 4), np.float32), "U": rng.random((1, 4), np.float32)})
    assert ei.value.kind == "copy_only_kernel" and "ScatterND 'scatter'" in ei.value.nodes


# -- item 4: partly written outputs ---------------------------------------------------------------------------
def test_scatternd_output_written_in_part_is_refused(backend, rng):
    sess = backend.session(scatter_model())
    feeds = {"D": rng.random((3, 4), np.float32), "U": rng.random((1, 4), np.float32)}
    try:
        g = sess.capture(feeds, verify=False)  # the sentinel check alone
    except CaptureError as exc:
        assert exc.kind == "partly_written_output" and exc.outputs == ["Y"] and "'Y'" in str(exc)
        return
    assert backend.name == "cuda", "WebGPU must refuse (measured: rows 1..2 keep the sentinel fill)"
    d, u = rng.random((3, 4), np.float32), rng.random((1, 4), np.float32)
    want = d.copy()
    want[0] = u[0]
    np.testing.assert_array_equal(g.run({"D": d, "U": u})[0], want)
    g.release()


def test_static_kv_cache_with_state_is_refused(backend, rng):
    sess = backend.session(kv_cache_model())
    feeds = {"cache_in": np.zeros((3, 4), np.float32), "pos": np.array([[0]], np.int64),
             "row": rng.random((1, 4), np.float32)}
    try:
        g = sess.capture(feeds, state={"cache_out": "cache_in"})
    except CaptureError as exc:
        assert getattr(exc, "kind", None) in ("partly_written_output", "copy_only_kernel", "varied")
        assert "cache_out" in str(exc)
        return
    assert backend.name == "cuda", "WebGPU must refuse"
    rows = [rng.random((1, 4), np.float32) for _ in range(2)]
    g.run({"pos": np.array([[0]], np.int64), "row": rows[0]})
    g.reset_state({"cache_in": np.full((3, 4), 7.0, np.float32)})
    g.run({"pos": np.array([[1]], np.int64), "row": rows[1]})
    want = np.full((3, 4), 7.0, np.float32)
    want[1] = rows[1][0]
    np.testing.assert_array_equal(ortcapture.to_numpy(g.inputs["cache_in"]), want)
    g.release()


def test_sentinel_second_pattern_keeps_real_values(backend):
    """An output whose real value equals the first pattern in some elements is not refused."""
    pattern = np.full(4, 0xA5, np.uint8).view(np.float32)[0]
    sess = backend.session(_model([helper.make_node("Mul", ["X", "one"], ["Y"])], [vi("X", [2, 4])], [vi("Y", [2, 4])],
                                  [numpy_helper.from_array(np.ones((2, 4), np.float32), "one")]))
    x = np.ones((2, 4), np.float32)
    x[0, 0] = pattern
    g = sess.capture({"X": x})
    np.testing.assert_array_equal(g.run({"X": x})[0], x)
    g.release()


# -- item 2: int64 on WebGPU ----------------------------------------------------------------------------------
def test_int64_arithmetic_refused_on_webgpu_unless_allowed(webgpu):
    with pytest.raises(CaptureUnsupportedError, match="Sub 'minus_one'") as ei:
        webgpu.session(int64_sub_model())
    assert ei.value.kind == "int64_as_int32" and ei.value.nodes == ["Sub 'minus_one'"]
    with pytest.raises(CaptureUnsupportedError, match="minus_one"):  # dynamic dims: refused before any sibling
        webgpu.session(int64_sub_model(dims=("n",)))
    sess = webgpu.session(int64_sub_model(), allow_int64_as_int32=True)
    x = np.array([3, -5, 2**30, 0], np.int64)
    g = sess.capture({"X": x})
    np.testing.assert_array_equal(g.run({"X": x})[0], x - 1)
    big = np.array([3000000000, -5000000000, 2**40, 0], np.int64)
    with pytest.raises(TransferError, match="outside the int32 range"):
        g.run({"X": big})
    with pytest.raises(TransferError, match="outside the int32 range"):
        ortcapture.update_inplace(g.inputs["X"], big)
    np.testing.assert_array_equal(ortcapture.to_numpy(g.inputs["X"]), x)  # refused before any copy
    g.release()


def test_int64_only_read_captures_and_is_range_checked(webgpu):
    sess = webgpu.session(gather_model())
    g = sess.capture({"ids": np.array([0, 3, 9], np.int64)})
    (y,) = g.run({"ids": np.array([1, 2, 3], np.int64)})
    np.testing.assert_array_equal(y, np.arange(40, dtype=np.float32).reshape(10, 4)[[1, 2, 3]])
    with pytest.raises(TransferError, match="int32 range"):
        g.run({"ids": np.array([1, 2, 2**32 + 3], np.int64)})
    g.release()


def test_int64_analysis():
    assert _model_checks.int64_arithmetic_nodes(onnx.load_from_string(int64_sub_model())) == ["Sub 'minus_one'"]
    assert _model_checks.int64_arithmetic_nodes(onnx.load_from_string(gather_model())) == []
    # shape arithmetic (Shape -> Gather -> Mul -> Reshape) is not flagged
    c = numpy_helper.from_array(np.array([2], np.int64), "c")
    i0 = numpy_helper.from_array(np.array(0, np.int64), "i0")
    m = onnx.load_from_string(_model([
        helper.make_node("Shape", ["X"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["d"]),
        helper.make_node("Unsqueeze", ["d", "zero"], ["d1"]), helper.make_node("Mul", ["d1", "c"], ["n"]),
        helper.make_node("Concat", ["n"], ["shp"], axis=0), helper.make_node("Reshape", ["X", "shp"], ["Y"])],
        [vi("X", ["a", 2])], [vi("Y", None)] if False else [vi("Y", ["b"])],
        [c, i0, numpy_helper.from_array(np.array([0], np.int64), "zero")]))
    assert _model_checks.int64_arithmetic_nodes(m) == []


def _where_model(big, as_constant: bool = False, slice_ends: bool = False) -> bytes:
    """Y = Where(B, BIG, X) over int64 (BIG an initializer or a Constant node); ``slice_ends``: also Z = X[0:INT64_MAX]
    (an int64 beyond int32 that ORT reads on the host)."""
    nodes = [helper.make_node("Where", ["B", "BIG", "X"], ["Y"])]
    inits = []
    if as_constant:
        nodes.insert(0, helper.make_node("Constant", [], ["BIG"], name="big", value=numpy_helper.from_array(
            np.array(big, np.int64))))
    else:
        inits.append(numpy_helper.from_array(np.array(big, np.int64), "BIG"))
    outs = [vi("Y", [3], TensorProto.INT64)]
    ins = [vi("B", [3], TensorProto.BOOL), vi("X", [3], TensorProto.INT64)]
    if slice_ends:
        inits += [numpy_helper.from_array(np.array([1], np.int64), "s0"),
                  numpy_helper.from_array(np.array([2**63 - 1], np.int64), "s1")]
        nodes.append(helper.make_node("Slice", ["F", "s0", "s1"], ["Z"]))
        ins.append(vi("F", [3]))
        outs.append(vi("Z", [2]))
    return _model(nodes, ins, outs, inits)


def test_int64_constants_beyond_int32_read_as_data_are_refused_on_webgpu(webgpu):
    """ORT's WebGPU EP under enableGraphCapture=1 kept the low 32 bits of an int64 initializer read by Where
    (5000000000 -> 705032704, captured and gpu_graph_id=-1 alike) and the capture check compared it with the same
    wrong value: refused at construction, naming the constant and its reader; a Slice end of INT64_MAX (read on the
    host) is not."""
    big = [5_000_000_000, -3_000_000_000, 7]
    for as_constant in (False, True):
        with pytest.raises(CaptureUnsupportedError, match=r"\(e\.g\. -3000000000\) read by Where .*beyond the int32 range") as ei:
            webgpu.session(_where_model(big, as_constant))
        assert ei.value.kind == "int64_as_int32"
    feeds = {"B": np.array([True, True, False]), "X": np.array([1, 2, 3], np.int64),
             "F": np.array([1.0, 2.0, 3.0], np.float32)}
    sess = webgpu.session(_where_model([5, -3, 7], slice_ends=True))  # within int32, and a host-read INT64_MAX
    g = sess.capture(feeds)
    y, z = g.run(feeds)
    np.testing.assert_array_equal(y, [5, -3, 3])
    np.testing.assert_array_equal(z, [2.0, 3.0])
    g.release()
    webgpu.session(_where_model(big), allow_int64_as_int32=True)  # the caller's promise


def test_int64_wide_constant_analysis():
    m = onnx.load_from_string(_where_model([5_000_000_000, 1, 2]))
    assert _model_checks.int64_wide_constants(m) == [
        "initializer 'BIG' (e.g. 5000000000) read by Where (unnamed, output 'Y')"]
    m = onnx.load_from_string(_where_model([1, -3_000_000_000, 2], as_constant=True, slice_ends=True))
    assert _model_checks.int64_wide_constants(m) == [
        "Constant 'big''s value (e.g. -3000000000) read by Where (unnamed, output 'Y')"]
    assert _model_checks.int64_wide_constants(onnx.load_from_string(_where_model([1, 2, 3], slice_ends=True))) == []
    # a scripted while-loop's trip count of INT64_MAX is read on the host
    body = helper.make_graph([helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Add", ["v", "v"],
                                                                                            ["v_out"])], "body",
                             [vi("i", [], TensorProto.INT64), vi("c", [], TensorProto.BOOL), vi("v", [3])],
                             [vi("c_out", [], TensorProto.BOOL), vi("v_out", [3])])
    loop = _model([helper.make_node("Loop", ["M", "cond", "X"], ["Y"], body=body)],
                  [vi("X", [3]), vi("cond", [], TensorProto.BOOL)], [vi("Y", [3])],
                  [numpy_helper.from_array(np.array(2**63 - 1, np.int64), "M")], check=False)
    assert _model_checks.int64_wide_constants(onnx.load_from_string(loop)) == []


@pytest.mark.slow
def test_reference_model_has_no_int64_arithmetic_and_captures_verified(webgpu, reference_model_path, rng):
    model = onnx.load(reference_model_path)
    assert any(n.op_type in ("Range", "Gather", "Shape") for n in model.graph.node)
    assert _model_checks.int64_arithmetic_nodes(model) == []
    sess = webgpu.session(reference_model_path)
    x = rng.random((1, 3, 320, 320), np.float32)
    with sess.capture({"images": x}, verify="full") as g:
        np.testing.assert_array_equal(ortcapture.to_numpy(g.inputs["images"]), x)


# -- item 3: host-read inputs ---------------------------------------------------------------------------------
def test_host_read_input_is_a_checked_constant(backend, rng):
    sess = backend.session(reshape_model())
    if not hasattr(sess, "get_input_memory_infos"):
        pytest.skip("this onnxruntime has no get_input_memory_infos")
    from ortcapture._ort.specialize import host_read_inputs

    assert host_read_inputs(sess) == {"shp"}
    x = rng.standard_normal((2, 4)).astype(np.float32)
    g = sess.capture({"X": x, "shp": np.array([4, 2], np.int64)})  # full verify: shp is never varied
    assert g.frozen_inputs.keys() == {"shp"} and "shp" in g.verification.not_varied
    x2 = rng.standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_array_equal(g.run({"X": x2, "shp": np.array([4, 2], np.int64)})[0],
                                  np.maximum(x2.reshape(4, 2), 0))
    with pytest.raises(CaptureError, match="'shp'") as ei:
        g.run({"X": x2, "shp": np.array([8, 1], np.int64)})
    assert ei.value.kind == "host_read_input"
    # written into its fixed buffer outside run(): replay() and run() without it refuse too (a tester's Clip bound
    # written with update_inplace was silently kept at its capture-time value)
    ortcapture.update_inplace(g.inputs["shp"], np.array([8, 1], np.int64))
    for call in (g.replay, lambda: g.run({"X": x2})):
        with pytest.raises(CaptureError, match="finds in its fixed buffer") as ei:
            call()
        assert ei.value.kind == "host_read_input"
    ortcapture.update_inplace(g.inputs["shp"], np.array([4, 2], np.int64))  # the capture's value again: runs
    np.testing.assert_array_equal(g.run({"X": x2})[0], np.maximum(x2.reshape(4, 2), 0))
    g.release()


def test_raw_path_refuses_device_binding_of_host_read_input(backend):
    sess = backend.session(reshape_model())
    if not hasattr(sess, "get_input_memory_infos"):
        pytest.skip("this onnxruntime has no get_input_memory_infos")
    X, Y, S = sess.allocate((2, 4), np.float32), sess.allocate((4, 2), np.float32), sess.allocate((2,), np.int64)
    io = sess.io_binding()
    io.bind_ortvalue_input("X", X)
    io.bind_ortvalue_input("shp", S)
    io.bind_ortvalue_output("Y", Y)
    with pytest.raises(BindingError, match="'shp' is read by ORT in host memory"):
        sess.run_with_iobinding(io, ortcapture.run_options_for(1))
    # a host OrtValue can be changed in place after capture: refused the same way
    io2 = sess.io_binding()
    io2.bind_ortvalue_input("X", X)
    io2.bind_ortvalue_input("shp", ort.OrtValue.ortvalue_from_numpy(np.array([4, 2], np.int64)))
    io2.bind_ortvalue_output("Y", Y)
    with pytest.raises(BindingError, match="'shp' is read by ORT in host memory"):
        sess.run_with_iobinding(io2, ortcapture.run_options_for(2))
    # bind_cpu_input passes ortcapture's check (ORT's WebGPU EP then refuses any host input itself)
    io3 = sess.io_binding()
    io3.bind_ortvalue_input("X", X)
    io3.bind_cpu_input("shp", np.array([4, 2], np.int64))
    io3.bind_ortvalue_output("Y", Y)
    try:
        sess.run_with_iobinding(io3, ortcapture.run_options_for(3))
    except BindingError as exc:
        assert "'shp'" not in str(exc)
    except Exception:  # noqa: BLE001 - ORT's own WebGPU guard (host OrtValue under capture)
        assert backend.name == "webgpu"


@pytest.mark.cuda
def test_cuda_raw_path_accepts_bind_cpu_input_for_host_read_input(backend, rng):
    if backend.name != "cuda":
        pytest.skip("ORT's WebGPU EP accepts only device buffers under capture")
    sess = backend.session(reshape_model())
    X, Y = sess.allocate((2, 4), np.float32), sess.allocate((4, 2), np.float32)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    ortcapture.update_inplace(X, x)
    io = sess.io_binding()
    io.bind_ortvalue_input("X", X)
    shp = np.array([4, 2], np.int64)
    io.bind_cpu_input("shp", shp)
    io.bind_ortvalue_output("Y", Y)
    try:
        sess.run_with_iobinding(io, ortcapture.run_options_for(1))  # ortcapture accepts it for a host-read input
    except BindingError:
        raise
    except Exception as exc:  # noqa: BLE001 - ORT's own refusal of a host input under capture is not ours
        pytest.fail(f"onnxruntime refused a host-read input bound with bind_cpu_input under capture: {exc}")
    np.testing.assert_array_equal(ortcapture.to_numpy(Y), np.maximum(x.reshape(4, 2), 0))
    x2 = rng.standard_normal((2, 4)).astype(np.float32)
    ortcapture.update_inplace(X, x2)
    sess.run_with_iobinding(io, ortcapture.run_options_for(1))
    np.testing.assert_array_equal(ortcapture.to_numpy(Y), np.maximum(x2.reshape(4, 2), 0))
    shp[:] = [8, 1]  # bind_cpu_input may wrap the array: a change in place is refused, not silently ignored
    with pytest.raises(CaptureError, match="'shp'"):
        sess.run_with_iobinding(io, ortcapture.run_options_for(1))


def test_dropin_host_read_values_are_right(backend, rng):
    with ortcapture.patched(backend.name):
        sess = ort.InferenceSession(reshape_model())
        x = rng.standard_normal((2, 4)).astype(np.float32)
        for shp in ([4, 2], [8, 1], [4, 2]):
            (y,) = sess.run(None, {"X": x, "shp": np.array(shp, np.int64)})
            np.testing.assert_array_equal(y, np.maximum(x.reshape(shp), 0))
    assert sess.stats["replayed"] + sess.stats["uncaptured"] == 3


def test_dropin_verifies_and_runs_copy_only_model_uncaptured(webgpu, rng):
    with ortcapture.patched("webgpu"):
        sess = ort.InferenceSession(max1_model())
        with pytest.warns(RuntimeWarning, match="copy_max"):
            for _ in range(2):
                x = rng.random((2, 4), np.float32)
                np.testing.assert_array_equal(sess.run(None, {"X": x})[0], x + 1)
    assert sess.stats["uncaptured"] == 2 and sess.stats["captured"] == 0


# -- item 6: doctor -------------------------------------------------------------------------------------------
def _doctor(capsys, tmp_path, name, model, *extra):
    from ortcapture import cli

    path = tmp_path / f"{name}.onnx"
    path.write_bytes(model)
    code = cli.main(["doctor", str(path), "--provider", "webgpu", "--json", *extra])
    report = json.loads(capsys.readouterr().out)
    return code, report


@pytest.mark.parametrize("name,model,kind,named", [
    ("max1", max1_model(), "copy_only_kernel", "copy_max"),
    ("scatter", scatter_model(), "partly_written_output", "Y"),
    ("int64", int64_sub_model(), "int64_as_int32", "minus_one"),
])
def test_doctor_names_each_kind_with_fix(webgpu, capsys, tmp_path, name, model, kind, named):
    code, report = _doctor(capsys, tmp_path, name, model)
    assert code == 1 and report["verdict"] == "not capturable"
    found = [f for f in report["findings"] if f["kind"] == kind]
    assert found and found[0]["severity"] == "error" and found[0]["fix"], report["findings"]
    assert named in found[0]["message"]


def test_doctor_int64_probe_beyond_int32(webgpu, capsys, tmp_path):
    """An int64 pass-through computed as Cast(int64 -> float): a read, not arithmetic; the probe with values beyond
    int32 shows the capture-enabled session reads only the low 32 bits."""
    m = _model([helper.make_node("Cast", ["X"], ["Y"], to=TensorProto.FLOAT)], [vi("X", [4], TensorProto.INT64)],
               [vi("Y", [4])])
    code, report = _doctor(capsys, tmp_path, "cast", m)
    found = [f for f in report["findings"] if f["kind"] == "int64_as_int32"]
    assert found and found[0]["severity"] == "warning" and found[0]["fix"], report["findings"]
    assert "['X']" in found[0]["message"] and not found[0]["details"].get("overruled_by_capture")


def test_doctor_reports_host_read_inputs(webgpu, capsys, tmp_path):
    m = _model([helper.make_node("Clip", ["X", "lo"], ["Y"])], [vi("X", [4]), vi("lo", [])], [vi("Y", [4])])
    code, report = _doctor(capsys, tmp_path, "clip", m)
    found = [f for f in report["findings"] if f["kind"] == "host_read_input"]
    assert found and found[0]["details"]["inputs"] == ["lo"] and found[0]["fix"], report["findings"]
    assert code == 0 and report["capture"]["outcome"] == "captured", report["capture"]


# -- uncaptured runs of a device session: what ORT crashes on or gets wrong (found by a tester) --------------------
_NONE_FEEDS = """
import sys, threading, warnings
import numpy as np, onnxruntime as ort, ortcapture
from onnx import TensorProto, helper, numpy_helper
from tests import tiny
warnings.simplefilter("ignore")
opts = ortcapture.webgpu.session_options(capture=True)
buckets = ortcapture.InferenceSession(tiny.dynamic_model(), opts, buckets={"batch": [1, 2]})
plain = ortcapture.InferenceSession(tiny.affine_model(), opts)
with ortcapture.patched("webgpu"):
    dropin = ort.InferenceSession(tiny.affine_model())
done = threading.Event()
for call in (lambda: buckets.run(None, {"X": None}), lambda: dropin.run(None, {"X": None}),
             lambda: plain.run(None, {"X": None}, ortcapture.run_options_for(-1)),
             lambda: plain.run_async(None, {"X": None}, lambda *a: done.set(), None, ortcapture.run_options_for(-1))):
    try:
        call()
        print("RAN")
    except ValueError as exc:
        print("ValueError", "missing" in str(exc))
# an input with an initializer as its default: None leaves it out, as ORT's run on the CPU EP does
g = helper.make_graph([helper.make_node("Add", ["x", "b"], ["y"])], "g",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                       helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                      initializer=[numpy_helper.from_array(np.array([10, 20], np.float32), "b")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
x = np.array([1, 2], np.float32)
for s in (ortcapture.InferenceSession(m, opts), ortcapture.InferenceSession(m, providers=["CPUExecutionProvider"])):
    print("DEFAULT", s.run(None, {"x": x, "b": None}, ortcapture.run_options_for(-1))[0].tolist())
"""


def test_a_none_feed_is_left_out_as_ort_does_never_a_segfault(webgpu):
    """``{"X": None}`` segfaulted ORT's WebGPU EP (exit 139) in a bucket session, the drop-in, ``gpu_graph_id=-1``
    runs and ``run_async`` (a tester). ORT's Python run skips a None feed on the CPU EP: an input with an initializer
    keeps its default, a required one gets ORT's "missing" error — so ortcapture leaves None feeds out before ORT,
    on every EP (a reviewer: raising instead broke the initializer-default case). In a child process: a crash fails
    the test, not the run."""
    from tests.children import run_python

    proc = run_python(_NONE_FEEDS, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-1500:])
    lines = proc.stdout.split("\n")
    assert lines[:6] == ["ValueError True"] * 4 + ["DEFAULT [11.0, 22.0]"] * 2, proc.stdout


def _cast_model() -> bytes:
    return _model([helper.make_node("Cast", ["X"], ["Y"], to=TensorProto.FLOAT)],
                  [vi("X", ["n", 1], TensorProto.INT64)], [vi("Y", ["n", 1])])


def test_uncaptured_webgpu_runs_refuse_int64_past_int32_and_read_big_endian_right(webgpu):
    """int64 values outside int32 came back cut to 32 bits on the uncaptured WebGPU paths (a bucket session's
    oversize request, ``gpu_graph_id=-1``, the drop-in past ``max_graphs``) while the captured paths refuse them
    (issue 15): refused alike now, as an array, an array subclass or a list. Inputs ORT reads on the host keep their
    values (a Slice end of INT64_MAX is right: a reviewer). A big-endian feed (``>f4``, a subclass too) was read as
    native bytes (wrong values, as raw ORT does): it is sent in native order."""
    model = _cast_model()
    sess = webgpu.session(model, buckets={"n": [1, 2]})
    big = np.full((9, 1), 2**33 + 5, np.int64)  # 9 rows: beyond the largest bucket, run uncaptured
    with pytest.raises(TransferError, match="input 'X': int64 value 8589934597 is outside the int32 range"):
        sess.run(None, {"X": big})
    np.testing.assert_array_equal(sess.run(None, {"X": np.full((9, 1), 7, np.int64)})[0], np.full((9, 1), 7.0))
    plain = webgpu.session(model)
    sub = type("Sub", (np.ndarray,), {})
    for feed in (big[:2], big[:2].view(sub), big[:2].tolist()):
        with pytest.raises(TransferError, match="outside the int32 range"):
            plain.run(None, {"X": feed}, ortcapture.run_options_for(-1))

    sliced = _model([helper.make_node("Slice", ["X", "S", "E"], ["Y"])],
                    [vi("X", [2, 4]), vi("S", [1], TensorProto.INT64), vi("E", [1], TensorProto.INT64)],
                    [vi("Y", ["m", 4])])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    feeds = {"X": x, "S": np.array([1], np.int64), "E": np.array([np.iinfo(np.int64).max], np.int64)}
    got = webgpu.session(sliced).run(None, feeds, ortcapture.run_options_for(-1))[0]
    np.testing.assert_array_equal(got, x[1:])  # Slice without axes: along axis 0

    from tests import tiny

    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    want = ort.InferenceSession(tiny.bucket_model(), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    for s, ro in ((webgpu.session(tiny.bucket_model(), buckets={"batch": [2, 4]}), None),
                  (webgpu.session(tiny.bucket_model()), ortcapture.run_options_for(-1))):
        for swapped in (x.astype(">f4"), x.astype(">f4").view(sub)):
            np.testing.assert_allclose(s.run(None, {"X": swapped}, ro)[0], want, rtol=1e-4, atol=1e-5)


def test_a_pointer_binding_ort_would_crash_on_is_refused_before_ort(webgpu):
    """``bind_input(..., buffer_ptr=0)`` segfaulted inside ORT's bind on WebGPU (a tester): a pointer that is not an
    int, negative, or 0 for a tensor with elements, or a negative dim, is a BindingError before ORT is called. An
    empty tensor's pointer may be 0 (torch's, CuPy's) and a numpy array as ``shape`` is taken, as ORT takes them (a
    reviewer)."""
    from tests import tiny

    b = webgpu.session(tiny.affine_model()).io_binding()
    for ptr, shape, words in [(0, [2, 4], "an int above 0"), (-8, [2, 4], "an int above 0"),
                              ("8", [2, 4], "an int above 0"), (1.5, [2, 4], "an int above 0"),
                              (True, [2, 4], "an int above 0"), (4096, [2, -4], "non-negative ints")]:
        with pytest.raises(BindingError, match=words):
            b.bind_input("X", "cpu", 0, np.float32, shape, ptr)
        with pytest.raises(BindingError, match=words):
            b.bind_output("Y", "cpu", 0, np.float32, shape, ptr)
    relu = _model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", ["n", 2])], [vi("y", ["n", 2])])
    cpu = ortcapture.InferenceSession(relu, providers=["CPUExecutionProvider"])
    b = cpu.io_binding()
    b.bind_input("x", "cpu", 0, np.float32, [0, 2], 0)
    b.bind_output("y", "cpu")
    cpu.run_with_iobinding(b)
    assert b.copy_outputs_to_cpu()[0].shape == (0, 2)
    x, y = np.array([[-1, 2], [3, -4]], np.float32), np.zeros((2, 2), np.float32)
    b = cpu.io_binding()
    b.bind_input("x", "cpu", 0, np.float32, np.array(x.shape), x.ctypes.data)
    b.bind_output("y", "cpu", 0, np.float32, np.array(y.shape), y.ctypes.data)
    cpu.run_with_iobinding(b)
    np.testing.assert_array_equal(y, np.maximum(x, 0))
