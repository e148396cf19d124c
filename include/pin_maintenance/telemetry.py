"""What a job reports: structured log lines, metrics and alerts, behind small interfaces.

The job package only knows these protocols. ``include.pin_airflow`` supplies the real sinks
(Airflow's stats client, the alert notifier with its webhook); tests and the CLI can pass
:class:`RecordingMetrics` / :class:`LogOnlyAlerts`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol

Severity = Literal["warning", "critical"]


@dataclass(frozen=True)
class Alert:
    """An alert as DESIGN section 4 shapes it (dag_id and run_id are added by the notifier)."""

    name: str
    severity: Severity
    summary: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def dedupe_key(self) -> str:
        return f"{self.name}:{json.dumps(self.details, sort_keys=True, default=str)}"


class MetricsSink(Protocol):
    def incr(self, name: str, count: int = 1) -> None: ...
    def gauge(self, name: str, value: float) -> None: ...
    def timing(self, name: str, value: timedelta) -> None: ...


class AlertSink(Protocol):
    def send(self, alert: Alert) -> None: ...


class JobLog:
    """One-line ``key=value`` log records that always carry the run id (correlation id).

    ``log.info("batch_claimed", rows=100)`` ->
    ``event=batch_claimed job=news_snapshot_detach_retry run_id=scheduled__... rows=100``
    """

    def __init__(self, job: str, run_id: str, logger: logging.Logger | None = None) -> None:
        self.job = job
        self.run_id = run_id
        self.logger = logger or logging.getLogger(f"pin_maintenance.{job}")

    def line(self, event: str, fields: Mapping[str, Any]) -> str:
        parts = [f"event={event}", f"job={self.job}", f"run_id={self.run_id}"]
        parts += [f"{k}={_value(v)}" for k, v in fields.items()]
        return " ".join(parts)

    def debug(self, event: str, **fields: Any) -> None:
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(self.line(event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self.logger.info(self.line(event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self.logger.warning(self.line(event, fields))

    def error(self, event: str, **fields: Any) -> None:
        self.logger.error(self.line(event, fields))


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".")
    text = str(v)
    return json.dumps(text) if (" " in text or "=" in text or text == "") else text


@dataclass
class Telemetry:
    """Everything a job run reports through: its log, its metrics and its alerts."""

    log: JobLog
    metrics: MetricsSink
    alerts: AlertSink

    @classmethod
    def local(cls, log: JobLog, metrics: MetricsSink | None = None) -> Telemetry:
        """Outside Airflow (CLIs, tests): metrics kept in memory, alerts as log lines only."""
        return cls(log, metrics or RecordingMetrics(), LogOnlyAlerts(log))


class RecordingMetrics:
    """Keeps metrics in memory (for the CLI report and for tests of the job functions)."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.gauges: dict[str, float] = {}
        self.timings: dict[str, list[float]] = {}

    def incr(self, name: str, count: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + count

    def gauge(self, name: str, value: float) -> None:
        self.gauges[name] = value

    def timing(self, name: str, value: timedelta) -> None:
        self.timings.setdefault(name, []).append(value.total_seconds())


class LogOnlyAlerts:
    """Alerts as a single greppable log line each; keeps them for inspection."""

    def __init__(self, log: JobLog) -> None:
        self.log = log
        self.sent: list[Alert] = []

    def send(self, alert: Alert) -> None:
        self.sent.append(alert)
        emit = self.log.error if alert.severity == "critical" else self.log.warning
        emit(
            "alert",
            alert=alert.name,
            severity=alert.severity,
            summary=alert.summary,
            details=json.dumps(dict(alert.details), sort_keys=True, default=str),
        )
