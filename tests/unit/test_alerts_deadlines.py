"""The deadlines: the mechanism in the installed pin_maintenance_plugin.deadlines, the per-DAG
defaults in the bundle's include/pin_airflow/deadlines.py.

The scheduler-side evaluation is proven end to end in tests/e2e/test_deadline_alerts.py; here:
the pure fallback rule, the alert's shape, its serialization round trip through Airflow's own
encoder/decoder (with the plugin registry), the callback's payload on a real webhook, and the
reference's edge paths: a run without ``queued_at`` (on Airflow's own tables in SQLite) and a
custom secrets backend that fails (in a subprocess configured like a deployment).
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from airflow.sdk import DeadlineAlert, SyncCallback

from include.pin_airflow.deadlines import DEFAULT_DEADLINE_SECONDS, deadline_alert
from pin_maintenance_plugin import deadlines
from pin_maintenance_plugin.deadlines import (
    QueuedAtPlusTunableInterval,
    deadline_missed_alert,
    on_deadline_missed,
    parse_interval_seconds,
)
from tests.e2e.loopback import RecordingWebhook

JOB_DAGS = ("news_snapshot_detach_retry", "calendar_slot_expiration", "user_activity_retention")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, (600, "default")),
        ("900", (900, "variable")),
        (" 120 ", (120, "variable")),
        ("90.7", (90, "variable")),
        (45, (45, "variable")),
        ("0", (600, "default (invalid variable)")),
        ("-5", (600, "default (invalid variable)")),
        ("ten minutes", (600, "default (invalid variable)")),
        ("", (600, "default (invalid variable)")),
        ('{"seconds": 5}', (600, "default (invalid variable)")),
    ],
)
def test_interval_falls_back_to_default_unless_variable_is_positive(raw, expected) -> None:
    assert parse_interval_seconds(raw, 600) == expected


def test_every_job_dag_has_a_default() -> None:
    assert set(DEFAULT_DEADLINE_SECONDS) == set(JOB_DAGS)
    assert DEFAULT_DEADLINE_SECONDS["news_snapshot_detach_retry"] == 600  # 2 x polling SLO
    assert DEFAULT_DEADLINE_SECONDS["user_activity_retention"] > 1800  # > max_run_duration


@pytest.mark.parametrize("dag_id", JOB_DAGS)
def test_deadline_alert_shape(dag_id) -> None:
    alert = deadline_alert(dag_id)
    assert isinstance(alert, DeadlineAlert)
    assert alert.reference == QueuedAtPlusTunableInterval(
        variable=f"{dag_id}_deadline_seconds", default_seconds=DEFAULT_DEADLINE_SECONDS[dag_id]
    )
    assert alert.interval == timedelta(0)  # the reference carries the interval
    assert isinstance(alert.callback, SyncCallback)
    assert alert.callback.path == "pin_maintenance_plugin.deadlines.on_deadline_missed"
    assert alert.callback.kwargs == {
        "variable": f"{dag_id}_deadline_seconds",
        "default_seconds": DEFAULT_DEADLINE_SECONDS[dag_id],
    }


def test_deadline_alert_rejects_unknown_dag_without_default_and_bad_default() -> None:
    with pytest.raises(KeyError):
        deadline_alert("some_other_dag")
    with pytest.raises(ValueError, match="default_seconds"):
        deadline_alert("some_other_dag", 0)
    assert deadline_alert("some_other_dag", 30).reference.default_seconds == 30


def test_reference_round_trips_through_airflow_serialization() -> None:
    """What the dag-processor stores and the scheduler decodes (needs the plugin registry)."""
    from airflow.serialization.decoders import decode_deadline_alert
    from airflow.serialization.definitions.deadline import SerializedReferenceModels
    from airflow.serialization.encoders import encode_deadline_alert

    encoded = json.loads(
        json.dumps(encode_deadline_alert(deadline_alert("calendar_slot_expiration")))
    )
    assert encoded["reference"] == {
        "reference_type": "QueuedAtPlusTunableInterval",
        "variable": "calendar_slot_expiration_deadline_seconds",
        "default_seconds": 600,
        "__class_path": "pin_maintenance_plugin.deadlines.QueuedAtPlusTunableInterval",
    }
    decoded = decode_deadline_alert(encoded)
    assert isinstance(decoded.reference, SerializedReferenceModels.SerializedCustomReference)
    assert isinstance(decoded.reference, SerializedReferenceModels.TYPES.DAGRUN)
    assert decoded.reference.inner_ref == QueuedAtPlusTunableInterval(
        "calendar_slot_expiration_deadline_seconds", 600
    )
    assert decoded.interval == timedelta(0)


def test_variable_from_environment_sets_the_interval(monkeypatch) -> None:
    ref = QueuedAtPlusTunableInterval("pin_unit_deadline_seconds", 600)
    monkeypatch.setenv("AIRFLOW_VAR_PIN_UNIT_DEADLINE_SECONDS", "42")
    assert ref.interval_seconds() == 42
    monkeypatch.setenv("AIRFLOW_VAR_PIN_UNIT_DEADLINE_SECONDS", "soon")
    assert ref.interval_seconds() == 600


CONTEXT = {
    "dag_run": {
        "dag_run_id": "scheduled__2026-01-01T00:05:00+00:00",
        "dag_id": "calendar_slot_expiration",
        "queued_at": "2026-01-01T00:05:01Z",
        "start_date": "2026-01-01T00:05:02Z",
        "state": "running",
        "run_type": "scheduled",
    },
    "deadline": {"id": "0199-dead", "deadline_time": "2026-01-01T00:15:01+00:00"},
}


def test_deadline_missed_alert_from_callback_context() -> None:
    dag_id, run_id, alert = deadline_missed_alert(
        CONTEXT, variable="calendar_slot_expiration_deadline_seconds", default_seconds=600
    )
    assert (dag_id, run_id) == ("calendar_slot_expiration", "scheduled__2026-01-01T00:05:00+00:00")
    assert alert.name == "deadline_missed"
    assert alert.severity == deadlines.DEADLINE_MISSED_SEVERITY == "warning"
    assert alert.details["deadline_time"] == "2026-01-01T00:15:01+00:00"
    assert alert.details["tune_with_variable"] == "calendar_slot_expiration_deadline_seconds"
    assert alert.details["runbook"] == "docs/runbooks/deadline-missed.md"
    assert "calendar_slot_expiration" in alert.summary


def test_on_deadline_missed_posts_to_webhook(monkeypatch) -> None:
    with RecordingWebhook() as hook:
        monkeypatch.setenv(
            "AIRFLOW_CONN_ALERTS_WEBHOOK", json.dumps({"conn_type": "http", "host": hook.url})
        )
        on_deadline_missed(
            context=CONTEXT,
            variable="calendar_slot_expiration_deadline_seconds",
            default_seconds=600,
        )
    [sent] = hook.received
    assert sent["alert"] == "deadline_missed"
    assert sent["dag_id"] == "calendar_slot_expiration"
    assert sent["run_id"] == "scheduled__2026-01-01T00:05:00+00:00"
    assert sent["details"]["deadline_id"] == "0199-dead"


def _context(state: str, end_date: str | None, deadline_time: object) -> dict:
    return {
        "dag_run": {**CONTEXT["dag_run"], "state": state, "end_date": end_date},
        "deadline": {"id": "0199-dead", "deadline_time": deadline_time},
    }


@pytest.mark.parametrize(
    ("state", "end_date", "deadline_time", "silent"),
    [
        # the shapes seen under the 3.3.2 scheduler: ISO end date, "YYYY-MM-DD HH:MM:SS+00:00"
        ("failed", "2026-01-01T00:05:09.5Z", "2026-01-01 00:15:01.000001+00:00", True),
        ("success", "2026-01-01T00:05:09Z", "2026-01-01T00:15:01+00:00", True),
        ("failed", "2026-01-01T00:16:00Z", "2026-01-01T00:15:01+00:00", False),  # late, then failed
        ("running", None, "2026-01-01T00:15:01+00:00", False),
        ("queued", None, "2026-01-01T00:15:01+00:00", False),
        ("failed", None, "2026-01-01T00:15:01+00:00", False),  # unknown end: alert
        ("failed", "2026-01-01T00:05:09Z", "not a time", False),
    ],
)
def test_a_run_that_ended_before_its_deadline_is_not_alerted(
    monkeypatch, state, end_date, deadline_time, silent
) -> None:
    with RecordingWebhook() as hook:
        monkeypatch.setenv(
            "AIRFLOW_CONN_ALERTS_WEBHOOK", json.dumps({"conn_type": "http", "host": hook.url})
        )
        context = _context(state, end_date, deadline_time)
        assert deadlines.finished_before_deadline(context) is silent
        on_deadline_missed(context=context, variable="v", default_seconds=600)
    assert [a["alert"] for a in hook.received] == ([] if silent else ["deadline_missed"])


def test_a_datetime_deadline_time_is_compared_too() -> None:
    from datetime import UTC, datetime

    due = datetime(2026, 1, 1, 0, 15, 1, tzinfo=UTC)
    assert deadlines.finished_before_deadline(_context("failed", "2026-01-01T00:05:00Z", due))


def test_deadlines_module_does_no_io_at_import() -> None:
    """Parse-time safety: importing builds nothing that touches Variables or the DB."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(deadlines))
    top_level_calls = [
        node
        for stmt in tree.body
        if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))
        for node in ast.walk(stmt)
        if isinstance(node, ast.Call)
    ]
    assert [ast.unparse(c) for c in top_level_calls] == ["logging.getLogger(__name__)"]


