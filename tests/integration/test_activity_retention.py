"""ActivityRetentionJob against a real Postgres: the seed's test table and the failure modes.

Each test asserts the database state it promises. Data comes from
``devtools.retention_data.seed_sessions`` (eligible sessions first, oldest = number 1) or from
:func:`add_session` when a test needs exact timestamps.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from devtools.bench_data import RETENTION_SHAPES, load_retention, retention_dataset
from devtools.retention_data import (
    insert_session,
    seed_sessions,
    session_id,
    set_apply_filter_event,
)
from include.pin_maintenance.db import SessionSettings, advisory_lock
from include.pin_maintenance.jobs import activity_retention as job
from include.pin_maintenance.jobs.activity_retention_config import CANCEL_TIMEOUT_SECONDS
from include.pin_maintenance.jobs.activity_retention_walk import BatchFailed
from include.pin_maintenance.pacing_config import PACING_OFF
from include.pin_maintenance.stopping import JobCancelled, StopSignal
from include.pin_maintenance.telemetry import RecordingMetrics
from tests.job_db import job_cli, job_connect, job_telemetry, job_url

pytestmark = pytest.mark.integration

UNPACED = PACING_OFF

REPO = Path(__file__).resolve().parents[2]
# The clean-stop bound the tests hold the job to: from the first exception in any loop until
# the step has returned with every connection closed. The job's own bound is one cancel round
# trip per loop (CANCEL_TIMEOUT_SECONDS at most) and a rollback; measured well under 1 s.
# A blocked statement would otherwise wait for its 120 s lock_timeout.
STOP_BOUND_SECONDS = 2 * CANCEL_TIMEOUT_SECONDS
TABLES = ("sessions", "property_object_views", "action_events", "property_object_view_stats")


# ---------------------------------------------------------------------------------- helpers


def config(**overrides):
    return job.CONFIG.resolve(None, overrides)


def counts(db) -> dict[str, int]:
    with db.connect() as conn:
        return {
            t: conn.execute(f"select count(*) from user_activity.{t}").fetchone()[0] for t in TABLES
        }


def snapshot(db, table: str) -> list[tuple]:
    with db.connect() as conn:
        return conn.execute(f"select * from user_activity.{table} order by 1").fetchall()


def existing(db, table: str, column: str, ids) -> set:
    with db.connect() as conn:
        rows = conn.execute(
            f"select distinct {column} from user_activity.{table} where {column} = any(%s)",
            (list(ids),),
        ).fetchall()
    return {r[0] for r in rows}


def eligible_left(db, cutoff=None) -> dict[str, int]:
    """Eligible sessions and the child rows that still hang on eligible sessions."""
    with db.connect() as conn:
        cut = cutoff or conn.execute("select now() - interval '365 days'").fetchone()[0]
        q = (
            "select count(*) from user_activity.{t} c join user_activity.sessions s"
            " on s.id = c.session_id where s.status = 'Inactive' and s.ended_at < %(c)s"
        )
        return {
            "sessions": conn.execute(
                "select count(*) from user_activity.sessions"
                " where status = 'Inactive' and ended_at < %(c)s",
                {"c": cut},
            ).fetchone()[0],
            "action_events": conn.execute(q.format(t="action_events"), {"c": cut}).fetchone()[0],
            "property_object_views": conn.execute(
                q.format(t="property_object_views"), {"c": cut}
            ).fetchone()[0],
        }


def add_session(conn, *, ended_at, status: str = "Inactive", children: int = 1) -> uuid.UUID:
    """One session with ``children`` views and events, linked both ways (circular SET NULL)."""
    return insert_session(
        conn, ended_at=ended_at, status=status, views=children, events=children, linked=True
    )


@pytest.fixture
def seeded(db):
    """30 eligible sessions (2 views + 2 events each), 10 young ones, stats rows."""
    with db.connect() as conn:
        data = seed_sessions(conn, 30, 10, 2, tag="t")
        conn.commit()
    return data


def ids(first: int, last: int) -> list[uuid.UUID]:
    return [session_id("t", i) for i in range(first, last + 1)]


# ------------------------------------------------------------------------------ seed table


def test_batches_split_sessions_that_share_one_ended_at(db, caplog):
    """The claim's last key is (ended_at, id): batches that cut through sessions with the same
    ended_at take each of them exactly once, in id order, and the run drains them all."""
    with db.connect() as conn:
        ended = conn.execute("select now() - interval '400 days'").fetchone()[0]
        tied = sorted(add_session(conn, ended_at=ended) for _ in range(7))
        later = add_session(conn, ended_at=ended + timedelta(seconds=1))
        conn.commit()
    caplog.set_level(logging.DEBUG, logger="pin_maintenance")

    result = job.run(
        job_connect(db, job.JOB),
        config(batch_size=3, runners=1),
        job_telemetry(job.JOB),
        StopSignal(),
    )

    assert result.deleted_sessions == 8
    assert result.deleted_action_events == result.deleted_property_object_views == 8
    # 3 session batches: 3 + 3 + (1 tied + the later one), each step took the same three
    assert result.batches_processed == 3
    assert result.batches_by_table == dict.fromkeys(job.TABLES, 3)
    session_batches = [r.getMessage() for r in caplog.records if "event=batch " in r.getMessage()]
    sizes = [m.split(" sessions=")[1].split()[0] for m in session_batches if "table=sessions" in m]
    assert sizes == ["3", "3", "2"]
    assert existing(db, "sessions", "id", [*tied, later]) == set()


def test_empty_run_is_a_successful_noop(db):
    with db.connect() as conn:
        seed_sessions(conn, 0, 6, 1, tag="young")
        conn.commit()
    before = counts(db)
    metrics = RecordingMetrics()

    result = job.run(
        job_connect(db, job.JOB), config(), job_telemetry(job.JOB, metrics=metrics), StopSignal()
    )

    assert result.as_dict() == {
        "DeletedSessions": 0,
        "DeletedPropertyObjectViews": 0,
        "DeletedActionEvents": 0,
        "BatchesProcessed": 0,
        "ActionEventBatches": 0,
        "PropertyObjectViewBatches": 0,
        "SessionBatches": 0,
        "HasMore": False,
        "DryRun": False,
        "PacedMs": 0,
    }
    assert counts(db) == before
    assert metrics.gauges["activity_retention_eligible_backlog"] == 0
    assert "activity_retention_last_success_timestamp_seconds" in metrics.gauges
    assert "activity_retention_run_duration_seconds" in metrics.timings
    # every counter is sent at 0 (statsd_exporter then has the series before its first event)
    assert metrics.counters == {
        **dict.fromkeys(job.DELETED_METRIC.values(), 0),
        job.M_BATCHES: 0,
        job.M_LOCK_CONTENTION: 0,
        "activity_retention_paced_replica_lag_milliseconds_total": 0,
        "activity_retention_paced_wal_rate_milliseconds_total": 0,
    }


def test_children_go_before_parents_without_restrict_errors(db, seeded):
    conn_factory = job_connect(db, job.JOB)
    tel = job_telemetry(job.JOB)
    plan = job.prepare(conn_factory, config(batch_size=7), tel)
    eligible = ids(1, 30)

    # delete_sessions first would hit RESTRICT if it ignored children: it deletes nothing.
    early = job.delete_step(conn_factory, plan, "sessions", tel, StopSignal())
    assert early.rows == 0
    assert existing(db, "sessions", "id", eligible) == set(eligible)

    events = job.delete_step(conn_factory, plan, "action_events", tel, StopSignal())
    assert events.rows == 60
    assert existing(db, "action_events", "session_id", eligible) == set()
    assert existing(db, "property_object_views", "session_id", eligible) == set(eligible)
    assert existing(db, "sessions", "id", eligible) == set(eligible)

    views = job.delete_step(conn_factory, plan, "property_object_views", tel, StopSignal())
    assert views.rows == 60
    assert existing(db, "property_object_views", "session_id", eligible) == set()
    assert existing(db, "sessions", "id", eligible) == set(eligible)

    sessions = job.delete_step(conn_factory, plan, "sessions", tel, StopSignal())
    assert sessions.rows == 30
    assert counts(db)["sessions"] == 10
    assert counts(db)["action_events"] == counts(db)["property_object_views"] == 20


def test_threshold_is_strict_and_active_sessions_stay(db):
    conn_factory = job_connect(db, job.JOB)
    tel = job_telemetry(job.JOB)
    plan = job.prepare(conn_factory, config(), tel)
    cutoff = plan.cutoff
    with db.connect() as conn:
        just_expired = add_session(conn, ended_at=cutoff - timedelta(seconds=1))
        at_cutoff = add_session(conn, ended_at=cutoff)
        just_young = add_session(conn, ended_at=cutoff + timedelta(seconds=1))
        old_active = add_session(conn, ended_at=None, status="Active")
        odd_active = add_session(conn, ended_at=cutoff - timedelta(days=30), status="Active")
        unknown = add_session(conn, ended_at=cutoff - timedelta(days=30), status="Archived")
        conn.commit()

    steps = [job.delete_step(conn_factory, plan, t, tel, StopSignal()) for t in job.TABLES]
    result = job.report(plan, steps, tel)

    assert result.deleted_sessions == 1
    assert result.deleted_action_events == result.deleted_property_object_views == 1
    survivors = {at_cutoff, just_young, old_active, odd_active, unknown}
    assert existing(db, "sessions", "id", survivors | {just_expired}) == survivors
    assert existing(db, "action_events", "session_id", survivors) == survivors


def test_property_object_view_stats_are_untouched(db, seeded):
    stats_before = snapshot(db, "property_object_view_stats")
    assert stats_before

    job.run(job_connect(db, job.JOB), config(batch_size=8), job_telemetry(job.JOB), StopSignal())

    assert counts(db)["property_object_views"] == 20  # only the young sessions' views left
    assert snapshot(db, "property_object_view_stats") == stats_before


def test_partial_failure_keeps_earlier_batches_and_the_next_run_finishes(db, seeded):
    poison = session_id("t", 13)  # batch 3 of batch_size 5 (sessions 11..15)
    with db.connect() as conn:
        conn.execute(
            """
            create table public.poison (session_id uuid primary key);
            -- security definer: it reads a test table the job's role has no privilege on
            create function public.refuse_poison() returns trigger language plpgsql
            security definer as $$
            begin
              if exists (select 1 from public.poison p where p.session_id = old.session_id) then
                raise exception 'injected failure for session %', old.session_id;
              end if;
              return old;
            end $$;
            create trigger refuse_poison before delete on user_activity.action_events
              for each row execute function public.refuse_poison();
            """
        )
        conn.execute("insert into public.poison values (%s)", (poison,))
        conn.commit()
    tel = job_telemetry(job.JOB)

    # one loop: the seed's "batches 1..N-1 committed" exactly (with several loops the committed
    # batches are any subset: test_a_failed_batch_with_several_loops_leaves_whole_batches)
    with pytest.raises(BatchFailed, match="batch 2"):
        job.run(job_connect(db, job.JOB), config(batch_size=5, runners=1), tel, StopSignal())

    # batches 1..2 (sessions 1..10) committed, batch 3 and later untouched
    assert existing(db, "action_events", "session_id", ids(1, 30)) == set(ids(11, 30))
    assert existing(db, "sessions", "id", ids(1, 30)) == set(ids(1, 30))  # run stopped there
    [alert] = tel.alerts.sent
    assert alert.name == "retention_batch_failed"
    assert alert.details["batch_ids"] == {
        "first": str(session_id("t", 11)),
        "last": str(session_id("t", 15)),
        "count": 5,
        "ids": [str(i) for i in ids(11, 15)],
    }
    assert alert.details["error"] == "RaiseException P0001"  # class + SQLSTATE, not the text
    assert tel.metrics.counters["activity_retention_deleted_action_events"] == 20
    # no session batch is complete: the run stopped in its first (action_events) step
    assert tel.metrics.counters["activity_retention_batches_processed"] == 0

    with db.connect() as conn:
        conn.execute("delete from public.poison")
        conn.commit()
    result = job.run(
        job_connect(db, job.JOB), config(batch_size=5), job_telemetry(job.JOB), StopSignal()
    )

    assert result.deleted_sessions == 30
    assert result.deleted_action_events == 40  # 20 sessions' events were left
    assert result.deleted_property_object_views == 60
    assert eligible_left(db) == {"sessions": 0, "action_events": 0, "property_object_views": 0}
    assert counts(db)["sessions"] == 10


def test_max_batches_bounds_a_run_and_the_next_runs_resume(db, seeded):
    bounded = config(batch_size=4, max_batches_per_run=3)

    first = job.run(job_connect(db, job.JOB), bounded, job_telemetry(job.JOB), StopSignal())

    assert first.deleted_sessions == 12  # the 12 oldest
    assert first.deleted_action_events == first.deleted_property_object_views == 24
    assert first.batches_processed == 3  # session batches, 3 per delete step
    assert first.batches_by_table == dict.fromkeys(job.TABLES, 3)
    assert first.has_more is True
    assert existing(db, "sessions", "id", ids(1, 30)) == set(ids(13, 30))

    second = job.run(job_connect(db, job.JOB), bounded, job_telemetry(job.JOB), StopSignal())
    third = job.run(job_connect(db, job.JOB), bounded, job_telemetry(job.JOB), StopSignal())

    assert (second.deleted_sessions, second.has_more) == (12, True)
    assert (third.deleted_sessions, third.has_more) == (6, False)
    assert eligible_left(db) == {"sessions": 0, "action_events": 0, "property_object_views": 0}
    assert counts(db)["sessions"] == 10


def test_run_duration_bound_stops_between_batches_with_has_more(db, seeded):
    # A budget that is used up at once: each delete step still runs its first batch (progress
    # is guaranteed), then stops at the bound.
    result = job.run(
        job_connect(db, job.JOB),
        config(batch_size=4, max_run_duration_seconds=0.001),
        job_telemetry(job.JOB),
        StopSignal(),
    )

    assert result.has_more is True
    assert (result.deleted_sessions, result.batches_processed) == (4, 1)
    assert existing(db, "sessions", "id", ids(1, 30)) == set(ids(5, 30))
    assert all(s.stop_reason == "max_duration" for s in result.steps)


def test_a_backlog_night_deletes_whole_sessions_within_its_budget(db):
    """A backlog larger than one night's time budget: the first step stops at its share of
    the run, and the later steps finish exactly the sessions it cleared (before the budget
    split, the first step spent the whole budget and the night deleted about one batch of
    sessions). The run ends within its budget plus the batches in hand."""
    with db.connect() as conn:
        seed_sessions(conn, 40_000, 0, 1, tag="night")
        conn.commit()
    budget = 4.0

    started = time.monotonic()
    result = job.run(
        job_connect(db, job.JOB),
        # unpaced: the split is sized for steps at their own speed; pacing slows whichever step
        # runs while the database is busy, and the rest waits for the next night (resumable)
        config(
            batch_size=100, max_batches_per_run=50_000, max_run_duration_seconds=budget, **UNPACED
        ),
        job_telemetry(job.JOB),
        StopSignal(),
    )
    took = time.monotonic() - started

    events, views, sessions = result.steps
    assert events.stop_reason == "max_duration"  # the backlog is larger than the night
    assert result.has_more is True
    assert result.deleted_sessions > 3 * 100  # far more than one batch of sessions
    # whole sessions: every session whose children were deleted is deleted too
    assert result.deleted_sessions == result.deleted_action_events
    assert result.deleted_sessions == result.deleted_property_object_views
    assert sessions.batches == views.batches == events.batches == result.batches_processed
    with db.connect() as conn:
        half_done = conn.execute(
            "select count(*) from user_activity.sessions s where not exists"
            " (select 1 from user_activity.action_events e where e.session_id = s.id)"
        ).fetchone()[0]
    assert half_done == 0
    assert counts(db)["sessions"] == 40_000 - result.deleted_sessions
    assert took < budget + 3.0  # the budget, plus prepare and one batch in hand per step


def test_sessions_step_keeps_sessions_whose_children_an_earlier_bounded_step_left(db, seeded):
    conn_factory = job_connect(db, job.JOB)
    tel = job_telemetry(job.JOB)
    narrow = job.prepare(conn_factory, config(batch_size=4, max_batches_per_run=1), tel)
    wide = job.RunPlan.from_xcom({**narrow.to_xcom(), "max_batches_per_run": 100})

    job.delete_step(conn_factory, narrow, "action_events", tel, StopSignal())  # sessions 1..4
    job.delete_step(conn_factory, wide, "property_object_views", tel, StopSignal())  # all 30
    sessions = job.delete_step(conn_factory, wide, "sessions", tel, StopSignal())

    assert sessions.rows == 4
    assert existing(db, "sessions", "id", ids(1, 30)) == set(ids(5, 30))
    assert existing(db, "action_events", "session_id", ids(1, 30)) == set(ids(5, 30))
    # the next full run finishes the rest
    assert job.run(conn_factory, config(), tel, StopSignal()).deleted_sessions == 26
    assert eligible_left(db) == {"sessions": 0, "action_events": 0, "property_object_views": 0}


def test_circular_and_cross_session_references_are_cleared(db):
    with db.connect() as conn:
        cutoff = conn.execute("select now() - interval '365 days'").fetchone()[0]
        old = add_session(conn, ended_at=cutoff - timedelta(days=3), children=3)
        young = add_session(conn, ended_at=cutoff + timedelta(days=100), children=2)
        # A young view pointing at an old session's event (the seed says it never happens;
        # if it does, SET NULL keeps the young view and drops only the reference).
        old_event = conn.execute(
            "select id from user_activity.action_events where session_id = %s limit 1", (old,)
        ).fetchone()[0]
        young_view = conn.execute(
            "select id from user_activity.property_object_views where session_id = %s limit 1",
            (young,),
        ).fetchone()[0]
        set_apply_filter_event(conn, young_view, old_event)
        conn.commit()

    result = job.run(job_connect(db, job.JOB), config(), job_telemetry(job.JOB), StopSignal())

    assert (result.deleted_sessions, result.deleted_action_events) == (1, 3)
    assert result.deleted_property_object_views == 3
    assert existing(db, "sessions", "id", [old, young]) == {young}
    with db.connect() as conn:
        row = conn.execute(
            "select apply_filter_event_id from user_activity.property_object_views where id = %s",
            (young_view,),
        ).fetchone()
        assert row == (None,)
        young_refs = conn.execute(
            "select count(*) from user_activity.action_events"
            " where session_id = %s and property_object_view_id is not null",
            (young,),
        ).fetchone()[0]
        assert young_refs == 2


# --------------------------------------------------------------------------- concurrency


def test_busy_lock_is_a_noop_success_with_contention_metric(db, seeded):
    before = counts(db)
    metrics = RecordingMetrics()
    with advisory_lock(job_connect(db, job.JOB), job.LOCK_NAME, 60) as held:
        assert held
        result = job.run(
            job_connect(db, job.JOB),
            config(),
            job_telemetry(job.JOB, metrics=metrics),
            StopSignal(),
        )
        plan = job.prepare(job_connect(db, job.JOB), config(), job_telemetry(job.JOB))
        step = job.delete_step(
            job_connect(db, job.JOB), plan, "action_events", job_telemetry(job.JOB), StopSignal()
        )

    assert result.deleted_sessions == 0
    assert result.has_more is True
    assert step.lock_skipped and step.has_more and step.rows == 0
    assert metrics.counters["activity_retention_lock_contention_total"] == 1
    assert "activity_retention_last_success_timestamp_seconds" in metrics.gauges
    assert "activity_retention_run_duration_seconds" not in metrics.timings  # a skip is no run
    assert counts(db) == before


def test_a_busy_run_of_the_dag_shape_counts_one_contention_not_one_per_task(db, seeded):
    """The DAG's shape: prepare, three delete tasks that each find the lock busy, report."""
    metrics = RecordingMetrics()
    tel = job_telemetry(job.JOB, metrics=metrics)
    with advisory_lock(job_connect(db, job.JOB), job.LOCK_NAME, 60) as held:
        assert held
        plan = job.prepare(job_connect(db, job.JOB), config(), tel)
        steps = [
            job.delete_step(job_connect(db, job.JOB), plan, t, tel, StopSignal())
            for t in job.TABLES
        ]
    job.report(plan, steps, tel)

    assert all(s.lock_skipped for s in steps)
    assert metrics.counters["activity_retention_lock_contention_total"] == 1
    assert "activity_retention_run_duration_seconds" not in metrics.timings


