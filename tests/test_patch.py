"""``ortcapture patch`` against throw-away ORT source trees built from each patch's own pre-image.

The trees hold only what the patches need: ``VERSION_NUMBER`` and, for every file a patch changes, its
hunks' context and removed lines (at the hunks' own line numbers, with filler in between). The patches
are parsed with ``unidiff``, never by hand.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import unidiff  # test dependency (pyproject: [project.optional-dependencies] test)

from ortcapture import cli
from ortcapture.cli import patch as patching
from ortcapture.cli import patch_hunks

ROOT = patching.patches_root()
SERIES = patching.known_series()
README = ROOT.parent / "README.md"


@pytest.fixture(autouse=True)
def _tools():
    missing = [tool for tool in ("git", "patch") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"`ortcapture patch` needs {' and '.join(missing)} (Debian packages: git, patch)")


def series_patches(line: str) -> list[Path]:
    names = (ROOT / line / "series").read_text().split("\n")
    return [ROOT / line / n.strip() for n in names if n.strip() and not n.startswith("#")]


def parse(patch: Path) -> "unidiff.PatchSet":
    return unidiff.PatchSet.from_filename(str(patch), encoding="utf-8")


def pre_image(pfile) -> str:
    """The smallest file that a patched file's hunks match: their source lines at their own positions."""
    out: list[str] = []
    for hunk in pfile:
        while len(out) < hunk.source_start - 1:
            out.append(f"// filler {len(out) + 1}\n")
        out.extend(line.value for line in hunk.source_lines())
    out.append("// end of file\n")
    return "".join(out)


MARKED = {  # what a 1.30+ tree shows of ORT #32317/#32315 (the series for those lines expect it)
    "onnxruntime/core/providers/webgpu/data_transfer.h": "  static bool IsSupportedDevicePair(const OrtDevice&, const OrtDevice&);\n",
    "onnxruntime/core/providers/webgpu/webgpu_provider_factory.cc": "static OrtStatus* CopyTensorsOrThrow();\n",
}


def upstream_fixed(line: str) -> bool:
    return line == "main" or tuple(map(int, line.split("."))) >= (1, 30)


def make_tree(tmp_path: Path, line: str, version: str | None = None, git: bool = True, eol: str = "\n") -> Path:
    src = tmp_path / "onnxruntime"
    src.mkdir()
    (src / "VERSION_NUMBER").write_text((version or ("1.33.0" if line == "main" else f"{line}.0")) + "\n")
    if upstream_fixed(line):
        for rel, text in MARKED.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(text.replace("\n", eol).encode())
    for patch in series_patches(line):
        for pfile in parse(patch):
            if not pfile.is_added_file:
                target = src / pfile.path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(pre_image(pfile).replace("\n", eol).encode())
    if git:
        g = ["git", "-C", str(src), "-c", "user.email=t@example.com", "-c", "user.name=t", "-c", "core.autocrlf=false"]
        subprocess.run(g + ["init", "-q"], check=True)
        subprocess.run(g + ["add", "-A"], check=True)
        subprocess.run(g + ["commit", "-qm", "upstream"], check=True)
    return src


def snapshot(src: Path) -> dict[str, bytes]:
    return {str(p.relative_to(src)): p.read_bytes()
            for p in sorted(src.rglob("*")) if p.is_file() and ".git" not in p.parts}


