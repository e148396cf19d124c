"""user_activity_retention as Airflow sees it: structure from the DagBag, real `dags test` runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.retention_data import seed_sessions
from tests.dags.conftest import dag_of

pytestmark = pytest.mark.dags

DAG_ID = "user_activity_retention"
TIMEOUT_FIXTURES = Path(__file__).resolve().parent / "fixtures_dags" / "timeout"
TABLES = ("sessions", "property_object_views", "action_events", "property_object_view_stats")


def _completed_line(output: str) -> str:
    """The report task's ``event=job_completed`` line (docs/design.md, "Log vocabulary")."""
    (line,) = [x for x in output.splitlines() if "event=job_completed " in x]
    return line


@pytest.fixture(scope="module")
def retention_dag(dagbag):
    return dag_of(dagbag, DAG_ID)


def test_schedule_and_run_policy(retention_dag):
    dag = retention_dag
    assert dag.timetable.expression == "0 3 * * *"
    assert str(dag.timetable.timezone.name) == "Europe/Moscow"
    assert dag.start_date.tzinfo is not None
    assert dag.max_active_runs == 1
    assert dag.catchup is False
    assert set(dag.tags) == {"pin", "postgres-maintenance", "user-activity"}
    assert dag.doc_md and "Runbook" in dag.doc_md
    assert set(dag.params) == {
        "retention_period_days",
        "batch_size",
        "runners",
        "max_batches_per_run",
        "max_run_duration_seconds",
        "max_replica_lag_seconds",
        "max_wal_mb_per_second",
        "dry_run",
    }
    assert all(t.execution_timeout is not None for t in dag.tasks)


def test_delete_tasks_run_in_fk_order_between_prepare_and_report(retention_dag):
    dag = retention_dag
    order = [t.task_id for t in dag.topological_sort()]
    assert order == [
        "prepare",
        "delete_action_events",
        "delete_property_object_views",
        "delete_sessions",
        "report",
    ]
    assert dag.get_task("delete_action_events").upstream_task_ids == {"prepare"}
    assert dag.get_task("delete_property_object_views").upstream_task_ids == {
        "prepare",
        "delete_action_events",
    }
    assert dag.get_task("delete_sessions").upstream_task_ids == {
        "prepare",
        "delete_property_object_views",
    }
    assert dag.get_task("report").upstream_task_ids == {
        "prepare",
        "delete_action_events",
        "delete_property_object_views",
        "delete_sessions",
    }


def _counts(db) -> dict[str, int]:
    with db.connect() as conn:
        return {
            t: conn.execute(f"select count(*) from user_activity.{t}").fetchone()[0] for t in TABLES
        }


def _stats(db) -> list[tuple]:
    with db.connect() as conn:
        return conn.execute(
            "select * from user_activity.property_object_view_stats order by 1"
        ).fetchall()


@pytest.fixture
def seeded(db):
    with db.connect() as conn:
        seed_sessions(conn, 25, 8, 2, tag="dag")
        conn.commit()
    return db


def test_a_real_run_deletes_the_eligible_sessions_in_batches(run_dag, seeded):
    db = seeded
    stats = _stats(db)

    done = run_dag(DAG_ID, db, conf={"batch_size": 7})

    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert _counts(db) == {
        "sessions": 8,
        "property_object_views": 16,
        "action_events": 16,
        "property_object_view_stats": len(stats),
    }
    assert _stats(db) == stats
    completed = _completed_line(output)
    assert "deleted_sessions=25" in completed
    assert "deleted_action_events=50" in completed
    assert "has_more=False" in completed


def test_dry_run_changes_nothing(run_dag, seeded):
    db = seeded
    before = _counts(db)

    done = run_dag(DAG_ID, db, conf={"dry_run": True})

    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert _counts(db) == before
    completed = _completed_line(output)
    assert "dry_run=True" in completed
    assert "deleted_sessions=0" in completed and "would_delete_sessions=25" in completed


@pytest.mark.parametrize(
    ("variables", "conf", "key"),
    [
        ({DAG_ID: {"max_batches_per_run": 0}}, None, "max_batches_per_run"),
        (None, {"retention_period_days": 0}, "retention_period_days"),
    ],
    ids=["variable", "param"],
)
def test_invalid_config_fails_the_run_before_any_delete(run_dag, seeded, variables, conf, key):
    db = seeded
    before = _counts(db)

    done = run_dag(DAG_ID, db, conf=conf, variables=variables)

    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert key in output
    assert _counts(db) == before


def _alerts(output: str) -> list[dict]:
    """The ``PIN_ALERT {json}`` payloads of a run's log, in order."""
    import json

    return [
        json.JSONDecoder().raw_decode(line.split("PIN_ALERT ", 1)[1])[0]
        for line in output.splitlines()
        if "PIN_ALERT {" in line
    ]