def test_two_runs_at_once_delete_every_row_exactly_once(db, seeded):
    barrier = threading.Barrier(2)
    results: list = []
    errors: list = []

    def one_run(name: str) -> None:
        try:
            barrier.wait(timeout=10)
            results.append(
                job.run(
                    job_connect(db, job.JOB),
                    config(batch_size=3),
                    job_telemetry(job.JOB, name),
                    StopSignal(),
                )
            )
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one_run, args=(f"run{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    assert errors == []
    assert sum(r.deleted_sessions for r in results) == 30
    assert sum(r.deleted_action_events for r in results) == 60
    assert sum(r.deleted_property_object_views for r in results) == 60
    assert eligible_left(db) == {"sessions": 0, "action_events": 0, "property_object_views": 0}
    assert counts(db)["sessions"] == 10


@pytest.mark.parametrize("table", job.TABLES)
def test_skip_locked_keeps_two_lockless_steps_apart(db, seeded, table):
    """Even without the advisory lock (seed: "even without lock ... never twice")."""
    conn_factory = job_connect(db, job.JOB)
    plan = job.prepare(conn_factory, config(batch_size=1), job_telemetry(job.JOB))
    if table == "sessions":  # make every session deletable at this step
        for t in ("action_events", "property_object_views"):
            job.delete_step(conn_factory, plan, t, job_telemetry(job.JOB), StopSignal())
    expected = {"action_events": 60, "property_object_views": 60, "sessions": 30}[table]
    barrier = threading.Barrier(2)
    results: list = []
    errors: list = []

    def step() -> None:
        try:
            barrier.wait(timeout=10)
            results.append(
                job.delete_step(
                    conn_factory, plan, table, job_telemetry(job.JOB), StopSignal(), lock_name=None
                )
            )
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=step) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    assert errors == []
    assert sum(r.rows for r in results) == expected
    assert eligible_left(db)[table] == 0


