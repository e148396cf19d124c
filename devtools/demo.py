"""`make demo`: every job on the embedded Postgres, run through Airflow, with a short report.

1. starts the embedded PostgreSQL (or uses PIN_PG_URL) and recreates the database ``pin_demo``
   with the reference schema, the job roles of ``include/sql/schema/job_roles.sql``
   (``pin_news``, ``pin_calendar``, ``pin_activity``: every DAG's job connection logs in as
   its role, never as the owner) and realistic data for all three jobs;
2. starts the local selections service on loopback (scripted: successes, already detached,
   5xx, unknown snapshots, throttling) and a webhook sink for alerts;
3. runs each DAG once with ``airflow dags test`` (docs/design.md, "Running a DAG the
   standard way");
4. prints what each job did, read back from the database, and how to open the UI.

Exits non-zero if any DAG run fails.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psycopg

from devtools import airflow_env as ae
from devtools import pg
from devtools.outbox_data import generate_outbox
from devtools.retention_data import seed_sessions
from devtools.selections_service import SelectionsService

REPO = Path(__file__).resolve().parent.parent
# Where the embedded server's data and the demo's Airflow home live (tests point it elsewhere).
LOCAL = Path(os.environ.get("PIN_LOCAL_DIR", REPO / ".local"))
DEMO_DB = "pin_demo"
AIRFLOW_HOME = LOCAL / "airflow-demo"
SEED_SQL = Path(__file__).resolve().parent / "sql"

Counts = dict[str, int]


@dataclass
class DemoJob:
    dag_id: str
    snapshot: Callable[[psycopg.Connection], Counts]
    describe: Callable[[Counts, Counts], str]
    conf: dict | None = None


def _one(conn: psycopg.Connection, query: str) -> int:
    return int(conn.execute(query).fetchone()[0])


def slot_counts(conn: psycopg.Connection) -> Counts:
    return {
        "due": _one(
            conn,
            "select count(*) from calendar.availability_slots"
            " where status = 'Available' and start_at <= now()",
        ),
        "expired": _one(
            conn, "select count(*) from calendar.availability_slots where status = 'Expired'"
        ),
        "booked": _one(
            conn, "select count(*) from calendar.availability_slots where status = 'Booked'"
        ),
        "future": _one(
            conn,
            "select count(*) from calendar.availability_slots"
            " where status = 'Available' and start_at > now()",
        ),
    }


def describe_slots(before: Counts, after: Counts) -> str:
    return (
        f"expired {after['expired'] - before['expired']} slots "
        f"(due before {before['due']}, due after {after['due']}); "
        f"booked {after['booked']}/{before['booked']} and future {after['future']}"
        f"/{before['future']} untouched"
    )


def activity_counts(conn: psycopg.Connection) -> Counts:
    return {
        "sessions": _one(conn, "select count(*) from user_activity.sessions"),
        "views": _one(conn, "select count(*) from user_activity.property_object_views"),
        "events": _one(conn, "select count(*) from user_activity.action_events"),
        "stats_views": _one(
            conn,
            "select coalesce(sum(views_count), 0) from user_activity.property_object_view_stats",
        ),
    }


def describe_retention(before: Counts, after: Counts) -> str:
    return (
        f"deleted sessions {before['sessions'] - after['sessions']}, "
        f"property_object_views {before['views'] - after['views']}, "
        f"action_events {before['events'] - after['events']}; "
        f"kept {after['sessions']} sessions; stats aggregate "
        f"{'unchanged' if before['stats_views'] == after['stats_views'] else 'CHANGED'}"
    )


def outbox_counts(conn: psycopg.Connection) -> Counts:
    rows = conn.execute(
        "select status, count(*), coalesce(sum(attempts), 0)"
        " from news.snapshot_detach_outbox group by status"
    ).fetchall()
    counts = {f"{status}": n for status, n, _ in rows}
    counts["attempts"] = sum(a for *_, a in rows)
    return counts


def describe_detach(before: Counts, after: Counts) -> str:
    detached = after.get("Done", 0) - before.get("Done", 0)
    quarantined = after.get("Quarantined", 0) - before.get("Quarantined", 0)
    attempted = after["attempts"] - before["attempts"]  # one claim = one attempt per row
    return (
        f"detached {detached}, retried later (still Pending, backoff set) "
        f"{attempted - detached - quarantined}, quarantined {quarantined}; "
        f"{after.get('Pending', 0)} Pending rows remain"
    )


def describe_requeue(before: Counts, after: Counts) -> str:
    return (
        f"dry run: would requeue {after.get('Quarantined', 0)} Quarantined rows; "
        f"changed nothing ({'ok' if before == after else 'CHANGED'})"
    )


JOBS = [
    DemoJob("news_snapshot_detach_retry", outbox_counts, describe_detach),
    DemoJob(
        "news_snapshot_detach_requeue",
        outbox_counts,
        describe_requeue,
        conf={"all_quarantined": True, "dry_run": True},
    ),
    # drain mode: the whole demo backlog in one cycle (a default cycle takes one batch of 500)
    DemoJob(
        "calendar_slot_expiration",
        slot_counts,
        describe_slots,
        conf={"max_batches_per_cycle": 10},
    ),
    DemoJob("user_activity_retention", activity_counts, describe_retention),
]


def alerts_raised(output: str) -> str:
    """``; alerts: name x N`` from the run's ``PIN_ALERT {json}`` log lines (deduplicated)."""
    counts: dict[str, int] = {}
    seen: set[str] = set()
    for match in re.finditer(r"PIN_ALERT (\{.*\})", output):
        payload = match.group(1)
        if payload in seen:  # the same line can reach both stdout and the task log echo
            continue
        seen.add(payload)
        name = json.loads(payload)["alert"]
        counts[name] = counts.get(name, 0) + 1
    return "".join(f"; alert {name} x{n}" for name, n in sorted(counts.items()))