def test_a_missing_grant_fails_prepare_once_with_one_configuration_alert(run_dag, seeded):
    """The role without DELETE on sessions: prepare refuses for all three delete steps, before
    any of them deletes an event; no retry (it would only fail again), one alert that says
    configuration, and the task_failed that follows names it (one page per event)."""
    from psycopg import sql

    db = seeded
    role = db.roles["user_activity_db"].name
    with db.connect() as conn:
        conn.execute(
            sql.SQL("revoke delete on user_activity.sessions from {}").format(sql.Identifier(role))
        )
    before = _counts(db)

    done = run_dag(DAG_ID, db)

    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert _counts(db) == before
    assert output.count("event=privileges_missing") == 1, output[-4000:]  # one try, no retry
    assert f"role {role} lacks DELETE on user_activity.sessions (the sessions delete step)" in (
        output
    )
    assert "event=batch" not in output  # no delete task ran
    refused, failed = _alerts(output)
    assert (refused["alert"], refused["severity"]) == ("database_privileges_missing", "critical")
    assert refused["details"]["problem"] == "configuration"
    assert refused["details"]["role"] == role
    assert (failed["alert"], failed["details"]["task_id"]) == ("task_failed", "prepare")
    assert failed["details"]["event"] == "database_privileges_missing"
    assert failed["details"]["error"] == "MissingPrivileges"


def test_busy_lock_makes_every_delete_task_a_successful_noop(run_dag, seeded):
    import psycopg

    from include.pin_maintenance.db import advisory_lock
    from include.pin_maintenance.jobs.activity_retention import LOCK_NAME

    db = seeded
    before = _counts(db)

    with advisory_lock(lambda: psycopg.connect(db.url), LOCK_NAME, 300) as held:
        assert held
        done = run_dag(DAG_ID, db)

    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert _counts(db) == before
    # the first delete task finds the lock busy; the later ones cover only what it covered
    assert output.count("event=job_skipped") == 1
    assert output.count("event=step_skipped") == 2
    assert "has_more=True" in _completed_line(output)


def _job_statements(db) -> list[tuple[int, str]]:
    """The job's backends (pid, state) as pg_stat_activity shows them now."""
    import psycopg

    from include.pin_maintenance.jobs.activity_retention import SESSION_SETTINGS

    with psycopg.connect(db.url, autocommit=True) as conn:
        return conn.execute(
            "select pid, state from pg_stat_activity where datname = current_database()"
            " and application_name = %s and query ilike '%%delete from user_activity.action%%'"
            " and state = 'active'",
            (SESSION_SETTINGS.application_name,),
        ).fetchall()


def test_execution_timeout_mid_step_stops_the_step_cleanly(run_dag, db):
    """``execution_timeout`` fires while a batch loop is inside a 60 s statement: the Task SDK
    raises AirflowTaskTimeout (a BaseException) in the task's main thread; the job cancels
    every loop's statement in flight on the server, rolls back the batches not committed,
    closes its connections, and the task fails with that exception. The DAG itself refuses a
    timeout that short in prepare, so the fixture DAG runs its first delete task under one."""
    import threading
    import time

    from devtools.retention_data import session_id

    with db.connect() as conn:
        seed_sessions(conn, 30, 10, 2, tag="to")
        # batch 3 of batch_size 5 (sessions 11..15) takes 60 s in its action_events delete
        conn.execute(
            """
            create function public.slow_13() returns trigger language plpgsql as $$
            begin
              if old.session_id = %s::uuid then perform pg_sleep(60); end if;
              return old;
            end $$;
            create trigger slow_13 before delete on user_activity.action_events
              for each row execute function public.slow_13();
            """.replace("%s", f"'{session_id('to', 13)}'")
        )
        conn.commit()
    seen: dict[int, list[float]] = {}  # pid of the slow statement: first and last seen
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            now = time.monotonic()
            for pid, _ in _job_statements(db):
                seen.setdefault(pid, [now, now])[1] = now
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_dag(
            "pin_fixture_retention_timeout",
            db,
            extra_env={"AIRFLOW__CORE__DAGS_FOLDER": str(TIMEOUT_FIXTURES)},
        )
    finally:
        done.set()
        watcher.join(timeout=10)

    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert "AirflowTaskTimeout" in output  # the task failed with the original exception
    assert seen, "the slow statement never ran"
    # each attempt's slow statement ended within the timeout plus the stop bound, not after
    # its 60 s sleep (a statement left running would have held its transaction open)
    for first, last in seen.values():
        print(f"slow statement lived {last - first:.2f} s (timeout 4 s, sleep 60 s)")
        assert last - first < 4 + 10
    assert _job_statements(db) == []
    with db.connect() as conn:
        kept = {
            r[0]
            for r in conn.execute(
                "select distinct session_id from user_activity.action_events"
            ).fetchall()
        }
    batch_3 = {session_id("to", i) for i in range(11, 16)}
    assert batch_3 <= kept  # the interrupted batch rolled back
    # the other batches, committed before the timeout, stay committed
    assert not ({session_id("to", i) for i in range(1, 31)} - batch_3) & kept
    assert _counts(db)["sessions"] == 40  # the later delete tasks never ran
