"""``ortcapture patch``: check, apply or revert ortcapture's native patches on an ONNX Runtime source tree.

What is guarded: source builds of ORT release lines 1.24-1.29, which lack two WebGPU fixes that upstream
ORT gained for 1.30:

* ORT #32317 - ``webgpu::DataTransfer::CanCopy`` claimed GPU memory of a foreign vendor (e.g. a CUDA
  buffer, vendor 0x10DE) and handed it to Dawn as a ``WGPUBuffer``;
* ORT #32315 - an exception thrown inside the ``noexcept`` C-ABI callback ``CopyTensorsImpl`` (aliased
  src/dst, undersized destination, mapped buffer) ended the process with ``std::terminate``.

The series for a tree is picked from its ``VERSION_NUMBER`` (``--series`` overrides). Every patch is
dry-run first (``git apply --check`` when ``--ort-src`` is the top of a git work tree, GNU
``patch --dry-run --fuzz=0`` otherwise) in both directions, so already-applied patches are recognised and
every command is idempotent. Changes are all or none: nothing is written unless every pending patch
checks cleanly, and a tool failure midway restores the files it touched.

A patch whose files already carry the upstream fix (a patch release that cherry-picked it) is
reported as ``fixed upstream`` and left alone.

Exit codes:

* 0 - ok: ``check`` found every patch applied or fixed upstream (or the release line needs none);
  ``apply``/``revert`` finished, or had nothing to do.
* 1 - ``check`` only: patches are pending (they apply cleanly; run ``apply``).
* 2 - usage error or refusal: no/unknown ``VERSION_NUMBER`` or series, sources that match neither the
  original nor the patched text (the message names the file and hunk), a missing tool, a tool failure.

This module never imports onnxruntime.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ortcapture.errors import PatchError

UPSTREAM_FIXED_FROM = (1, 30)  # first release line that carries ORT #32317 and #32315 itself
# text (any of) whose presence shows a file carries the fix: upstream's names, or this package's backport
UPSTREAM_MARKERS = {
    "onnxruntime/core/providers/webgpu/data_transfer.h": ("IsSupportedDevicePair",),
    "onnxruntime/core/providers/webgpu/webgpu_provider_factory.cc": ("CopyTensorsOrThrow",
                                                                     "Backport of ORT #32315"),
}
_FILE_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$")


def patches_root() -> Path:
    """The ``onnxruntime`` patch folder: the repository's ``patches/`` or the installed package data."""
    in_repo = Path(__file__).resolve().parents[2] / "patches" / "onnxruntime"
    if in_repo.is_dir():
        return in_repo
    spec = importlib.util.find_spec("ortcapture.patches")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "onnxruntime").is_dir():
            return Path(location) / "onnxruntime"
    raise PatchError("ortcapture's patch files are missing from this installation")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("check", "apply", "revert"),
                        help="check: report state (exit 1 if patches are pending); apply/revert: change the tree")
    parser.add_argument("--ort-src", required=True, type=Path, help="root of the ONNX Runtime source tree")
    parser.add_argument("--series", help="patch series (release line, e.g. 1.24) instead of VERSION_NUMBER's")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args.action, Path(args.ort_src), args.series)
    except PatchError as exc:
        print(f"ortcapture patch: {exc}", file=sys.stderr)
        return 2


def _run(action: str, src: Path, series: str | None) -> int:
    if not src.is_dir():
        raise PatchError(f"--ort-src {src} is not a directory")
    if series is not None and not re.fullmatch(r"\d+\.\d+", series):
        raise PatchError(f"--series {series!r} is not a release line such as 1.24")
    version = _read_version(src)
    line = series or ".".join(version.split(".")[:2])
    folder = patches_root() / line
    if series is None and not folder.is_dir() and _line_key(line) >= UPSTREAM_FIXED_FROM:
        return _check_upstream(src, version)
    if not folder.is_dir():
        known = ", ".join(sorted(p.name for p in patches_root().iterdir() if p.is_dir()))
        raise PatchError(f"no patch series for ORT {line} (VERSION_NUMBER {version}); known series: {known}")
    if series and not version.startswith(series + "."):
        print(f"note: --series {series} forced on a tree whose VERSION_NUMBER is {version}")
    patches = _load_series(folder)
    tool = _Tool(src)
    print(f"ORT source {src} (VERSION_NUMBER {version}): series {line}, {len(patches)} patches, using {tool.name}")
    state = {p: _classify(tool, p) for p in patches}
    for p, s in state.items():
        print(f"  {p.name}: {s}")
    drifted = [p for p, s in state.items() if s == "drifted"]
    if drifted:
        raise PatchError("refusing: the tree matches neither the original nor the patched text; no file was "
                         "changed.\n" + "\n".join(_diagnose(tool, p) for p in drifted))
    if action == "check":
        pending = [p.name for p, s in state.items() if s == "pending"]
        if pending:
            print(f"{len(pending)} patch(es) pending; run: ortcapture patch apply --ort-src {src}")
            return 1
        print("nothing pending: every patch is applied or fixed upstream")
        return 0
    reverse = action == "revert"
    todo = [p for p in (reversed(patches) if reverse else patches)
            if state[p] == ("applied" if reverse else "pending")]
    if not todo:
        print("nothing to revert" if reverse else "already applied; nothing to do")
        return 0
    _apply_all_or_none(tool, src, todo, reverse)
    print(f"{'reverted' if reverse else 'applied'}: " + ", ".join(p.name for p in todo))
    return 0


