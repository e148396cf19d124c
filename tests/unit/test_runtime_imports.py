"""Every module that the DAGs, the job code and the plugins import, inside functions too, is
installed.

In the .venv this checks little (it has everything). In the Astro image's environment
(tests/image runs this tier there, and ``astro dev pytest`` runs it in the image itself) it is
the check that requirements.txt carries what the code needs at run time: an import inside a
task body, which keeps DAG parsing light, is otherwise only tried when the task runs in
production.
"""

from __future__ import annotations

import ast
import sys
from importlib.util import find_spec
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What runs in Airflow's processes (task runner, dag-processor, scheduler, API server).
RUNTIME_DIRS = [
    d for d in ("dags", "include", "plugins", "scheduler_plugin") if (REPO / d).is_dir()
]
# Top-level names that are this repository's development tools: never needed at run time.
DEV_ONLY_PACKAGES = {"devtools", "tests"}


def runtime_files() -> list[Path]:
    return sorted(
        p
        for d in RUNTIME_DIRS
        for p in (REPO / d).rglob("*.py")
        if "tests" not in p.relative_to(REPO / d).parts
    )


def plugin_module_names() -> set[str]:
    """Modules Airflow imports from ``[core] plugins_folder`` by file name (not on sys.path)."""
    return {p.stem for p in (REPO / "plugins").glob("*.py")}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in ``path``, outside ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    typing_only = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def test_the_scan_sees_the_imports_inside_task_bodies() -> None:
    modules = {m for _, m in imported_modules(REPO / "dags" / "calendar_slot_expiration.py")}
    assert "include.pin_airflow.runtime" in modules  # imported inside the task body


def test_every_runtime_import_is_installed() -> None:
    plugins = plugin_module_names()
    missing = []
    for path in runtime_files():
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__" or top in plugins:
                continue
            if not _installed(module):
                missing.append(f"{path.relative_to(REPO)}:{line}: {module}")
    assert missing == [], "not installed here (add to requirements.txt?):\n" + "\n".join(missing)


def test_runtime_code_imports_no_development_tool() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in runtime_files()
        for line, module in imported_modules(path)
        if module.split(".")[0] in DEV_ONLY_PACKAGES
    ]
    assert offenders == []