def seed_calendar_and_activity(conn: psycopg.Connection) -> None:
    """The demo's slots (1250 due, 300 future, Booked, Expired, Archived) and user activity:
    3000 Inactive sessions past retention (ended over 100 days before the cutoff), 700 that
    stay (half Inactive and young, half Active), 6 views and 7 events each, 50 stats rows."""
    conn.execute((SEED_SQL / "demo_seed_calendar.sql").read_text())
    seed_sessions(
        conn,
        3000,
        700,
        6,
        tag="demo",
        step_seconds=100 * 86400 // 3000,
        n_property_objects=50,
        events_per_session=7,
    )
    conn.commit()


def seed(url: str, selections: SelectionsService) -> None:
    """Demo rows for every job; the selections service is scripted per outbox snapshot."""
    with psycopg.connect(url) as conn:
        seed_calendar_and_activity(conn)
        # Rows are claimed in the order they are made. Each failing row sits between
        # successes (five failures in a row would read as an outage and open the breaker), and
        # the 429s come last, together: a Retry-After past 30 s stops calling for the run.
        generate_outbox(conn, 20)  # selections answers 2xx: Done (40 in all)
        for snapshot_id in generate_outbox(conn, 5):
            selections.mark_detached(snapshot_id)  # already detached: 2xx again, Done
        failing = [("error_503", {})] * 5  # transient: Pending with backoff
        failing += [("not_found", {})] * 3  # unknown snapshot: Quarantined
        # the 12th failure: Quarantined
        failing += [("error_503", {"attempts": 11, "last_error": "HttpError 503"})] * 2
        for behaviour, kwargs in failing:
            for snapshot_id in generate_outbox(conn, 1, **kwargs):
                selections.script(snapshot_id, behaviour)
            generate_outbox(conn, 2)
        for snapshot_id in generate_outbox(conn, 2):
            selections.script(snapshot_id, "rate_limited")  # 429 + Retry-After: Pending
        generate_outbox(conn, 10, due_in=timedelta(hours=1))  # not due yet: untouched


def seed_ui_data(conn: psycopg.Connection) -> str | None:
    """Demo rows for ``make up`` when every job table is empty; what was added, or None.

    The same calendar and activity data as the demo; the outbox gets rows the local selections
    service (every snapshot exists) detaches, rows not yet due, and Quarantined rows for the
    requeue runbook. Existing rows are never touched: a table with data means no seeding.
    """
    if conn.execute((SEED_SQL / "job_tables_have_rows.sql").read_text()).fetchone()[0]:
        return None
    seed_calendar_and_activity(conn)
    generate_outbox(conn, 40)
    generate_outbox(conn, 10, due_in=timedelta(hours=1))
    generate_outbox(conn, 5, status="Quarantined", attempts=12, last_error="HttpError 404")
    return (
        "demo data: 1250 due slots, 3000 sessions past retention, "
        "40 due + 10 later outbox rows, 5 Quarantined"
    )


def main() -> int:
    started = time.monotonic()
    admin = pg.admin_url(LOCAL / "pg")
    if pg.EXTERNAL_URL_ENV in os.environ:
        where = f"external server ({pg.EXTERNAL_URL_ENV})"
    else:
        where = f"embedded PostgreSQL in {LOCAL / 'pg'}"
    print(f"==> Postgres: {where}")
    database = pg.job_database(admin, DEMO_DB)

    with ExitStack() as stack:
        # Retry-After 2 s: the detach run pauses that long once (longer ones end its calls)
        selections = stack.enter_context(SelectionsService(latency_ms=20, retry_after_seconds=2))
        print(f"==> selections service on {selections.url} (20 ms per call, scripted answers)")
        seed(database.url, selections)
        roles = ", ".join(sorted({role.name for role in database.roles.values()}))
        print(f"==> database {DEMO_DB}: reference schema + demo data; the jobs log in as {roles}")
        env = ae.airflow_env(
            AIRFLOW_HOME, job_db_url=database.job_urls(), selections_url=selections.url
        )
        print("==> migrating the Airflow metadata DB (SQLite, first run only takes longer)")
        ae.migrate(env)
        failures = []
        report = []
        for job in JOBS:
            with database.connect() as conn:
                before = job.snapshot(conn)
            print(f"==> airflow dags test {job.dag_id}")
            t0 = time.monotonic()
            args = ["dags", "test", job.dag_id]
            if job.conf is not None:
                args += ["--conf", json.dumps(job.conf)]
            done = ae.airflow(args, env)
            elapsed = time.monotonic() - t0
            with database.connect() as conn:
                after = job.snapshot(conn)
            ok = done.returncode == 0
            if not ok:
                failures.append(job.dag_id)
                log = LOCAL / f"demo-{job.dag_id}.log"
                log.write_text(done.stdout + done.stderr)
                print(f"    FAILED (exit {done.returncode}); output in {log}")
            text = job.describe(before, after) + alerts_raised(done.stdout + done.stderr)
            report.append((job.dag_id, ok, elapsed, text))

    print("\n=== What each job did ===")
    for dag_id, ok, elapsed, text in report:
        print(f"{'ok  ' if ok else 'FAIL'} {dag_id:32} {elapsed:5.1f}s  {text}")
    print(
        f"\nDemo finished in {time.monotonic() - started:.0f}s. The data stays in database "
        f"{DEMO_DB} (the embedded Postgres keeps running; `make clean` stops it).\n"
        "Open the Airflow UI: `make up` (prints the URL and login; DAGs start paused), "
        "`make down` to stop it."
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
