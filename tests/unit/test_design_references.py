"""Every reference into docs/design.md names a section that exists there.

Code and docs point into the design document as ``docs/design.md, "<section title>"`` (a title
may wrap onto the next line, also inside a ``#`` or ``--`` comment) or as a Markdown link
``design.md#<anchor>``. Rename a heading and its references together; this test names the
reference that broke. The old numbered references to a design document outside the repository
are gone for good.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
SKIP_DIRS = {".git", ".venv", ".local", "node_modules", "__pycache__", ".ruff_cache"}
TEXT_SUFFIXES = {".py", ".md", ".yml", ".yaml", ".sql", ".toml", ".txt", ".sh", ".json", ".cfg"}
TEXT_NAMES = {"Makefile", "Dockerfile", "run", ".airflowignore"}

REFERENCE = re.compile(r'docs/design\.md,\s*(?:(?:#+|--)\s*)?"([^"]+)"')
ANCHOR = re.compile(r"design\.md#([A-Za-z0-9_-]+)")
# what the references looked like before docs/design.md existed (assembled, so that this file
# does not match itself)
OLD_STYLE = re.compile("DESIGN" + r"(?:\.md)?,?\s+(?:sections?\s+)?\d|" + "DESIGN" + r"\.md")


@cache
def headings() -> dict[str, str]:
    """Section title -> its GitHub anchor, for every heading of docs/design.md."""
    found: dict[str, str] = {}
    in_fence = False
    for line in DESIGN.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"#{1,6}\s+(.+?)\s*$", line)):
            found[m.group(1)] = slug(m.group(1))
    return found


def slug(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces -> hyphens."""
    text = re.sub(r"[^\w\s-]", "", title.lower())
    return re.sub(r"\s", "-", text.strip())


def normalize(title: str) -> str:
    """A title as written across lines (docstring indent, ``#`` / ``--`` comment markers)."""
    return " ".join(re.sub(r"\n\s*(?:#+|--)?", " ", title).split())


def references(text: str) -> list[str]:
    return [normalize(m.group(1)) for m in REFERENCE.finditer(text)]


def broken(text: str) -> list[str]:
    """The references of ``text`` that name no section of docs/design.md."""
    titles = set(headings())
    anchors = set(headings().values())
    # `"<section title>"` is the form itself, as the design document states it
    bad = [f'"{t}"' for t in references(text) if t not in titles and not t.startswith("<")]
    bad += [f"#{a}" for a in ANCHOR.findall(text) if a not in anchors]
    return bad


def _files() -> list[Path]:
    out = []
    for path in sorted(REPO.rglob("*")):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS for part in rel.parts) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES:
            out.append(path)
    return out


THIS = Path(__file__).resolve()
# this file quotes broken references on purpose (the cases below)
FILES = {str(p.relative_to(REPO)): p.read_text(errors="replace") for p in _files() if p != THIS}


def test_design_document_has_the_sections_the_brief_names() -> None:
    for title in (
        "Architecture",
        "How a run flows",
        "Contracts",
        "DAGs",
        "Connections",
        "Configuration",
        "Schedules",
        "Database schema",
        "Selections API",
        "Alerts",
        "Log vocabulary",
        "Running side by side",
        "Seed requirements",
    ):
        assert title in headings(), f"docs/design.md has no section {title!r}"
    assert len(set(headings())) == len(headings()), "two sections share a title"


def test_references_name_existing_sections() -> None:
    bad = {name: broken(text) for name, text in FILES.items() if broken(text)}
    assert not bad, f"not a section of docs/design.md: {bad} (sections: {sorted(headings())})"


def test_no_reference_to_the_design_document_outside_the_repository() -> None:
    old = {n: [m.group(0) for m in OLD_STYLE.finditer(t)] for n, t in FILES.items()}
    old = {n: found for n, found in old.items() if found}
    assert not old, f'{old}: point into docs/design.md, "<section title>" instead'


def test_the_code_and_docs_do_reference_the_design_document() -> None:
    """The scan finds the references (a regex that matched nothing would pass everything)."""
    found = [t for text in FILES.values() for t in references(text)]
    assert len(found) >= 30, found
    assert "Running side by side" in found  # include/pin_maintenance/parallel.py


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ('see docs/design.md, "Configuration".', []),
        ('(docs/design.md, "Known Airflow 3.3.2\n    behaviour")', []),
        ('# deadline alerts (docs/design.md,\n# "Deadlines")', []),
        ('-- schema (docs/design.md, "Database\n-- schema")', []),
        ("[contracts](../design.md#selections-api)", []),
        ('docs/design.md, "Configuration keys"', ['"Configuration keys"']),
        ('docs/design.md, "Running side\n by sides"', ['"Running side by sides"']),
        ("[x](design.md#section-4)", ["#section-4"]),
    ],
)
def test_the_check_catches_a_reference_to_a_missing_section(text: str, bad: list[str]) -> None:
    assert broken(text) == bad


@pytest.mark.parametrize(
    "text", ["(DESIGN section 4)", "DESIGN sections 1, 3, 4", "(DESIGN.md section 5)", "DESIGN 8"]
)
def test_the_check_catches_the_old_style(text: str) -> None:
    assert OLD_STYLE.search(text)