def ortcapture(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(["patch", *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def assert_patched(src: Path, line: str) -> None:
    for patch in series_patches(line):
        for pfile in parse(patch):
            text = (src / pfile.path).read_text()
            for hunk in pfile:
                assert "".join(ln.value for ln in hunk.target_lines()) in text, (pfile.path, hunk)


# ---- the patch files themselves ---------------------------------------------------------------------

RELEASES = [line for line in SERIES if line != "main"]
H = "onnxruntime/core/providers/webgpu/data_transfer.h"
CC = "onnxruntime/core/providers/webgpu/data_transfer.cc"
FACTORY = "onnxruntime/core/providers/webgpu/webgpu_provider_factory.cc"
PLUGIN = "onnxruntime/core/framework/plugin_data_transfer.cc"


def apply_hunks(src: Path, patch: Path, path: str, reverse: bool = False) -> None:
    """Apply only ``path``'s part of ``patch`` (a half-applied patch)."""
    subprocess.run(["git", "-C", str(src), "apply", "--include", path] + (["-R"] if reverse else []) + [str(patch)],
                   check=True)


# ---- the patch files themselves ---------------------------------------------------------------------

@pytest.mark.parametrize("line", SERIES)
def test_series_patches_parse_and_carry_headers(line):
    patches = series_patches(line)
    want = ["0003-"] if upstream_fixed(line) else ["0001-", "0002-", "0003-"]
    assert [p.name[:5] for p in patches] == want
    touched: set[str] = set()
    for patch in patches:
        files = parse(patch)
        assert len(files) and all(len(f) for f in files)
        names = {f.path for f in files}
        assert not names & touched, "patches in one series must change disjoint files"
        touched |= names
        head = patch.read_text().split("diff --git", 1)[0]
        assert "What it fixes:" in head and "Upstream:" in head and ("main" if line == "main" else f"{line}.x") in head
        assert re.search(r"@ [0-9a-f]{40}", head)
        if patch.name.startswith("0003-"):
            assert "Applies, not built" in head and "PluginDataTransferSizeCheckTest" in head
        else:
            assert re.search(r"ORT #3231[57]", head)
    assert PLUGIN in touched and "onnxruntime/test/framework/plugin_data_transfer_size_check_test.cc" in touched
    if not upstream_fixed(line):
        assert {H, CC, FACTORY, "onnxruntime/test/providers/webgpu/data_transfer_test.cc"} <= touched


def test_0002_hunk_headers_are_the_stored_files_own_line_numbers():
    for line in RELEASES:
        if not upstream_fixed(line):
            (factory,) = parse(series_patches(line)[1])
            assert [h.source_start for h in factory] == [334, 367]


def test_0003_is_the_same_fix_on_every_series():
    bodies = {(p.read_text().split("diff --git", 1)[1]) for line in SERIES for p in series_patches(line)
              if p.name.startswith("0003-")}
    assert len(bodies) == 1


def test_readme_matrix_names_every_series_and_the_gtests():
    text = README.read_text()
    for line in SERIES:
        assert f"| {line} " in text
    for needle in ("WebGpuDataTransferTest", "PluginDataTransferSizeCheckTest", "applies, not built",
                   "12fa819caa4922904c915ce4a5f61d9a349da24b", "1.28.2", "1.29.1", "ortcapture selftest"):
        assert needle in text


# ---- the command ------------------------------------------------------------------------------------

@pytest.mark.parametrize("git", [True, False], ids=["git", "plain"])
@pytest.mark.parametrize("line", SERIES)
def test_every_series_applies_forward_and_back(tmp_path, capsys, line, git):
    src = make_tree(tmp_path, line, git=git)
    original = snapshot(src)
    n = len(series_patches(line))
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src), "--series", line)
    assert rc == 1 and ("git apply" if git else "using patch") in out and out.count(": applicable") == n, out
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src), "--series", line)
    assert rc == 0 and "applied:" in out, out
    assert_patched(src, line)
    assert "PluginDataTransferSizeCheckTest" in (
        src / "onnxruntime/test/framework/plugin_data_transfer_size_check_test.cc").read_text()
    assert not list(src.rglob("*.orig")) and not list(src.rglob("*.rej"))
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src), "--series", line)
    assert rc == 0 and out.count(": contains the fix") == n and "fix is present" in out, out
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src), "--series", line)
    assert rc == 0 and "nothing to do" in out
    rc, out = ortcapture(capsys, "revert", "--ort-src", str(src), "--series", line)
    assert rc == 0 and "reverted:" in out, out
    assert snapshot(src) == original
    rc, out = ortcapture(capsys, "revert", "--ort-src", str(src), "--series", line)
    assert rc == 0 and "nothing to revert" in out


def test_series_from_version_number(tmp_path, capsys):
    src = make_tree(tmp_path, "1.31", version="1.31.1")
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 1 and "series 1.31" in out and "ORT #32317 and #32315: present upstream" in out


def test_half_applied_series_reports_each_patch_and_completes(tmp_path, capsys):
    line = RELEASES[0]
    src = make_tree(tmp_path, line)
    first, second, third = series_patches(line)
    subprocess.run(["git", "-C", str(src), "apply", str(first)], check=True)
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 1 and f"{first.name}: contains the fix" in out and f"{second.name}: applicable" in out
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src))
    assert rc == 0 and out.strip().endswith(f"applied: {second.name}, {third.name}")
    assert_patched(src, line)


