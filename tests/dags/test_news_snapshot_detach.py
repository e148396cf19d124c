"""The detach retry and requeue DAGs: structure, and real runs with `airflow dags test`."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from devtools.selections_service import SelectionsService
from tests.integration.snapshot_detach_fixtures import insert_entries, insert_entry, rows

pytestmark = pytest.mark.dags

RETRY = "news_snapshot_detach_retry"
REQUEUE = "news_snapshot_detach_requeue"


@pytest.mark.parametrize("dag_id", [RETRY, REQUEUE])
def test_dag_loads_without_import_errors(dagbag, dag_id):
    mine = {k: v for k, v in dagbag.import_errors.items() if "news_snapshot_detach" in k}
    assert mine == {}
    assert dag_id in dagbag.dags


def test_retry_dag_structure(dagbag):
    dag = dagbag.dags[RETRY]
    assert dag.catchup is False
    assert dag.max_active_runs == 1
    assert dag.timetable.expression == "*/5 * * * *"
    assert str(dag.timezone) == "UTC"
    assert set(dag.tags) == {"pin", "postgres-maintenance", "news"}
    assert dag.doc_md and "Runbook" in dag.doc_md
    assert [t.task_id for t in dag.tasks] == ["detach_pending_snapshots"]
    task = dag.tasks[0]
    assert task.execution_timeout == timedelta(minutes=10)  # > the worst-case run (250 s)
    assert dag.dagrun_timeout == timedelta(minutes=25)  # > the 10-min deadline
    expected = {
        "batch_size",
        "max_run_duration_seconds",
        "max_attempts",
        "backoff_base_seconds",
        "backoff_factor",
        "backoff_cap_seconds",
        "detach_call_timeout_seconds",
        "lock_ttl_seconds",
        "detach_concurrency",
        "detach_concurrency_min",
        "breaker_failure_threshold",
        "misroute_quarantine_limit",
        "dry_run",
    }
    assert set(dag.params.keys()) == expected


def test_requeue_dag_structure(dagbag):
    dag = dagbag.dags[REQUEUE]
    assert dag.timetable.can_be_scheduled is False  # schedule=None: manual only
    assert dag.max_active_runs == 1
    assert set(dag.tags) == {"pin", "postgres-maintenance", "news"}
    assert set(dag.params.keys()) == {"snapshot_ids", "all_quarantined", "dry_run"}
    assert [t.task_id for t in dag.tasks] == ["requeue_quarantined_snapshots"]


def test_requeue_params_refuse_a_malformed_id_before_a_run(dagbag):
    """The param schema (checked by the trigger form and the REST API) refuses what is not a
    uuid; the task's own check (parse_choice) agrees on both sides."""
    from airflow.sdk.exceptions import ParamValidationError

    from include.pin_maintenance.jobs import snapshot_requeue

    param = dagbag.dags[REQUEUE].params.get_param("snapshot_ids")
    good = "0B5C1D2E-3F40-4A5B-8C6D-7E8F90A1B2C3"
    assert param.resolve([good]) == [good]
    assert snapshot_requeue.parse_choice([good], False).snapshot_ids == (good.lower(),)
    for bad in ("not-a-uuid", "0b5c1d2e3f404a5b8c6d7e8f90a1b2c3", f" {good}", f"{good}x"):
        with pytest.raises(ParamValidationError, match="does not match") as err:
            param.resolve([bad])
        # Airflow's message quotes the id twice and the item schema once: still short
        assert len(f"Invalid input for param snapshot_ids: {err.value}") <= 400
    with pytest.raises(ParamValidationError) as err:
        param.resolve([good, "x" * 64])
    assert len(f"Invalid input for param snapshot_ids: {err.value}") <= 400


def test_requeue_params_leave_a_huge_value_to_the_task(dagbag):
    """What Airflow's schema would quote in full (more ids than allowed, an id of 100,000
    characters) passes the schema; the task refuses it in one short line (parse_choice)."""
    from include.pin_maintenance.jobs import snapshot_requeue

    param = dagbag.dags[REQUEUE].params.get_param("snapshot_ids")
    many = [str(uuid.UUID(int=n)) for n in range(100_000)]
    assert param.resolve(many) == many
    assert param.resolve(["x" * 100_000]) == ["x" * 100_000]
    assert "maxItems" not in param.schema
    assert f"At most {snapshot_requeue.MAX_SNAPSHOT_IDS} per run." in param.description


