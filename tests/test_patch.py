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

ROOT = patching.patches_root()
SERIES = sorted(p.name for p in ROOT.iterdir() if (p / "series").is_file())
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


def make_tree(tmp_path: Path, line: str, version: str | None = None, git: bool = True) -> Path:
    src = tmp_path / "onnxruntime"
    src.mkdir()
    (src / "VERSION_NUMBER").write_text((version or f"{line}.0") + "\n")
    for patch in series_patches(line):
        for pfile in parse(patch):
            if not pfile.is_added_file:
                target = src / pfile.path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(pre_image(pfile))
    if git:
        g = ["git", "-C", str(src), "-c", "user.email=t@example.com", "-c", "user.name=t"]
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

@pytest.mark.parametrize("line", SERIES)
def test_series_patches_parse_and_carry_headers(line):
    patches = series_patches(line)
    assert [p.name[:5] for p in patches] == ["0001-", "0002-"]
    touched: set[str] = set()
    for patch in patches:
        files = parse(patch)
        assert len(files) and all(len(f) for f in files)
        names = {f.path for f in files}
        assert not names & touched, "patches in one series must change disjoint files"
        touched |= names
        head = patch.read_text().split("diff --git", 1)[0]
        assert "What it fixes:" in head and "Upstream:" in head and f"{line}.x" in head
        assert re.search(r"ORT #3231[57]", head) and re.search(r"@ [0-9a-f]{40}", head)
    assert "onnxruntime/core/providers/webgpu/data_transfer.h" in touched
    assert "onnxruntime/test/providers/webgpu/data_transfer_test.cc" in touched
    assert "onnxruntime/core/providers/webgpu/webgpu_provider_factory.cc" in touched


def test_readme_matrix_names_every_series_and_the_gtest():
    text = README.read_text()
    for line in SERIES:
        assert f"| {line} " in text
    assert "WebGpuDataTransferTest" in text


# ---- the command ------------------------------------------------------------------------------------

@pytest.mark.parametrize("line", SERIES)
def test_clean_apply_in_git_tree(tmp_path, capsys, line):
    src = make_tree(tmp_path, line, version=f"{line}.3")
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 1 and "git apply" in out and out.count(": pending") == 2
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src))
    assert rc == 0 and "applied:" in out
    assert_patched(src, line)
    test_file = src / "onnxruntime/test/providers/webgpu/data_transfer_test.cc"
    assert "WebGpuDataTransferTest" in test_file.read_text()
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 0 and "nothing pending" in out


def test_already_applied_is_idempotent(tmp_path, capsys):
    src = make_tree(tmp_path, SERIES[0])
    assert ortcapture(capsys, "apply", "--ort-src", str(src))[0] == 0
    before = snapshot(src)
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src))
    assert rc == 0 and "already applied" in out and out.count(": applied") == 2
    assert snapshot(src) == before


def test_half_applied_series_reports_each_patch_and_completes(tmp_path, capsys):
    line = SERIES[-1]
    src = make_tree(tmp_path, line)
    first, second = series_patches(line)
    subprocess.run(["git", "-C", str(src), "apply", str(first)], check=True)
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 1 and f"{first.name}: applied" in out and f"{second.name}: pending" in out
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src))
    assert rc == 0 and out.strip().endswith(f"applied: {second.name}")
    assert_patched(src, line)


@pytest.mark.parametrize("git", [True, False], ids=["git", "plain"])
def test_partially_drifted_source_is_refused_naming_file_and_hunk(tmp_path, capsys, git):
    src = make_tree(tmp_path, SERIES[0], git=git)
    # data_transfer.h still matches patch 0001; a line inside CanCopy's body in data_transfer.cc does not
    cc = src / "onnxruntime/core/providers/webgpu/data_transfer.cc"
    cc.write_text(cc.read_text().replace("src_device.Type() == OrtDevice::GPU) ||",
                                         "src_device.Type() == OrtDevice::GPU) ||  // local change"))
    before = snapshot(src)
    for action in ("check", "apply", "revert"):
        rc, out = ortcapture(capsys, action, "--ort-src", str(src))
        assert rc == 2 and "refusing" in out, action
        assert "onnxruntime/core/providers/webgpu/data_transfer.cc: hunk #1 (@@ -" in out
        assert "data_transfer.h:" not in out and "webgpu_provider_factory.cc:" not in out
    assert snapshot(src) == before