@pytest.mark.parametrize("present, missing", [(H, CC), (CC, H)], ids=["only-h", "only-cc"])
def test_half_of_a_patch_is_refused_naming_the_missing_hunks(tmp_path, capsys, present, missing):
    """Only the .h (or only the .cc) half of 0001: never "contains the fix", and apply changes nothing."""
    src = make_tree(tmp_path, "1.29")
    first = series_patches("1.29")[0]
    apply_hunks(src, first, present)
    before = snapshot(src)
    for action in ("check", "apply", "revert"):
        rc, out = ortcapture(capsys, action, "--ort-src", str(src))
        assert rc == 2 and f"{first.name}: partial" in out and "refusing" in out, (action, out)
        assert f"{missing}: hunk #1 (@@ -" in out and "is not patched" in out
        assert f"{present}: hunk #1 (@@ -" in out and "is patched" in out
        assert "contains the fix" not in out.split(first.name, 1)[1].split("\n", 1)[0]
    assert snapshot(src) == before
    assert "IsSupportedDevicePair(src_device, dst_device)" not in (src / CC).read_text() or present == CC


@pytest.mark.parametrize("git", [True, False], ids=["git", "plain"])
def test_context_edited_after_apply_is_drift_not_a_fix(tmp_path, capsys, git):
    src = make_tree(tmp_path, "1.24", git=git)
    assert ortcapture(capsys, "apply", "--ort-src", str(src))[0] == 0
    cc = src / CC
    cc.write_text(cc.read_text().replace("common::Status DataTransfer::CopyTensor(",
                                         "common::Status /* local */ DataTransfer::CopyTensor("))
    before = snapshot(src)
    for action in ("check", "apply", "revert"):
        rc, out = ortcapture(capsys, action, "--ort-src", str(src))
        assert rc == 2 and "drifted" in out and "nothing to revert" not in out, (action, out)
        assert f"{CC}: hunk #1 (@@ -" in out and "matches neither" in out
        assert f"{H}: hunk" not in out and f"{FACTORY}:" not in out
    assert snapshot(src) == before


def test_drift_in_a_later_patch_leaves_earlier_patches_unapplied(tmp_path, capsys):
    src = make_tree(tmp_path, "1.24")
    factory = src / FACTORY
    text = factory.read_text()  # hunk #1 still matches, hunk #2 does not
    factory.write_text(text.replace("    return nullptr;\n  }\n", "    return nullptr;  // local change\n  }\n"))
    before = snapshot(src)
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src))
    assert rc == 2 and "no file was changed" in out
    assert f"{FACTORY}: hunk #2" in out and f"{FACTORY}: hunk #1" not in out
    assert snapshot(src) == before


@pytest.mark.parametrize("git", [True, False], ids=["git", "plain"])
@pytest.mark.parametrize("line", ["1.24", "1.32"])
def test_crlf_checkout_is_handled_and_said(tmp_path, capsys, line, git):
    src = make_tree(tmp_path, line, git=git, eol="\r\n")
    original = snapshot(src)
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 1 and "CRLF" in out and PLUGIN in out and "drifted" not in out, out
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src))
    assert rc == 0, out
    text = (src / PLUGIN).read_bytes()
    assert b"ValidateCopyPairs" in text and text.count(b"\n") == text.count(b"\r\n")
    assert ortcapture(capsys, "check", "--ort-src", str(src))[0] == 0
    assert ortcapture(capsys, "revert", "--ort-src", str(src))[0] == 0
    assert snapshot(src) == original


@pytest.mark.parametrize("version, message", [
    ("1.23.2", "no patch series for ORT 1.23"),
    ("1.2.3", "no patch series for ORT 1.2"),
    ("2.0", "use --series main"),  # newer than every release series
    ("1.24.1-dev", "unrecognised VERSION_NUMBER"),
])
def test_wrong_or_unknown_version_is_refused(tmp_path, capsys, version, message):
    src = make_tree(tmp_path, "1.24", version=version)
    before = snapshot(src)
    for action in ("check", "apply"):
        rc, out = ortcapture(capsys, action, "--ort-src", str(src))
        assert rc == 2 and message in out
    assert snapshot(src) == before


