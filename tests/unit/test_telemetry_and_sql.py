"""Log line format, alert recording and the named-SQL loader (pure; no DB)."""

from __future__ import annotations

import logging

import pytest

from include.pin_maintenance import sql
from include.pin_maintenance.telemetry import Alert, JobLog, LogOnlyAlerts


def test_log_line_carries_event_job_and_run_id_first(caplog):
    log = JobLog("calendar_slot_expiration", "scheduled__2026-01-01T00:05:00+00:00")
    with caplog.at_level(logging.INFO):
        log.info("job_completed", expired=3, duration_ms=12.5, note="two words")
    assert caplog.messages == [
        "event=job_completed job=calendar_slot_expiration "
        "run_id=scheduled__2026-01-01T00:05:00+00:00 expired=3 duration_ms=12.5 "
        'note="two words"'
    ]


def test_debug_lines_are_not_built_when_debug_is_off(caplog):
    log = JobLog("j", "r")
    with caplog.at_level(logging.INFO):
        log.debug("batch", n=1)
    assert caplog.messages == []


def test_log_only_alerts_emit_one_error_line_for_critical(caplog):
    alerts = LogOnlyAlerts(JobLog("j", "r1"))
    with caplog.at_level(logging.WARNING):
        alerts.send(
            Alert("selections_auth_failed", "critical", "401 from selections", {"code": 401})
        )
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert "alert=selections_auth_failed" in caplog.messages[0]
    assert "run_id=r1" in caplog.messages[0]
    assert alerts.sent[0].details == {"code": 401}


def test_alert_dedupe_key_ignores_detail_order():
    a = Alert("x", "warning", "s", {"a": 1, "b": 2})
    b = Alert("x", "warning", "other summary", {"b": 2, "a": 1})
    assert a.dedupe_key() == b.dedupe_key()


def test_sql_loader_reads_named_file():
    assert "create table news.snapshot_detach_outbox" in sql.load("schema/reference_schema")


@pytest.mark.parametrize("name", ["../secrets", "schema/Reference", "a;b", ""])
def test_sql_loader_rejects_bad_names(name):
    with pytest.raises(sql.UnknownQuery, match="invalid query name"):
        sql.load(name)


def test_sql_loader_names_missing_file():
    with pytest.raises(sql.UnknownQuery, match=r"no SQL file sql/nope/missing\.sql"):
        sql.load("nope/missing")