# ---------------------------------------------------------------------- stop and crashes


class StopAfterBatches(RecordingMetrics):
    """Asks the run to stop once ``n`` action_events batches have committed (as SIGTERM would)."""

    def __init__(self, stop: StopSignal, n: int) -> None:
        super().__init__()
        self.stop, self.n, self.batches = stop, n, 0

    def incr(self, name: str, count: int = 1) -> None:
        super().incr(name, count)
        if name == "activity_retention_deleted_action_events" and count:
            self.batches += 1
            if self.batches >= self.n:
                self.stop.set("test stop")


def test_cancellation_between_batches_keeps_committed_batches(db, seeded):
    stop = StopSignal()
    metrics = StopAfterBatches(stop, 2)

    with pytest.raises(JobCancelled, match="after 2 committed"):
        job.run(
            job_connect(db, job.JOB),
            config(batch_size=5, runners=1),
            job_telemetry(job.JOB, metrics=metrics),
            stop,
        )

    assert existing(db, "action_events", "session_id", ids(1, 30)) == set(ids(11, 30))
    assert counts(db)["sessions"] == 40
    assert metrics.counters["activity_retention_deleted_action_events"] == 20
    # and a later run finishes the work
    result = job.run(
        job_connect(db, job.JOB), config(batch_size=5), job_telemetry(job.JOB), StopSignal()
    )
    assert result.deleted_sessions == 30
    assert eligible_left(db) == {"sessions": 0, "action_events": 0, "property_object_views": 0}


