"""What a job reports: structured log lines, metrics, alerts and trace spans.

The job package only knows these protocols. ``include.pin_airflow`` supplies the real sinks
(Airflow's stats client, the alert notifier with its webhook, the OpenTelemetry tracer Airflow
configured); tests and the CLI can pass :class:`RecordingMetrics` / :class:`LogOnlyAlerts`.
The tracer defaults to OpenTelemetry's no-op tracer; the job package never configures a
tracer provider itself.
"""

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
    """An exception as an alert may carry it: its class and, when it has one, its code.

    ``"ClassName"`` plus the SQLSTATE of a database error (``"RaiseException P0001"``) or the
    HTTP status of an HTTP error (``"HTTPError 503"``); for a chained exception the cause's code
    when the exception itself has none. Never the message: a database error's text can name the
    host and user (a failed connection) or carry row values (a trigger's ``RAISE``), an HTTP
    error's text its URL; only the task log gets the text. The rule of ``last_error``
    (docs/design.md, "Selections API") and of the span's ``error.type``, for alert details and
    summaries.
    """
    if exc is None:
        return "unknown"
    name = type(exc).__name__
    for candidate in (exc, exc.__cause__):
        code = _code_of(candidate)
        if code:
            return f"{name} {code}"
    return name


def _code_of(exc: BaseException | None) -> str | None:
    if exc is None:
        return None
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str) and len(sqlstate) == 5 and sqlstate.isalnum():
        return sqlstate
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status is None:
        status = getattr(exc, "status", None)
    if isinstance(status, int) and 100 <= status <= 599:
        return str(status)
    return None


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
        span = trace.get_current_span().get_span_context()
        if span.is_valid:  # logs and traces join on these two
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

# Span attribute values OpenTelemetry accepts (None is dropped before a span sees it).
AttrValue = str | bool | int | float


@dataclass
class Telemetry:
    """Everything a job run reports through: its log, its metrics, its alerts and its spans.

    ``run_attributes`` are put on the run span as they are (the Airflow glue passes the DAG
    id, run id, task id and try number under Airflow's own attribute names). ``refuse`` turns
    the error of a run refused for its configuration (a missing database privilege: nothing was
    written, no retry can help) into what the host fails such a run with (Airflow: a task
    failure without a retry); None raises the error as it is.
    """

    log: JobLog
    metrics: MetricsSink
    alerts: AlertSink
    tracer: Tracer = _NO_OP
    run_attributes: Mapping[str, AttrValue] = field(default_factory=dict)
    refuse: Callable[[Exception], BaseException] | None = None

    def run_span(self, name: str) -> contextlib.AbstractContextManager[Span]:
        """The span of one job run (current while it is open), carrying the correlation id."""
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
        """A current span that records an escaping exception by its class name only."""
        span = self.tracer.start_span(
            name,
            context=context,
            kind=kind,
            # None values dropped: OpenTelemetry refuses them with a warning per attribute
            attributes={k: v for k, v in (attributes or {}).items() if v is not None},
            record_exception=False,  # the SDK would keep str(exc): it may name a URL or a value
            set_status_on_exception=False,
        )
        return resumed(span)

    @classmethod
    def local(
        cls, log: JobLog, metrics: MetricsSink | None = None, tracer: Tracer | None = None
    ) -> Telemetry:
        """Outside Airflow (CLIs, tests): metrics kept in memory, alerts as log lines only,
        spans to ``tracer`` (the no-op tracer when None)."""
        return cls(log, metrics or RecordingMetrics(), LogOnlyAlerts(log), tracer or _NO_OP)


@contextlib.contextmanager
def resumed(span: Span) -> Iterator[Span]:
    """Make a started ``span`` current and end it on exit, recording an escaping exception by
    its class only (also a pipelined batch's: started at its claim, ended once its outcomes
    are recorded)."""
    with trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    ) as current:
        try:
            yield current
        except BaseException as exc:
            record_error(current, type(exc).__name__)
            raise


def record_error(span: Span, error_type: str) -> None:
    """Mark ``span`` failed with an error class or code only, the ``last_error`` rule: no
    message, credential, header, URL or body ever reaches a span."""
    if not span.is_recording():
        return
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, error_type))


def set_result(span: Span, result: Mapping[str, Any], prefix: str = "pin.result.") -> None:
    """Put a job result's scalar counts and flags on ``span`` (its XCom dict, as is)."""
    if not span.is_recording():
        return
    span.set_attributes(
        {
            prefix + key: value
            for key, value in result.items()
            if isinstance(value, str | bool | int | float)
        }
    )


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