def test_release_lines_with_the_upstream_fixes_must_show_them(tmp_path, capsys):
    src = make_tree(tmp_path, "1.29", version="1.30.0")  # a 1.30 VERSION_NUMBER on pre-fix sources
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 2 and "lacks IsSupportedDevicePair" in out and "--series 1.29" in out
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src), "--series", "1.29")
    assert rc == 1 and "--series 1.29 forced" in out and "upstream" not in out.split("\n", 1)[1], out
    assert ortcapture(capsys, "apply", "--ort-src", str(src), "--series", "1.29")[0] == 0
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src), "--series", "1.29")
    assert rc == 0 and out.count(": contains the fix") == 3


def test_unknown_series_is_named_before_anything_else(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out = ortcapture(capsys, "check", "--ort-src", str(empty), "--series", "9.9")
    assert rc == 2 and "unknown --series '9.9'" in out and "VERSION_NUMBER" not in out and "main" in out


def test_usage_errors(tmp_path, capsys):
    src = make_tree(tmp_path, "1.24")
    assert ortcapture(capsys, "check", "--ort-src", str(tmp_path / "missing"))[0] == 2
    assert ortcapture(capsys, "check", "--ort-src", str(src), "--series", "../1.24")[0] == 2
    (src / "VERSION_NUMBER").unlink()
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 2 and "VERSION_NUMBER" in out
    with pytest.raises(SystemExit) as exc:
        cli.main(["patch", "check"])
    assert exc.value.code == 2


def test_git_subdirectory_is_treated_as_a_plain_tree(tmp_path, capsys):
    outer = make_tree(tmp_path, "1.24")  # a git repo whose subfolder holds the ORT tree
    inner = outer / "vendor" / "onnxruntime"
    inner.mkdir(parents=True)
    for rel, data in snapshot(outer).items():
        if not rel.startswith("vendor"):
            (inner / rel).parent.mkdir(parents=True, exist_ok=True)
            (inner / rel).write_bytes(data)
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(inner))
    assert rc == 0 and "using patch" in out


def test_missing_patch_tool_is_a_refusal(tmp_path, capsys, monkeypatch):
    src = make_tree(tmp_path, "1.24", git=False)
    real_which = shutil.which
    monkeypatch.setattr(patch_hunks.shutil, "which", lambda name: None if name == "patch" else real_which(name))
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 2 and "package: patch" in out


def test_tool_failure_midway_restores_the_tree(tmp_path, capsys, monkeypatch):
    src = make_tree(tmp_path, "1.24")
    before = snapshot(src)
    real = patch_hunks.Tool.apply_file

    def failing_on_the_factory(self, fp, reverse):
        if fp.path == FACTORY:
            return subprocess.CompletedProcess([], 1, "", "simulated failure")
        return real(self, fp, reverse)

    monkeypatch.setattr(patch_hunks.Tool, "apply_file", failing_on_the_factory)
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src))
    assert rc == 2 and "restored" in out
    assert snapshot(src) == before


def _python(code: str, cwd: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return eval(r.stdout.strip().splitlines()[-1])  # a dict literal printed by the snippet


def test_patch_command_does_not_import_onnxruntime_even_when_blocked(tmp_path):
    """`ortcapture patch` works where onnxruntime is not even installed (source-build machines)."""
    src = make_tree(tmp_path, "1.24")
    repo = Path(patching.__file__).resolve().parents[2]
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'onnxruntime': raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from ortcapture import cli\n"
            f"rc = cli.main(['patch', 'check', '--ort-src', {str(src)!r}])\n"
            "print({'rc': rc, 'ort': 'onnxruntime' in sys.modules})\n")
    assert _python(code, repo) == {"rc": 1, "ort": False}


def test_a_missing_file_is_missing_not_drifted(tmp_path, capsys):
    src = make_tree(tmp_path, "1.24", git=False)
    (src / CC).unlink()
    before = snapshot(src)
    for action in ("check", "apply", "revert"):
        rc, out = ortcapture(capsys, action, "--ort-src", str(src))
        assert rc == 2 and "missing" in out and "drifted" not in out, (action, out)
        assert f"{CC} is missing from the tree" in out and "matches neither" not in out
    assert snapshot(src) == before
