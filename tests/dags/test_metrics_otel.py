"""The jobs' metrics reach an OTLP/HTTP receiver from ``airflow dags test`` with
``[metrics] otel_on=True``, each under Airflow's prefix with the value its run earned.

A loopback receiver (devtools/otlp_receiver.py) decodes the real ``ExportMetricsServiceRequest``
protobuf that Airflow's OTel metrics logger sends. Each job runs once on data whose outcome the
test measures in the database (slots expired, rows deleted, outbox rows done / pending /
quarantined) and in the selections service (failed calls); every metric of the job must arrive
as ``airflow.<name>`` with the OTLP kind of its type and that value.

What Airflow 3.3.2 does with a name (read in ``airflow.sdk._shared.observability.metrics.
otel_logger``, shown by these tests): the instrument is ``<otel_prefix>.<name>`` (prefix
``airflow``; an empty ``otel_prefix`` falls back to it), the name itself unchanged (dots stay
dots). A counter is a monotonic cumulative sum (sent at 0 when the run starts, so it arrives
even when nothing happened), a gauge a gauge, a timing an exponential histogram in
milliseconds (unit ``ms``). No attributes. The periodic reader exports every
``otel_interval_milliseconds`` (60 s by default) and once more at the process's exit, so a run
shorter than the interval still arrives; the receiver keeps every export and the last point of
a series is its final value.

The job runs use ``[metrics] otel_on`` with the standard ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``
(the form Airflow 3.3.2 advises, and the one docs/design.md gives), one receiver and so one
warm interpreter (devtools/airflow_forkserver.py) for the three of them. One more run, of the
fixture DAG that emits the whole catalog, uses Airflow's own ``[metrics] otel_host`` /
``otel_port`` / ``otel_prefix`` / ``otel_service`` settings (the form of Airflow's metrics page,
logged as deprecated by 3.3.2; Airflow adds ``/v1/metrics``; ignored when the variable is set).

To check one more metric, add its line to the job's table: the name, and what must arrive
(``counter``, ``gauge`` or ``timing`` of a number or of a fact the test measured).
"""

from __future__ import annotations

import ast
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from itertools import takewhile

import pytest

from devtools.otlp_receiver import OtlpReceiver, ReceivedPoint
from devtools.pg import Database
from devtools.retention_data import seed_sessions
from devtools.selections_service import SelectionsService
from tests.dags.test_metrics_statsd import CATALOG, FIXTURES, NO_JOB_DB, emit_plan
from tests.dags.test_traces_dags_test import tracing_env
from tests.integration.slot_expiration_fixtures import (
    DAG_CONF,
    seed_slots_with_poison,
    table_state,
)
from tests.integration.snapshot_detach_fixtures import insert_entry, rows

pytestmark = pytest.mark.dags

PREFIX = "airflow."  # [metrics] otel_prefix, Airflow's default
SLOTS = "calendar_slot_expiration"
RETENTION = "user_activity_retention"
DETACH = "news_snapshot_detach_retry"


@dataclass(frozen=True)
class Range:
    """A value known to lie within [lo, hi] (a timestamp, a duration)."""

    lo: float
    hi: float


Value = float | str  # a number, or the name of a fact the test measured (a number or a Range)


@dataclass(frozen=True)
class Expect:
    """What one metric must arrive as: its OTLP kind, its value and, for a timing (histogram),
    how many observations (``value`` is then their sum in milliseconds)."""

    kind: str
    value: Value
    count: Value = 1


def counter(value: Value) -> Expect:
    return Expect("sum", value)


def gauge(value: Value) -> Expect:
    return Expect("gauge", value)


def timing(count: Value, total_ms: Value) -> Expect:
    return Expect("exponential_histogram", total_ms, count)


OTEL_KIND = {"counter": "sum", "gauge": "gauge", "timing": "exponential_histogram"}