def _backends(db, *, waiting: bool = False) -> int:
    with psycopg.connect(db.url, autocommit=True) as conn:
        return conn.execute(
            "select count(*) from pg_stat_activity where datname = current_database()"
            " and application_name = %s and (not %s or wait_event_type = 'Lock')",
            (job.SESSION_SETTINGS.application_name, waiting),
        ).fetchone()[0]


def _wait_for(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_sigkill_in_the_middle_of_a_batch_then_a_normal_run(db, seeded, tmp_path):
    blocked = session_id("t", 13)  # in batch 3 of batch_size 5
    holder = db.connect()
    holder.execute(
        "select id from user_activity.action_events where session_id = %s for update", (blocked,)
    )
    job_log = (tmp_path / "job.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "include.pin_maintenance.jobs.activity_retention",
            "--db-url",
            _named_url(job_cli(db, job.JOB)[0]),
            "--config",
            json.dumps({"batch_size": 5}),
            "--lock-timeout-ms",
            "120000",
        ],
        cwd=REPO,
        env={**os.environ, **job_cli(db, job.JOB)[1], "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=job_log,
    )
    try:
        # three loops: one blocks inside batch 3, the other two delete and commit the rest.
        # Both halves are waited for: a loop's connection is also idle before its first batch
        # and between batches, so the backends alone can match while batches are still to come.
        _wait_for(
            lambda: (
                _job_backends(db) == {"waiting": 1, "idle in transaction": 1, "idle": 2}
                and existing(db, "action_events", "session_id", ids(1, 30)) == set(ids(11, 15))
            ),
            "one loop blocked inside batch 3 and every other batch committed",
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        holder.rollback()
        holder.close()
        job_log.close()
    assert proc.returncode == -signal.SIGKILL
    _wait_for(lambda: _backends(db) == 0, "the killed job's backends to end")

    # the killed batch rolled back as a whole
    assert existing(db, "action_events", "session_id", ids(11, 15)) == set(ids(11, 15))
    assert counts(db)["sessions"] == 40

    result = job.run(
        job_connect(db, job.JOB), config(batch_size=5), job_telemetry(job.JOB), StopSignal()
    )

    assert result.deleted_sessions == 30
    assert result.deleted_action_events == 10  # batch 3's
    assert eligible_left(db) == {"sessions": 0, "action_events": 0, "property_object_views": 0}
    after = counts(db)
    assert (after["sessions"], after["action_events"], after["property_object_views"]) == (
        10,
        20,
        20,
    )


def _start_cli(db, log_file, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "include.pin_maintenance.jobs.activity_retention",
            "--db-url",
            _named_url(job_cli(db, job.JOB)[0]),
            *args,
        ],
        cwd=REPO,
        env={**os.environ, **job_cli(db, job.JOB)[1], "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=log_file,
    )


def test_sigterm_finishes_the_batch_in_hand_and_stops(db, seeded, tmp_path):
    blocked = session_id("t", 13)  # in batch 3 of batch_size 5
    holder = db.connect()
    holder.execute(
        "select id from user_activity.action_events where session_id = %s for update", (blocked,)
    )
    log_path = tmp_path / "job.log"
    with log_path.open("w") as log_file:
        # one loop: "nothing after the batch in hand was started" is then exact
        proc = _start_cli(
            db,
            log_file,
            "--config",
            json.dumps({"batch_size": 5, "runners": 1}),
            "--lock-timeout-ms",
            "120000",
        )
        try:
            _wait_for(lambda: _backends(db, waiting=True) == 1, "the job to block in batch 3")
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)  # the signal lands while the batch waits; release the row lock
            holder.rollback()
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            holder.close()

    assert proc.returncode == 3, log_path.read_text()
    assert "SIGTERM received" in log_path.read_text()
    # batch 3 was finished and committed, nothing after it was started
    assert existing(db, "action_events", "session_id", ids(1, 30)) == set(ids(16, 30))
    assert counts(db)["sessions"] == 40


# ----------------------------------------------------------------------- config, dry run


@pytest.mark.parametrize(
    ("variable", "key"),
    [
        ({"retention_period_days": 0}, "retention_period_days"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 50_001}, "batch_size"),
        ({"max_batches_per_run": 0}, "max_batches_per_run"),
        ({"max_run_duration_seconds": 0}, "max_run_duration_seconds"),
        ({"batch_size": "5000"}, "batch_size"),
        ({"retention_days": 30}, "retention_days"),
    ],
)
def test_cli_with_invalid_config_fails_before_any_delete(db, seeded, variable, key):
    before = counts(db)

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "include.pin_maintenance.jobs.activity_retention",
            "--db-url",
            _named_url(job_cli(db, job.JOB)[0]),
            "--config",
            json.dumps(variable),
        ],
        cwd=REPO,
        env={**os.environ, **job_cli(db, job.JOB)[1], "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert done.returncode != 0
    assert "ConfigError" in done.stderr
    assert key in done.stderr
    assert counts(db) == before


def test_dry_run_counts_and_changes_nothing(db, seeded):
    before = {t: snapshot(db, t) for t in TABLES}
    metrics = RecordingMetrics()

    result = job.run(
        job_connect(db, job.JOB),
        config(batch_size=7),
        job_telemetry(job.JOB, metrics=metrics),
        StopSignal(),
        dry_run=True,
    )

    assert result.as_dict() == {
        "DeletedSessions": 0,
        "DeletedPropertyObjectViews": 0,
        "DeletedActionEvents": 0,
        "BatchesProcessed": 5,
        "ActionEventBatches": 5,
        "PropertyObjectViewBatches": 5,
        "SessionBatches": 5,
        "HasMore": False,
        "DryRun": True,
        "PacedMs": 0,
        "WouldDeleteSessions": 30,
        "WouldDeletePropertyObjectViews": 60,
        "WouldDeleteActionEvents": 60,
    }
    assert {t: snapshot(db, t) for t in TABLES} == before
    deleted = {
        n: v for n, v in metrics.counters.items() if n.startswith("activity_retention_deleted")
    }
    assert set(deleted.values()) <= {0}  # sent at 0 only (the series exists), nothing counted


def test_dry_run_respects_the_batch_bound(db, seeded):
    result = job.run(
        job_connect(db, job.JOB),
        config(batch_size=4, max_batches_per_run=2),
        job_telemetry(job.JOB),
        StopSignal(),
        dry_run=True,
    )
    assert (result.deleted_sessions, result.deleted_action_events, result.has_more) == (
        8,
        16,
        True,
    )
    assert counts(db)["sessions"] == 40


# ------------------------------------------------------------------ batch loops side by side


def _job_backends(db) -> dict[str, int]:
    """The job's backends by state (the advisory-lock holder is one 'idle in transaction')."""
    with psycopg.connect(db.url, autocommit=True) as conn:
        rows = conn.execute(
            "select case when wait_event_type = 'Lock' then 'waiting' else state end, count(*)"
            " from pg_stat_activity where datname = current_database()"
            " and application_name = %s group by 1",
            (job.SESSION_SETTINGS.application_name,),
        ).fetchall()
    return dict(rows)


def _named_url(url: str) -> str:
    """The test database with the job's application_name as a startup parameter: the job sets
    its name per transaction only (db.configured), so an idle job connection would otherwise
    show the role's default and the backend counts below could not tell it from others."""
    return make_conninfo(url, application_name=job.SESSION_SETTINGS.application_name)


def _patient(db) -> job.Connect:
    """The job's connections with a long lock_timeout (a test holds a row lock for a while)."""
    return job_connect(
        db,
        job.JOB,
        SessionSettings(
            statement_timeout_ms=120_000,
            lock_timeout_ms=120_000,
            application_name=job.SESSION_SETTINGS.application_name,
        ),
        url=_named_url(job_url(db, job.JOB)),
    )


def _hold_events_of(db, sid) -> psycopg.Connection:
    holder = db.connect()
    holder.execute(
        "select id from user_activity.action_events where session_id = %s for update", (sid,)
    )
    return holder


def test_loops_never_wait_for_each_other_with_a_transaction_open(db, seeded):
    """Independent loops: while one waits inside batch 3, the others delete and commit every
    other batch, and none of them holds a transaction open meanwhile (only the lock does)."""
    holder = _hold_events_of(db, session_id("t", 13))  # batch 3 (index 2) of batch_size 5
    results: list = []
    errors: list = []

    def one_run() -> None:
        try:
            results.append(
                job.run(
                    _patient(db),
                    # unpaced: a paced loop is idle between batches, which this test reads as done
                    config(batch_size=5, runners=2, **UNPACED),
                    job_telemetry(job.JOB),
                    StopSignal(),
                )
            )
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    runner = threading.Thread(target=one_run)
    runner.start()
    try:
        # one loop blocked in batch 3 while the other commits every other batch of the step
        # (an idle session alone can be a loop between two batches: wait for the commits too)
        _wait_for(
            lambda: (
                _job_backends(db) == {"waiting": 1, "idle in transaction": 1, "idle": 1}
                and existing(db, "action_events", "session_id", ids(1, 30)) == set(ids(11, 15))
            ),
            "one loop blocked in batch 3 and the other done with the rest",
        )
    finally:
        holder.rollback()
        holder.close()
        runner.join(timeout=120)

    assert errors == []
    [result] = results
    assert (result.deleted_sessions, result.deleted_action_events) == (30, 60)
    assert result.deleted_property_object_views == 60
    assert result.batches_processed == 6  # session batches: 30 / 5
    assert result.batches_by_table == dict.fromkeys(job.TABLES, 6)
    assert result.has_more is False
    assert eligible_left(db) == {"sessions": 0, "action_events": 0, "property_object_views": 0}
    assert counts(db)["sessions"] == 10


def test_a_failed_batch_with_several_loops_leaves_whole_batches(db, seeded):
    """Three loops, batch 3 fails: the step fails with BatchFailed, every batch is either
    committed whole or rolled back whole, and the next run finishes."""
    with db.connect() as conn:
        conn.execute(
            """
            create function public.refuse_13() returns trigger language plpgsql as $$
            begin
              if old.session_id = %s::uuid then raise exception 'injected failure'; end if;
              return old;
            end $$;
            create trigger refuse_13 before delete on user_activity.action_events
              for each row execute function public.refuse_13();
            """.replace("%s", f"'{session_id('t', 13)}'")
        )
        conn.commit()
    tel = job_telemetry(job.JOB)

    with pytest.raises(BatchFailed, match="RaiseException P0001"):
        job.run(job_connect(db, job.JOB), config(batch_size=5, runners=3), tel, StopSignal())

    left = existing(db, "action_events", "session_id", ids(1, 30))
    assert set(ids(11, 15)) <= left  # the failed batch rolled back whole
    for first in range(1, 31, 5):  # each batch is whole: all of its sessions' events or none
        batch = set(ids(first, first + 4))
        assert batch <= left or not (batch & left), f"batch from {first} is partial"
    assert counts(db)["sessions"] == 40  # the run stopped in its first step
    assert _backends(db) == 0
    [alert] = tel.alerts.sent
    assert alert.details["batch_ids"]["ids"] == [str(i) for i in ids(11, 15)]

    with db.connect() as conn:
        conn.execute("drop trigger refuse_13 on user_activity.action_events")
        conn.commit()
    assert (
        job.run(
            job_connect(db, job.JOB), config(batch_size=5), job_telemetry(job.JOB), StopSignal()
        ).deleted_sessions
        == 30
    )
    assert eligible_left(db) == {"sessions": 0, "action_events": 0, "property_object_views": 0}


class Injected(Exception):
    """A bug in a side loop: not a psycopg error."""


class ExplodeInASideLoop(RecordingMetrics):
    """The first counter a side loop (not the caller's thread) sends raises :class:`Injected`,
    once another loop of the step is blocked on a row lock in the middle of its batch."""

    def __init__(self, db) -> None:
        super().__init__()
        self.db, self.raised_at = db, None
        self._once = threading.Lock()

    def incr(self, name: str, count: int = 1) -> None:
        super().incr(name, count)
        if threading.current_thread() is threading.main_thread() or count == 0:
            return
        if not self._once.acquire(blocking=False):
            return
        _wait_for(lambda: _backends(self.db, waiting=True) == 1, "a loop blocked in batch 3")
        self.raised_at = time.monotonic()
        raise Injected("side loop bug")


def test_an_exception_in_a_side_loop_stops_the_step_within_the_bound(db, seeded):
    """Any exception in any loop ends the step at once: the blocked loop's statement is
    cancelled (not left to its 120 s lock_timeout), its batch rolls back, committed batches
    stay, no backend of the job is left, and the original exception is raised."""
    holder = _hold_events_of(db, session_id("t", 13))  # batch 3 of batch_size 5
    metrics = ExplodeInASideLoop(db)
    try:
        with pytest.raises(Injected, match="side loop bug"):
            job.run(
                _patient(db),
                config(batch_size=5, runners=3),
                job_telemetry(job.JOB, metrics=metrics),
                StopSignal(),
            )
        stopped_after = time.monotonic() - metrics.raised_at
        # every connection closed, nothing left in a transaction (waited for while the holder
        # still holds the lock: the server drops a closed session a moment after the client)
        _wait_for(lambda: _backends(db) == 0, "the job's sessions to end", timeout=10)
    finally:
        holder.rollback()
        holder.close()

    print(f"clean stop: {stopped_after:.3f} s after the exception")
    assert stopped_after < STOP_BOUND_SECONDS
    left = existing(db, "action_events", "session_id", ids(1, 30))
    assert set(ids(11, 15)) <= left  # the blocked batch rolled back
    assert len(left) < 30  # the batch the failing loop committed stays committed
    for first in range(1, 31, 5):
        batch = set(ids(first, first + 4))
        assert batch <= left or not (batch & left), f"batch from {first} is partial"
    assert counts(db)["sessions"] == 40
    result = job.run(
        job_connect(db, job.JOB), config(batch_size=5), job_telemetry(job.JOB), StopSignal()
    )
    assert result.deleted_sessions == 30


class Alarm(BaseException):
    """What the Task SDK's AirflowTaskTimeout is: a BaseException raised by SIGALRM."""


def test_a_base_exception_from_sigalrm_mid_statement_stops_every_loop(db, seeded):
    """SIGALRM raises in the caller's thread (lane 0) wherever it is, in a statement or in
    the join; psycopg does not cancel the statement for it, the job does."""
    holder = _hold_events_of(db, session_id("t", 13))
    raised: list[float] = []

    def alarm(signum, frame):
        raised.append(time.monotonic())
        raise Alarm("execution_timeout")

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        # the alarm fires once a loop is blocked in batch 3 (well inside the 120 s lock wait)
        waiter = threading.Thread(
            target=lambda: (
                _wait_for(lambda: _backends(db, waiting=True) == 1, "a blocked loop"),
                signal.setitimer(signal.ITIMER_REAL, 0.2),
            )
        )
        waiter.start()
        with pytest.raises(Alarm):
            job.run(
                _patient(db), config(batch_size=5, runners=3), job_telemetry(job.JOB), StopSignal()
            )
        stopped_after = time.monotonic() - raised[0]
        # while the holder still holds the lock: a session the job left behind (or a statement
        # it did not cancel) would stay; a closed one leaves pg_stat_activity a moment after
        # the client hung up, later on a loaded machine
        _wait_for(lambda: _backends(db) == 0, "the job's sessions to end", timeout=10)
        waiter.join(timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        holder.rollback()
        holder.close()

    print(f"clean stop: {stopped_after:.3f} s after the exception")
    assert stopped_after < STOP_BOUND_SECONDS
    left = existing(db, "action_events", "session_id", ids(1, 30))
    assert set(ids(11, 15)) <= left
    for first in range(1, 31, 5):
        batch = set(ids(first, first + 4))
        assert batch <= left or not (batch & left), f"batch from {first} is partial"
    assert counts(db)["sessions"] == 40


@pytest.mark.parametrize("shape", sorted(RETENTION_SHAPES))
def test_every_benchmark_shape_is_deleted_completely(db, shape):
    """The bench's data shapes (few children, many events, every SET NULL reference set)."""
    ds = retention_dataset(23, shape)  # 23 eligible + 10 that stay; batches of 5: 5 per step
    load_retention(db.url, ds)
    with db.connect() as conn:
        linked = conn.execute(
            "select count(*) from user_activity.property_object_views"
            " where apply_filter_event_id is not null"
        ).fetchone()[0]
    per_session = ds.shape.views if ds.shape.apply_filter == "all" else 1
    assert linked == ds.sessions * min(per_session, ds.shape.events)
    stats = snapshot(db, "property_object_view_stats")

    result = job.run(
        job_connect(db, job.JOB), config(batch_size=5), job_telemetry(job.JOB), StopSignal()
    )

    assert result.deleted_sessions == 23
    assert result.deleted_property_object_views == 23 * ds.views_per_session
    assert result.deleted_action_events == 23 * ds.events_per_session
    assert result.batches_processed == 5
    assert result.batches_by_table == dict.fromkeys(job.TABLES, 5)
    assert eligible_left(db) == {"sessions": 0, "action_events": 0, "property_object_views": 0}
    after = counts(db)
    assert (after["sessions"], after["action_events"], after["property_object_views"]) == (
        10,
        10 * ds.events_per_session,
        10 * ds.views_per_session,
    )
    assert snapshot(db, "property_object_view_stats") == stats
