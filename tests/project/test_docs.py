"""Every ```python snippet in docs/ and the README runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET = re.compile(r"```python\n(.*?)```", re.DOTALL)
SNIPPETS = [
    pytest.param(code, id=f"{page.stem}-{index}")
    for page in PAGES
    for index, code in enumerate(SNIPPET.findall(page.read_text()))
]


def test_docs_have_snippets():
    assert SNIPPETS


@pytest.mark.parametrize("code", SNIPPETS)
def test_snippet_runs(code, in_tmp_dir):
    exec(compile(code, "<docs snippet>", "exec"), {"__name__": "__docs__"})
