"""What a job reports: structured log lines, metrics, alerts and trace spans, through sinks
``include.pin_airflow`` supplies (or the in-memory ones here, for the CLI and tests)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

Severity = Literal["warning", "critical"]


@dataclass(frozen=True)
class Alert:
    """An alert as docs/design.md, "Alerts" shapes it (the notifier adds dag_id and run_id)."""

    name: str
    severity: Severity
    summary: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def dedupe_key(self) -> str:
        return f"{self.name}:{json.dumps(self.details, sort_keys=True, default=str)}"


def error_code(exc: BaseException | None) -> str:
    """An exception's class plus its (or its cause's) SQLSTATE or HTTP status, as in
    ``"RaiseException P0001"``, ``"HTTPError 503"``: never the message, which may carry a host,
    user, URL or row values (the ``last_error`` rule, docs/design.md, "Selections API")."""
    if exc is None:
        return "unknown"
    for candidate in (exc, exc.__cause__):
        sqlstate = getattr(candidate, "sqlstate", None)
        if isinstance(sqlstate, str) and len(sqlstate) == 5 and sqlstate.isalnum():
            return f"{type(exc).__name__} {sqlstate}"
        status = getattr(getattr(candidate, "response", None), "status_code", None)
        if status is None:
            status = getattr(candidate, "status", None)
        if isinstance(status, int) and 100 <= status <= 599:
            return f"{type(exc).__name__} {status}"
    return type(exc).__name__


class MetricsSink(Protocol):
    def incr(self, name: str, count: int = 1) -> None: ...
    def gauge(self, name: str, value: float) -> None: ...
    def timing(self, name: str, value: timedelta) -> None: ...


class AlertSink(Protocol):
    def send(self, alert: Alert) -> None: ...


class JobLog:
    """One-line ``event=... job=... run_id=... key=value`` records (docs/design.md, "Log
    vocabulary"), with the trace and span ids when a span is current."""

    def __init__(self, job: str, run_id: str, logger: logging.Logger | None = None) -> None:
        self.job, self.run_id = job, run_id
        self.logger = logger or logging.getLogger(f"pin_maintenance.{job}")

    def line(self, event: str, fields: Mapping[str, Any]) -> str:
        parts = [f"event={event}", f"job={self.job}", f"run_id={self.run_id}"]
        parts += [f"{k}={_value(v)}" for k, v in fields.items()]
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            parts += [f"trace_id={span.trace_id:032x}", f"span_id={span.span_id:016x}"]
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


_NO_OP = trace.NoOpTracer()
AttrValue = str | bool | int | float


@dataclass
class Telemetry:
    """Everything a job run reports through. ``run_attributes`` go on the run span as they
    are; ``refuse`` turns the error of a run refused for its configuration (a missing privilege)
    into what the host fails it with (Airflow: no retry); None raises it as it is."""

    log: JobLog
    metrics: MetricsSink
    alerts: AlertSink
    tracer: Tracer = _NO_OP
    run_attributes: Mapping[str, AttrValue] = field(default_factory=dict)
    refuse: Callable[[Exception], BaseException] | None = None

    def run_span(self, name: str) -> contextlib.AbstractContextManager[Span]:
        """The span of one job run, current while it is open."""
        attributes = {"pin.job": self.log.job, "pin.run_id": self.log.run_id}
        return self.span(name, {**attributes, **self.run_attributes})

    def span(
        self,
        name: str,
        attributes: Mapping[str, AttrValue | None] | None = None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        context: Context | None = None,
    ) -> contextlib.AbstractContextManager[Span]:
        """A current span (None attributes dropped) recording an exception by its class only."""
        span = self.tracer.start_span(
            name,
            context=context,
            kind=kind,
            attributes={k: v for k, v in (attributes or {}).items() if v is not None},
            record_exception=False,  # the SDK would keep str(exc): it may name a URL or a value
            set_status_on_exception=False,
        )
        return resumed(span)

    @classmethod
    def local(
        cls, log: JobLog, metrics: MetricsSink | None = None, tracer: Tracer | None = None
    ) -> Telemetry:
        """Outside Airflow (CLIs, tests): metrics in memory, alerts as log lines only."""
        return cls(log, metrics or RecordingMetrics(), LogOnlyAlerts(log), tracer or _NO_OP)


@contextlib.contextmanager
def resumed(span: Span) -> Iterator[Span]:
    """Make a started ``span`` current and end it on exit, recording an escaping exception by
    its class only."""
    with trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    ) as current:
        try:
            yield current
        except BaseException as exc:
            record_error(current, type(exc).__name__)
            raise


def record_error(span: Span, error_type: str) -> None:
    """Mark ``span`` failed with an error class or code only, never a message."""
    if span.is_recording():
        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, error_type))


def set_result(span: Span, result: Mapping[str, Any], prefix: str = "pin.result.") -> None:
    """Put a job result's scalar counts and flags on ``span`` (its XCom dict, as is)."""
    if span.is_recording():
        span.set_attributes({prefix + k: v for k, v in result.items() if isinstance(v, AttrValue)})


class RecordingMetrics:
    """Keeps metrics in memory (the CLI report, tests)."""

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
    """Alerts as one log line each, kept for inspection."""

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
