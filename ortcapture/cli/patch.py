"""``ortcapture patch``: check, apply or revert ortcapture's native patches on an ONNX Runtime source tree.

The fixes (see ``patches/README.md``):

* 0001, ORT #32317 - ``webgpu::DataTransfer::CanCopy`` claimed GPU memory of a foreign vendor (e.g. a CUDA buffer,
  vendor 0x10DE) and handed it to Dawn as a ``WGPUBuffer``; release lines 1.24-1.29;
* 0002, ORT #32315 - an exception inside the ``noexcept`` C-ABI callback ``CopyTensorsImpl`` (aliased src/dst,
  undersized destination, mapped buffer) ended the process with ``std::terminate``; release lines 1.24-1.29;
* 0003 - the public ``CopyTensors`` path handed pairs to the EP's data transfer without checking that their byte
  sizes and element types match (an undersized destination was written past its end); every line, 1.24-1.32 and
  ``main`` (upstream has no fix yet).

The series is picked from the tree's ``VERSION_NUMBER`` (``--series 1.27`` or ``--series main`` overrides it).
Every hunk of every file is judged on its own (``git apply --check`` at the top of a git work tree, GNU
``patch --dry-run --fuzz=0`` elsewhere, both directions), and each patch is then:

* ``contains the fix`` - every hunk's patched text is present (applied here, or the same text upstream);
* ``applicable`` - every hunk's original text is present;
* ``partial`` - some hunks patched, the others original (e.g. only the ``.h`` half of a patch);
* ``drifted`` - some hunk matches neither text (e.g. a context line edited after applying);
* ``missing`` - a file the patch changes is not in the tree (a wrong ``--ort-src``, a file moved upstream).

Partial, drifted and missing patches are refused, naming every file and hunk that is not in the patched state. Files with
CRLF line endings (Windows checkouts) are matched with CRLF hunks and said so. Changes are all or none: nothing is
written unless every pending patch checks cleanly, a tool failure midway restores the files it touched, and the
result is judged again after writing. For release lines that took ORT #32317/#32315 upstream (1.30 and later, and
``main``) the tree must show them (``IsSupportedDevicePair``, ``CopyTensorsOrThrow``), else it is refused.

Exit codes:

* 0 - ``check``: every patch contains the fix; ``apply``/``revert``: done, or nothing to do.
* 1 - ``check`` only: patches are applicable (run ``apply``).
* 2 - usage error or refusal: unknown series, no/unrecognised ``VERSION_NUMBER``, a partial or drifted patch
  or missing file (named by file and hunk), upstream fixes missing on a 1.30+ tree, a missing tool, a tool failure.

Raises nothing to its caller: :class:`ortcapture.errors.PatchError` becomes the exit-2 message. This module never
imports onnxruntime.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

from ortcapture.cli.patch_hunks import FilePatch, HunkState, Tool, judge, line_ending, parse
from ortcapture.errors import PatchError

UPSTREAM_FIXED_FROM = (1, 30)  # first release line that carries ORT #32317 and #32315 itself
# text (any of) whose presence shows a file carries an upstream fix: upstream's names, or this package's backport
UPSTREAM_MARKERS = {
    "onnxruntime/core/providers/webgpu/data_transfer.h": ("IsSupportedDevicePair",),
    "onnxruntime/core/providers/webgpu/webgpu_provider_factory.cc": ("CopyTensorsOrThrow",
                                                                     "Backport of ORT #32315"),
}
FIXED = "contains the fix"
APPLICABLE = "applicable"


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


def known_series() -> list[str]:
    """Series folders, release lines in version order, then ``main``."""
    names = [p.name for p in patches_root().iterdir() if (p / "series").is_file()]
    return sorted(names, key=lambda n: _line_key(n) or (10**6,))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("check", "apply", "revert"),
                        help="check: report state (exit 1 if patches are applicable); apply/revert: change the tree")
    parser.add_argument("--ort-src", required=True, type=Path, help="root of the ONNX Runtime source tree")
    parser.add_argument("--series", help="patch series (release line such as 1.24, or main) instead of "
                                         "VERSION_NUMBER's")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args.action, Path(args.ort_src), args.series)
    except PatchError as exc:
        print(f"ortcapture patch: {exc}", file=sys.stderr)
        return 2


def _run(action: str, src: Path, series: str | None) -> int:
    if not src.is_dir():
        raise PatchError(f"--ort-src {src} is not a directory")
    known = known_series()
    if series is not None and series not in known:
        raise PatchError(f"unknown --series {series!r}; known series: {', '.join(known)}")
    version = _read_version(src)
    line = series or _series_for(version, known)
    if series and not version.startswith(series + "."):
        print(f"note: --series {series} forced on a tree whose VERSION_NUMBER is {version}")
    if line == "main" or _line_key(line) >= UPSTREAM_FIXED_FROM:
        _require_upstream_fixes(src, version, line)
    patches = _load_series(patches_root() / line)
    tool = Tool(src)
    print(f"ORT source {src} (VERSION_NUMBER {version}): series {line}, {len(patches)} patches, using {tool.name}")
    crlf = sorted({fp.path for fps in patches.values() for fp in fps if line_ending(src / fp.path) == "\r\n"})
    if crlf:
        print(f"note: CRLF line endings (a Windows checkout) in {', '.join(crlf)}: hunks are matched and applied "
              "with CRLF")
    hunks = {name: [h for fp in fps for h in judge(tool, fp)] for name, fps in patches.items()}
    state = {name: _patch_state(hs) for name, hs in hunks.items()}
    for name, s in state.items():
        print(f"  {name}: {s}")
    bad = [name for name, s in state.items() if s not in (FIXED, APPLICABLE)]
    if bad:
        raise PatchError("refusing: these patches are partly applied, or their files have changed or are missing; "
                         "no file was changed.\n" + "\n".join(_explain(name, state[name], hunks[name]) for name in bad))
    if action == "check":
        pending = [name for name, s in state.items() if s == APPLICABLE]
        if pending:
            print(f"{len(pending)} patch(es) applicable; run: ortcapture patch apply --ort-src {src}"
                  + (f" --series {series}" if series else ""))
            return 1
        print("every patch's fix is present (applied here or upstream)")
        return 0
    reverse = action == "revert"
    names = list(reversed(patches) if reverse else patches)
    todo = [name for name in names if state[name] == (FIXED if reverse else APPLICABLE)]
    if not todo:
        print("nothing to revert" if reverse else "every patch's fix is already present; nothing to do")
        return 0
    _apply_all_or_none(tool, src, [(name, patches[name]) for name in todo], reverse)
    print(f"{'reverted' if reverse else 'applied'}: " + ", ".join(todo))
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


def _series_for(version: str, known: list[str]) -> str:
    line = ".".join(version.split(".")[:2])
    if line in known:
        return line
    releases = [k for k in known if _line_key(k)]
    if releases and _line_key(line) > _line_key(releases[-1]):
        raise PatchError(f"no patch series for ORT {line} (VERSION_NUMBER {version}): it is newer than the newest "
                         f"release series {releases[-1]}; for a main checkout use --series main")
    raise PatchError(f"no patch series for ORT {line} (VERSION_NUMBER {version}); known series: {', '.join(known)}")


def _require_upstream_fixes(src: Path, version: str, line: str) -> None:
    for rel, markers in UPSTREAM_MARKERS.items():
        path = src / rel
        text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
        if not any(marker in text for marker in markers):
            raise PatchError(f"series {line} expects ORT #32317 and #32315 upstream, but {rel} lacks "
                             f"{' / '.join(markers)} (VERSION_NUMBER {version}; a checkout from before they "
                             "landed?). The 1.29 series carries backports of both: --series 1.29")
    print(f"ORT #32317 and #32315: present upstream ({', '.join(UPSTREAM_MARKERS)})")


def _load_series(folder: Path) -> dict[str, list[FilePatch]]:
    names = [ln.strip() for ln in (folder / "series").read_text(encoding="utf-8").splitlines()]
    patches: dict[str, list[FilePatch]] = {}
    seen: dict[str, str] = {}
    for name in (n for n in names if n and not n.startswith("#")):
        path = folder / name
        if not path.is_file():
            raise PatchError(f"series {folder.name} names a missing patch {name}")
        patches[name] = parse(path)
        for fp in patches[name]:
            if fp.path in seen:  # disjoint files keep per-patch judgements valid on the untouched tree
                raise PatchError(f"series {folder.name}: {name} and {seen[fp.path]} both change {fp.path}")
            seen[fp.path] = name
    return patches


def _patch_state(hunks: list[HunkState]) -> str:
    states = {h.state for h in hunks}
    if states == {"patched"}:
        return FIXED
    if states == {"original"}:
        return APPLICABLE
    if "missing" in states:
        return "missing"
    return "drifted" if "neither" in states else "partial"


def _explain(name: str, state: str, hunks: list[HunkState]) -> str:
    lines = [f"  {name} ({state}):"]
    for path in dict.fromkeys(h.path for h in hunks if h.state == "missing"):
        lines.append(f"    {path} is missing from the tree")
    for h in hunks:
        if h.state == "missing":
            continue
        if h.state == "neither":
            lines.append(f"    {h.name()} matches neither the original nor the patched text")
        elif state == "partial":
            lines.append(f"    {h.name()} is {'patched' if h.state == 'patched' else 'not patched'}")
    return "\n".join(lines)


def _apply_all_or_none(tool: Tool, src: Path, todo: list[tuple[str, list[FilePatch]]], reverse: bool) -> None:
    files = [src / fp.path for _, fps in todo for fp in fps]
    saved = {f: f.read_bytes() if f.is_file() else None for f in files}

    def restore() -> None:
        for f, data in saved.items():
            if data is None:
                f.unlink(missing_ok=True)
            else:
                f.write_bytes(data)

    for name, fps in todo:
        for fp in fps:
            r = tool.apply_file(fp, reverse=reverse)
            if r.returncode != 0:
                restore()
                raise PatchError(f"{tool.name} failed on {name} ({fp.path}); the tree was restored:\n"
                                 f"{r.stdout}{r.stderr}")
    want = "original" if reverse else "patched"
    wrong = [h for _, fps in todo for fp in fps for h in judge(tool, fp) if h.state != want]
    if wrong:
        restore()
        raise PatchError("after writing, these hunks are not " + want + "; the tree was restored:\n"
                         + "\n".join(f"    {h.name()}: {h.state}" for h in wrong))
