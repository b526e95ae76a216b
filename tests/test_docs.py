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


def prose_lines(markdown: str) -> list[str]:
    """The lines of ``markdown`` outside fenced code blocks (```` ``` ```` or ``~~~`` fences)."""
    lines, fence = [], None
    for line in markdown.splitlines():
        m = re.match(r"^\s*(```|~~~)", line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            lines.append(line)
    return lines


def prose_words(markdown: str) -> list[str]:
    """The whitespace-separated words of ``markdown`` outside fenced code blocks."""
    return [w for line in prose_lines(markdown) for w in line.split()]


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


def _local_links(path: Path) -> list[tuple[str, Path]]:
    """``(link, resolved file)`` for every relative Markdown link of ``path`` outside code blocks (no URLs, no
    in-page anchors)."""
    out = []
    for word in re.findall(r"\]\(([^)\s]+)\)", " ".join(prose_words(path.read_text(encoding="utf-8")))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", word) or word.startswith("#"):
            continue
        out.append((word, (path.parent / word.split("#", 1)[0]).resolve()))
    return out


def _anchors(path: Path) -> set[str]:
    """GitHub's (and MyST's ``myst_heading_anchors``) anchors of a Markdown file's headings."""
    heads = [m.group(1) for line in prose_lines(path.read_text(encoding="utf-8"))
             if (m := re.match(r"^#+\s+(.*)$", line))]
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_local_links_of_the_readme_and_the_guides_resolve():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for link, target in _local_links(page):
            anchor = link.split("#", 1)[1] if "#" in link else None
            if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target)):
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, broken
    readme_links = {target for _link, target in _local_links(README)}
    guides = {p.resolve() for p in (ROOT / "docs").glob("*.md") if p.name != "index.md"}
    assert guides <= readme_links, f"guides the README does not link: {sorted(g.name for g in guides - readme_links)}"