def test_drift_in_a_later_patch_leaves_earlier_patches_unapplied(tmp_path, capsys):
    src = make_tree(tmp_path, SERIES[0])
    factory = src / "onnxruntime/core/providers/webgpu/webgpu_provider_factory.cc"
    text = factory.read_text()  # hunk #1 still matches, hunk #2 does not
    factory.write_text(text.replace("    return nullptr;\n  }\n", "    return nullptr;  // local change\n  }\n"))
    before = snapshot(src)
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src))
    assert rc == 2 and "no file was changed" in out
    assert "webgpu_provider_factory.cc: hunk #2" in out and "hunk #1" not in out
    assert snapshot(src) == before


def test_upstream_cherry_pick_is_reported_and_left_alone(tmp_path, capsys):
    line = SERIES[-1]
    src = make_tree(tmp_path, line)
    first, second = series_patches(line)
    # upstream's own wording of the fix: the helper exists, but the text differs from this patch's
    h = src / "onnxruntime/core/providers/webgpu/data_transfer.h"
    helper = "  static bool IsSupportedDevicePair(const OrtDevice& src, const OrtDevice& dst);\n"
    h.write_text(h.read_text().replace("  bool CanCopy(", helper + "  bool CanCopy("))
    cc = src / "onnxruntime/core/providers/webgpu/data_transfer.cc"
    cc.write_text(cc.read_text().replace("bool DataTransfer::CanCopy(", "bool DataTransfer::CanCopyUpstream("))
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 1 and f"{first.name}: fixed upstream" in out and f"{second.name}: pending" in out
    assert ortcapture(capsys, "apply", "--ort-src", str(src))[0] == 0
    before = snapshot(src)
    rc, out = ortcapture(capsys, "revert", "--ort-src", str(src))
    assert rc == 0 and out.strip().endswith(f"reverted: {second.name}")
    assert snapshot(src)["onnxruntime/core/providers/webgpu/data_transfer.h"] == before[
        "onnxruntime/core/providers/webgpu/data_transfer.h"]


@pytest.mark.parametrize("version, message", [
    ("1.23.2", "no patch series for ORT 1.23"),
    ("1.2.3", "no patch series for ORT 1.2"),
    ("2.0", "no series targets this tree"),  # a later line must carry the fixes itself
    ("1.24.1-dev", "unrecognised VERSION_NUMBER"),
])
def test_wrong_or_unknown_version_is_refused(tmp_path, capsys, version, message):
    src = make_tree(tmp_path, SERIES[0], version=version)
    before = snapshot(src)
    for action in ("check", "apply"):
        rc, out = ortcapture(capsys, action, "--ort-src", str(src))
        assert rc == 2 and message in out
    assert snapshot(src) == before


def test_release_lines_with_the_upstream_fix_need_no_series(tmp_path, capsys):
    src = make_tree(tmp_path, SERIES[0], version="1.30.1")
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 2 and "lacks IsSupportedDevicePair" in out  # VERSION_NUMBER says 1.30, sources say otherwise
    assert ortcapture(capsys, "apply", "--ort-src", str(src), "--series", SERIES[0])[0] == 0
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 0 and "no patches needed" in out


def test_usage_errors(tmp_path, capsys):
    src = make_tree(tmp_path, SERIES[0])
    assert ortcapture(capsys, "check", "--ort-src", str(tmp_path / "missing"))[0] == 2
    assert ortcapture(capsys, "check", "--ort-src", str(src), "--series", "9.99")[0] == 2
    assert ortcapture(capsys, "check", "--ort-src", str(src), "--series", "../1.24")[0] == 2
    (src / "VERSION_NUMBER").unlink()
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 2 and "VERSION_NUMBER" in out
    with pytest.raises(SystemExit) as exc:
        cli.main(["patch", "check"])
    assert exc.value.code == 2


def test_series_override_notes_the_version_mismatch(tmp_path, capsys):
    src = make_tree(tmp_path, SERIES[0], version="1.31.0")
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src), "--series", SERIES[0])
    assert rc == 1 and f"--series {SERIES[0]} forced" in out


