"""user_activity_retention as Airflow sees it: structure from the DagBag, real `dags test` runs."""

from __future__ import annotations

import pytest

from devtools.retention_data import seed_sessions

pytestmark = pytest.mark.dags

DAG_ID = "user_activity_retention"
TABLES = ("sessions", "property_object_views", "action_events", "property_object_view_stats")


def _completed_line(output: str) -> str:
    """The report task's ``event=completed`` line (docs/design.md, "Log vocabulary")."""
    (line,) = [x for x in output.splitlines() if "event=completed " in x]
    return line


@pytest.fixture(scope="module")
def retention_dag():
    from airflow.dag_processing.dagbag import DagBag

    from tests.conftest import _REPO

    bag = DagBag(dag_folder=str(_REPO / "dags" / f"{DAG_ID}.py"))
    assert bag.import_errors == {}
    return bag.dags[DAG_ID]


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
    assert output.count("event=lock_skip") == 3
    assert "has_more=True" in _completed_line(output)
