"""Task-time adapters: build a job's connection factory, config and telemetry from the context."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from include.pin_maintenance.config import ConfigError, ConfigSpec
from include.pin_maintenance.db import Connect, SessionSettings, configured
from include.pin_maintenance.telemetry import Alert, JobLog, Telemetry

log = logging.getLogger(__name__)

ALERTS_WEBHOOK_CONN_ID = "alerts_webhook"
WEBHOOK_CONNECT_TIMEOUT_SECONDS = 3
WEBHOOK_READ_TIMEOUT_SECONDS = 5


def postgres_connect(conn_id: str, settings: SessionSettings) -> Connect:
    """Connections from ``PostgresHook`` (psycopg 3), each with the job's session guards."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    hook = PostgresHook(postgres_conn_id=conn_id)
    return configured(hook.get_conn, settings)


def read_variable_json(key: str) -> str | None:
    """The raw text of Variable ``key`` or None when it does not exist."""
    from airflow.sdk import Variable

    return Variable.get(key, default=None)


class InvalidConfig(ConfigError, AirflowFailException):
    """A bad config value fails the task at once: an Airflow retry cannot fix it (while
    infrastructure failures keep their retry). Still a ConfigError for callers and tests."""


def resolve_config(spec: ConfigSpec, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Defaults <- Variable named after the DAG id <- trigger params (DESIGN section 4).

    Raises :class:`InvalidConfig` naming the key, its value and the allowed range.
    """
    try:
        return spec.resolve(read_variable_json(spec.job), params_for_spec(spec, params))
    except ConfigError as exc:
        raise InvalidConfig(str(exc)) from None


def params_for_spec(spec: ConfigSpec, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The params that belong to config (declared extras such as dry_run are handled apart)."""
    return {k: v for k, v in (params or {}).items() if k not in spec.extra_params}


class StatsMetrics:
    """Metrics through Airflow's stats client: StatsD or OpenTelemetry per ``[metrics]``."""

    def __init__(self) -> None:
        from airflow.sdk.observability import stats

        self._stats = stats

    def incr(self, name: str, count: int = 1) -> None:
        self._stats.incr(name, count)

    def gauge(self, name: str, value: float) -> None:
        self._stats.gauge(name, value)

    def timing(self, name: str, value: timedelta) -> None:
        self._stats.timing(name, value)


class WebhookRejectedError(Exception):
    """The webhook answered with a status other than 2xx."""

    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.status = status


class Notifier:
    """Every alert: one greppable log line, then (optionally) a JSON POST to ``alerts_webhook``.

    Deduplicated within the process (one task run). Delivery is bounded by connect/read
    timeouts and never fails the job; a failure is logged as one line with the error class
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

    def payload(self, alert: Alert) -> dict[str, Any]:
        return {
            "alert": alert.name,
            "severity": alert.severity,
            "dag_id": self.dag_id,
            "run_id": self.run_id,
            "summary": alert.summary,
            "details": dict(alert.details),
        }

    def send(self, alert: Alert) -> None:
        key = alert.dedupe_key()
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
        except Exception as exc:  # delivery must never fail the job
            self.logger.warning(
                "PIN_ALERT_DELIVERY_FAILED alert=%s error=%s%s",
                body["alert"],
                type(exc).__name__,
                f" status={exc.status}" if isinstance(exc, WebhookRejectedError) else "",
            )


def telemetry_for(job: str, context: Mapping[str, Any]) -> Telemetry:
    """Telemetry for one task run, correlated by the DAG run id."""
    run_id = str(context.get("run_id") or "manual")
    return Telemetry(
        log=JobLog(job, run_id),
        metrics=StatsMetrics(),
        alerts=Notifier(job, run_id),
    )