def test_non_git_tree_uses_patch_and_reverts(tmp_path, capsys):
    line = SERIES[0]
    src = make_tree(tmp_path, line, git=False)
    original = snapshot(src)
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 1 and "using patch" in out
    assert ortcapture(capsys, "apply", "--ort-src", str(src))[0] == 0
    assert_patched(src, line)
    assert not list(src.rglob("*.orig")) and not list(src.rglob("*.rej"))
    assert ortcapture(capsys, "check", "--ort-src", str(src))[0] == 0
    assert ortcapture(capsys, "revert", "--ort-src", str(src))[0] == 0
    assert snapshot(src) == original


def test_git_subdirectory_is_treated_as_a_plain_tree(tmp_path, capsys):
    outer = make_tree(tmp_path, SERIES[0])  # a git repo whose subfolder holds the ORT tree
    inner = outer / "vendor" / "onnxruntime"
    inner.mkdir(parents=True)
    for rel, data in snapshot(outer).items():
        if not rel.startswith("vendor"):
            (inner / rel).parent.mkdir(parents=True, exist_ok=True)
            (inner / rel).write_bytes(data)
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(inner))
    assert rc == 0 and "using patch" in out


def test_revert_in_git_tree_restores_the_original(tmp_path, capsys):
    src = make_tree(tmp_path, SERIES[0])
    original = snapshot(src)
    assert ortcapture(capsys, "apply", "--ort-src", str(src))[0] == 0
    rc, out = ortcapture(capsys, "revert", "--ort-src", str(src))
    assert rc == 0 and "reverted:" in out
    assert snapshot(src) == original
    rc, out = ortcapture(capsys, "revert", "--ort-src", str(src))
    assert rc == 0 and "nothing to revert" in out


def test_missing_patch_tool_is_a_refusal(tmp_path, capsys, monkeypatch):
    src = make_tree(tmp_path, SERIES[0], git=False)
    real_which = shutil.which
    monkeypatch.setattr(patching.shutil, "which", lambda name: None if name == "patch" else real_which(name))
    rc, out = ortcapture(capsys, "check", "--ort-src", str(src))
    assert rc == 2 and "package: patch" in out


def test_tool_failure_midway_restores_the_tree(tmp_path, capsys, monkeypatch):
    src = make_tree(tmp_path, SERIES[0])
    before = snapshot(src)
    real_run = patching._Tool.run

    def failing_second_patch(self, patch, reverse, dry):
        if not dry and patch.name.startswith("0002-"):
            return subprocess.CompletedProcess([], 1, "", "simulated failure")
        return real_run(self, patch, reverse, dry)

    monkeypatch.setattr(patching._Tool, "run", failing_second_patch)
    rc, out = ortcapture(capsys, "apply", "--ort-src", str(src))
    assert rc == 2 and "restored" in out
    assert snapshot(src) == before


def _python(code: str, cwd: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return eval(r.stdout.strip().splitlines()[-1])  # a dict literal printed by the snippet


def test_patching_module_never_imports_onnxruntime(tmp_path):
    """patching.py and what it imports must work where onnxruntime is not even installed."""
    src = make_tree(tmp_path, SERIES[0])
    package = Path(patching.__file__).resolve().parents[1]  # ortcapture/ (its __init__ not run)
    code = ("import argparse, sys, types\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'onnxruntime': raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "pkg = types.ModuleType('ortcapture'); pkg.__path__ = [%r]; sys.modules['ortcapture'] = pkg\n"
            "from ortcapture.cli import patch as patching\n"
            "p = argparse.ArgumentParser(); patching.add_arguments(p)\n"
            "rc = patching.run(p.parse_args(['check', '--ort-src', %r]))\n"
            "print({'rc': rc, 'ort': 'onnxruntime' in sys.modules})\n") % (str(package), str(src))
    assert _python(code, tmp_path) == {"rc": 1, "ort": False}


def test_patch_command_end_to_end_does_not_import_onnxruntime(tmp_path):
    src = make_tree(tmp_path, SERIES[0])
    repo = Path(patching.__file__).resolve().parent.parent
    assert _python("import sys, ortcapture; print({'ort': 'onnxruntime' in sys.modules})", repo) == {"ort": False}
    code = ("import sys\nfrom ortcapture import cli\n"
            f"rc = cli.main(['patch', 'check', '--ort-src', {str(src)!r}])\n"
            "print({'rc': rc, 'ort': 'onnxruntime' in sys.modules})\n")
    assert _python(code, repo) == {"rc": 1, "ort": False}
