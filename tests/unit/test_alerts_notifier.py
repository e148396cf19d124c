"""The notifier (pin_maintenance_plugin.notify.Notifier) against a real loopback webhook.

docs/design.md, "Alerts": one greppable WARNING/ERROR line per alert, a JSON POST of
{"alert","severity","dag_id","run_id","summary","details"} to the http connection
``alerts_webhook`` when it exists, delivery failures logged and never raised, bounded by a
timeout, duplicates within a run sent once. With the http connection ``alertmanager``, the
same alert also goes to Alertmanager's v2 API (labels alertname/severity/dag_id), and the
webhook stays as it is. (A real Alertmanager receives them in tests/e2e/test_alert_chain.py.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from devtools.local_airflow import free_port
from include.pin_maintenance.telemetry import Alert
from pin_maintenance_plugin import notify
from pin_maintenance_plugin.notify import Notifier
from tests.e2e.loopback import RecordingWebhook

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


@pytest.fixture(params=[Notifier], ids=["notify.Notifier"])
def notifier_class(request) -> type[Notifier]:
    return request.param


@pytest.fixture
def notifier(notifier_class):
    def make() -> Notifier:
        logger = logging.getLogger("test_alerts_notifier")
        return notifier_class("news_snapshot_detach_retry", "scheduled__1", logger)

    return make


def use_webhook(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_ALERTS_WEBHOOK", json.dumps({"conn_type": "http", "host": url})
    )


def test_alert_is_one_log_line_and_one_json_post(monkeypatch, records, notifier) -> None:
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


def test_warning_alert_logs_at_warning(monkeypatch, records, notifier) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_ALERTS_WEBHOOK", raising=False)
    notifier().send(Alert("deadline_missed", "warning", "late", {"deadline_id": "d"}))
    [line] = records.lines("PIN_ALERT ")
    assert line.levelno == logging.WARNING


def test_without_webhook_connection_only_the_log_line(monkeypatch, records, notifier) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_ALERTS_WEBHOOK", raising=False)
    notifier().send(QUARANTINE)
    assert len(records.lines("PIN_ALERT ")) == 1
    assert records.lines("PIN_ALERT_DELIVERY_FAILED") == []


def test_duplicate_alert_in_one_run_is_sent_once(monkeypatch, records, notifier) -> None:
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
def test_webhook_error_answer_is_logged_not_raised(monkeypatch, records, status, notifier) -> None:
    with RecordingWebhook(status=status) as hook:
        use_webhook(monkeypatch, hook.url)
        notifier().send(QUARANTINE)
    assert len(hook.received) == 1
    [failure] = records.lines("PIN_ALERT_DELIVERY_FAILED")
    assert failure.levelno == logging.WARNING
    assert "alert=snapshot_detach_quarantined" in failure.getMessage()


def test_unreachable_webhook_is_logged_not_raised(monkeypatch, records, notifier) -> None:
    use_webhook(monkeypatch, f"http://127.0.0.1:{free_port()}/alerts")  # nothing listens
    notifier().send(QUARANTINE)
    assert len(records.lines("PIN_ALERT ")) == 1
    assert len(records.lines("PIN_ALERT_DELIVERY_FAILED")) == 1


def test_slow_webhook_is_cut_off_by_the_timeout(monkeypatch, records, notifier) -> None:
    monkeypatch.setattr(notify, "WEBHOOK_READ_TIMEOUT_SECONDS", 0.3)
    with RecordingWebhook(delay=1.5) as hook:
        use_webhook(monkeypatch, hook.url)
        notifier().send(QUARANTINE)
        [failure] = records.lines("PIN_ALERT_DELIVERY_FAILED")
    assert "error=ReadTimeout" in failure.getMessage()


@pytest.mark.parametrize("status", [None, 500])
def test_notifier_logs_no_url_or_body_anywhere(monkeypatch, caplog, status) -> None:
    """Slack/Teams-style webhooks carry their secret in the path: it must not reach a log."""
    secret_path = "/services/T0/B0/s3cretT0ken"
    caplog.set_level(logging.INFO)  # the level tasks log at (urllib3 shows paths at DEBUG)
    logger = logging.getLogger("test_alerts_notifier_root")
    if status is None:  # nothing listens: connection refused
        use_webhook(monkeypatch, f"http://127.0.0.1:{free_port()}{secret_path}")
        Notifier("d", "r", logger).send(QUARANTINE)
    else:
        with RecordingWebhook(status=status) as hook:
            use_webhook(monkeypatch, hook.url.replace("/alerts", secret_path))
            Notifier("d", "r", logger).send(QUARANTINE)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "PIN_ALERT_DELIVERY_FAILED" in text
    assert "s3cretT0ken" not in text
    if status:
        assert f"status={status}" in text


def use_alertmanager(monkeypatch: pytest.MonkeyPatch, base_url: str) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_ALERTMANAGER", json.dumps({"conn_type": "http", "host": base_url})
    )


def test_alertmanager_gets_a_v2_alert_and_the_webhook_its_payload(monkeypatch, records) -> None:
    with RecordingWebhook() as hook, RecordingWebhook() as manager:
        use_webhook(monkeypatch, hook.url)
        use_alertmanager(monkeypatch, manager.url.removesuffix("/alerts"))
        Notifier("news_snapshot_detach_retry", "scheduled__1", logging.getLogger("t")).send(
            QUARANTINE
        )

    assert [a["alert"] for a in hook.received] == ["snapshot_detach_quarantined"]
    assert manager.paths == ["/api/v2/alerts"]
    [[posted]] = manager.received
    assert posted["labels"] == {
        "alertname": "snapshot_detach_quarantined",
        "severity": "critical",
        "dag_id": "news_snapshot_detach_retry",
        # one page per event (ops/alertmanager/alertmanager.yml inhibits its rule)
        "pin_event": "snapshot_detach_quarantined",
        "pin_detail": "true",
        "pin_alert_id": posted["labels"]["pin_alert_id"],
    }
    assert posted["annotations"]["summary"] == QUARANTINE.summary
    assert posted["annotations"]["runbook_url"] == "docs/runbooks/snapshot-detach-quarantined.md"
    assert posted["annotations"]["run_id"] == "scheduled__1"
    assert json.loads(posted["annotations"]["details"]) == QUARANTINE.details
    starts = datetime.fromisoformat(posted["startsAt"])
    ends = datetime.fromisoformat(posted["endsAt"])
    assert (ends - starts).total_seconds() == notify.EVENTS["snapshot_detach_quarantined"].seconds
    assert starts.tzinfo is not None


def test_every_task_alert_name_has_a_runbook_that_exists() -> None:
    repo = Path(__file__).resolve().parents[2]
    for (name, dag_id), path in notify.RUNBOOKS_BY_DAG.items():
        assert notify.runbook_for(name, dag_id) == path
    for path in [*notify.RUNBOOKS.values(), *notify.RUNBOOKS_BY_DAG.values()]:
        assert (repo / path).is_file(), path
    assert notify.runbook_for("lock_held_too_long", "calendar_slot_expiration") == (
        notify.RUNBOOK_INDEX
    )


def test_unreachable_alertmanager_is_logged_and_the_webhook_still_gets_it(
    monkeypatch, records
) -> None:
    with RecordingWebhook() as hook:
        use_webhook(monkeypatch, hook.url)
        use_alertmanager(monkeypatch, f"http://127.0.0.1:{free_port()}")  # nothing listens
        Notifier("d", "r", logging.getLogger("test_alerts_notifier")).send(QUARANTINE)
    assert len(hook.received) == 1
    [failure] = records.lines("PIN_ALERT_DELIVERY_FAILED")
    assert "target=alertmanager" in failure.getMessage()


def test_alertmanager_rejecting_the_alert_is_logged_not_raised(monkeypatch, records) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_ALERTS_WEBHOOK", raising=False)
    with RecordingWebhook(status=400) as manager:
        use_alertmanager(monkeypatch, manager.url.removesuffix("/alerts"))
        Notifier("d", "r", logging.getLogger("test_alerts_notifier")).send(QUARANTINE)
    assert len(manager.received) == 1
    [failure] = records.lines("PIN_ALERT_DELIVERY_FAILED")
    assert "target=alertmanager" in failure.getMessage() and "status=400" in failure.getMessage()


# --- one page per event: the labels the shipped inhibition keys on ----------------------------


def _body(alert: str, details: dict, dag_id: str = "news_snapshot_detach_retry") -> dict:
    return {
        "alert": alert,
        "severity": "warning",
        "dag_id": dag_id,
        "run_id": "r",
        "summary": "s",
        "details": details,
    }


def test_an_event_alert_is_identified_by_its_subject_not_its_run() -> None:
    first = notify.alertmanager_labels(_body("snapshot_detach_quarantined", {"snapshot_id": "a"}))
    again = notify.alertmanager_labels(
        _body("snapshot_detach_quarantined", {"snapshot_id": "a", "attempts": 3})
    )
    other = notify.alertmanager_labels(_body("snapshot_detach_quarantined", {"snapshot_id": "b"}))
    assert first == again  # the same row seen again refreshes its alert
    assert first["pin_alert_id"] != other["pin_alert_id"]  # a second quarantine is a new alert
    assert (first["pin_event"], first["pin_detail"]) == ("snapshot_detach_quarantined", "true")


def test_alerts_outside_the_event_table_keep_three_labels() -> None:
    for name in ("task_failed", "deadline_missed", "selections_auth_failed"):
        assert set(notify.alertmanager_labels(_body(name, {"error": "X"}))) == {
            "alertname",
            "severity",
            "dag_id",
        }


def test_task_failed_after_an_event_names_it_without_carrying_the_details() -> None:
    labels = notify.alertmanager_labels(
        _body("task_failed", {"event": "retention_batch_failed"}, "user_activity_retention")
    )
    assert labels["pin_event"] == "retention_batch_failed"
    assert "pin_detail" not in labels  # a target of the inhibition, never its source
    unknown = notify.alertmanager_labels(_body("task_failed", {"event": "made_up"}))
    assert "pin_event" not in unknown


def test_a_refused_run_pages_once_for_its_missing_privileges() -> None:
    """The job's alert carries the details and pages; the task_failed that follows is muted
    by it; the same shortfall on the next run refreshes the alert, another one is new."""
    missing = {"role": "pin_news", "missing": ["role pin_news lacks USAGE on schema news (x)"]}
    refused = notify.alertmanager_labels(_body("database_privileges_missing", missing))
    failed = notify.alertmanager_labels(
        _body("task_failed", {"event": "database_privileges_missing"})
    )
    assert (refused["pin_event"], refused["pin_detail"]) == ("database_privileges_missing", "true")
    assert failed["pin_event"] == "database_privileges_missing" and "pin_detail" not in failed
    again = notify.alertmanager_labels(_body("database_privileges_missing", dict(missing)))
    other = notify.alertmanager_labels(
        _body("database_privileges_missing", {**missing, "missing": ["another"]})
    )
    assert refused["pin_alert_id"] == again["pin_alert_id"] != other["pin_alert_id"]
    assert notify.runbook_for("database_privileges_missing", "news_snapshot_detach_retry") == (
        "docs/runbooks/database-privileges-missing.md"
    )


def test_an_event_alert_outlives_every_rule_it_inhibits() -> None:
    """Each event's task alert stays active longer than its rule fires after the last event:
    the rule's counting window (the ``[W]`` of ``increase``) plus 5 min for scrape, evaluation
    and Prometheus' resend. (A ``for:`` only delays when a rule starts: events keep coming
    meanwhile, each one refreshing its task alert.)"""
    import re

    import yaml

    repo = Path(__file__).resolve().parents[2]
    rules = [
        rule
        for group in yaml.safe_load((repo / "ops/prometheus/alerts.yml").read_text())["groups"]
        for rule in group["rules"]
        if "pin_event" in rule.get("labels", {})
    ]
    units = {"m": 60, "h": 3600, "d": 86400}
    assert {r["labels"]["pin_event"] for r in rules} <= set(notify.EVENTS)
    for rule in rules:
        windows = [
            int(n) * units[u]
            for n, u in re.findall(r"increase\([^\[]*\[(\d+)([mhd])\]\)", rule["expr"])
        ]
        fires_for = max(windows) + 300
        seconds = notify.alertmanager_seconds(rule["labels"]["pin_event"], rule["labels"]["dag_id"])
        assert seconds > fires_for, (rule["alert"], seconds, fires_for)


def test_scrub_redacts_userinfo_and_credential_values() -> None:
    text = "failed: https://svc:hunter2@host/x?token=abc123 and password = s3cr3t; user=pin"
    cleaned = notify.scrub({"summary": text, "nested": [text], "n": 3})
    assert "hunter2" not in json.dumps(cleaned)
    assert "abc123" not in json.dumps(cleaned) and "s3cr3t" not in json.dumps(cleaned)
    assert "https://***@host/x" in cleaned["summary"] and "user=pin" in cleaned["summary"]
    assert cleaned["n"] == 3


def test_the_notifier_scrubs_the_log_line_and_both_posts(monkeypatch, records) -> None:
    leaky = Alert("task_failed", "critical", "at postgresql://u:pw-leak@db/x", {"e": "pwd=pw-leak"})
    with RecordingWebhook() as hook, RecordingWebhook() as manager:
        use_webhook(monkeypatch, hook.url)
        use_alertmanager(monkeypatch, manager.url.removesuffix("/alerts"))
        Notifier("d", "r", logging.getLogger("test_alerts_notifier")).send(leaky)
    [line] = records.lines("PIN_ALERT ")
    assert "pw-leak" not in json.dumps([hook.received, manager.received]) + line.getMessage()
