"""What the runbooks and DAG docs quote exists in the code: log events and their fields, metric
names, ``last_error`` values, alert names, lock names and keys.

The docs are docs/runbooks/*.md and each DAG file's docstring (its ``doc_md``). The code side is
read from the source (log calls and ``Alert(...)`` by AST, metric names from the job modules and
ops/metrics.yml) or produced by the code itself (every ``last_error`` the outcome rules can
write, by calling them), never from a list kept here.

Log events and fields go through the vocabulary tables of docs/design.md, "Log vocabulary": the
code must log exactly what the tables say, the tables must follow the convention, and the docs
may quote only what the tables hold. So the runbooks, the code and the table cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from include.pin_maintenance import lifecycle
from include.pin_maintenance.db import lock_key
from include.pin_maintenance.jobs import activity_retention, snapshot_detach
from include.pin_maintenance.jobs.snapshot_detach_answers import CallOutcome, answer_of, decide

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


def _is_log_method(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in LOG_METHODS


def _log_aliases(tree: ast.Module) -> set[str]:
    """Names bound to a choice of log methods (``emit = log.error if ... else log.warning``)."""
    return {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.IfExp)
        and _is_log_method(node.value.body)
        and _is_log_method(node.value.orelse)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _event_names(arg: ast.AST) -> list[str]:
    """``"name"``, ``"a" if ... else "b"`` or a lifecycle constant (``STARTED``): the event
    names a log call can write."""
    options = [arg.body, arg.orelse] if isinstance(arg, ast.IfExp) else [arg]
    names = [o.value for o in options if isinstance(o, ast.Constant) and isinstance(o.value, str)]
    names += [
        getattr(lifecycle, o.id)
        for o in options
        if isinstance(o, ast.Name) and isinstance(getattr(lifecycle, o.id, None), str)
    ]
    return [n for n in names if re.fullmatch(r"[a-z][a-z0-9_]*", n)]


LIFECYCLE = Path(lifecycle.__file__).resolve()


def _spreads_progress(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "progress" for n in ast.walk(node))


def _lifecycle_methods() -> dict[str, tuple[str, set[str]]]:
    """JobRun method -> (the event it logs, its own parameters): a job's call of the method
    logs that event with the call's other keywords (``run.started(as_of=...)``)."""
    (cls,) = [
        n
        for n in ast.walk(ast.parse(LIFECYCLE.read_text()))
        if isinstance(n, ast.ClassDef) and n.name == "JobRun"
    ]
    methods = {}
    for func in cls.body:
        if not isinstance(func, ast.FunctionDef):
            continue
        params = {a.arg for a in func.args.args + func.args.kwonlyargs}
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and _is_log_method(node.func) and node.args:
                for event in _event_names(node.args[0]):
                    methods[func.name] = (event, params)
    return methods


def _progress_fields(tree: ast.Module) -> set[str]:
    """Fields a job puts in ``run.progress`` (``.update(k=...)`` or ``["k"] = ...``)."""
    fields: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and _spreads_progress(node.func.value)
        ):
            fields |= {kw.arg for kw in node.keywords if kw.arg}
        if isinstance(node, ast.Assign):
            fields |= {
                t.slice.value
                for t in node.targets
                if isinstance(t, ast.Subscript)
                and _spreads_progress(t.value)
                and isinstance(t.slice, ast.Constant)
            }
    return fields


def _log_calls(tree: ast.Module) -> list[tuple[str, list[ast.keyword]]]:
    """(event, keywords) of each log call: ``log.info("name", ...)`` and its aliases, and a
    job's call of a lifecycle method (``run.started(...)``: the method's event, the call's
    keywords that are not the method's own parameters)."""
    aliases = _log_aliases(tree)
    methods = _lifecycle_methods()
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in methods:
            event, params = methods[func.attr]
            calls.append((event, [kw for kw in node.keywords if kw.arg not in params]))
        elif node.args and (
            _is_log_method(func) or (isinstance(func, ast.Name) and func.id in aliases)
        ):
            calls += [(event, node.keywords) for event in _event_names(node.args[0])]
    return calls


@cache
def logged_events() -> dict[str, dict[str, object]]:
    """event name -> {field: constant value or None}; '**' in the fields if any are spread.

    The lifecycle's own lines spread what the jobs give them: the keywords of a job's
    ``run.started(...)`` / ``run.completed(...)`` / ... call, and the fields a job puts in
    ``run.progress`` (on the lines that spread it); both are read from the jobs.
    """
    events: dict[str, dict[str, object]] = {}
    with_progress: set[str] = set()
    progress: set[str] = set()
    for path, tree in _trees():
        in_lifecycle = path.resolve() == LIFECYCLE
        progress |= _progress_fields(tree)
        for event, keywords in _log_calls(tree):
            fields = events.setdefault(event, {})
            for kw in keywords:
                if in_lifecycle and kw.arg is None:  # the jobs' fields, read from the jobs
                    if _spreads_progress(kw.value):
                        with_progress.add(event)
                    continue
                value = kw.value.value if isinstance(kw.value, ast.Constant) else None
                fields.setdefault(kw.arg or "**", value)
    for event in with_progress:
        for field in progress:
            events[event].setdefault(field, None)
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
    # keys built by f-string (f"Deleted{k}"): produced by the code itself, dry run or not
    for dry_run in (False, True):
        keys |= set(activity_retention.RetentionResult(dry_run=dry_run).as_dict())
    return keys


@cache
def all_fields() -> set[str]:
    """Every log field: the rows of docs/design.md's "Log fields" table."""
    return set(vocabulary_fields())


# ------------------------------------------------------------------- the vocabulary tables

