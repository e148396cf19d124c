"""The ``task_failed`` failure callback (every DAG's ``DEFAULT_ARGS``).

Alerts go through the one notifier, ``pin_maintenance_plugin.notify.Notifier``, like the jobs'
own alerts and the deadline callback.

Airflow calls ``on_failure_callback`` once a task instance has failed for good, i.e. after its
retries are used up (a failed try that will be retried calls ``on_retry_callback`` instead),
inside the task's own process, so connections resolve as in the task. Imported at parse
time: nothing here does I/O at import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from include.pin_maintenance.config import ConfigError
from include.pin_maintenance.telemetry import Alert, Severity, error_code

TASK_FAILED_SEVERITY: Severity = "critical"
# A manual run refused for its own bad input (a typo in the trigger form: ConfigError, raised
# before any write) changed nothing and is already in front of the person who triggered it:
# still alerted, but not paged. A bad Variable on a scheduled run stays critical (every tick
# fails until someone fixes it).
BAD_MANUAL_INPUT_SEVERITY: Severity = "warning"
# Some failure paths hand the callback a string instead of an exception (Airflow's own
# wording, "Task received SIGTERM signal"): kept only when it is letters and spaces (no digit,
# quote, '@', '/', ':' or '=': nothing that can spell a URL, an id, a number or a key=value),
# else "unknown"; the task log has the text.
PLAIN_WORDS = re.compile(r"[A-Za-z][A-Za-z_ ]{0,79}")


def error_summary(exc: BaseException | str | None) -> str:
    """The failure as an alert carries it: class and SQLSTATE / HTTP code, never its text.

    ``telemetry.error_code``: an exception's message can name the database host and user or
    carry a trigger's ``RAISE`` text with row values; Airflow's secrets masker sees task logs,
    not alert payloads. The traceback and the message stay in the task log.
    """
    if exc is None or isinstance(exc, BaseException):
        return error_code(exc)
    text = str(exc).strip()
    return text if PLAIN_WORDS.fullmatch(text) else "unknown"


def task_failed_alert(context: Mapping[str, Any]) -> tuple[str, str, Alert]:
    """(dag_id, run_id, alert) for the context Airflow passes to ``on_failure_callback``."""
    ti = context.get("ti") or context.get("task_instance")
    dag = context.get("dag")
    dag_id = str(getattr(dag, "dag_id", None) or getattr(ti, "dag_id", None) or "unknown")
    run_id = str(context.get("run_id") or getattr(ti, "run_id", None) or "unknown")
    task_id = str(getattr(ti, "task_id", None) or "unknown")
    exc = context.get("exception")  # an exception, or a string for some failure paths
    error = error_summary(exc)
    details: dict[str, Any] = {
        "task_id": task_id,
        "try_number": getattr(ti, "try_number", None),
        "max_tries": getattr(ti, "max_tries", None),
        "map_index": getattr(ti, "map_index", None),
        "error": error,
    }
    caused_by = getattr(exc, "alert_event", None)  # the failure already sent its own alert
    if isinstance(caused_by, str):
        details["event"] = caused_by
    log_url = _safe_attr(ti, "log_url")
    if log_url:
        details["log_url"] = log_url
    if isinstance(exc, ConfigError) and _is_manual(context, run_id):
        details["bad_input"] = True
        summary = f"{dag_id}.{task_id} refused its trigger params in run {run_id}: {error}"
        return dag_id, run_id, Alert("task_failed", BAD_MANUAL_INPUT_SEVERITY, summary, details)
    summary = f"{dag_id}.{task_id} failed after its retries in run {run_id}: {error}"
    return dag_id, run_id, Alert("task_failed", TASK_FAILED_SEVERITY, summary, details)


def _is_manual(context: Mapping[str, Any], run_id: str) -> bool:
    run_type = getattr(context.get("dag_run"), "run_type", None)
    if run_type is not None:
        return str(getattr(run_type, "value", run_type)) == "manual"
    return run_id.startswith("manual__")


def on_task_failed(context: Mapping[str, Any]) -> None:
    """``on_failure_callback``: one ``task_failed`` alert (log line + webhook)."""
    from include.pin_airflow.scheduler_side import notify  # task time only

    dag_id, run_id, alert = task_failed_alert(context)
    notify.Notifier(dag_id, run_id).send(alert)


def _safe_attr(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name, None)
    except Exception:  # a property that needs config/API we do not have: leave it out
        return None