def _output(done) -> str:
    return f"{done.stdout}\n{done.stderr}"


def test_retry_dag_run_detaches_retries_and_quarantines(db, run_dag):
    ok = insert_entries(db, 5)
    flaky = insert_entry(db)
    gone = insert_entry(db)
    with SelectionsService() as svc:
        svc.script(flaky.snapshot_id, "error_503")
        svc.script(gone.snapshot_id, "not_found")
        done = run_dag(RETRY, db, selections_url=svc.url)
        counts = svc.call_counts()
    assert done.returncode == 0, _output(done)
    state = rows(db)
    assert all(state[e.snapshot_id].status == "Done" for e in ok)
    assert (state[flaky.snapshot_id].status, state[flaky.snapshot_id].attempts) == ("Pending", 1)
    assert state[gone.snapshot_id].status == "Quarantined"
    assert set(counts.values()) == {1} and len(counts) == 7
    out = _output(done)
    assert "event=job_completed" in out and "succeeded=5" in out
    assert "PIN_ALERT" in out and "snapshot_detach_quarantined" in out
    assert "local-dev-secret" not in out


def test_retry_dag_invalid_config_fails_before_any_call(db, run_dag):
    entry = insert_entry(db)
    before = rows(db)
    with SelectionsService() as svc:
        done = run_dag(
            RETRY,
            db,
            selections_url=svc.url,
            variables={RETRY: {"lock_ttl_seconds": 245}},  # not > 240 + 5 + 5 s margin
        )
        assert svc.calls == []
    assert done.returncode != 0
    assert "lock_ttl_seconds" in _output(done)
    assert rows(db) == before
    assert entry.snapshot_id in before


def test_requeue_dag_moves_chosen_rows(db, run_dag):
    q1 = insert_entry(db, status="Quarantined", attempts=12, last_error="HttpNotFound 404")
    q2 = insert_entry(db, status="Quarantined", attempts=12)
    done = run_dag(REQUEUE, db, conf={"snapshot_ids": [q1.snapshot_id]})
    assert done.returncode == 0, _output(done)
    state = rows(db)
    assert (state[q1.snapshot_id].status, state[q1.snapshot_id].attempts) == ("Pending", 0)
    assert state[q1.snapshot_id].last_error == "requeued: HttpNotFound 404"
    assert state[q2.snapshot_id].status == "Quarantined"
    assert "event=job_completed" in _output(done) and "requeued_count=1" in _output(done)


def test_requeue_dag_refuses_100000_ids_in_one_short_line(db, run_dag):
    """The issue's case: 100,000 ids through `airflow dags test -c` gave one line of 4,000,095
    characters (8.5 MB of output) and never said the count or the limit."""
    q = insert_entry(db, status="Quarantined", attempts=12)
    ids = [q.snapshot_id, *(str(uuid.UUID(int=n)) for n in range(99_999))]
    done = run_dag(REQUEUE, db, conf={"snapshot_ids": ids})
    out = _output(done)
    assert done.returncode != 0
    [line] = [ln for ln in out.splitlines() if "refused bad input" in ln]
    assert len(line) <= 400, len(line)
    says = "snapshot_ids has 100000 ids (from trigger params); allowed at most 10000 per run"
    assert says in line
    # every line short, the whole output a fraction of one copy of the ids (3.9 MB)
    assert max(len(ln) for ln in out.splitlines()) <= 1000
    assert len(out) < 200_000, len(out)
    assert ids[1] not in out
    assert rows(db)[q.snapshot_id].status == "Quarantined"


def test_requeue_dag_refuses_an_empty_choice(db, run_dag):
    q = insert_entry(db, status="Quarantined", attempts=12)
    done = run_dag(REQUEUE, db, conf={"snapshot_ids": [], "all_quarantined": False})
    assert done.returncode != 0
    assert "nothing chosen" in _output(done)
    assert rows(db)[q.snapshot_id].status == "Quarantined"