DESIGN = REPO / "docs" / "design.md"

# Names the code logs today that break the convention -> the conventional name. They are
# renamed in one commit of their own (docs/design.md, "Log vocabulary"); a name stays here only
# while the code still logs it.
PENDING_RENAMES: dict[str, str] = {}


def _table_after(heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after ``heading`` in docs/design.md."""
    lines = DESIGN.read_text().splitlines()
    start = lines.index(heading)
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert rows, f"docs/design.md: no table after {heading!r}"
    header, _, *body = rows
    return [dict(zip(header, row, strict=True)) for row in body]  # type: ignore[misc]


def _quoted(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@cache
def vocabulary_events() -> dict[str, set[str]]:
    """docs/design.md "Log events": event -> its fields (beyond job and run_id)."""
    table = _table_after("### Log events")
    events = {}
    for row in table:
        (event,) = _quoted(row["event"])
        assert event not in events, f"Log events: {event!r} twice"
        events[event] = set(_quoted(row["fields (beyond `job`, `run_id`)"]))
    return events


@cache
def vocabulary_fields() -> dict[str, dict[str, object]]:
    """docs/design.md "Log fields": field -> its seed names and result key."""
    fields: dict[str, dict[str, object]] = {}
    for row in _table_after("### Log fields"):
        (name,) = _quoted(row["field"])
        assert name not in fields, f"Log fields: {name!r} twice"
        result_key = _quoted(row["result key"])
        fields[name] = {
            "seed": _quoted(row["seed name"]),
            "result_key": result_key[0] if result_key else None,
        }
    return fields


def snake(name: str) -> str:
    """``SkippedLockedCount`` -> ``skipped_locked_count``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def config_keys() -> set[str]:
    from include.pin_maintenance.jobs import (
        activity_retention_config,
        slot_expiration_config,
        snapshot_detach_config,
    )

    specs = (activity_retention_config, slot_expiration_config, snapshot_detach_config)
    return {s.name for m in specs for s in m.CONFIG.settings}


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
    max_attempts = snapshot_detach.CONFIG.defaults.max_attempts
    outcomes = [CallOutcome(status_code=code) for code in range(100, 600)]
    outcomes += [CallOutcome(status_code=c, retry_after_seconds=120.0) for c in (429, 503)]
    # transport errors as the client reports them; ClientError:<class> is what the job records
    # when the client raises (tests/integration/test_snapshot_detach_branches.py)
    outcomes += [CallOutcome(error_class=c) for c in ("Timeout", "ConnectionError")]
    outcomes += [CallOutcome(error_class="ClientError:RuntimeError")]
    for outcome in outcomes:
        for attempts in (1, max_attempts):
            error = decide(answer_of(outcome), attempts, max_attempts).error
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
    """The fields a log line of ``event`` carries, as docs/design.md's "Log events" says (the
    tests below hold the table to the code)."""
    return vocabulary_events()[event] | ALWAYS_LOGGED


def test_every_logged_event_is_a_row_of_the_vocabulary() -> None:
    code, table = set(logged_events()), set(vocabulary_events())
    assert code - table == set(), f"logged but not in docs/design.md's Log events: {code - table}"
    assert table - code == set(), f"in docs/design.md's Log events but not logged: {table - code}"


@pytest.mark.parametrize("event", sorted(logged_events()))
def test_each_event_logs_exactly_the_fields_of_its_row(event: str) -> None:
    code = set(logged_events()[event])
    table = vocabulary_events().get(event, set())
    if "**" in code:  # a spread result: the rest of the row must be keys of a result
        explicit = code - {"**"}
        assert explicit <= table, f"{event}: logged, not in its row: {explicit - table}"
        assert table - explicit <= spread_fields(), f"{event}: {table - explicit - spread_fields()}"
    else:
        assert code == table, (
            f"{event}: logged but not in its row {sorted(code - table)}; "
            f"in its row but not logged {sorted(table - code)}"
        )


def test_every_field_of_an_event_is_a_row_of_the_fields_table() -> None:
    used = {f for fields in vocabulary_events().values() for f in fields} | ALWAYS_LOGGED
    described = set(vocabulary_fields())
    assert used - described == set(), f"fields without a row in Log fields: {used - described}"
    assert described - used == set(), f"Log fields rows no event logs: {described - used}"


def test_the_fields_follow_the_convention() -> None:
    """snake_case; a result's key in snake_case; durations in duration_ms; one field per seed
    name. Only PENDING_RENAMES may break it, until their commit."""
    keys = config_keys()
    owner: dict[str, str] = {}
    for name, row in vocabulary_fields().items():
        if name in PENDING_RENAMES:
            continue
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", name), f"{name}: not snake_case"
        if row["result_key"]:
            assert name == snake(row["result_key"]), f"{name}: result key {row['result_key']}"
        if name not in keys and name != "duration_ms":
            assert "duration" not in name and not name.endswith("_seconds"), (
                f"{name}: a measured duration is duration_ms"
            )
        for seed_name in row["seed"]:
            assert owner.setdefault(seed_name, name) == name, (
                f"seed name {seed_name!r} is two fields: {owner[seed_name]!r} and {name!r}"
            )


def test_pending_renames_are_still_logged() -> None:
    """Once the code stops logging a name, it leaves PENDING_RENAMES (and the table)."""
    logged = {f for fields in logged_events().values() for f in fields} | spread_fields()
    assert set(PENDING_RENAMES) <= logged, set(PENDING_RENAMES) - logged
    assert set(PENDING_RENAMES) <= set(vocabulary_fields())


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
        r"(?i)^(\.\.\.;? )?(http|timeout|connection|clienterror|unknownreason|requeued:)"
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
