"""Retention's lock-busy path on a real Postgres: a stuck holder raises ``lock_held_too_long``.

A holder that has kept the job's advisory lock longer than its lease
(``max_run_duration_seconds`` + ``LOCK_TTL_MARGIN_SECONDS``, the longest a live step holds it)
is a stuck worker or a stray session: the skipping task alerts with its pid. A holder younger
than that may be a run in progress: the task skips quietly (warning + metric).
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from devtools.retention_data import insert_session
from include.pin_maintenance.db import configured, lock_key
from include.pin_maintenance.jobs import activity_retention as job
from include.pin_maintenance.runloop import StopSignal
from include.pin_maintenance.telemetry import JobLog, RecordingMetrics, Telemetry

pytestmark = pytest.mark.integration


def _holder(db) -> psycopg.Connection:
    conn = psycopg.connect(db.url)
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
    connect = configured(lambda: psycopg.connect(db.url), job.SESSION_SETTINGS)
    metrics = RecordingMetrics()
    telemetry = Telemetry.local(JobLog(job.JOB, "lock-test"), metrics)
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
