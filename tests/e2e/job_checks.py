"""Scenarios for the shipped DAGs, run against any e2e Airflow (LocalExecutor or Celery).

Each scenario seeds its own rows in the stack's job database, triggers the DAG the way a user
does (CLI or REST API with a JWT) with params, waits for the run under the scheduler and checks
both the run (state, conf, the task's result) and the tables.

The shipped DAGs keep their contract schedules (``*/5 * * * *``; retention nightly). Unpausing
one makes the scheduler run its latest tick at once (``catchup=False``), and a later tick may
fall inside a scenario. :func:`quiet_window` therefore waits, before seeding, until no run is
in flight and the next scheduled tick is a little way off; should a scheduled run still land
inside a scenario (a slow machine) and break its checks, :func:`scenario` runs it once more
right after that tick, so every change checked belongs to the runs the scenario triggered.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from devtools.local_airflow import wait_for
from devtools.outbox_data import generate_outbox
from devtools.retention_data import seed_sessions
from devtools.slot_data import insert_slots
from tests.e2e.stack_fixtures import E2EAirflow

SLOTS = "calendar_slot_expiration"
RETENTION = "user_activity_retention"
DETACH = "news_snapshot_detach_retry"
REQUEUE = "news_snapshot_detach_requeue"
JOB_DAGS = (SLOTS, RETENTION, DETACH, REQUEUE)
ACTIVE = frozenset({"queued", "running"})


def _ts(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def quiet_window(e2e: E2EAirflow, dag_id: str, need: timedelta = timedelta(seconds=45)) -> None:
    """Unpause ``dag_id``; return once no run is active and its next tick is ``need`` away."""
    dag = e2e.wait_dag(dag_id)
    if dag.get("is_paused"):
        e2e.set_paused(dag_id, False)
    if not e2e.scheduled_runs:
        return

    def quiet() -> bool:
        e2e.stack.check_alive()
        if any(r["state"] in ACTIVE for r in e2e.runs(dag_id)):
            return False
        info = e2e.api.get(f"/dags/{dag_id}").json()
        run_after = _ts(info.get("next_dagrun_run_after"))
        return run_after is None or run_after - datetime.now(UTC) > need

    wait_for(quiet, timeout=600, interval=2, what=f"a quiet scheduling window for {dag_id}")


def _scheduled_since(e2e: E2EAirflow, dag_id: str, since: datetime) -> bool:
    return any(
        r["run_type"] == "scheduled" and (_ts(r.get("run_after")) or since) >= since
        for r in e2e.runs(dag_id)
    )


def scenario(e2e: E2EAirflow, dag_id: str, body: Callable[[], None]) -> None:
    """``body`` in a quiet window; once more if a scheduled run landed inside and it failed."""
    for attempt in (1, 2):
        quiet_window(e2e, dag_id)
        started = datetime.now(UTC)
        try:
            body()
            return
        except AssertionError:
            if attempt == 2 or not _scheduled_since(e2e, dag_id, started):
                raise


def trigger(e2e: E2EAirflow, dag_id: str, conf: dict, via: str) -> str:
    """Trigger through ``via`` ("cli" or "api"); return the run id once it succeeded."""
    dag = e2e.api.get(f"/dags/{dag_id}").json()
    # a paused DAG's manual run stays queued: fail now, not after wait_run's timeout
    assert not dag.get("is_paused"), f"{dag_id} is paused (quiet_window unpauses it)"
    run_id = e2e.new_run_id(via)
    if via == "cli":
        done = e2e.trigger_cli(dag_id, conf, run_id)
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        r = e2e.trigger_api(dag_id, conf, run_id)
        assert r.status_code == 200, r.text
    run = e2e.wait_run(dag_id, run_id)
    assert run["state"] == "success", e2e.run_logs(dag_id, run_id)
    assert run["run_type"] == "manual"
    assert run["conf"] == conf
    return run_id


def assert_rejected(e2e: E2EAirflow, dag_id: str, conf: dict) -> None:
    """An out-of-range param: the API answers 400 naming the key, and no run is created."""
    run_id = e2e.new_run_id("bad")
    r = e2e.trigger_api(dag_id, conf, run_id)
    assert r.status_code == 400, r.text
    assert next(iter(conf)) in r.text, r.text
    assert e2e.run(dag_id, run_id) is None


# -- calendar_slot_expiration -----------------------------------------------------------------


def check_slot_expiration(e2e: E2EAirflow, *, dry_run_via: str = "cli", via: str = "api") -> None:
    def body() -> None:
        now = datetime.now(UTC)
        with e2e.job_conn() as conn:
            conn.execute("delete from calendar.availability_slots")
            insert_slots(
                conn,
                status="Available",
                count=30,
                first_start=now - timedelta(days=2),
                last_start=now - timedelta(minutes=5),
            )
            insert_slots(
                conn,
                status="Available",
                count=5,
                first_start=now + timedelta(days=1),
                last_start=now + timedelta(days=2),
            )
            insert_slots(
                conn,
                status="Booked",
                count=4,
                first_start=now - timedelta(days=1),
                last_start=now - timedelta(hours=1),
            )

        dry = trigger(e2e, SLOTS, {"dry_run": True, "batch_size": 7}, dry_run_via)
        assert _slot_counts(e2e) == {"Available": 35, "Booked": 4}, "a dry run changed slots"
        assert e2e.xcom(SLOTS, dry, "expire_slots")["ExpiredCount"] == 0

        run_id = trigger(e2e, SLOTS, {"batch_size": 7, "max_batches_per_cycle": 10}, via)

        assert _slot_counts(e2e) == {"Available": 5, "Booked": 4, "Expired": 30}
        result = e2e.xcom(SLOTS, run_id, "expire_slots")
        assert result["ExpiredCount"] == 30
        assert result["Batches"] >= 5  # 30 rows in batches of 7: the param reached the job
        with e2e.job_conn() as conn:
            future_available = conn.execute(
                "select count(*) from calendar.availability_slots"
                " where status = 'Available' and start_at > now()"
            ).fetchone()[0]
        assert future_available == 5

    scenario(e2e, SLOTS, body)


def _slot_counts(e2e: E2EAirflow) -> dict[str, int]:
    with e2e.job_conn() as conn:
        rows = conn.execute(
            "select status, count(*) from calendar.availability_slots group by status"
        ).fetchall()
    return {status: n for status, n in rows}


# -- user_activity_retention ------------------------------------------------------------------


def check_retention(e2e: E2EAirflow, *, dry_run_via: str = "cli", via: str = "api") -> None:
    def body() -> None:
        with e2e.job_conn() as conn:
            _clear_user_activity(conn)
            seeded = seed_sessions(conn, n_eligible=20, n_young=6, children_per_session=2)
            conn.commit()
        stats_before = _stats(e2e)
        before = _activity_counts(e2e)
        assert before == {"sessions": 26, "views": 52, "events": 52}

        trigger(e2e, RETENTION, {"dry_run": True, "batch_size": 3}, dry_run_via)
        assert _activity_counts(e2e) == before, "a dry run deleted rows"

        run_id = trigger(e2e, RETENTION, {"batch_size": 4, "retention_period_days": 365}, via)

        assert _activity_counts(e2e) == {"sessions": 6, "views": 12, "events": 12}
        assert _stats(e2e) == stats_before  # property_object_view_stats is never touched
        report = e2e.xcom(RETENTION, run_id, "report")
        assert report["DeletedSessions"] == seeded.eligible_sessions
        assert report["DeletedActionEvents"] == 40
        assert report["DeletedPropertyObjectViews"] == 40
        assert report["HasMore"] is False

    scenario(e2e, RETENTION, body)


def _clear_user_activity(conn) -> None:
    conn.execute("update user_activity.property_object_views set apply_filter_event_id = null")
    conn.execute("delete from user_activity.action_events")
    conn.execute("delete from user_activity.property_object_views")
    conn.execute("delete from user_activity.sessions")
    conn.execute("delete from user_activity.property_object_view_stats")


def _activity_counts(e2e: E2EAirflow) -> dict[str, int]:
    with e2e.job_conn() as conn:
        row = conn.execute(
            "select (select count(*) from user_activity.sessions),"
            " (select count(*) from user_activity.property_object_views),"
            " (select count(*) from user_activity.action_events)"
        ).fetchone()
    return dict(zip(("sessions", "views", "events"), row, strict=True))


def _stats(e2e: E2EAirflow) -> list[tuple]:
    with e2e.job_conn() as conn:
        return conn.execute(
            "select * from user_activity.property_object_view_stats order by 1"
        ).fetchall()


# -- news_snapshot_detach_retry and _requeue --------------------------------------------------


def check_detach_retry(e2e: E2EAirflow, *, dry_run_via: str = "cli", via: str = "api") -> None:
    def body() -> None:
        assert e2e.selections is not None
        with e2e.job_conn() as conn:
            conn.execute("delete from news.snapshot_detach_outbox")
            conn.commit()
            snapshots = generate_outbox(conn, 10)
            not_due = generate_outbox(conn, 2, due_in=timedelta(hours=1))
        calls_before = e2e.selections.call_counts()

        dry = trigger(e2e, DETACH, {"dry_run": True, "batch_size": 3}, dry_run_via)
        assert _outbox(e2e, snapshots) == {s: ("Pending", 0) for s in snapshots}
        assert e2e.selections.call_counts() == calls_before, "a dry run called selections"
        dry_report = e2e.xcom(DETACH, dry, "detach_pending_snapshots")
        assert dry_report["DryRun"] is True, dry_report
        assert dry_report["Due"] == 10, dry_report  # the 10 due rows, not the 2 later ones
        assert (dry_report["Claimed"], dry_report["Calls"]) == (0, 0), dry_report

        run_id = trigger(e2e, DETACH, {"batch_size": 3, "detach_concurrency": 2}, via)

        assert _outbox(e2e, snapshots) == {s: ("Done", 1) for s in snapshots}
        assert _outbox(e2e, not_due) == {s: ("Pending", 0) for s in not_due}
        for s in snapshots:
            assert e2e.selections.call_count(s) == 1, s
        for s in not_due:
            assert e2e.selections.call_count(s) == 0, s
        result = e2e.xcom(DETACH, run_id, "detach_pending_snapshots")
        assert result["DryRun"] is False, result
        assert (result["Claimed"], result["Succeeded"], result["Calls"]) == (10, 10, 10), result
        assert (result["Retried"], result["Quarantined"], result["Failed"]) == (0, 0, 0), result
        assert result["Batches"] >= 4, result  # 10 rows in batches of 3: the param reached it
        assert result["Pending"] == 2, result  # the two rows not yet due

    scenario(e2e, DETACH, body)


def check_requeue(e2e: E2EAirflow, *, via: str = "api") -> None:
    e2e.wait_dag(REQUEUE)
    e2e.set_paused(REQUEUE, False)  # manual only: no schedule to keep out of the way
    with e2e.job_conn() as conn:
        quarantined = generate_outbox(
            conn, 4, status="Quarantined", attempts=12, last_error="HttpStatus 404"
        )
    chosen, others = quarantined[:2], quarantined[2:]

    dry = trigger(e2e, REQUEUE, {"snapshot_ids": chosen, "dry_run": True}, via)
    assert {s: st for s, (st, _) in _outbox(e2e, quarantined).items()} == dict.fromkeys(
        quarantined, "Quarantined"
    )
    dry_report = e2e.xcom(REQUEUE, dry, "requeue_quarantined_snapshots")
    assert dry_report["DryRun"] is True, dry_report
    assert (dry_report["WouldRequeueCount"], dry_report["RequeuedCount"]) == (2, 0), dry_report
    assert sorted(dry_report["SnapshotIds"]) == sorted(chosen), dry_report

    run_id = trigger(e2e, REQUEUE, {"snapshot_ids": chosen}, via)
    report = e2e.xcom(REQUEUE, run_id, "requeue_quarantined_snapshots")
    assert (report["RequeuedCount"], report["WouldRequeueCount"]) == (2, 0), report
    assert sorted(report["SnapshotIds"]) == sorted(chosen), report

    state = _outbox(e2e, quarantined)
    assert {s: state[s] for s in chosen} == {s: ("Pending", 0) for s in chosen}
    assert {s: state[s] for s in others} == {s: ("Quarantined", 12) for s in others}
    with e2e.job_conn() as conn:
        due = conn.execute(
            "select bool_and(next_attempt_at <= now()) from news.snapshot_detach_outbox"
            " where snapshot_id = any(%s::uuid[])",
            (chosen,),
        ).fetchone()[0]
    assert due is True


def _outbox(e2e: E2EAirflow, snapshot_ids: list[str]) -> dict[str, tuple[str, int]]:
    with e2e.job_conn() as conn:
        rows = conn.execute(
            "select snapshot_id::text, status, attempts from news.snapshot_detach_outbox"
            " where snapshot_id = any(%s::uuid[])",
            ([uuid.UUID(s) for s in snapshot_ids],),
        ).fetchall()
    return {s: (status, attempts) for s, status, attempts in rows}