# --- the scheduler-side evaluation's edge paths ------------------------------------------------


@pytest.fixture
def metadata_session():
    """A session on a real (in-memory SQLite) database with Airflow's own tables."""
    from airflow.models import import_all_models
    from airflow.models.base import Base
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    import_all_models()
    engine = create_engine("sqlite://")
    Base.metadata.create_all(engine)
    with Session(engine) as session:
        yield session
    engine.dispose()


def _add_run(session, run_id: str, queued_at) -> None:
    from datetime import UTC, datetime

    from airflow.models import DagRun
    from sqlalchemy import insert

    session.execute(
        insert(DagRun.__table__).values(
            dag_id="calendar_slot_expiration",
            run_id=run_id,
            run_type="scheduled",
            queued_at=queued_at,
            run_after=datetime.now(UTC),
        )
    )


def test_a_run_without_queued_at_gets_no_deadline_and_others_queued_at_plus_interval(
    metadata_session, monkeypatch
) -> None:
    from datetime import UTC, datetime

    from airflow.models import Variable

    monkeypatch.delenv("AIRFLOW_VAR_CALENDAR_SLOT_EXPIRATION_DEADLINE_SECONDS", raising=False)
    queued = datetime(2026, 1, 1, 0, 5, 1, tzinfo=UTC)
    _add_run(metadata_session, "never_queued", None)
    _add_run(metadata_session, "queued", queued)
    ref = QueuedAtPlusTunableInterval("calendar_slot_expiration_deadline_seconds", 600)

    def deadline(run_id: str):
        return ref._evaluate_with(
            session=metadata_session, dag_id="calendar_slot_expiration", run_id=run_id
        )

    assert deadline("never_queued") is None  # like Airflow's DAGRUN_QUEUED_AT
    assert deadline("queued").replace(tzinfo=UTC) == queued + timedelta(seconds=600)
    # the Variable in the metadata DB, read through the scheduler's own session
    metadata_session.add(Variable(key="calendar_slot_expiration_deadline_seconds", val="120"))
    metadata_session.flush()
    assert deadline("queued").replace(tzinfo=UTC) == queued + timedelta(seconds=120)


