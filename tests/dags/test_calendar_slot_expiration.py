"""calendar_slot_expiration: DAG structure and real runs through ``airflow dags test``."""

from __future__ import annotations

import ast
import json
from datetime import UTC, datetime, timedelta

import pytest

from devtools.pg import Database
from include.pin_maintenance.jobs import slot_expiration as se
from tests.dags.conftest import dag_of
from tests.integration.slot_expiration_fixtures import insert_slot, statuses, table_state

pytestmark = pytest.mark.dags

DAG_ID = "calendar_slot_expiration"


@pytest.fixture(scope="module")
def dag(dagbag):
    return dag_of(dagbag, DAG_ID)


def test_structure(dag):
    assert type(dag.timetable).__name__ == "CronTriggerTimetable"
    assert dag.timetable.expression == "*/5 * * * *"
    assert str(dag.timetable.timezone) == "UTC"
    assert dag.max_active_runs == 1
    assert dag.catchup is False
    assert dag.tags == {"pin", "postgres-maintenance", "calendar"}
    assert "Runbook" in dag.doc_md and "Safe to rerun" in dag.doc_md
    assert set(dag.params.keys()) == {
        "batch_size",
        "max_batches_per_cycle",
        "runners",
        "max_run_duration_seconds",
        "max_replica_lag_seconds",
        "max_wal_mb_per_second",
        "dry_run",
    }
    assert [t.task_id for t in dag.tasks] == ["expire_slots"]
    assert dag.tasks[0].execution_timeout == timedelta(minutes=10)


def _seed(db: Database) -> dict:
    now = datetime.now(UTC)
    with db.connect() as conn:
        ids = {
            "due": [insert_slot(conn, start_at=now - timedelta(hours=h)) for h in range(1, 6)],
            "future": insert_slot(conn, start_at=now + timedelta(days=1)),
            "booked": insert_slot(conn, status="Booked", start_at=now - timedelta(hours=2)),
            "archived": insert_slot(conn, status="Archived", start_at=now - timedelta(days=3)),
        }
    return ids


def _return_value(output: str) -> dict | None:
    """The task's return value as ``airflow dags test`` logs it."""
    marker = "Returned value was: "
    for line in output.splitlines():
        if marker in line:
            text = line.split(marker, 1)[1]
            return ast.literal_eval(text[: text.rindex("}") + 1])
    return None


def test_run_expires_due_slots_isolates_a_poison_row_and_exits_zero(db: Database, run_dag):
    ids = _seed(db)
    with db.connect() as conn:  # version + 1 overflows: a poison row that must not fail the run
        poison = insert_slot(
            conn, start_at=datetime.now(UTC) - timedelta(hours=9), version=2**31 - 1
        )
    before = table_state(db)

    done = run_dag(DAG_ID, db, conf={"batch_size": 2, "max_batches_per_cycle": 100})

    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    after = table_state(db)
    assert all(after[i][:2] == ("Expired", 2) for i in ids["due"])
    for key in ("future", "booked", "archived"):
        assert after[ids[key]] == before[ids[key]]
    assert after[poison] == before[poison]
    result = _return_value(output)
    assert result is not None, output[-5000:]
    assert result["ExpiredCount"] == 5
    assert result["SkippedLockedCount"] == 0
    assert result["ErrorsCount"] == 1
    assert result["Runners"] == 2  # the first batch was full: a second loop, own connection
    assert isinstance(result["DurationMs"], int)
    alerts = [
        json.JSONDecoder().raw_decode(line.split("PIN_ALERT ", 1)[1])[0]
        for line in output.splitlines()
        if "PIN_ALERT {" in line
    ]
    assert [(a["alert"], a["details"]["slot_id"]) for a in alerts] == [
        ("slot_expiration_poison_row", str(poison))
    ]
    assert "event=item_failed" in output and f"slot_id={poison}" in output


def test_a_default_cycle_expires_one_batch_and_leaves_the_backlog_for_the_next(
    db: Database, run_dag
):
    """Seed 002: batch_size is the bound of rows per cycle (max_batches_per_cycle 1)."""
    now = datetime.now(UTC)
    with db.connect() as conn:
        ids = [insert_slot(conn, start_at=now - timedelta(minutes=m)) for m in range(1, 8)]
    done = run_dag(DAG_ID, db, conf={"batch_size": 3})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    result = _return_value(output)
    assert result is not None, output[-5000:]
    assert (result["ExpiredCount"], result["Batches"], result["Runners"]) == (3, 1, 1)
    assert (result["StopReason"], result["SkippedLockedCount"], result["Backlog"]) == (
        "max_batches",
        0,
        4,
    )
    state = table_state(db)
    oldest_first = sorted(ids, key=lambda i: state[i][3])
    assert [state[i][0] for i in oldest_first] == ["Expired"] * 3 + ["Available"] * 4


def test_dry_run_changes_nothing(db: Database, run_dag):
    _seed(db)
    before = table_state(db)

    done = run_dag(DAG_ID, db, conf={"dry_run": True})

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "would_expire_count=5" in done.stdout + done.stderr
    assert table_state(db) == before


def test_invalid_variable_fails_the_run_naming_the_key_before_any_write(db: Database, run_dag):
    _seed(db)

    done = run_dag(DAG_ID, db, variables={DAG_ID: json.dumps({"batch_size": 0})})

    assert done.returncode != 0
    assert "batch_size = 0" in done.stdout + done.stderr
    assert statuses(db) == {"Available": 6, "Booked": 1, "Archived": 1}


def test_a_run_duration_the_timeout_cannot_hold_fails_the_run_naming_both(db: Database, run_dag):
    _seed(db)

    done = run_dag(DAG_ID, db, variables={DAG_ID: json.dumps({"max_run_duration_seconds": 3600})})

    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert (
        "max_run_duration_seconds = 3600 (from Variable calendar_slot_expiration) needs up to "
        "3635 s in task expire_slots, more than its execution_timeout of 600 s; allowed: <= 565"
    ) in output, output[-3000:]
    assert "AirflowTaskTimeout" not in output
    assert statuses(db) == {"Available": 6, "Booked": 1, "Archived": 1}


def test_invalid_param_fails_the_run_naming_the_key(db: Database, run_dag):
    _seed(db)

    done = run_dag(DAG_ID, db, conf={"max_run_duration_seconds": 0})

    assert done.returncode != 0
    assert "Invalid input for param max_run_duration_seconds" in done.stdout + done.stderr
    assert statuses(db) == {"Available": 6, "Booked": 1, "Archived": 1}


def test_job_config_and_dag_params_agree():
    assert se.CONFIG.job == DAG_ID
