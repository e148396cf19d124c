"""The deadlines: the mechanism in the installed pin_maintenance_plugin.deadlines, the per-DAG
defaults in the bundle's include/pin_airflow/deadlines.py.

The scheduler-side evaluation is proven end to end in tests/e2e/test_deadline_alerts.py; here:
the pure fallback rule, the alert's shape, its serialization round trip through Airflow's own
encoder/decoder (with the plugin registry) and the callback's payload on a real webhook.
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