BROKEN_BACKEND_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
from pin_maintenance_plugin.deadlines import QueuedAtPlusTunableInterval
print(QueuedAtPlusTunableInterval("pin_unit_deadline_seconds", 600).interval_seconds())
"""


@pytest.mark.parametrize(("env_value", "expected"), [("42", 42), (None, 600)])
def test_a_failing_secrets_backend_is_skipped_not_fatal(tmp_path, env_value, expected) -> None:
    """A custom backend that raises (an outage) is skipped like Airflow skips it: the next
    backend's value, else the default; never an exception (which would lose the deadline)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_VAR_")}
    env.update(
        AIRFLOW_HOME=str(tmp_path),
        AIRFLOW__SECRETS__BACKEND="tests.unit.broken_secrets_backend.UnreachableSecretsBackend",
        PYTHONPATH=str(repo),
    )
    if env_value is not None:
        env["AIRFLOW_VAR_PIN_UNIT_DEADLINE_SECONDS"] = env_value
    done = subprocess.run(
        [sys.executable, "-c", BROKEN_BACKEND_SCRIPT],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip().splitlines()[-1]) == expected
    # Airflow's logging (structlog) may write to stdout or stderr
    logged = done.stdout + done.stderr
    assert "deadline variable pin_unit_deadline_seconds: UnreachableSecretsBackend failed" in logged
