"""What every job run does around its own work, written once (docs/design.md, "Layout of the
job package"): span and result, shared log events, metrics, the lock-busy path, capped alerts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from opentelemetry.trace import Span

from include.pin_maintenance.config import ConfigSpec
from include.pin_maintenance.db import Connect, lock_held_too_long
from include.pin_maintenance.stopping import JobCancelled
from include.pin_maintenance.telemetry import Alert, AlertSink, Telemetry, set_result

# docs/design.md, "Log events"
STARTED = "job_started"
COMPLETED = "job_completed"
SKIPPED = "job_skipped"
CANCELLED = "job_cancelled"
FAILED = "job_failed"
CONFIG_INVALID = "config_invalid"

MAX_ROW_ALERTS_PER_RUN = 20  # per-row alerts past this are counted, for one summary alert
ERROR_TEXT_LIMIT = 300


@dataclass(frozen=True)
class JobMetrics:
    """The metric names a job's lifecycle emits (contracts: docs/design.md, "Metrics")."""

    counters: tuple[str, ...]  # sent at 0 when a run starts
    duration: str | None  # None: a job without them (requeue)
    last_success: str | None
    lock_contention: str | None = None


@dataclass(frozen=True)
class JobSpec:
    """One job as the lifecycle and the CLI see it: its DAG id, config keys and metrics."""

    job: str
    config: ConfigSpec
    metrics: JobMetrics


def describe_error(exc: BaseException) -> str:
    """Error class, SQLSTATE and the server's primary message; no row data beyond that."""
    sqlstate = getattr(exc, "sqlstate", None)
    message = getattr(getattr(exc, "diag", None), "message_primary", None) or str(exc)
    lines = message.strip().splitlines()
    text = type(exc).__name__ + (f" {sqlstate}" if sqlstate else "")
    return (text + (f": {lines[0]}" if lines else ""))[:ERROR_TEXT_LIMIT]


class CappedAlerts:
    """Per-row alerts of one run, at most ``cap``; the rest are counted for one summary."""

    def __init__(self, sink: AlertSink, cap: int = MAX_ROW_ALERTS_PER_RUN) -> None:
        self._sink, self._cap, self._lock = sink, cap, threading.Lock()
        self.sent = self.suppressed = 0

    def send(self, alert: Alert) -> bool:
        """Send ``alert`` unless the cap is reached; True when it was sent."""
        with self._lock:
            if self.sent >= self._cap:
                self.suppressed += 1
                return False
            self.sent += 1
        self._sink.send(alert)
        return True

    def summarize(self, summary: Callable[[int, int], Alert]) -> None:
        """Send ``summary(sent, suppressed)`` once when any alert was suppressed."""
        if self.suppressed:
            self._sink.send(summary(self.sent, self.suppressed))


class JobRun:
    """One run (or one task of a multi-task run) of a job: what its body reports through."""

    def __init__(
        self,
        spec: JobSpec,
        telemetry: Telemetry,
        span: Span,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.spec, self.telemetry, self.span, self.wall_clock = spec, telemetry, span, wall_clock
        self.log, self.metrics = telemetry.log, telemetry.metrics
        self.progress: dict[str, Any] = {}  # fields for a job_failed / job_cancelled line
        self._ended = False

    def started(self, **fields: Any) -> None:
        """Send every counter at 0 (a series starting above 0 shows no rise) and log it."""
        for counter in self.spec.metrics.counters:
            self.metrics.incr(counter, 0)
        self.log.info(STARTED, **fields)

    def skipped_lock_busy(
        self,
        connect: Connect,
        lock_name: str,
        lease_seconds: float,
        *,
        alerts: AlertSink | None = None,
        count_contention: bool = True,
        **fields: Any,
    ) -> None:
        """The single-runner lock is busy: log it, count it, alert if held past the lease."""
        if count_contention and self.spec.metrics.lock_contention:
            self.metrics.incr(self.spec.metrics.lock_contention)
        self.log.info(SKIPPED, reason="lock_busy", lock=lock_name, **fields)
        alert = lock_held_too_long(connect, lock_name, lease_seconds, job=self.spec.job)
        if alert:
            (alerts or self.telemetry.alerts).send(alert)

    def completed(
        self,
        result: Mapping[str, Any],
        *,
        duration_seconds: float | None,
        success: bool = True,
        **fields: Any,
    ) -> None:
        """Record the end: duration (None: did not run), last success, result, the log line."""
        if duration_seconds is not None and self.spec.metrics.duration:
            self.metrics.timing(self.spec.metrics.duration, timedelta(seconds=duration_seconds))
        if success and self.spec.metrics.last_success:
            self.metrics.gauge(self.spec.metrics.last_success, self.wall_clock())
        set_result(self.span, result)
        self.log.info(COMPLETED, **fields)
        self._ended = True

    def cancelled(self, reason: str, message: str, **fields: Any) -> JobCancelled:
        """Log ``job_cancelled`` and return the exception for the caller to raise."""
        self.log.warning(CANCELLED, reason=reason, **{**self.progress, **fields})
        self._ended = True
        return JobCancelled(message)


@contextmanager
def job_run(
    spec: JobSpec,
    telemetry: Telemetry,
    phase: str = "run",
    *,
    wall_clock: Callable[[], float] = time.time,
) -> Iterator[JobRun]:
    """The span of one run (or of its ``phase``); an error is logged and re-raised as it is."""
    with telemetry.run_span(f"{spec.job} {phase}") as span:
        run = JobRun(spec, telemetry, span, wall_clock)
        try:
            yield run
        except JobCancelled as exc:
            if not run._ended:
                telemetry.log.warning(CANCELLED, reason=str(exc), **run.progress)
            raise
        except BaseException as exc:
            telemetry.log.error(FAILED, error=describe_error(exc), phase=phase, **run.progress)
            raise
