"""Alert delivery: one greppable log line per alert, then optional POSTs to a webhook and to
Alertmanager.

The webhook payload is docs/design.md, "Alerts": ``{"alert", "severity", "dag_id", "run_id",
"summary", "details"}``; the webhook is the http connection ``alerts_webhook``. With the http
connection ``alertmanager`` (host = Alertmanager's base URL, e.g. ``http://alertmanager:9093``),
each alert is also posted to Alertmanager's v2 API (``POST /api/v2/alerts``) with the labels
``alertname`` (the alert's name), ``severity`` and ``dag_id`` (plus, for an event that a
Prometheus rule also counts, ``pin_event``, ``pin_detail`` and ``pin_alert_id``:
:func:`alertmanager_labels`) and the annotations ``summary``, ``runbook_url``, ``run_id`` and
``details``, so task alerts share the routing, silences and dedupe of the Prometheus rules, and
the shipped inhibition makes one event page once (ops/README.md). It stays active for
:data:`ALERTMANAGER_EVENT_SECONDS` (an event, not a state), longer for those events.
Summaries and details pass :func:`scrub` (URL userinfo, ``password=`` values) on the way.
Without either connection the log line is the alert. Used by the deadline callback (a
scheduler-side process) and, through the bundle's ``include.pin_airflow.runtime``, by every
task-side alert, so both are delivered the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, NamedTuple, Protocol

Severity = Literal["warning", "critical"]

ALERTS_WEBHOOK_CONN_ID = "alerts_webhook"
WEBHOOK_CONNECT_TIMEOUT_SECONDS = 3
WEBHOOK_READ_TIMEOUT_SECONDS = 5
ALERTMANAGER_CONN_ID = "alertmanager"
ALERTMANAGER_ENDPOINT = "api/v2/alerts"
# a task alert stays active this long in Alertmanager, then resolves by itself (an event, not a
# state); the same 15 min as the event rules of ops/prometheus/alerts.yml
ALERTMANAGER_EVENT_SECONDS = 900


class EventSpec(NamedTuple):
    """A task alert that carries one event's details, and a Prometheus rule counts the same
    events (ops/prometheus/alerts.yml, label ``pin_event``).

    ``identity``: the detail keys that tell one event from another (label ``pin_alert_id``, so
    a second quarantine is a second alert, while the same poison slot seen again next cycle
    refreshes the first). ``seconds``: how long it stays active, longer than its rule can fire
    after the last such event, so the rule stays inhibited (ops/alertmanager/alertmanager.yml)
    for as long as it fires.
    """

    identity: tuple[str, ...]
    seconds: int


# One event, one page (ops/README.md, "One page per event"). Rule windows: quarantined 15 min,
# poison-slot errors 15 min, detach lock 20 min, retention lock 36 h. A missing database
# privilege or an unsupported server has no rule: its alert mutes the task_failed that follows
# (every run of the job fails the same way and refreshes it, one page until it is fixed).
EVENTS: dict[str, EventSpec] = {
    "snapshot_detach_quarantined": EventSpec(("snapshot_id",), 1800),
    "slot_expiration_poison_row": EventSpec(("slot_id",), 1800),
    "retention_batch_failed": EventSpec(("table", "batch_ids"), 1800),
    "lock_held_too_long": EventSpec(("lock", "pid"), 1800),
    "database_privileges_missing": EventSpec(("role", "missing"), 1800),
    "database_server_unsupported": EventSpec(("server_version",), 1800),
}
EVENT_SECONDS_BY_DAG = {("lock_held_too_long", "user_activity_retention"): 37 * 3600}
# a task alert that follows from an event another alert already carries (task_failed after a
# failed retention batch) names it in this detail key: inhibited by that event's alert
CAUSED_BY_EVENT = "event"
# relative to the repository root, like the rules' runbook_url (ops/README.md)
RUNBOOKS = {
    "deadline_missed": "docs/runbooks/deadline-missed.md",
    "task_failed": "docs/runbooks/task-failed.md",
    "snapshot_detach_quarantined": "docs/runbooks/snapshot-detach-quarantined.md",
    "selections_auth_failed": "docs/runbooks/snapshot-detach-pending.md",
    "slot_expiration_poison_row": "docs/runbooks/slot-expiration-poison-slot.md",
    "retention_batch_failed": "docs/runbooks/activity-retention-failure.md",
    "database_privileges_missing": "docs/runbooks/database-privileges-missing.md",
    "database_server_unsupported": "docs/runbooks/database-server-unsupported.md",
}
RUNBOOKS_BY_DAG = {
    ("lock_held_too_long", "news_snapshot_detach_retry"): (
        "docs/runbooks/snapshot-detach-worker-stopped.md"
    ),
    ("lock_held_too_long", "user_activity_retention"): "docs/runbooks/activity-retention-lock.md",
}
RUNBOOK_INDEX = "docs/runbooks/README.md"


def runbook_for(alert: str, dag_id: str) -> str:
    return RUNBOOKS_BY_DAG.get((alert, dag_id)) or RUNBOOKS.get(alert, RUNBOOK_INDEX)


class AlertLike(Protocol):
    """What the notifier reads of an alert (the jobs' ``telemetry.Alert`` has this shape)."""

    @property
    def name(self) -> str: ...
    @property
    def severity(self) -> str: ...
    @property
    def summary(self) -> str: ...
    @property
    def details(self) -> Mapping[str, Any]: ...


class Alert(NamedTuple):
    """An alert raised by this package itself (the deadline callback)."""

    name: str
    severity: Severity
    summary: str
    details: Mapping[str, Any]


def dedupe_key(alert: AlertLike) -> str:
    return f"{alert.name}:{json.dumps(dict(alert.details), sort_keys=True, default=str)}"


# The last guard, for text an alert should never have held (alerts carry error classes and
# codes, telemetry.error_code): the userinfo of a URL and the value of a key=value credential.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@")
_CREDENTIAL = re.compile(
    r"\b(password|passwd|pwd|secret|token|api_key|apikey)(\s*[=:]\s*)[^\s&;,'\"]+",
    re.IGNORECASE,
)
REDACTED = "***"


def scrub(value: Any) -> Any:
    """``value`` with URL userinfo and ``password=...``-style values redacted, in every string
    of a nested dict/list; anything else is returned as it is."""
    if isinstance(value, str):
        value = _USERINFO.sub(rf"\1{REDACTED}@", value)
        return _CREDENTIAL.sub(rf"\1\2{REDACTED}", value)
    if isinstance(value, Mapping):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    return value


class WebhookRejectedError(Exception):
    """The webhook answered with a status other than 2xx."""

    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.status = status


class Notifier:
    """Every alert: one greppable log line, then (optionally) a JSON POST to ``alerts_webhook``.

    Deduplicated within the process (one task run). Delivery is bounded by connect/read
    timeouts and never fails the caller; a failure is logged as one line with the error class
    (and HTTP status) only. The POST goes through the session ``HttpHook.get_conn`` builds (auth,
    headers and options from the connection), not ``HttpHook.run``: that one logs the exception
    text (the webhook's host and path; for Slack/Teams-style webhooks the path is the secret)
    and the response body. A missing connection means "log line only".
    """

    def __init__(self, dag_id: str, run_id: str, logger: logging.Logger | None = None) -> None:
        self.dag_id = dag_id
        self.run_id = run_id
        self.logger = logger or logging.getLogger("pin_maintenance.alerts")
        self._seen: set[str] = set()

    def payload(self, alert: AlertLike) -> dict[str, Any]:
        """The alert as posted and logged; free text passes :func:`scrub` on the way."""
        return {
            "alert": alert.name,
            "severity": alert.severity,
            "dag_id": self.dag_id,
            "run_id": self.run_id,
            "summary": scrub(alert.summary),
            "details": scrub(dict(alert.details)),
        }

    def send(self, alert: AlertLike) -> None:
        key = dedupe_key(alert)
        if key in self._seen:
            return
        self._seen.add(key)
        body = self.payload(alert)
        level = logging.ERROR if alert.severity == "critical" else logging.WARNING
        self.logger.log(level, "PIN_ALERT %s", json.dumps(body, sort_keys=True, default=str))
        self._post(ALERTS_WEBHOOK_CONN_ID, None, body, body["alert"])
        self._post(
            ALERTMANAGER_CONN_ID, ALERTMANAGER_ENDPOINT, alertmanager_alerts(body), body["alert"]
        )

    def _post(self, conn_id: str, endpoint: str | None, payload: Any, name: str) -> None:
        try:
            from airflow.providers.http.hooks.http import HttpHook
            from airflow.sdk.exceptions import AirflowNotFoundException

            hook = HttpHook(method="POST", http_conn_id=conn_id)
            try:
                session = hook.get_conn(headers={"Content-Type": "application/json"})
            except AirflowNotFoundException:  # not configured: nothing to deliver there
                return
            with session:
                response = session.post(
                    hook.url_from_endpoint(endpoint),
                    json=payload,
                    timeout=(WEBHOOK_CONNECT_TIMEOUT_SECONDS, WEBHOOK_READ_TIMEOUT_SECONDS),
                    allow_redirects=False,
                )
            if not 200 <= response.status_code < 300:
                raise WebhookRejectedError(response.status_code)
        except Exception as exc:  # delivery must never fail the caller
            self.logger.warning(
                "PIN_ALERT_DELIVERY_FAILED alert=%s target=%s error=%s%s",
                name,
                conn_id,
                type(exc).__name__,
                f" status={exc.status}" if isinstance(exc, WebhookRejectedError) else "",
            )


def alertmanager_labels(body: Mapping[str, Any]) -> dict[str, str]:
    """Alertmanager's identity, grouping and inhibition keys for one alert.

    Always ``alertname``, ``severity``, ``dag_id``. An event alert (:data:`EVENTS`) adds
    ``pin_event`` (shared with its rule), ``pin_detail="true"`` (it carries the details, so it
    is the one that pages) and ``pin_alert_id`` (the event's identity). An alert that follows
    from such an event adds only ``pin_event``. Labels stay few: run ids and details are
    annotations.
    """
    name, dag_id = str(body["alert"]), str(body["dag_id"])
    details = body.get("details") or {}
    labels = {"alertname": name, "severity": str(body["severity"]), "dag_id": dag_id}
    spec = EVENTS.get(name)
    if spec is not None:
        identity = json.dumps(
            [name, dag_id, *(details.get(key) for key in spec.identity)],
            sort_keys=True,
            default=str,
        )
        labels["pin_event"] = name
        labels["pin_detail"] = "true"
        labels["pin_alert_id"] = hashlib.sha256(identity.encode()).hexdigest()[:16]
    elif details.get(CAUSED_BY_EVENT) in EVENTS:
        labels["pin_event"] = str(details[CAUSED_BY_EVENT])
    return labels


def alertmanager_seconds(name: str, dag_id: str) -> int:
    """How long a task alert stays active in Alertmanager."""
    spec = EVENTS.get(name)
    default = spec.seconds if spec is not None else ALERTMANAGER_EVENT_SECONDS
    return EVENT_SECONDS_BY_DAG.get((name, dag_id), default)


def alertmanager_alerts(
    body: Mapping[str, Any], *, now: datetime | None = None
) -> list[dict[str, Any]]:
    """The webhook payload as Alertmanager v2 ``postableAlerts`` (a list of one alert)."""
    starts = now or datetime.now(UTC)
    seconds = alertmanager_seconds(str(body["alert"]), str(body["dag_id"]))
    ends = starts + timedelta(seconds=seconds)
    return [
        {
            "labels": alertmanager_labels(body),
            "annotations": {
                "summary": str(body["summary"]),
                "runbook_url": runbook_for(str(body["alert"]), str(body["dag_id"])),
                "run_id": str(body["run_id"]),
                "details": json.dumps(body["details"], sort_keys=True, default=str),
            },
            "startsAt": starts.isoformat(),
            "endsAt": ends.isoformat(),
        }
    ]