# What each job's run must export, by the name ops/metrics.yml promises. One line per metric.
SLOT_METRICS = {
    "calendar_slot_expiration_items_total": counter("expired"),
    # the job's role is not in pg_monitor (the grant script's): its runs are not paced, sent at 0
    "calendar_slot_expiration_paced_replica_lag_milliseconds_total": counter(0),
    "calendar_slot_expiration_paced_wal_rate_milliseconds_total": counter(0),
    "calendar_slot_expiration_skip_locked_total": counter(0),  # nothing else locks a slot
    "calendar_slot_expiration_errors_total": counter("poison_rows"),
    "calendar_slot_expiration_backlog": gauge("due_left"),
    "calendar_slot_expiration_cycle_duration_seconds": timing(1, "run_ms"),
    "calendar_slot_expiration_last_success_timestamp_seconds": gauge("run_window"),
}
RETENTION_METRICS = {
    "activity_retention_deleted_sessions": counter("deleted_sessions"),
    "activity_retention_deleted_property_object_views": counter("deleted_property_object_views"),
    "activity_retention_deleted_action_events": counter("deleted_action_events"),
    "activity_retention_batches_processed": counter("session_batches"),
    "activity_retention_eligible_backlog": gauge("deleted_sessions"),  # all eligible, all gone
    "activity_retention_lock_contention_total": counter(0),
    "activity_retention_paced_replica_lag_milliseconds_total": counter(0),  # not paced, as slots
    "activity_retention_paced_wal_rate_milliseconds_total": counter(0),
    "activity_retention_run_duration_seconds": timing(1, "run_ms"),
    "activity_retention_last_success_timestamp_seconds": gauge("run_window"),
}
DETACH_METRICS = {
    "news_snapshot_detach_succeeded_total": counter("done"),
    "news_snapshot_detach_retried_total": counter("pending"),
    "news_snapshot_detach_quarantined_total": counter("quarantined"),
    "news_snapshot_detach_failed_total": counter("failed_calls"),
    "news_snapshot_detach_lock_contention_total": counter(0),
    "news_snapshot_detach_breaker_open_total": counter(0),
    "news_snapshot_detach_pending": gauge("pending"),
    "news_snapshot_detach_oldest_age_seconds": gauge("oldest_pending_age"),
    "news_snapshot_detach_concurrency_limit": gauge("concurrency_limit"),
    "news_snapshot_detach_lag_seconds": timing("done", "done_lag_ms"),
    "news_snapshot_detach_run_duration_seconds": timing(1, "run_ms"),
    "news_snapshot_detach_last_success_timestamp_seconds": gauge("run_window"),
}
JOB_TABLES = {SLOTS: SLOT_METRICS, RETENTION: RETENTION_METRICS, DETACH: DETACH_METRICS}


def test_the_tables_cover_the_catalog_with_its_types() -> None:
    """Together the three runs show every metric ops/metrics.yml promises."""
    tables = {name: e for table in JOB_TABLES.values() for name, e in table.items()}
    promised = set(CATALOG)
    assert set(tables) >= promised
    assert {n: tables[n].kind for n in promised} == {
        n: OTEL_KIND[CATALOG[n]["type"]] for n in promised
    }


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


def otel_env(receiver: OtlpReceiver) -> dict[str, str]:
    """The settings docs/design.md ("Metrics") gives: ``otel_on`` and the standard variable."""
    return {
        "AIRFLOW__METRICS__OTEL_ON": "True",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.metrics_endpoint,
    }


@dataclass
class Run:
    """One ``dags test`` run with the receiver cleared before it; ``facts`` gets the run's
    wall-clock window (``run_window``, Unix s) and an upper bound of its duration (``run_ms``)."""

    output: str
    facts: dict[str, float | Range]


def run_with_otel(
    run_dag, otlp: OtlpReceiver, dag_id: str, db: Database, env: dict | None = None, **kwargs
) -> Run:
    otlp.clear()
    t0, m0 = time.time(), time.monotonic()
    done = run_dag(dag_id, db, extra_env=(env or {}) | otel_env(otlp), **kwargs)
    t1, wall_ms = time.time(), (time.monotonic() - m0) * 1000
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return Run(output, {"run_window": Range(t0, t1), "run_ms": Range(0, wall_ms)})


def final_points(otlp: OtlpReceiver, names: set[str]) -> dict[str, ReceivedPoint]:
    """The last point of each of ``names`` (cumulative: its final value), once all arrived."""
    wanted = {PREFIX + n for n in names}
    points = otlp.wait_for_metrics(lambda got: wanted <= {p.name for p in got}, timeout=15)
    last = {p.name.removeprefix(PREFIX): p for p in points if p.name in wanted}
    return last


def _want(value: Value, facts: dict[str, float | Range]) -> float | Range:
    return facts[value] if isinstance(value, str) else float(value)


