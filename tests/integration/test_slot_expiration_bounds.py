"""Seed 002's per-cycle bound (max_batches_per_cycle), SkippedLockedCount on a bound, and the
runners' clean stop on any exception (parallel.run_lanes), on a real Postgres."""

from __future__ import annotations

import logging
import time

import psycopg
import pytest

from devtools.pg import Database
from include.pin_maintenance.jobs import slot_expiration as se
from include.pin_maintenance.telemetry import JobLog, LogOnlyAlerts, RecordingMetrics, Telemetry
from tests.integration.slot_expiration_fixtures import (
    NOW,
    connect_for,
    insert_due,
    lock_all_nowait,
    new_run,
    run_job,
    statuses,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_the_default_cycle_takes_one_batch_on_one_connection(db: Database):
    insert_due(db, 25)
    opened = []
    connect = connect_for(db)

    def counting_connect() -> psycopg.Connection:
        opened.append(True)
        return connect()

    run = new_run()
    result = se.run(counting_connect, {"batch_size": 10}, run.telemetry, run.stop, now=lambda: NOW)
    assert (result.expired_count, result.batches, result.runners) == (10, 1, 1)
    assert (result.stop_reason, result.skipped_locked_count, result.backlog) == (
        "max_batches",
        0,  # the 15 left are backlog the cycle never reached, not skipped
        15,
    )
    # the privilege check's connection (closed before the batch), then one loop: runners 2 by
    # default, but one batch needs one loop
    assert len(opened) == 2
    assert statuses(db) == {"Expired": 10, "Available": 15}


@pytest.mark.parametrize(("limit", "runners"), [(3, 1), (3, 2), (5, 4)])
def test_max_batches_per_cycle_bounds_the_rows_with_any_number_of_runners(
    db: Database, limit: int, runners: int
):
    insert_due(db, 100)
    result = run_job(db, {"batch_size": 10, "max_batches_per_cycle": limit, "runners": runners})
    assert result.batches == limit
    assert result.expired_count == 10 * limit
    assert result.stop_reason == "max_batches"
    assert statuses(db) == {"Expired": 10 * limit, "Available": 100 - 10 * limit}


def test_skipped_locked_counts_only_rows_passed_over_when_the_cycle_stops_on_its_bound(
    db: Database,
):
    ids = insert_due(db, 30)
    with db.connect() as booking:  # a booking in flight holds the 3rd oldest slot
        booking.execute(
            "select 1 from calendar.availability_slots where id = %s for update", (ids[2],)
        )
        result = run_job(db, {"batch_size": 10, "max_batches_per_cycle": 1, "runners": 1})
        booking.rollback()
    assert result.expired_count == 10  # slots 1-2 and 4-11
    assert result.skipped_locked_count == 1  # the held one; not the 19 never reached
    assert result.stop_reason == "max_batches"


class Sabotage(BaseException):
    """Not a psycopg error, not even an Exception: like the Task SDK's AirflowTaskTimeout."""


class SabotagedLog(JobLog):
    """Raises in runner 2 right after its first batch committed."""

    def info(self, event: str, **fields) -> None:
        super().info(event, **fields)
        if event == "batch_selected" and fields.get("runner") == 2:
            raise Sabotage("runner 2 broke after its batch")


def test_a_non_psycopg_exception_in_a_side_runner_stops_the_cycle_cleanly(
    db: Database, caplog: pytest.LogCaptureFixture
):
    insert_due(db, 400)
    log = SabotagedLog(se.JOB, "sabotage", logging.getLogger(f"pin_maintenance.{se.JOB}"))
    telemetry = Telemetry(log, RecordingMetrics(), LogOnlyAlerts(log))
    run = new_run()
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    with pytest.raises(Sabotage, match="runner 2 broke"):
        se.run(
            connect_for(db, "sabotaged"),
            {"batch_size": 10, "max_batches_per_cycle": 1000, "runners": 2},
            telemetry,
            run.stop,
            now=lambda: NOW,
        )
    assert time.monotonic() - started < 30  # the bound: one statement at most, not forever
    committed = sum(
        int(r.getMessage().split(" expired=")[1].split()[0])
        for r in caplog.records
        if "event=batch_selected" in r.getMessage()
    )
    counts = statuses(db)
    assert counts.get("Expired", 0) == committed >= 20  # committed batches stay, whole
    assert committed % 10 == 0 and committed < 400  # the others stopped: no drain
    assert lock_all_nowait(db) == 400  # no row lock left: no transaction left open
    # every connection of the cycle is closed: the job role's backends exit (a closed
    # connection's backend lingers in pg_stat_activity for a moment after the client's close)
    wait_for(lambda: not role_backends(db, "calendar_db"), "the cycle's backends to exit")


def role_backends(db: Database, conn_id: str) -> list[tuple]:
    with db.connect(autocommit=True) as conn:
        return conn.execute(
            "select pid, state from pg_stat_activity"
            " where datname = current_database() and usename = %s",
            (db.roles[conn_id].name,),
        ).fetchall()
