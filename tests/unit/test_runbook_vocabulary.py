"""What the runbooks and DAG docs quote exists in the code: log events and their fields, metric
names, ``last_error`` values, alert names, lock names and keys.

The docs are docs/runbooks/*.md and each DAG file's docstring (its ``doc_md``). The code side is
read from the source (log calls and ``Alert(...)`` by AST, metric names from the job modules and
ops/metrics.yml) or produced by the code itself (every ``last_error`` the outcome rules can
write, by calling them), never from a list kept here.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from include.pin_maintenance.db import lock_key
from include.pin_maintenance.jobs import activity_retention, snapshot_detach
from include.pin_maintenance.jobs.snapshot_detach_client import CallOutcome

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"
DAGS = REPO / "dags"
CODE_DIRS = [REPO / "include"] + [p for p in (REPO / "scheduler_plugin",) if p.is_dir()]
METRIC_PREFIXES = ("news_snapshot_detach_", "calendar_slot_expiration_", "activity_retention_")
# the DAG docs abbreviate their metrics as `_items_total` after the first full name
DAG_METRIC_PREFIX = {
    "calendar_slot_expiration.py": "calendar_slot_expiration",
    "news_snapshot_detach_retry.py": "news_snapshot_detach",
    "user_activity_retention.py": "activity_retention",
    "news_snapshot_detach_requeue.py": "news_snapshot_detach",
}
ALWAYS_LOGGED = {"job", "run_id"}  # JobLog.line puts them on every line
LOG_METHODS = {"debug", "info", "warning", "error"}


# ------------------------------------------------------------------------------- the docs


def _docs() -> dict[str, str]:
    docs = {f"docs/runbooks/{p.name}": p.read_text() for p in sorted(RUNBOOKS.glob("*.md"))}
    for path in sorted(DAGS.glob("*.py")):
        docs[f"dags/{path.name}"] = ast.get_docstring(ast.parse(path.read_text())) or ""
    return docs


DOCS = _docs()


def _prose(text: str) -> str:
    """The text without fenced code blocks (their SQL is run by the integration test)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def spans(text: str) -> list[str]:
    return [re.sub(r"\s+", " ", s).strip() for s in re.findall(r"`([^`]+)`", _prose(text))]


def paragraphs(text: str) -> list[str]:
    """Paragraphs and list items of the prose."""
    return [p for p in re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )", _prose(text)) if p.strip()]


# ------------------------------------------------------------------------------- the code


@cache
def _trees() -> list[tuple[Path, ast.Module]]:
    files = [p for d in CODE_DIRS for p in sorted(d.rglob("*.py"))]
    return [(p, ast.parse(p.read_text())) for p in files]


@cache
def logged_events() -> dict[str, dict[str, object]]:
    """event name -> {field: constant value or None}; '**' in the fields if any are spread."""
    events: dict[str, dict[str, object]] = {}
    for _, tree in _trees():
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LOG_METHODS
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and re.fullmatch(r"[a-z][a-z0-9_]*", node.args[0].value)
            ):
                continue
            fields = events.setdefault(node.args[0].value, {})
            for kw in node.keywords:
                name = kw.arg or "**"
                value = kw.value.value if isinstance(kw.value, ast.Constant) else None
                fields.setdefault(name, value)
    return events


@cache
def spread_fields() -> set[str]:
    """Keys of ``as_dict()`` results (spread into log lines with ``**result.as_dict()``)."""
    keys: set[str] = set()
    for _, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "as_dict":
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Dict):
                        keys |= {
                            k.value
                            for k in sub.keys
                            if isinstance(k, ast.Constant) and isinstance(k.value, str)
                        }
    return keys


@cache
def all_fields() -> set[str]:
    return {f for fields in logged_events().values() for f in fields} | spread_fields()