def _matches(got: float, want: float | Range) -> bool:
    if isinstance(want, Range):
        return want.lo <= got <= want.hi
    return got == want


def check_job_metrics(otlp: OtlpReceiver, table: dict[str, Expect], facts: dict) -> None:
    """Every metric of ``table`` arrived once per export, as its kind, with its value; no
    other metric with the job's prefix arrived."""
    finals = final_points(otlp, set(table))
    mismatches = {}
    for name, expect in table.items():
        p = finals[name]
        want, count = _want(expect.value, facts), _want(expect.count, facts)
        got = (p.kind, p.value, p.count, p.attributes)
        if not (
            p.kind == expect.kind
            and _matches(p.value, want)
            and _matches(p.count, count)
            and p.attributes == {}
        ):
            mismatches[name] = {"got": got, "want": (expect.kind, want, count, {})}
        if expect.kind == "sum":
            assert (p.monotonic, p.temporality) == (True, "CUMULATIVE"), name
        if expect.kind == "exponential_histogram":
            assert p.unit == "ms", name
    assert mismatches == {}
    shared = takewhile(lambda chars: len(set(chars)) == 1, zip(*table, strict=False))
    job = PREFIX + "".join(c[0] for c in shared)  # e.g. airflow.calendar_slot_expiration_
    arrived = {p.name for p in otlp.metrics() if p.name.startswith(job)}
    others = arrived - {PREFIX + n for n in table}
    assert others == set(), "a metric of the job arrived that its table does not list"


def _return_value(output: str) -> dict:
    marker = "Returned value was: "
    (line,) = [x for x in output.splitlines() if marker in x]
    text = line.split(marker, 1)[1]
    return ast.literal_eval(text[: text.rindex("}") + 1])


def test_slot_expiration_metrics_arrive_with_the_run_s_counts(db: Database, run_dag, otlp):
    poison = seed_slots_with_poison(db)  # isolated and counted as an error
    before = table_state(db)

    run = run_with_otel(run_dag, otlp, SLOTS, db, conf=DAG_CONF)

    after = table_state(db)
    expired = [i for i in after if after[i][0] == "Expired" and before[i][0] == "Available"]
    assert after[poison] == before[poison]
    with db.connect() as conn:
        (due_left,) = conn.execute(
            "select count(*) from calendar.availability_slots"
            " where status = 'Available' and start_at < now()"
        ).fetchone()
    facts = run.facts | {"expired": len(expired), "poison_rows": 1, "due_left": due_left}
    assert (len(expired), due_left) == (5, 1)
    check_job_metrics(otlp, SLOT_METRICS, facts)


def _activity_counts(db: Database) -> dict[str, int]:
    with db.connect() as conn:
        return {
            t: conn.execute(f"select count(*) from user_activity.{t}").fetchone()[0]
            for t in ("sessions", "property_object_views", "action_events")
        }


def test_retention_metrics_arrive_with_the_rows_deleted(db: Database, run_dag, otlp):
    with db.connect() as conn:
        seed_sessions(conn, 25, 8, 2, tag="otel")
        conn.commit()
    before = _activity_counts(db)

    run = run_with_otel(run_dag, otlp, RETENTION, db, conf={"batch_size": 7})

    after = _activity_counts(db)
    deleted = {f"deleted_{t}": before[t] - after[t] for t in before}
    assert deleted == {
        "deleted_sessions": 25,
        "deleted_property_object_views": 50,
        "deleted_action_events": 50,
    }
    (completed,) = [x for x in run.output.splitlines() if "event=job_completed " in x]
    batches = int(completed.split("batches_processed=", 1)[1].split()[0])
    assert batches == 4  # 25 sessions in batches of 7
    check_job_metrics(otlp, RETENTION_METRICS, run.facts | deleted | {"session_batches": batches})


