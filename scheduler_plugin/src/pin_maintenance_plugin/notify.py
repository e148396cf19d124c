"""Alert delivery: one greppable log line per alert, then an optional JSON POST to a webhook.

The payload is DESIGN section 4's ``{"alert", "severity", "dag_id", "run_id", "summary",
"details"}``. The webhook is the http connection ``alerts_webhook``; without it the log line is
the alert. Used by the deadline callback (a scheduler-side process) and, through the bundle's
``include.pin_airflow.runtime``, by every task-side alert, so both are delivered the same way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, Protocol

Severity = Literal["warning", "critical"]

ALERTS_WEBHOOK_CONN_ID = "alerts_webhook"
WEBHOOK_CONNECT_TIMEOUT_SECONDS = 3
WEBHOOK_READ_TIMEOUT_SECONDS = 5


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
        return {
            "alert": alert.name,
            "severity": alert.severity,
            "dag_id": self.dag_id,
            "run_id": self.run_id,
            "summary": alert.summary,
            "details": dict(alert.details),
        }

    def send(self, alert: AlertLike) -> None:
        key = dedupe_key(alert)
        if key in self._seen:
            return
        self._seen.add(key)
        body = self.payload(alert)
        level = logging.ERROR if alert.severity == "critical" else logging.WARNING
        self.logger.log(level, "PIN_ALERT %s", json.dumps(body, sort_keys=True, default=str))
        self._post(body)

    def _post(self, body: dict[str, Any]) -> None:
        try:
            from airflow.providers.http.hooks.http import HttpHook
            from airflow.sdk.exceptions import AirflowNotFoundException

            hook = HttpHook(method="POST", http_conn_id=ALERTS_WEBHOOK_CONN_ID)
            try:
                session = hook.get_conn(headers={"Content-Type": "application/json"})
            except AirflowNotFoundException:  # no webhook configured: the log line is the alert
                return
            with session:
                response = session.post(
                    hook.url_from_endpoint(None),
                    json=body,
                    timeout=(WEBHOOK_CONNECT_TIMEOUT_SECONDS, WEBHOOK_READ_TIMEOUT_SECONDS),
                    allow_redirects=False,
                )
            if not 200 <= response.status_code < 300:
                raise WebhookRejectedError(response.status_code)
        except Exception as exc:  # delivery must never fail the caller
            self.logger.warning(
                "PIN_ALERT_DELIVERY_FAILED alert=%s error=%s%s",
                body["alert"],
                type(exc).__name__,
                f" status={exc.status}" if isinstance(exc, WebhookRejectedError) else "",
            )
