"""The supported-major rule, its words and its Airflow glue. The refusal on a real server of an
older major, before any statement: tests/majors/test_supported_majors.py."""

from __future__ import annotations

import pytest

from include.pin_maintenance import privileges, server_version
from include.pin_maintenance.telemetry import JobLog, Telemetry


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        (140022, False),
        (130000, False),
        (150000, True),
        (150018, True),
        (180001, True),
        (190000, True),
    ],
)
def test_a_major_below_the_range_is_refused_and_a_newer_one_runs(version, supported):
    assert server_version.is_supported(version) is supported


def test_the_error_names_the_server_the_range_and_that_nothing_changed():
    error = server_version.UnsupportedServer("calendar_slot_expiration", 140022)
    assert str(error) == (
        "calendar_slot_expiration: the database runs PostgreSQL 14.22; the jobs support "
        "PostgreSQL 15 to 18. Nothing was changed: run the job against a supported server "
        '(docs/deploying.md, "Supported PostgreSQL")'
    )
    alert = error.alert()
    assert (alert.name, alert.severity) == ("database_server_unsupported", "critical")
    assert dict(alert.details) == {
        "problem": "configuration",
        "server_version": "14.22",
        "supported": "15 to 18",
    }
    assert error.alert_event == alert.name  # the task_failed that follows names it


def _telemetry():
    return Telemetry.local(JobLog("calendar_slot_expiration", "test"))


def test_an_older_server_logs_one_error_and_sends_one_alert(caplog):
    telemetry = _telemetry()
    with pytest.raises(server_version.UnsupportedServer):
        privileges._check_server("calendar_slot_expiration", telemetry, 140022)
    assert [a.name for a in telemetry.alerts.sent] == ["database_server_unsupported"]
    assert any("event=server_unsupported" in r.getMessage() for r in caplog.records)


def test_a_newer_major_runs_with_one_warning(caplog):
    telemetry = _telemetry()
    privileges._check_server("calendar_slot_expiration", telemetry, 190002)
    assert telemetry.alerts.sent == []
    [line] = [r.getMessage() for r in caplog.records if "server_untested" in r.getMessage()]
    assert "server_version=19.2" in line


def test_the_airflow_glue_fails_the_task_without_a_retry():
    from airflow.sdk.exceptions import AirflowFailException

    from include.pin_airflow import runtime

    refused = runtime.refuse_run(server_version.UnsupportedServer("user_activity_retention", 1))
    assert isinstance(refused, AirflowFailException)
    assert isinstance(refused, server_version.UnsupportedServer)
    assert refused.server_version == 1