def test_detach_metrics_arrive_with_the_run_s_outcomes_and_no_spans_with_tracing_off(
    db: Database, run_dag, otlp
):
    created_ago = timedelta(minutes=5)
    inserting = time.time()
    entries = [insert_entry(db, created_ago=created_ago) for _ in range(5)]
    inserted = time.time()
    ok, retry, bad = entries[:3], entries[3], entries[4]
    with SelectionsService() as svc:
        svc.script(retry.snapshot_id, "error_503")
        svc.script(bad.snapshot_id, "bad_request")
        # every OTEL_* setting of tracing in place, only [traces] otel_on off
        tracing_off = tracing_env(otlp.endpoint) | {"AIRFLOW__TRACES__OTEL_ON": "False"}
        run = run_with_otel(run_dag, otlp, DETACH, db, env=tracing_off, selections_url=svc.url)
        calls = [c for e in entries for c in svc.calls_for(e.snapshot_id)]
    assert all(c.traceparent is None for c in calls)
    assert otlp.spans() == [] and "trace_id=" not in run.output

    state = {sid: r.status for sid, r in rows(db).items()}
    outcome = {s: sum(v == s for v in state.values()) for s in ("Done", "Pending", "Quarantined")}
    assert outcome == {"Done": 3, "Pending": 1, "Quarantined": 1}
    assert {e.snapshot_id for e in ok} == {s for s, v in state.items() if v == "Done"}
    # now - created_at, seen during the run: created_at = (insert time) - created_ago
    window: Range = run.facts["run_window"]  # type: ignore[assignment]
    age_lo = window.lo - inserted + created_ago.total_seconds()
    age_hi = window.hi - inserting + created_ago.total_seconds()
    facts = run.facts | {
        "done": outcome["Done"],
        "pending": outcome["Pending"],
        "quarantined": outcome["Quarantined"],
        "failed_calls": sum(not (200 <= (c.status or 0) < 300) for c in calls),
        "oldest_pending_age": Range(age_lo, age_hi),
        # each Done row's lag (now - created_at) in milliseconds, the timing's unit, summed
        "done_lag_ms": Range(3 * age_lo * 1000, 3 * age_hi * 1000),
        "concurrency_limit": _return_value(run.output)["ConcurrencyLimit"],
    }
    assert facts["failed_calls"] == 2
    check_job_metrics(otlp, DETACH_METRICS, facts)


def test_airflow_s_own_otel_settings_carry_every_catalog_name(run_dag) -> None:
    """``[metrics] otel_host`` / ``otel_port`` / ``otel_ssl_active`` / ``otel_prefix`` /
    ``otel_service`` (the form of Airflow's metrics page, deprecated in 3.3.2 but working):
    every name of ops/metrics.yml passes Airflow's OTel name checks and arrives as
    ``<otel_prefix>.<name>``, once, with the kind of its type and its value.

    A receiver of its own: the warm interpreter of the job runs exports Airflow's own metrics
    (``airflow.serde.*``) to theirs every interval, for as long as the session lasts.
    """
    with OtlpReceiver() as otlp:
        host, port = otlp.address
        plan = emit_plan()
        points = _emit_through_airflow_settings(run_dag, otlp, host, port, plan)
    last = {p.name: p for p in points}
    got = {
        name: (last["pin." + name].kind, last["pin." + name].value, last["pin." + name].count)
        for name, _, _ in plan
    }
    assert got == {  # a timing's value is in milliseconds
        name: (OTEL_KIND[kind], value * 1000 if kind == "timing" else value, 1)
        for name, kind, value in plan
    }
    assert {p.service for p in points} == {"pin-maintenance-otel-test"}
    assert not [p.name for p in points if p.name.startswith(PREFIX)], "otel_prefix applies"


def _emit_through_airflow_settings(
    run_dag, otlp: OtlpReceiver, host: str, port: int, plan: list[list]
) -> list[ReceivedPoint]:
    env = {
        "AIRFLOW__CORE__DAGS_FOLDER": str(FIXTURES),
        "AIRFLOW__METRICS__OTEL_ON": "True",
        "AIRFLOW__METRICS__OTEL_HOST": host,
        "AIRFLOW__METRICS__OTEL_PORT": str(port),
        "AIRFLOW__METRICS__OTEL_SSL_ACTIVE": "False",
        "AIRFLOW__METRICS__OTEL_PREFIX": "pin",
        "AIRFLOW__METRICS__OTEL_SERVICE": "pin-maintenance-otel-test",
    }
    done = run_dag("pin_fixture_metrics", NO_JOB_DB, conf={"emit": plan}, extra_env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    wanted = {"pin." + name for name, _, _ in plan}
    return otlp.wait_for_metrics(lambda got: wanted <= {p.name for p in got}, timeout=15)