@cache
def code_strings() -> set[str]:
    return {
        node.value
        for _, tree in _trees()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


@cache
def alert_names() -> set[str]:
    names: set[str] = set()
    for _, tree in _trees():
        consts = {
            t.id: n.value.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Alert":
                arg = node.args[0] if node.args else None
                arg = arg or next((k.value for k in node.keywords if k.arg == "name"), None)
                if isinstance(arg, ast.Constant):
                    names.add(arg.value)
                elif isinstance(arg, ast.Name) and arg.id in consts:
                    names.add(consts[arg.id])
    return names


def prometheus_alerts() -> set[str]:
    rules = yaml.safe_load((REPO / "ops" / "prometheus" / "alerts.yml").read_text())
    return {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}


def catalog_metrics() -> dict[str, dict]:
    return yaml.safe_load((REPO / "ops" / "metrics.yml").read_text())["metrics"]


@cache
def last_error_values() -> set[str]:
    """Every ``last_error`` the detach outcome rules write (produced by calling them)."""
    values: set[str] = set()
    max_attempts = snapshot_detach.CONFIG.defaults["max_attempts"]
    outcomes = [CallOutcome(status_code=code) for code in range(100, 600)]
    outcomes += [CallOutcome(status_code=c, retry_after_seconds=120.0) for c in (429, 503)]
    # transport errors as the client reports them; ClientError:<class> is what the job records
    # when the client raises (tests/integration/test_snapshot_detach_branches.py)
    outcomes += [CallOutcome(error_class=c) for c in ("Timeout", "ConnectionError")]
    outcomes += [CallOutcome(error_class="ClientError:RuntimeError")]
    for outcome in outcomes:
        for attempts in (1, max_attempts):
            error = snapshot_detach.classify(outcome, attempts, max_attempts).error
            if error:
                values.add(error)
    assert '"UnknownReason"' in (REPO / snapshot_detach.__file__).read_text()
    values.add("UnknownReason")  # written for a row with an unknown reason, never called
    requeue = (REPO / "include/sql/news/requeue_quarantined_entries.sql").read_text()
    prefix = re.search(r"'(requeued: )'", requeue).group(1)
    values |= {prefix + v for v in list(values)}
    return values


def _pattern(span: str) -> re.Pattern[str]:
    """A doc value with placeholders (`<code>`, `<n>`, `...`, `4xx`) as a regex."""
    out = re.escape(span)
    for placeholder, regex in (
        (re.escape("<code>"), r"\d{3}"),
        (re.escape("<n>"), r"\d+(?:\.\d+)?"),
        (re.escape("<exception class>"), r"\w+"),
        (re.escape("..."), r".*"),
        ("4xx", r"4\d\d"),
        ("5xx", r"5\d\d"),
    ):
        out = out.replace(placeholder, regex)
    return re.compile(out)


# ------------------------------------------------------------------------------- the tests

DOC_IDS = list(DOCS)


def fields_of(event: str) -> set[str]:
    """The fields a log line of ``event`` carries (a ``**result.as_dict()`` spreads its keys)."""
    fields = set(logged_events()[event]) | ALWAYS_LOGGED
    return (fields - {"**"}) | spread_fields() if "**" in fields else fields


def _events_named(text: str) -> list[str]:
    return [m for m in re.findall(r"`event=([a-z_]+)", text)]


@pytest.mark.parametrize("doc", DOC_IDS)
def test_quoted_log_events_and_fields_are_logged(doc: str) -> None:
    events = logged_events()
    for span in spans(DOCS[doc]):
        if not span.startswith("event="):
            continue
        tokens = span.split()
        name = tokens[0].removeprefix("event=")
        if name == "...":
            continue
        assert name in events, f"{doc}: `{span}`: no code logs event {name!r}"
        for token in tokens[1:]:
            if "=" not in token:
                continue
            key, value = token.split("=", 1)
            assert key in fields_of(name), (
                f"{doc}: `{span}`: event {name!r} has no field {key!r} "
                f"(has {sorted(fields_of(name))})"
            )
            constant = events[name].get(key)
            if value != "..." and isinstance(constant, str):
                assert constant == value, f"{doc}: `{span}`: {key} is {constant!r}"


@pytest.mark.parametrize("doc", DOC_IDS)
def test_quoted_log_fields_exist(doc: str) -> None:
    """`HasMore=True` next to `event=completed`: a field of that line (else of some line)."""
    for para in paragraphs(DOCS[doc]):
        named = [e for e in _events_named(para) if e in logged_events()]
        for span in spans(para):
            m = re.fullmatch(r"([A-Za-z_]+)=(\S+)", span)
            if not m or span.startswith("event="):
                continue
            key = m.group(1)
            if any(_pattern(span).search(v) for v in last_error_values()):
                continue  # part of a last_error value (`retry_after=<n>s`)
            if any(span in p.read_text() for p in DAGS.glob("*.py")):
                continue  # a DAG argument (`max_active_runs=1`)
            if named:
                assert any(key in fields_of(e) for e in named), (
                    f"{doc}: `{span}`: not a field of the line(s) {named} it is quoted with"
                )
            else:
                assert key in all_fields(), f"{doc}: `{span}`: no log field {key!r}"


@pytest.mark.parametrize("doc", DOC_IDS)
def test_quoted_metric_names_are_emitted(doc: str) -> None:
    catalog = catalog_metrics()
    dag_ids = {p.stem for p in DAGS.glob("*.py")}
    prefix = DAG_METRIC_PREFIX.get(doc.removeprefix("dags/"))
    for span in spans(DOCS[doc]):
        name = span
        if prefix and re.fullmatch(r"_[a-z_]+", span):
            name = prefix + span
        if not re.fullmatch(r"[a-z_]+", name) or not name.startswith(METRIC_PREFIXES):
            if re.fullmatch(r"[a-z_]+_total", span):  # `errors_total`: a known metric's tail
                assert any(m.endswith("_" + span) for m in catalog), f"{doc}: `{span}`"
            continue
        if name in dag_ids or name.endswith("_deadline_seconds"):
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        metric = name if name in catalog else base
        assert metric in catalog, f"{doc}: `{span}` is not a metric in ops/metrics.yml"
        assert metric in code_strings(), f"{doc}: `{span}`: no job emits {metric}"
        if metric != name:
            assert catalog[metric]["type"] == "timing", f"{doc}: `{span}`"


def _last_error_candidates(doc: str) -> list[str]:
    """Backticked values that look like a ``last_error``, in the docs that talk about it.

    An error class or a guess at one (`HttpNotFound 404`, `http_404`, `timeout`,
    `connection_error`, `... ; max_attempts 12 reached`, `requeued: ...`).
    """
    if "last_error" not in DOCS[doc]:
        return []
    looks_like_error = re.compile(
        r"(?i)^(\.\.\.;? )?(http|timeout|connection|clienterror|unknownreason|requeued)"
        r"|max_attempts \d"
    )
    return [s for s in spans(DOCS[doc]) if looks_like_error.search(s)]


@pytest.mark.parametrize("doc", DOC_IDS)
def test_quoted_last_error_values_are_written_by_the_job(doc: str) -> None:
    values = last_error_values()
    for span in _last_error_candidates(doc):
        pattern = _pattern(span.rstrip(":") if span.endswith(":") else span)
        assert any(pattern.search(v) for v in values), (
            f"{doc}: `{span}` is not a last_error the job writes (e.g. {sorted(values)[:6]} ...)"
        )


def test_the_last_error_check_catches_the_old_guesses() -> None:
    """The values the runbooks used to quote, which the job never writes, are rejected."""
    values = last_error_values()
    for guess in ("http_404", "http_5xx:503", "timeout", "connection_error", "http_401"):
        assert not any(_pattern(guess).search(v) for v in values), guess
    for real in ("HttpNotFound 404", "HttpServerError <code>", "...; max_attempts 12 reached"):
        assert any(_pattern(real).search(v) for v in values), real


@pytest.mark.parametrize("doc", DOC_IDS)
def test_quoted_alert_names_exist(doc: str) -> None:
    text = _prose(DOCS[doc])
    prom = prometheus_alerts()
    for word in set(re.findall(r"\b(?:News|Calendar|Activity)[A-Z][A-Za-z]+\b", text)):
        assert word in prom, f"{doc}: {word} is not an alert in ops/prometheus/alerts.yml"
    notifier = alert_names()
    for para in paragraphs(DOCS[doc]):
        if not re.search(r"(?i)\balerts?\b", para):
            continue
        for span in spans(para):
            if span.endswith(("_failed", "_missed", "_quarantined", "_row", "_too_long")) and (
                re.fullmatch(r"[a-z_]+", span)
            ):
                if span in logged_events() and span not in notifier:
                    continue  # a log event named like an alert (`event=...` checked above)
                assert span in notifier, f"{doc}: `{span}` is not an alert the code sends"


def test_runbook_index_names_every_notifier_alert() -> None:
    index = (RUNBOOKS / "README.md").read_text()
    table = [line for line in index.splitlines() if line.startswith("| ")]
    quoted = {s for line in table for s in re.findall(r"`([a-z_]+)`", line)}
    assert quoted <= alert_names(), quoted - alert_names()
    assert alert_names() <= quoted, f"alerts without a runbook: {alert_names() - quoted}"


@pytest.mark.parametrize("doc", DOC_IDS)
def test_quoted_lock_names_and_keys_are_the_jobs(doc: str) -> None:
    locks = {activity_retention.LOCK_NAME, snapshot_detach.LOCK_NAME}
    keys = {lock_key(name) for name in locks}
    text = DOCS[doc]
    for span in spans(text):
        if "job:scheduled:" in span:
            name = re.search(r"['\"]?([\w:.-]*job:scheduled:[\w-]+)", span).group(1)
            assert name in locks, f"{doc}: `{span}` is not a job's lock name"
    for number in re.findall(r"-?\d{15,}", text):
        assert int(number) in keys, f"{doc}: {number} is not a job's lock key"
