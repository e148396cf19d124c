"""Alert delivery for Airflow callbacks, and the ``task_failed`` failure callback.

:class:`WebhookNotifier` is ``runtime.Notifier`` with a stricter webhook delivery (see its
docstring); the deadline and task-failure callbacks use it. Wire the failure callback into
every DAG through ``dag_support.DEFAULT_ARGS``::

    "on_failure_callback": on_task_failed,

Airflow calls ``on_failure_callback`` once a task instance has failed for good, i.e. after its
retries are used up (a failed try that will be retried calls ``on_retry_callback`` instead),
inside the task's own process, so connections resolve as in the task. Imported at parse
time: nothing here does I/O at import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from include.pin_airflow.runtime import ALERTS_WEBHOOK_CONN_ID, Notifier
from include.pin_maintenance.telemetry import Alert, Severity

TASK_FAILED_SEVERITY: Severity = "critical"
WEBHOOK_CONNECT_TIMEOUT_SECONDS = 3
WEBHOOK_READ_TIMEOUT_SECONDS = 5


class WebhookRejectedError(Exception):
    """The webhook answered with a status other than 2xx."""

    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.status = status


class WebhookNotifier(Notifier):
    """``runtime.Notifier`` whose webhook POST never puts the webhook URL or body in a log.

    ``runtime.Notifier`` posts with ``HttpHook.run``, which on a connection error logs the
    exception text (host, port and path of the webhook: for Slack/Teams-style webhooks the path
    is the secret) at WARNING, and on a non-2xx answer logs the response body at ERROR. Here the
    connection is resolved by ``HttpHook.get_conn`` (auth, headers and options from the
    ``alerts_webhook`` connection, as before) and the POST is sent on that session directly:
    connect/read timeouts, no redirects, and a failure is logged as one line with the error
    class (and HTTP status) only. A missing connection means "log line only", as before; any
    other lookup failure is now reported as a delivery failure instead of passing silently.
    """

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


MAX_ERROR_CHARS = 300  # one readable line; the task log has the traceback


def error_summary(exc: BaseException | None) -> str:
    """``ClassName: first line of the message`` (truncated), or ``unknown`` without one."""
    if exc is None:
        return "unknown"
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def task_failed_alert(context: Mapping[str, Any]) -> tuple[str, str, Alert]:
    """(dag_id, run_id, alert) for the context Airflow passes to ``on_failure_callback``."""
    ti = context.get("ti") or context.get("task_instance")
    dag = context.get("dag")
    dag_id = str(getattr(dag, "dag_id", None) or getattr(ti, "dag_id", None) or "unknown")
    run_id = str(context.get("run_id") or getattr(ti, "run_id", None) or "unknown")
    task_id = str(getattr(ti, "task_id", None) or "unknown")
    exc = context.get("exception")  # an exception, or a string for some failure paths
    if exc is None or isinstance(exc, BaseException):
        error = error_summary(exc)
    else:
        error = str(exc)[:MAX_ERROR_CHARS]
    details: dict[str, Any] = {
        "task_id": task_id,
        "try_number": getattr(ti, "try_number", None),
        "max_tries": getattr(ti, "max_tries", None),
        "map_index": getattr(ti, "map_index", None),
        "error": error,
    }
    log_url = _safe_attr(ti, "log_url")
    if log_url:
        details["log_url"] = log_url
    summary = f"{dag_id}.{task_id} failed after its retries in run {run_id}: {error}"
    return dag_id, run_id, Alert("task_failed", TASK_FAILED_SEVERITY, summary, details)


def on_task_failed(context: Mapping[str, Any]) -> None:
    """``on_failure_callback``: one ``task_failed`` alert (log line + webhook)."""
    dag_id, run_id, alert = task_failed_alert(context)
    WebhookNotifier(dag_id, run_id).send(alert)


def _safe_attr(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name, None)
    except Exception:  # a property that needs config/API we do not have: leave it out
        return None
