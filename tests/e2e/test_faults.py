"""Faults under the scheduler: the jobs' Postgres restarts in the middle of a run.

On the git-bundle stack (``bundle_e2e``: manual runs only, so no scheduled tick lands inside a
fault run); its task policy (tests/airflow_config) retries after 2 s instead of 30.

The job tables live on their own embedded server (``e2e_job_server``), so ``pg_ctl restart -m
fast`` ends every job session mid-batch while Airflow's metadata DB stays up. Expected: the
task in hand fails (Airflow retries it once, per DEFAULT_ARGS) with nothing half-applied; rows
that must survive survive; the retry or the next run finishes the work.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from devtools.local_airflow import wait_for
from devtools.outbox_data import generate_outbox
from devtools.retention_data import seed_sessions, session_id
from tests.e2e import job_checks as jc
from tests.e2e.stack_fixtures import E2EAirflow, JobServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONNECTION_LOST = ("OperationalError", "AdminShutdown", "terminating connection", "closed")


def _interrupted(e2e: E2EAirflow, dag_id: str, run_id: str) -> list[str]:
    """Task ids that failed at least once in the run (a failed try or a retry)."""
    return [
        ti["task_id"]
        for ti in e2e.task_instances(dag_id, run_id)
        if ti["state"] == "failed" or (ti.get("try_number") or 1) > 1
    ]


def _young_intact(e2e: E2EAirflow, ids: list[uuid.UUID]) -> tuple[int, int, int]:
    with e2e.job_conn() as conn:
        return conn.execute(
            "select (select count(*) from user_activity.sessions where id = any(%(ids)s)),"
            " (select count(*) from user_activity.property_object_views"
            "   where session_id = any(%(ids)s)),"
            " (select count(*) from user_activity.action_events where session_id = any(%(ids)s))",
            {"ids": ids},
        ).fetchone()


def test_postgres_restart_during_a_retention_run(
    bundle_e2e: E2EAirflow, e2e_job_server: JobServer
) -> None:
    e2e = bundle_e2e
    n_eligible, n_young = 20000, 40
    jc.quiet_window(e2e, jc.RETENTION, need=timedelta(seconds=30))
    tag = uuid.uuid4().hex[:12]
    with e2e.job_conn() as conn:
        jc._clear_user_activity(conn)
        seed_sessions(conn, n_eligible, n_young, 2, tag=tag)
        conn.commit()
    young = [session_id(tag, i) for i in range(n_eligible + 1, n_eligible + n_young + 1)]
    stats_before = jc._stats(e2e)
    total_events = (n_eligible + n_young) * 2
    conf = {"batch_size": 100, "max_batches_per_run": 1000}

    run_id = e2e.new_run_id("fault")
    r = e2e.trigger_api(jc.RETENTION, conf, run_id)
    assert r.status_code == 200, r.text
    # mid-run: some rows deleted, eligible sessions still there
    wait_for(
        lambda: (
            (c := jc._activity_counts(e2e))["events"] < total_events and c["sessions"] > n_young
        ),
        timeout=300,
        interval=0.2,
        what="the retention run to be deleting",
    )
    e2e_job_server.restart()

    # nothing half-applied: survivors and stats are whole right after the crash
    assert _young_intact(e2e, young) == (n_young, 2 * n_young, 2 * n_young)
    assert jc._stats(e2e) == stats_before

    run = e2e.wait_run(jc.RETENTION, run_id)
    interrupted = _interrupted(e2e, jc.RETENTION, run_id)
    logs = e2e.run_logs(jc.RETENTION, run_id)
    assert interrupted, f"no task saw the restart:\n{logs[-5000:]}"
    assert any(marker in logs for marker in CONNECTION_LOST), logs[-5000:]
    assert run["state"] in {"success", "failed"}

    # the next run completes whatever is left
    jc.trigger(e2e, jc.RETENTION, conf, "api")
    assert jc._activity_counts(e2e) == {
        "sessions": n_young,
        "views": 2 * n_young,
        "events": 2 * n_young,
    }
    assert _young_intact(e2e, young) == (n_young, 2 * n_young, 2 * n_young)
    assert jc._stats(e2e) == stats_before


def test_postgres_restart_during_a_detach_run(
    bundle_e2e: E2EAirflow, e2e_job_server: JobServer
) -> None:
    e2e = bundle_e2e
    svc = e2e.selections
    assert svc is not None
    n_rows, batch = 150, 10
    jc.quiet_window(e2e, jc.DETACH, need=timedelta(seconds=30))
    with e2e.job_conn() as conn:
        conn.execute("delete from news.snapshot_detach_outbox")
        conn.commit()
        snapshots = generate_outbox(conn, n_rows)
    conf = {
        "batch_size": batch,
        "detach_concurrency": 1,
        "backoff_base_seconds": 1,
        "backoff_cap_seconds": 5,
    }
    svc.latency_ms = 100  # ~15 s of calls: room to restart in the middle
    try:
        run_id = e2e.new_run_id("fault")
        r = e2e.trigger_api(jc.DETACH, conf, run_id)
        assert r.status_code == 200, r.text
        wait_for(
            lambda: 20 <= _done(e2e) < n_rows - 2 * batch,
            timeout=300,
            interval=0.2,
            what="the detach run to be half way",
        )
        e2e_job_server.restart()

        run = e2e.wait_run(jc.DETACH, run_id)
        interrupted = _interrupted(e2e, jc.DETACH, run_id)
        logs = e2e.run_logs(jc.DETACH, run_id)
        assert interrupted, f"no task saw the restart:\n{logs[-5000:]}"
        assert run["state"] in {"success", "failed"}

        # the next run completes: wait for the interrupted batch's (short) backoff first
        wait_for(lambda: _not_yet_due(e2e) == 0, timeout=120, what="backoff to pass")
        jc.trigger(e2e, jc.DETACH, conf, "api")
    finally:
        svc.latency_ms = 0

    state = jc._outbox(e2e, snapshots)
    assert sorted({st for st, _ in state.values()}) == ["Done"], state
    assert len(state) == n_rows  # no row lost
    assert max(att for _, att in state.values()) <= 3
    assert all(svc.is_detached(s) for s in snapshots)
    # a snapshot is called again only when its row was claimed again, i.e. its outcome was
    # not recorded before the crash (detach is idempotent); a recorded Done is never redone
    called_twice = {s: state[s] for s in snapshots if svc.call_count(s) > 1}
    assert all(attempts >= 2 for _, attempts in called_twice.values()), called_twice
    assert len(called_twice) <= 2 * batch, called_twice  # only what was in flight


def _done(e2e: E2EAirflow) -> int:
    with e2e.job_conn() as conn:
        return conn.execute(
            "select count(*) from news.snapshot_detach_outbox where status = 'Done'"
        ).fetchone()[0]


def _not_yet_due(e2e: E2EAirflow) -> int:
    with e2e.job_conn() as conn:
        return conn.execute(
            "select count(*) from news.snapshot_detach_outbox"
            " where status = 'Pending' and next_attempt_at > now()"
        ).fetchone()[0]
