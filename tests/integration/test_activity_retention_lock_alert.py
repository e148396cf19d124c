"""Retention's lock-busy path on a real Postgres: a stuck holder raises ``lock_held_too_long``.

A holder that has kept the job's advisory lock longer than its lease
(``max_run_duration_seconds`` + ``LOCK_TTL_MARGIN_SECONDS``, the longest a live step holds it)
is a stuck worker or a stray session: the skipping task alerts with its pid. A holder younger
than that may be a run in progress: the task skips quietly (warning + metric). A holder of
another role is seen without its age unless the job's role has pg_read_all_stats: the task then
skips quietly too (it cannot tell a stuck holder from a live one).
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg import sql

from devtools.retention_data import insert_session
from include.pin_maintenance.db import lock_key
from include.pin_maintenance.jobs import activity_retention as job
from include.pin_maintenance.stopping import StopSignal
from include.pin_maintenance.telemetry import RecordingMetrics
from tests.job_db import job_connect, job_telemetry, job_url

pytestmark = pytest.mark.integration


def _holder(db, url: str | None = None) -> psycopg.Connection:
    """A stuck worker of the job (its role), or a session of ``url``."""
    conn = psycopg.connect(url or job_url(db, job.JOB))
    conn.execute("select set_config('application_name', 'stuck-retention-worker', false)")
    conn.commit()
    conn.execute("select pg_advisory_xact_lock(%s)", (lock_key(job.LOCK_NAME),))
    return conn  # transaction left open: the lock is held until it ends


def _held_seconds(db, pid: int) -> float:
    with db.connect() as conn:
        row = conn.execute(
            "select extract(epoch from clock_timestamp() - xact_start)::float8"
            " from pg_stat_activity where pid = %s",
            (pid,),
        ).fetchone()
    return float(row[0])


def _eligible_session(db) -> uuid.UUID:
    with db.connect() as conn:
        return insert_session(conn, ended_at=datetime.now(UTC) - timedelta(days=800))


@pytest.mark.parametrize(
    ("stuck", "margin"),
    [(True, 1.0), (False, 30.0)],
    ids=["holder-past-its-lease", "holder-past-the-run-budget-inside-its-lease"],
)
def test_a_busy_lock_skips_the_step_and_alerts_only_a_stuck_holder(
    db, stuck: bool, margin: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The alert threshold is the lock's lease (max_run_duration_seconds + margin), not the
    run budget: a step of a live run holds the lock for up to its lease and must not alert.
    The margin is shortened here (300 s in production) so the holder can age past it."""
    monkeypatch.setattr(job, "LOCK_TTL_MARGIN_SECONDS", margin)
    _eligible_session(db)
    budget = 1.0
    lease = budget + margin
    connect = job_connect(db, job.JOB)
    metrics = RecordingMetrics()
    telemetry = job_telemetry(job.JOB, "lock-test", metrics=metrics)
    plan = job.prepare(
        connect, job.CONFIG.resolve(None, {"max_run_duration_seconds": budget}), telemetry
    )
    holder = _holder(db)
    try:
        pid = holder.info.backend_pid
        deadline = time.monotonic() + 30
        # past its lease (stuck), or past the run budget but inside the lease (a live step)
        older_than = lease if stuck else budget + 0.5
        while _held_seconds(db, pid) <= older_than:
            assert time.monotonic() < deadline
            time.sleep(0.1)

        step = job.delete_step(connect, plan, "action_events", telemetry, StopSignal())
    finally:
        holder.close()

    assert step.lock_skipped and step.rows == 0
    # a busy run counts once, in the report (not once per delete task)
    assert metrics.counters.get("activity_retention_lock_contention_total", 0) == 0
    job.report(plan, [step], telemetry)
    assert metrics.counters["activity_retention_lock_contention_total"] == 1
    if stuck:
        [alert] = telemetry.alerts.sent
        assert alert.name == "lock_held_too_long"
        assert alert.details["pid"] == pid
        assert alert.details["application_name"] == "stuck-retention-worker"
        assert alert.details["held_seconds"] >= lease and alert.details["limit_seconds"] == lease
        assert alert.details["lock"] == job.LOCK_NAME
    else:
        assert telemetry.alerts.sent == []
    with db.connect() as conn:  # nothing deleted by the skipped step
        assert conn.execute("select count(*) from user_activity.sessions").fetchone()[0] == 1


@pytest.mark.parametrize("read_all_stats", [False, True], ids=["role-alone", "pg_read_all_stats"])
def test_a_holder_of_another_role_is_judged_only_with_pg_read_all_stats(
    db, read_all_stats: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DBA's session (the owner) holds the lock past the lease. The job's role sees the
    holder's pid in pg_locks but its transaction start only with pg_read_all_stats: without it
    the step skips without an alert (no guess), with it the stuck holder is alerted."""
    monkeypatch.setattr(job, "LOCK_TTL_MARGIN_SECONDS", 0.5)
    _eligible_session(db)
    role = db.roles["user_activity_db"].name
    grant = sql.SQL("{} pg_read_all_stats {} {}")
    if read_all_stats:
        with db.connect(autocommit=True) as conn:
            conn.execute(grant.format(sql.SQL("grant"), sql.SQL("to"), sql.Identifier(role)))
    connect = job_connect(db, job.JOB)
    telemetry = job_telemetry(job.JOB, "lock-test")
    plan = job.prepare(
        connect, job.CONFIG.resolve(None, {"max_run_duration_seconds": 0.5}), telemetry
    )
    holder = _holder(db, db.url)
    try:
        while _held_seconds(db, holder.info.backend_pid) <= 1.5:
            time.sleep(0.1)
        step = job.delete_step(connect, plan, "action_events", telemetry, StopSignal())
    finally:
        holder.close()
        if read_all_stats:
            with db.connect(autocommit=True) as conn:
                conn.execute(grant.format(sql.SQL("revoke"), sql.SQL("from"), sql.Identifier(role)))

    assert step.lock_skipped and step.rows == 0
    alerts = [a.name for a in telemetry.alerts.sent]
    assert alerts == (["lock_held_too_long"] if read_all_stats else [])
