"""Judge every hunk of a patch against an ONNX Runtime source tree, one hunk at a time.

A hunk is ``patched`` when its post-image (patched text) is in the tree, ``original`` when its pre-image is, and
``neither`` otherwise. Each hunk is dry-run on its own, in both directions, with the tool that ``ortcapture patch``
uses (``git apply --check`` at the top of a git work tree, GNU ``patch --dry-run --fuzz=0`` elsewhere), so a half-
applied patch, or a changed context line after applying, is seen hunk by hunk instead of being hidden behind a
whole-patch result.

Line endings: a file with CRLF line endings (a Windows checkout; ORT's ``.gitattributes`` gives those) is matched
and changed with CRLF hunks, so CRLF trees are judged and patched like LF ones.

Raises :class:`ortcapture.errors.PatchError` when the patch tool is missing. Never imports onnxruntime.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ortcapture.errors import PatchError

FILE_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$")


@dataclass(frozen=True)
class FilePatch:
    """One file's part of a patch: its ``diff --git`` header lines and its hunks (each starting with ``@@``)."""

    path: str
    header: tuple[str, ...]
    hunks: tuple[tuple[str, ...], ...]

    @property
    def new_file(self) -> bool:
        return any(line.startswith("new file mode") for line in self.header)


@dataclass(frozen=True)
class HunkState:
    path: str
    number: int  # 1-based, within its file
    head: str  # the hunk's ``@@ ... @@`` line
    state: str  # "patched", "original", "neither" or "missing" (the file the hunk changes is not in the tree)

    def name(self) -> str:
        return f"{self.path}: hunk #{self.number} ({self.head})"


def parse(patch: Path) -> list[FilePatch]:
    """Split a ``git diff`` style patch into files and hunks (the text before the first ``diff --git`` is ignored)."""
    files: list[tuple[str, list[str], list[list[str]]]] = []
    for line in patch.read_text(encoding="utf-8").splitlines():
        m = FILE_RE.match(line)
        if m:
            files.append((m.group(2), [line], []))
        elif not files:
            continue
        elif line.startswith("@@"):
            files[-1][2].append([line])
        elif files[-1][2]:
            files[-1][2][-1].append(line)
        else:
            files[-1][1].append(line)
    return [FilePatch(path, tuple(head), tuple(tuple(h) for h in hunks)) for path, head, hunks in files]


def line_ending(path: Path) -> str:
    """``"\\r\\n"`` when the file uses CRLF line endings, else ``"\\n"`` (also for a missing file)."""
    return "\r\n" if path.is_file() and b"\r\n" in path.read_bytes() else "\n"


def render(fp: FilePatch, hunks: tuple[tuple[str, ...], ...], eol: str) -> str:
    """Patch text for ``hunks`` of ``fp``: header lines end in LF, hunk body lines in ``eol``."""
    out = [line + "\n" for line in fp.header]
    for hunk in hunks:
        out.append(hunk[0] + "\n")
        out.extend(line + ("\n" if line.startswith("\\") else eol) for line in hunk[1:])
    return "".join(out)


class Tool:
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

    def run(self, text: str, reverse: bool, dry: bool) -> subprocess.CompletedProcess:
        """Apply (or with ``dry``, only check) the patch ``text`` in ``src``."""
        with tempfile.TemporaryDirectory() as tmp:
            patch = Path(tmp) / "one.patch"
            patch.write_bytes(text.encode("utf-8"))
            if self.git:
                cmd = ["git", "-C", str(self.src), "apply", "-v"] + (["--check"] if dry else [])
                cmd += (["-R"] if reverse else []) + ["--", str(patch)]
            else:
                cmd = ["patch", "-d", str(self.src), "-p1", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
                       "--reject-file=-", "--binary"] + (["--dry-run"] if dry else [])
                cmd += (["-R"] if reverse else []) + ["-i", str(patch)]
            return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)

    def apply_file(self, fp: FilePatch, reverse: bool) -> subprocess.CompletedProcess:
        eol = line_ending(self.src / fp.path)
        return self.run(render(fp, fp.hunks, eol), reverse=reverse, dry=False)


def judge(tool: Tool, fp: FilePatch) -> list[HunkState]:
    """The state of every hunk of ``fp`` in the tree, each hunk dry-run alone in both directions; ``"missing"`` for
    every hunk of a file the patch changes (not creates) that the tree does not have."""
    if not fp.new_file and not (tool.src / fp.path).is_file():
        return [HunkState(fp.path, number, hunk[0], "missing") for number, hunk in enumerate(fp.hunks, 1)]
    eol = line_ending(tool.src / fp.path)
    states = []
    for number, hunk in enumerate(fp.hunks, 1):
        text = render(fp, (hunk,), eol)
        if tool.run(text, reverse=True, dry=True).returncode == 0:
            state = "patched"
        elif tool.run(text, reverse=False, dry=True).returncode == 0:
            state = "original"
        else:
            state = "neither"
        states.append(HunkState(fp.path, number, hunk[0], state))
    return states
