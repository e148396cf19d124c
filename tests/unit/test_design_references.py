"""Every reference into docs/design.md names a section that exists there, and every other claim
the docs make about this repository holds.

Code and docs point into the design document as ``docs/design.md, "<section title>"`` (a title
may wrap onto the next line, also inside a ``#`` or ``--`` comment) or as a Markdown link
``design.md#<anchor>``. Rename a heading and its references together; this test names the
reference that broke. The old numbered references to a design document outside the repository
are gone for good.

The docs (README.md and every Markdown file under docs/, runbooks included) also cite paths
(`include/pin_maintenance/parallel.py`, a relative Markdown link), dotted modules
(`include.pin_maintenance.jobs.slot_expiration`, `devtools.airflow_env.airflow`), test
functions (`tests/x.py::test_y`, or a backticked `test_y` alone) and the duration of
`make test`; each must exist, or agree with docs/testing.md. Placeholders (`<job>`, `*`, `...`),
URLs and paths outside the repository (`/usr/...`, `.local/...`) are not claims.
"""

from __future__ import annotations

import ast
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


# ------------------------------------------------------------------------------- other claims

DOCS = {
    str(p.relative_to(REPO)): p.read_text()
    for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
}
TOP = ("include", "tests", "devtools", "ops", "docs", "dags", "scheduler_plugin", "plugins", ".ci")
# a repository path: starts at a top-level folder, not inside a URL or another path
PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./{},*<>-]*)")
TEST_ID = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
MODULE = re.compile(r"(?<![\w./-])((?:include|devtools|tests)(?:\.\w+)+)(?![\w<])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BARE_TEST = re.compile(r"`(test_\w+)`")


def _expand(path: str) -> list[str]:
    """``a/{b,c}.md`` -> ``a/b.md``, ``a/c.md``."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [
        x for o in m.group(1).split(",") for x in _expand(path[: m.start()] + o + path[m.end() :])
    ]


def _exists(path: str) -> bool:
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def missing_paths(text: str, base: str = "") -> list[str]:
    """Repository paths and relative links of ``text`` (a doc at ``base``) that do not exist."""
    bad = []
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".,:;")
        if "<" in path or ">" in path or "..." in path or "//" in path:
            continue  # a placeholder (`include/sql/<job>/`) or elided (`scheduler_plugin/.../x`)
        bad += [p for p in _expand(path) if not _exists(p)]
    folder = (REPO / base).parent
    for m in LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"[a-z]+:", target) or target.startswith("/"):
            continue  # an anchor in the same page, a URL, a path outside the repository
        resolved = (folder / target).resolve()
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            bad.append(target)
    return bad


@cache
def _definitions(path: str) -> frozenset[str]:
    """Names a Python file defines: functions, classes (with their methods), assignments."""
    tree = ast.parse((REPO / path).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


@cache
def _test_functions() -> frozenset[str]:
    return frozenset(
        name
        for path in (REPO / "tests").rglob("test_*.py")
        for name in _definitions(str(path.relative_to(REPO)))
        if name.startswith("test_")
    )


def missing_tests(text: str) -> list[str]:
    """``tests/x.py::test_y`` whose file or function does not exist, and backticked test
    names that no test module defines."""
    bad = []
    for path, name in TEST_ID.findall(text):
        if not (REPO / path).is_file() or name not in _definitions(path):
            bad.append(f"{path}::{name}")
    bad += [n for n in BARE_TEST.findall(text) if n not in _test_functions()]
    return bad


def _module_file(parts: list[str]) -> str | None:
    for suffix in (".py", "/__init__.py"):
        path = "/".join(parts) + suffix
        if (REPO / path).is_file():
            return path
    return None


def missing_modules(text: str) -> list[str]:
    """Dotted names (``include.pin_maintenance.jobs.slot_expiration``, a module's attribute
    ``devtools.airflow_env.airflow``) that name no module, or no name the module defines."""
    bad = []
    for dotted in {m.group(1).rstrip(".") for m in MODULE.finditer(text)}:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = _module_file(parts[:cut])
            if module or (REPO / "/".join(parts[:cut])).is_dir():
                break
        rest = parts[cut:]
        if cut == 1 and not module:
            bad.append(dotted)  # not even a package below the top
        elif rest and (not module or rest[0] not in _definitions(module)):
            bad.append(dotted)
    return sorted(bad)


def test_every_path_the_docs_cite_exists() -> None:
    bad = {name: missing_paths(text, name) for name, text in DOCS.items()}
    bad = {name: found for name, found in bad.items() if found}
    assert not bad, f"the docs cite paths that do not exist: {bad}"


def test_every_module_the_docs_cite_exists() -> None:
    bad = {name: missing_modules(text) for name, text in DOCS.items()}
    bad = {name: found for name, found in bad.items() if found}
    assert not bad, f"the docs cite modules or names that do not exist: {bad}"


def test_every_test_the_docs_cite_exists() -> None:
    bad = {name: missing_tests(text) for name, text in DOCS.items()}
    bad = {name: found for name, found in bad.items() if found}
    assert not bad, f"the docs cite tests that do not exist: {bad}"


def test_the_claim_checks_do_read_the_docs() -> None:
    """The scans find claims (a regex that matched nothing would pass everything)."""
    text = "\n".join(DOCS.values())
    assert len(PATH.findall(text)) >= 100
    assert len(MODULE.findall(text)) >= 5
    assert len(TEST_ID.findall(text)) + len(BARE_TEST.findall(text)) >= 50
    assert "docs/runbooks/README.md" in DOCS


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("`include/pin_maintenance/parallel.py` and tests/unit/test_parallel.py.", []),
        ("`include/pin_maintenance/parallels.py`", ["include/pin_maintenance/parallels.py"]),
        ("(`tests/e2e/test_zz_shutdown.py`)", ["tests/e2e/test_zz_shutdown.py"]),
        ("`docs/runbooks/slot-expiration-{backlog,poison-slot}.md`", []),
        ("`docs/runbooks/task-{failed,gone}.md`", ["docs/runbooks/task-gone.md"]),
        ("`include/pin_maintenance/jobs/*_config.py`", []),
        ("`include/pin_maintenance/jobs/*_cfg.py`", ["include/pin_maintenance/jobs/*_cfg.py"]),
        ("`include/sql/<job>/<verb_object>.sql`, scheduler_plugin/.../notify.py", []),
        ("/usr/lib/postgresql/15/bin, .local/bench/x.md, https://github.com/x/docs/y", []),
        ("[design](design.md#pacing), [runbook](runbooks/task-failed.md)", []),
        ("[gone](design/nothing.md)", ["design/nothing.md"]),
        ("[out](../../etc/passwd), [web](https://example.com/a.md)", ["../../etc/passwd"]),
    ],
)  # fmt: skip
def test_the_check_catches_a_path_that_does_not_exist(text: str, bad: list[str]) -> None:
    assert missing_paths(text, "docs/README.md") == bad


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("`include.pin_maintenance.jobs.slot_expiration`", []),
        ("`python -m include.pin_maintenance.jobs.activity_retention --db-url`", []),
        ("`devtools.airflow_env.airflow` and `include.pin_airflow.runtime.resolve_config`", []),
        ("`include.pin_maintenance.jobs.<job>.run`", []),
        ("`include.pin_maintenance.slot_expiry`", ["include.pin_maintenance.slot_expiry"]),
        ("`include.pin_airflow.runtime.resolve_x`", ["include.pin_airflow.runtime.resolve_x"]),
        ("`devtools.benchmark`", ["devtools.benchmark"]),
    ],
)  # fmt: skip
def test_the_check_catches_a_module_that_does_not_exist(text: str, bad: list[str]) -> None:
    assert missing_modules(text) == bad


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("`tests/unit/test_design_references.py::test_references_name_existing_sections`", []),
        ("`tests/unit/test_parallel.py::test_nope`", ["tests/unit/test_parallel.py::test_nope"]),
        ("tests/unit/test_gone.py::test_x", ["tests/unit/test_gone.py::test_x"]),
        ("(`test_references_name_existing_sections`)", []),
        ("(`test_a_test_nobody_wrote`)", ["test_a_test_nobody_wrote"]),
    ],
)  # fmt: skip
def test_the_check_catches_a_test_that_does_not_exist(text: str, bad: list[str]) -> None:
    assert missing_tests(text) == bad


# ------------------------------------------------------------------------- make test's duration

TESTING = REPO / "docs" / "testing.md"


def latest_duration(testing: str) -> tuple[str, str]:
    """docs/testing.md, "How long it takes": the newest row's date and its bold result
    (``("2026-12-03", "13 min 3 s")``); of rows with the same date, the first (newest first)."""
    section = re.split(r"^## How long it takes\n", testing, maxsplit=1, flags=re.M)[1]
    section = section.split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        date = re.match(r"\d{4}-\d{2}-\d{2}", cells[0]) if line.startswith("|") else None
        if date and (result := re.search(r"\*\*([^*]+)\*\*", cells[-1])):
            rows.append((date.group(0), result.group(1)))
    assert rows, "docs/testing.md, How long it takes: no dated row with a **bold** result"
    newest = max(date for date, _ in rows)
    return next(row for row in rows if row[0] == newest)


def duration_claim_errors(readme: str, testing: str) -> list[str]:
    """The README's paragraph on how long `make test` takes must name the newest row of
    docs/testing.md's table: its date and its bold result, and no other date."""
    paragraphs = [p for p in re.split(r"\n\s*\n", readme) if "`make test` took" in p]
    if len(paragraphs) != 1:
        return [f"README: {len(paragraphs)} paragraphs say how long `make test` took, not 1"]
    paragraph = " ".join(paragraphs[0].split())
    date, result = latest_duration(testing)
    errors = [f"README does not name {x!r}" for x in (date, result) if x not in paragraph]
    errors += [
        f"README names {d}, not docs/testing.md's newest row ({date})"
        for d in sorted(set(re.findall(r"\d{4}-\d{2}-\d{2}", paragraph)) - {date})
    ]
    return errors


def test_the_readme_duration_is_the_newest_row_of_testing_md() -> None:
    assert duration_claim_errors(DOCS["README.md"], TESTING.read_text()) == []


TABLE = """\
## How long it takes

| measured | what | loop | result |
|---|---|---|---|
| 2026-12-03 afternoon | tree | 2.3 s | **13 min 3 s** of pytest |
| 2026-12-03 midday | tree | - | **11 min 48 s** of pytest |
| 2026-12-02 evening | clone | 1.8 s | **8 min 0 s** of pytest |

## Where the time goes
"""


@pytest.mark.parametrize(
    ("readme", "errors"),
    [
        ("On 2 cores `make test` took **13 min 3 s** on 2026-12-03 (docs/testing.md).", []),
        ("`make test` took 13 min 3 s\non 2026-12-03.", []),
        ("`make test` took 8 to 10 minutes (2026-12-04).", [
            "README does not name '2026-12-03'", "README does not name '13 min 3 s'",
            "README names 2026-12-04, not docs/testing.md's newest row (2026-12-03)"]),
        ("`make test` took 11 min 48 s on 2026-12-03.", ["README does not name '13 min 3 s'"]),
        ("`make test` took 13 min 3 s on 2026-12-03 and 8 min 0 s on 2026-12-02.", [
            "README names 2026-12-02, not docs/testing.md's newest row (2026-12-03)"]),
        ("no figure at all", ["README: 0 paragraphs say how long `make test` took, not 1"]),
    ],
)  # fmt: skip
def test_the_check_catches_a_duration_that_is_not_the_newest_row(
    readme: str, errors: list[str]
) -> None:
    assert duration_claim_errors(readme, TABLE) == errors


def test_a_new_row_on_top_becomes_the_newest() -> None:
    row = "| 2026-12-06 morning | clone | 2.0 s | **9 min 30 s** of pytest; 900 CPU-s |\n"
    table = TABLE.replace("|---|---|---|---|\n", "|---|---|---|---|\n" + row)
    assert latest_duration(table) == ("2026-12-06", "9 min 30 s")
    assert latest_duration(TABLE) == ("2026-12-03", "13 min 3 s")


def test_the_docs_index_lists_every_document() -> None:
    """docs/README.md links every document under docs/ (the runbooks through their index)."""
    index = DOCS["docs/README.md"]
    linked = {m.group(1).split("#", 1)[0] for m in LINK.finditer(index)}
    docs = REPO / "docs"
    wanted = {
        str(p.relative_to(docs))
        for p in docs.rglob("*.md")
        if p.parent.name != "runbooks" or p.name == "README.md"
    } - {"README.md"}
    assert sorted(wanted - linked) == []


# ------------------------------------------------ settings, metrics, events and alerts by name

SETTING = re.compile(r"\b(PIN_[A-Z0-9_]*[A-Z0-9])\b")
METRIC = re.compile(
    r"\b((?:news_snapshot_detach|calendar_slot_expiration|activity_retention)_[a-z_]+?"
    r"_(?:total|seconds|milliseconds|timestamp_seconds|backlog|count|ratio|rows|sessions))\b"
)
EVENT = re.compile(r"event=([a-z_]+)")
ALERT_CLAIM = re.compile(r"`([a-z]+(?:_[a-z]+)+)` alert|alert `([a-z]+(?:_[a-z]+)+)`")
CODE_SUFFIXES = {".py", ".sh", ".yml", ".yaml", ".toml", ".cfg", ".ini"}
THIS_FILE = Path(__file__).resolve()  # its bad examples are no names the repository has


@cache
def _code_text() -> str:
    """Every source and configuration file outside docs/ (what a doc's name must exist in)."""
    parts = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in SKIP_DIRS | {"docs"} or not path.is_file() or path == THIS_FILE:
            continue
        if path.suffix in CODE_SUFFIXES or path.name in TEXT_NAMES:
            parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


def unknown_names(text: str) -> list[str]:
    """Settings (``PIN_*``), metrics, ``event=`` names and alert names that ``text`` cites and
    no code or configuration file of the repository names."""
    from tests.unit import test_runbook_vocabulary as vocabulary

    code = _code_text()
    bad = [s for s in SETTING.findall(text) if s not in code]
    metrics = set(vocabulary.catalog_metrics())
    for name in METRIC.findall(text):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in metrics and base not in metrics:
            bad.append(name)
    events = set(vocabulary.logged_events())
    bad += [e for e in EVENT.findall(text) if e not in events]
    alerts = vocabulary.alert_names()
    bad += [a for pair in ALERT_CLAIM.findall(text) for a in pair if a and a not in alerts]
    return sorted(set(bad))


def test_every_setting_metric_event_and_alert_the_docs_name_exists() -> None:
    text = "\n".join(DOCS.values())  # the scans find names (else they would pass anything)
    assert len(SETTING.findall(text)) >= 20 and len(METRIC.findall(text)) >= 8
    assert len(EVENT.findall(text)) >= 20 and len(ALERT_CLAIM.findall(text)) >= 8
    bad = {name: unknown_names(text) for name, text in DOCS.items()}
    bad = {name: found for name, found in bad.items() if found}
    assert not bad, f"the docs name settings, metrics, events or alerts nothing has: {bad}"


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("`PIN_PG_URL`, `PIN_PG_MAJOR`, `PIN_REQUIRE_ALL=1`", []),
        ("`PIN_PG_VERSION`", ["PIN_PG_VERSION"]),
        ("`calendar_slot_expiration_items_total`", []),
        ("`calendar_slot_expiration_rows_total`", ["calendar_slot_expiration_rows_total"]),
        ("a line `event=job_completed stop_reason=...`", []),
        ("`event=job_finished`", ["job_finished"]),
        ("the `database_server_unsupported` alert", []),
        ("alert `database_server_too_old`", ["database_server_too_old"]),
    ],
)  # fmt: skip
def test_the_check_catches_a_name_nothing_has(text: str, bad: list[str]) -> None:
    assert unknown_names(text) == bad