def _read_version(src: Path) -> str:
    path = src / "VERSION_NUMBER"
    if not path.is_file():
        raise PatchError(f"{path} not found: --ort-src must be the root of an ONNX Runtime source tree")
    version = path.read_text(encoding="utf-8").strip()
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", version):
        raise PatchError(f"unrecognised VERSION_NUMBER {version!r} in {path}")
    return version


def _line_key(line: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in line.split("."))
    except ValueError:
        return ()


def _check_upstream(src: Path, version: str) -> int:
    for rel, markers in UPSTREAM_MARKERS.items():
        if not _has_fix(src, rel):
            raise PatchError(f"ORT {version} should carry ORT #32317/#32315 upstream, but {rel} lacks "
                             f"{' / '.join(markers)}; no series targets this tree (a pre-release main checkout?)")
    print(f"ORT {version}: upstream already carries ORT #32317 and #32315; no patches needed")
    return 0


def _load_series(folder: Path) -> list[Path]:
    names = [ln.strip() for ln in (folder / "series").read_text(encoding="utf-8").splitlines()]
    patches = [folder / n for n in names if n and not n.startswith("#")]
    seen: dict[str, str] = {}
    for p in patches:
        if not p.is_file():
            raise PatchError(f"series {folder.name} names a missing patch {p.name}")
        for f in _files(p.read_text(encoding="utf-8")):
            if f in seen:  # disjoint files keep per-patch checks valid on the untouched tree
                raise PatchError(f"series {folder.name}: {p.name} and {seen[f]} both change {f}")
            seen[f] = p.name
    return patches


def _files(text: str) -> list[str]:
    return [m.group(2) for m in map(_FILE_RE.match, text.splitlines()) if m]


class _Tool:
    """``git apply`` at the top of a git work tree, GNU ``patch`` anywhere else."""

    def __init__(self, src: Path):
        self.src = src.resolve()
        top = None
        if shutil.which("git"):
            r = subprocess.run(["git", "-C", str(self.src), "rev-parse", "--show-toplevel"],
                               capture_output=True, text=True)
            top = Path(r.stdout.strip()).resolve() if r.returncode == 0 else None
        self.git = top == self.src
        self.name = "git apply" if self.git else "patch"
        if not self.git and not shutil.which("patch"):
            raise PatchError(f"{src} is not the top of a git work tree and GNU patch is not installed "
                             "(Debian/Ubuntu package: patch)")

    def run(self, patch: Path, reverse: bool, dry: bool) -> subprocess.CompletedProcess:
        if self.git:
            cmd = ["git", "-C", str(self.src), "apply", "-v"] + (["--check"] if dry else [])
        else:
            cmd = ["patch", "-d", str(self.src), "-p1", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
                   "--reject-file=-"] + (["--dry-run"] if dry else [])
        cmd += (["-R"] if reverse else []) + ["-i" if not self.git else "--", str(patch.resolve())]
        return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def _classify(tool: _Tool, patch: Path) -> str:
    if tool.run(patch, reverse=True, dry=True).returncode == 0:
        return "applied"
    if tool.run(patch, reverse=False, dry=True).returncode == 0:
        return "pending"
    marked = [f for f in _files(patch.read_text(encoding="utf-8")) if f in UPSTREAM_MARKERS]
    if marked and all(_has_fix(tool.src, f) for f in marked):
        return "fixed upstream"  # e.g. a patch release that cherry-picked the fix; not ours to revert
    return "drifted"


def _has_fix(src: Path, rel: str) -> bool:
    path = src / rel
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    return any(marker in text for marker in UPSTREAM_MARKERS[rel])


def _diagnose(tool: _Tool, patch: Path) -> str:
    """Name every file and hunk of ``patch`` that matches neither the original nor the patched text."""
    lines = [f"  {patch.name}:"]
    header, blocks = None, []
    for ln in patch.read_text(encoding="utf-8").splitlines(keepends=True):
        if _FILE_RE.match(ln.rstrip("\n")):
            header = [ln]
            blocks.append((header, []))
        elif ln.startswith("@@") and blocks:
            blocks[-1][1].append([ln])
        elif blocks and blocks[-1][1]:
            blocks[-1][1][-1].append(ln)
        elif header is not None:
            header.append(ln)
    with tempfile.TemporaryDirectory() as tmp:
        for head, hunks in blocks:
            name = _FILE_RE.match(head[0].rstrip("\n")).group(2)
            for i, hunk in enumerate(hunks, 1):
                one = Path(tmp) / "hunk.patch"
                one.write_text("".join(head + hunk), encoding="utf-8")
                if not any(tool.run(one, reverse=r, dry=True).returncode == 0 for r in (False, True)):
                    lines.append(f"    {name}: hunk #{i} ({hunk[0].strip()}) does not match")
    return "\n".join(lines)


def _apply_all_or_none(tool: _Tool, src: Path, todo: list[Path], reverse: bool) -> None:
    files = [src / f for p in todo for f in _files(p.read_text(encoding="utf-8"))]
    saved = {f: f.read_bytes() if f.is_file() else None for f in files}
    for p in todo:
        r = tool.run(p, reverse=reverse, dry=False)
        if r.returncode != 0:
            for f, data in saved.items():
                if data is None:
                    f.unlink(missing_ok=True)
                else:
                    f.write_bytes(data)
            raise PatchError(f"{tool.name} failed on {p.name}; the tree was restored:\n{r.stdout}{r.stderr}")
