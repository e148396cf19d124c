"""Policy every DAG of the bundle follows (docs/design.md, "DAGs"; STYLE)."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.dags

REPO = Path(__file__).resolve().parents[2]
DAG_DIR = REPO / "dags"

# The contract: DAG id -> (cron, timezone); None = manual only.
EXPECTED = {
    "news_snapshot_detach_retry": ("*/5 * * * *", "UTC"),
    "calendar_slot_expiration": ("*/5 * * * *", "UTC"),
    "user_activity_retention": ("0 3 * * *", "Europe/Moscow"),
    "news_snapshot_detach_requeue": (None, None),
}
TAG_VOCABULARY = {"pin", "postgres-maintenance", "news", "calendar", "user-activity", "runbook"}


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}


def test_exactly_the_contract_dags(dagbag):
    assert set(dagbag.dag_ids) == set(EXPECTED)


def test_one_dag_per_file_named_after_its_id(dagbag):
    for dag_id in EXPECTED:
        assert Path(dagbag.dags[dag_id].fileloc).name == f"{dag_id}.py"


@pytest.mark.parametrize("dag_id", sorted(EXPECTED))
def test_schedule_timezone_and_run_policy(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    cron, tz = EXPECTED[dag_id]
    if cron is None:
        assert dag.timetable.can_be_scheduled is False, dag.timetable
    else:
        assert dag.timetable.expression == cron
        assert dag.timetable.timezone.name == tz
    assert dag.max_active_runs == 1
    assert dag.catchup is False
    assert dag.doc_md and len(dag.doc_md) > 200, "doc_md must explain purpose, rerun and runbook"
    assert set(dag.tags) <= TAG_VOCABULARY, set(dag.tags) - TAG_VOCABULARY
    assert {"pin", "postgres-maintenance"} <= set(dag.tags)
    assert dag.start_date.tzinfo is not None


@pytest.mark.parametrize("dag_id", sorted(EXPECTED))
def test_every_task_has_a_docstring_timeout_and_bounded_retries(dagbag, dag_id):
    for task in dagbag.dags[dag_id].tasks:
        assert task.doc_md or task.doc, f"{dag_id}.{task.task_id} has no docstring"
        assert isinstance(task.execution_timeout, timedelta), f"{task.task_id} no timeout"
        assert task.retries <= 2, f"{task.task_id}: Airflow retries are for infrastructure only"
        # the shipped delay; only the tests' Airflow homes shorten it (tests/airflow_config)
        assert task.retry_delay == timedelta(seconds=30), f"{task.task_id}: {task.retry_delay}"


def _bench_airflow_configs() -> dict[str, dict]:
    """What `make bench` hands `airflow dags test` as each DAG's Variable."""
    from devtools.bench_detach import AIRFLOW_CONFIG as detach
    from devtools.bench_neighbours import JOBS
    from devtools.bench_retention import AIRFLOW_CONFIG as retention
    from devtools.bench_slots import AIRFLOW_DRAIN_CONFIG as slots

    return {
        "news_snapshot_detach_retry": detach,
        "calendar_slot_expiration": slots | JOBS["slots"].base,
        "user_activity_retention": retention | JOBS["retention"].base,
    }


@pytest.mark.parametrize("source", ["defaults", "bench"])
def test_the_run_bounds_fit_the_tasks_timeouts(dagbag, source):
    """What resolve_config checks for every run: no shipped DAG refuses itself at its defaults,
    and the bench's configs (`airflow dags test` with a raised run bound) are not refused."""
    from include.pin_maintenance.jobs import activity_retention_config as retention
    from include.pin_maintenance.jobs import slot_expiration_config as slots
    from include.pin_maintenance.jobs import snapshot_detach_config as detach

    given = _bench_airflow_configs() if source == "bench" else {}
    resolved = {
        dag_id: module.CONFIG.resolve(given.get(dag_id))
        for dag_id, module in (
            ("calendar_slot_expiration", slots),
            ("news_snapshot_detach_retry", detach),
            ("user_activity_retention", retention),
        )
    }
    needs = {
        ("calendar_slot_expiration", "expire_slots"): slots.worst_case_run_seconds(
            resolved["calendar_slot_expiration"]
        ),
        ("news_snapshot_detach_retry", "detach_pending_snapshots"): detach.worst_case_run_seconds(
            resolved["news_snapshot_detach_retry"]
        ),
        **{
            ("user_activity_retention", f"delete_{table}"): retention.worst_case_step_seconds(
                resolved["user_activity_retention"], table
            )
            for table in retention.STEP_DEADLINE_SHARE
        },
    }
    for (dag_id, task_id), seconds in needs.items():
        timeout = dagbag.dags[dag_id].get_task(task_id).execution_timeout.total_seconds()
        assert seconds <= timeout, (dag_id, task_id, seconds, timeout)


