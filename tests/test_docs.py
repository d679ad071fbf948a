"""The user docs: a short front page, links that resolve, every config key described, and
no reference to the project's issue tracker."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from arctic.config import SequenceParallelConfig

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_the_front_page_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        assert where.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            assert anchor in _anchors(where), f"{page.name}: no heading #{anchor} in {where.name}"


def test_every_config_key_is_described():
    text = (REPO / "docs" / "config.md").read_text()
    for field in dataclasses.fields(SequenceParallelConfig):
        assert f"| `{field.name}` |" in text, field.name


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_user_docs_cite_no_issue_numbers(page):
    found = re.findall(r"\bissues? #?\d+", page.read_text(), flags=re.I)
    assert not found, f"{page.name}: {found}"
