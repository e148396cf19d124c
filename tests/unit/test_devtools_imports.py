"""The bench's import graph is one-way: sections -> bench_core, entry point -> sections."""

from __future__ import annotations

import ast
from pathlib import Path

DEVTOOLS = Path(__file__).resolve().parents[2] / "devtools"


def _imported_devtools_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):  # function-level ones too
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "devtools":
                found |= {a.name for a in node.names}
            elif node.module.startswith("devtools."):
                found.add(node.module.removeprefix("devtools."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("devtools.") for a in node.names}
    return found


def test_bench_core_imports_no_section():
    sections = {p.stem for p in DEVTOOLS.glob("bench_*.py")} - {"bench_core", "bench_data"}
    assert sections, "no bench sections found"
    assert _imported_devtools_modules(DEVTOOLS / "bench_core.py") & (sections | {"bench"}) == set()


def test_no_section_imports_the_entry_point():
    for path in DEVTOOLS.glob("bench_*.py"):
        assert "bench" not in _imported_devtools_modules(path), path.name
