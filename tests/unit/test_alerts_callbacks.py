"""``on_task_failed`` (include/pin_airflow/alerts.py): the ``task_failed`` alert's content.

The callback's wiring through a real ``airflow dags test`` run is in
tests/dags/test_deadline_failure_callback.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from include.pin_airflow.alerts import (
    error_summary,
    on_task_failed,
    task_failed_alert,
)
from include.pin_maintenance.config import ConfigError
from tests.e2e.loopback import RecordingWebhook


def context(exception: object = None) -> dict:
    # the attributes Airflow's RuntimeTaskInstance carries
    ti = SimpleNamespace(
        dag_id="user_activity_retention",
        run_id="scheduled__2026-01-02T00:00:00+00:00",
        task_id="delete_sessions",
        try_number=2,
        max_tries=1,
        map_index=-1,
    )
    return {
        "ti": ti,
        "dag": SimpleNamespace(dag_id="user_activity_retention"),
        "run_id": ti.run_id,
        "exception": exception,
    }


class _Psycopg(Exception):
    sqlstate = "P0001"


class _HttpError(Exception):
    response = SimpleNamespace(status_code=503)


def _chained() -> BaseException:
    try:
        try:
            raise _Psycopg("row 42 is bad")
        except _Psycopg as cause:
            raise RuntimeError("batch failed: row 42 is bad") from cause
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (None, "unknown"),
        (ValueError("bad batch_size=0 (allowed 1..50000)"), "ValueError"),
        (RuntimeError(""), "RuntimeError"),
        (KeyError("x"), "KeyError"),
        (_Psycopg("secret=abc for row 42"), "_Psycopg P0001"),
        (_HttpError("https://user:pw@host/x"), "_HttpError 503"),
        (_chained(), "RuntimeError P0001"),  # the cause's code, never the texts
        ("Task received SIGTERM signal", "Task received SIGTERM signal"),  # Airflow's wording
        ("password=hunter2", "unknown"),
        ("connection to 10.0.0.5 failed", "unknown"),
    ],
)
def test_error_summary_is_class_and_code_never_text(exc, expected) -> None:
    assert error_summary(exc) == expected


def test_task_failed_alert_content() -> None:
    dag_id, run_id, alert = task_failed_alert(context(RuntimeError("lock lost")))
    assert (dag_id, run_id) == ("user_activity_retention", "scheduled__2026-01-02T00:00:00+00:00")
    assert alert.name == "task_failed"
    assert alert.severity == "critical"
    assert alert.details == {
        "task_id": "delete_sessions",
        "try_number": 2,
        "max_tries": 1,
        "map_index": -1,
        "error": "RuntimeError",
    }
    assert "lock lost" not in alert.summary
    assert "delete_sessions" in alert.summary


def _manual(ctx: dict, run_type: object = "manual") -> dict:
    ctx["run_id"] = ctx["ti"].run_id = "manual__2026-01-02T10:00:00+00:00"
    ctx["dag_run"] = SimpleNamespace(run_type=run_type)
    return ctx


def test_bad_input_of_a_manual_run_is_a_warning_not_a_page() -> None:
    from include.pin_maintenance.jobs.snapshot_requeue import parse_choice

    with pytest.raises(ConfigError) as refused:
        parse_choice(["not-a-uuid"], False)
    _, _, alert = task_failed_alert(_manual(context(refused.value)))
    assert (alert.name, alert.severity) == ("task_failed", "warning")
    assert alert.details["bad_input"] is True
    assert alert.details["error"] == "RequeueRequestError" and "refused" in alert.summary
    assert "not-a-uuid" not in json.dumps([alert.summary, alert.details])  # the task log has it


def test_bad_input_is_read_from_the_run_id_without_a_dag_run() -> None:
    ctx = _manual(context(ConfigError("batch_size = 0 is out of range")))
    del ctx["dag_run"]
    assert task_failed_alert(ctx)[2].severity == "warning"


@pytest.mark.parametrize(
    ("ctx", "why"),
    [
        (context(ConfigError("batch_size = 0 is out of range")), "a bad Variable fails every tick"),
        (_manual(context(RuntimeError("lock lost"))), "not bad input"),
        (_manual(context(ConfigError("x")), run_type="scheduled"), "a scheduled run"),
    ],
)
def test_other_failures_stay_critical(ctx, why) -> None:
    alert = task_failed_alert(ctx)[2]
    assert alert.severity == "critical", why
    assert "bad_input" not in alert.details


def test_task_failed_alert_with_string_exception() -> None:
    _, _, alert = task_failed_alert(context("Task received SIGTERM signal"))
    assert alert.details["error"] == "Task received SIGTERM signal"


def test_on_task_failed_posts_to_webhook(monkeypatch) -> None:
    with RecordingWebhook() as hook:
        monkeypatch.setenv(
            "AIRFLOW_CONN_ALERTS_WEBHOOK", json.dumps({"conn_type": "http", "host": hook.url})
        )
        on_task_failed(context(RuntimeError("boom")))
    [sent] = hook.received
    assert sent["alert"] == "task_failed"
    assert sent["details"]["error"] == "RuntimeError"
