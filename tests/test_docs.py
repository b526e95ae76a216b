"""The documentation's promises, checked: a README a user reads in three minutes (issue 33) that keeps the two
commands, and guides whose local links resolve."""
from __future__ import annotations

import re

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the README's prose budget: whitespace-separated words outside fenced code blocks
MAX_README_WORDS = 1200


def prose_words(markdown: str) -> list[str]:
    """The words of ``markdown`` outside fenced code blocks (```` ``` ```` or ``~~~`` fences)."""
    words, fence = [], None
    for line in markdown.splitlines():
        m = re.match(r"^\s*(```|~~~)", line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            words += line.split()
    return words


def test_prose_words_leave_out_code_blocks():
    text = "one two\n```bash\nthree four five\n```\nsix\n~~~\nseven\n~~~\n"
    assert prose_words(text) == ["one", "two", "six"]


def test_readme_is_short():
    n = len(prose_words(README.read_text()))
    assert n <= MAX_README_WORDS, f"README.md has {n} words of prose (at most {MAX_README_WORDS}): move details to docs/"


def test_readme_keeps_the_two_commands():
    text = README.read_text()
    for command in ("bash tools/demo.sh", "bash tools/test.sh"):
        assert re.search(rf"^{re.escape(command)}\s", text, re.M), command
    assert (ROOT / "tools" / "demo.sh").is_file() and (ROOT / "tools" / "test.sh").is_file()


# ---- docs/ARCHITECTURE.md's generated module map --------------------------------------------------------------

def _module_map():
    import importlib.util

    spec = importlib.util.spec_from_file_location("module_map", ROOT / "tools" / "module_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_has_a_one_line_summary():
    mm = _module_map()
    problems = []
    for path in mm.modules().values():
        try:
            mm.summary(path)
        except ValueError as exc:
            problems.append(str(exc))
    assert not problems, "\n".join(problems)


def test_summary_rules(tmp_path):
    mm = _module_map()
    cases = {'"""One line."""\n': "One line.",
             '"""Does it?\n\nMore text.\n"""\n': "Does it?",
             "x = 1\n": None,                                         # no docstring
             '"""A summary that goes on\nto a second line."""\n': None,  # not one line
             '"""No full stop\n\nMore."""\n': None}
    for i, (source, want) in enumerate(cases.items()):
        path = tmp_path / f"case{i}.py"
        path.write_text(source)
        mm_root, mm.ROOT = mm.ROOT, tmp_path  # summary() names the file relative to ROOT
        try:
            if want is None:
                with pytest.raises(ValueError):
                    mm.summary(path)
            else:
                assert mm.summary(path) == want
        finally:
            mm.ROOT = mm_root


def test_architecture_module_map_is_up_to_date():
    """docs/ARCHITECTURE.md's groups, contracts and module map are what tools/module_map.py generates from
    .importlinter and the module docstrings (run ``python tools/module_map.py`` after changing either)."""
    mm = _module_map()
    text = mm.DOC.read_text(encoding="utf-8")
    assert mm.updated(text) == text, "docs/ARCHITECTURE.md is out of date: run python tools/module_map.py"
    generated = mm.render()
    for name in mm.modules():  # every module is in the map, every contract's layers are listed
        rel = mm.modules()[name].relative_to(mm.PACKAGE).as_posix()
        assert f"`{rel}`" in generated or f"`{name}`" in generated, name
    for contract in mm.contracts():
        assert contract["name"].replace("|", "\\|") in generated


def test_module_map_check_fails_on_a_stale_map(tmp_path, monkeypatch):
    mm = _module_map()
    stale = tmp_path / "ARCHITECTURE.md"
    stale.write_text(f"# x\n\n{mm.BEGIN}\n| `old.py` | gone |\n{mm.END}\n")
    monkeypatch.setattr(mm, "DOC", stale)
    assert mm.main(["--check"]) == 1
    assert mm.main([]) == 0 and mm.main(["--check"]) == 0  # rewritten: now up to date
    assert "`session.py`" in stale.read_text() and "old.py" not in stale.read_text()