@pytest.mark.parametrize("dag_id", sorted(EXPECTED))
def test_dag_file_does_no_io_at_import(dag_id):
    """Import the DAG file with an audit hook that records sockets, subprocesses and DB opens.

    Airflow and croniter are imported first (croniter shells out once to ``file`` through
    ``platform.architecture()`` at import); what is recorded after that is what the DAG file
    and our modules do.
    """
    probe = f"""
import sys
import airflow.sdk  # noqa: F401
import croniter  # noqa: F401
events = []
def hook(event, args):
    if event in ("socket.connect", "socket.getaddrinfo", "subprocess.Popen", "sqlite3.connect"):
        events.append(event)
sys.addaudithook(hook)
import runpy
runpy.run_path({str(DAG_DIR / f"{dag_id}.py")!r})
print("EVENTS", sorted(set(events)))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "EVENTS []" in done.stdout, done.stdout


@pytest.mark.parametrize("dag_id", sorted(EXPECTED))
def test_each_task_returns_one_xcom(dagbag, dag_id):
    """TaskFlow infers multiple_outputs from a ``-> dict`` annotation (one XCom per key)."""
    for task in dagbag.dags[dag_id].tasks:
        assert task.multiple_outputs is False, f"{dag_id}.{task.task_id}"


@pytest.mark.parametrize("dag_id", sorted(EXPECTED))
def test_flags_default_false_and_are_not_marked_required(dagbag, dag_id):
    """The trigger form stars a boolean param whose type lacks null as "required"."""
    flags = {
        name: param.schema
        for name, param in dagbag.dags[dag_id].params.items()
        if "boolean" in param.schema.get("type", ())
    }
    assert "dry_run" in flags
    for name, schema in flags.items():
        assert set(schema["type"]) == {"boolean", "null"}, name
        assert dagbag.dags[dag_id].params[name] is False, name
    help_text = dagbag.dags[dag_id].params.get_param("dry_run").description
    assert "Unpause on trigger" in help_text and "airflow dags test" in help_text


@pytest.mark.parametrize("dag_id", sorted(d for d, (cron, _) in EXPECTED.items() if cron))
def test_unpausing_runs_the_latest_missed_tick(dagbag, dag_id):
    """Why each doc says to preview a paused DAG with `airflow dags test`: with catchup=False the
    timetable of Airflow 3.3.2 always offers the latest past tick, whatever run_immediately is
    (it only applies to a DAG without start_date). Fails when Airflow changes that, so the docs
    can be revised."""
    import pendulum
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.timetables.base import DataInterval, TimeRestriction

    timetable = DagSerialization.from_dict(DagSerialization.to_dict(dagbag.dags[dag_id])).timetable
    assert timetable._run_immediately is False  # the default, and still:
    now = pendulum.now("UTC")
    week_ago = now - timedelta(days=7)
    info = timetable.next_dagrun_info(
        last_automated_data_interval=DataInterval(week_ago, week_ago),
        restriction=TimeRestriction(
            earliest=week_ago - timedelta(days=1), latest=None, catchup=False
        ),
    )
    assert info.run_after <= now  # due at once: the scheduler starts it on unpause


def _result_keys() -> dict[str, set[str]]:
    """Every key of each DAG's result (its last task's XCom), from the job's own result type."""
    from datetime import UTC, datetime

    from include.pin_maintenance.jobs.activity_retention import RetentionResult
    from include.pin_maintenance.jobs.slot_expiration import ExpirationResult
    from include.pin_maintenance.jobs.snapshot_detach import DetachResult
    from include.pin_maintenance.jobs.snapshot_requeue import RequeueResult

    def keys(result) -> set[str]:
        return set(result.as_dict())

    now = datetime.now(UTC)
    return {
        "calendar_slot_expiration": keys(ExpirationResult(0, 0, 0, now))
        | keys(ExpirationResult(0, 0, 0, now, dry_run=True)),
        "user_activity_retention": keys(RetentionResult()) | keys(RetentionResult(dry_run=True)),
        "news_snapshot_detach_retry": keys(DetachResult()),
        "news_snapshot_detach_requeue": keys(RequeueResult(dry_run=False, choice="")),
    }


def _doc_paragraph(doc: str, title: str) -> str:
    """The ``**<title>**`` paragraph of a DAG's doc_md (up to the next ``**Bold.**`` lead)."""
    start = doc.index(f"**{title}")
    end = doc.find("\n\n**", start)
    return doc[start : end if end != -1 else None]


@pytest.mark.parametrize("dag_id", sorted(EXPECTED))
def test_the_doc_beside_the_trigger_form_names_every_param_and_result_field(dagbag, dag_id):
    """What an operator reads in the UI says what the README says: each param of the trigger
    form in the **Params** paragraph, each field of the run's result in **Result**."""
    dag = dagbag.dags[dag_id]
    params = _doc_paragraph(dag.doc_md, "Params")
    assert [key for key in dag.params if f"`{key}`" not in params] == []
    result = _doc_paragraph(dag.doc_md, "Result")
    assert sorted(key for key in _result_keys()[dag_id] if f"`{key}`" not in result) == []
