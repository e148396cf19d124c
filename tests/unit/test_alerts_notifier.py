"""The Notifier (include/pin_airflow/runtime.py) against a real loopback webhook.

DESIGN section 4: one greppable WARNING/ERROR line per alert, a JSON POST of
{"alert","severity","dag_id","run_id","summary","details"} to the http connection
``alerts_webhook`` when it exists, delivery failures logged and never raised, bounded by a
timeout, duplicates within a run sent once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from include.pin_airflow import runtime
from include.pin_airflow.runtime import Notifier
from include.pin_maintenance.telemetry import Alert
from tests.e2e.deadline_helpers import RecordingWebhook, free_port

QUARANTINE = Alert(
    "snapshot_detach_quarantined",
    "critical",
    "snapshot quarantined after 12 attempts",
    {"snapshot_id": "s-1", "post_id": "p-1", "reason": "PostDeleted", "attempts": 12},
)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, prefix: str) -> list[logging.LogRecord]:
        return [r for r in self.records if r.getMessage().startswith(prefix)]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("test_alerts_notifier")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield handler
    logger.removeHandler(handler)


def notifier() -> Notifier:
    return Notifier(
        "news_snapshot_detach_retry", "scheduled__1", logging.getLogger("test_alerts_notifier")
    )


def use_webhook(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_ALERTS_WEBHOOK", json.dumps({"conn_type": "http", "host": url})
    )


def test_alert_is_one_log_line_and_one_json_post(monkeypatch, records) -> None:
    with RecordingWebhook() as hook:
        use_webhook(monkeypatch, hook.url)
        notifier().send(QUARANTINE)

    expected = {
        "alert": "snapshot_detach_quarantined",
        "severity": "critical",
        "dag_id": "news_snapshot_detach_retry",
        "run_id": "scheduled__1",
        "summary": "snapshot quarantined after 12 attempts",
        "details": {
            "snapshot_id": "s-1",
            "post_id": "p-1",
            "reason": "PostDeleted",
            "attempts": 12,
        },
    }
    assert hook.received == [expected]
    assert hook.headers[0]["Content-Type"] == "application/json"
    [line] = records.lines("PIN_ALERT ")
    assert line.levelno == logging.ERROR
    assert "\n" not in line.getMessage()
    assert json.loads(line.getMessage().removeprefix("PIN_ALERT ")) == expected
    assert records.lines("PIN_ALERT_DELIVERY_FAILED") == []


def test_warning_alert_logs_at_warning(monkeypatch, records) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_ALERTS_WEBHOOK", raising=False)
    notifier().send(Alert("deadline_missed", "warning", "late", {"deadline_id": "d"}))
    [line] = records.lines("PIN_ALERT ")
    assert line.levelno == logging.WARNING


def test_without_webhook_connection_only_the_log_line(monkeypatch, records) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_ALERTS_WEBHOOK", raising=False)
    notifier().send(QUARANTINE)
    assert len(records.lines("PIN_ALERT ")) == 1
    assert records.lines("PIN_ALERT_DELIVERY_FAILED") == []


def test_duplicate_alert_in_one_run_is_sent_once(monkeypatch, records) -> None:
    with RecordingWebhook() as hook:
        use_webhook(monkeypatch, hook.url)
        n = notifier()
        n.send(QUARANTINE)
        n.send(QUARANTINE)
        n.send(
            Alert(
                QUARANTINE.name, "critical", "other", {**QUARANTINE.details, "snapshot_id": "s-2"}
            )
        )
    assert [a["details"]["snapshot_id"] for a in hook.received] == ["s-1", "s-2"]
    assert len(records.lines("PIN_ALERT ")) == 2


@pytest.mark.parametrize("status", [400, 500, 503])
def test_webhook_error_answer_is_logged_not_raised(monkeypatch, records, status) -> None:
    with RecordingWebhook(status=status) as hook:
        use_webhook(monkeypatch, hook.url)
        notifier().send(QUARANTINE)
    assert len(hook.received) == 1
    [failure] = records.lines("PIN_ALERT_DELIVERY_FAILED")
    assert failure.levelno == logging.WARNING
    assert "alert=snapshot_detach_quarantined" in failure.getMessage()


def test_unreachable_webhook_is_logged_not_raised(monkeypatch, records) -> None:
    use_webhook(monkeypatch, f"http://127.0.0.1:{free_port()}/alerts")  # nothing listens
    notifier().send(QUARANTINE)
    assert len(records.lines("PIN_ALERT ")) == 1
    assert len(records.lines("PIN_ALERT_DELIVERY_FAILED")) == 1


def test_slow_webhook_is_cut_off_by_the_timeout(monkeypatch, records) -> None:
    monkeypatch.setattr(runtime, "ALERTS_WEBHOOK_TIMEOUT_SECONDS", 0.3)
    with RecordingWebhook(delay=3) as hook:
        use_webhook(monkeypatch, hook.url)
        notifier().send(QUARANTINE)
        [failure] = records.lines("PIN_ALERT_DELIVERY_FAILED")
    assert "error=ReadTimeout" in failure.getMessage()


def test_delivery_failure_log_carries_no_url_or_credentials(monkeypatch, records) -> None:
    url = f"http://user:s3cret@127.0.0.1:{free_port()}/alerts"
    use_webhook(monkeypatch, url)
    notifier().send(QUARANTINE)
    text = " ".join(r.getMessage() for r in records.records)
    assert "s3cret" not in text
