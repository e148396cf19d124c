"""What every job run does around its own work, written once (docs/design.md, "Layout of the
job package").

A job module holds its queries, its rules and its batch body. This module holds the rest of a
run: its span and result, counters sent at zero, one vocabulary of log events for the same
moments in every job (``job_started``, ``job_completed``, ``job_skipped``, ``job_cancelled``,
``job_failed``), the single-runner lock's busy path, the duration and last-success metrics,
alerts capped per run, and how an error is described for a log line.

A run is ``with job_run(SPEC, telemetry) as run:`` around the job's body; the body calls
``run.started(...)`` first and ``run.completed(...)`` (or ``run.skipped_lock_busy(...)``) last.
A job whose run spans several Airflow tasks (retention) opens one ``job_run`` per task with its
phase name; only the last phase completes the run.
"""

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

# Log events every job writes at the same moments (docs/design.md, "Log events").
STARTED = "job_started"
COMPLETED = "job_completed"
SKIPPED = "job_skipped"
CANCELLED = "job_cancelled"
FAILED = "job_failed"
CONFIG_INVALID = "config_invalid"

# A per-row alert (a quarantined entry, a poison slot) past this many in one run is only
# counted; one summary alert then carries the count, so a systematic fault pages once.
MAX_ROW_ALERTS_PER_RUN = 20
# Error text in log lines: the class, SQLSTATE and the server's first line, cut here.
ERROR_TEXT_LIMIT = 300


@dataclass(frozen=True)
class JobMetrics:
    """The metric names a job's lifecycle emits (contracts: docs/design.md, "Metrics")."""

    counters: tuple[str, ...]  # sent at 0 when a run starts
    # a run that ran (a skip records none: its few ms would dilute the rules); None for a
    # job without these metrics (the requeue runbook action)
    duration: str | None
    last_success: str | None
    lock_contention: str | None = None  # a run that found the single-runner lock busy


@dataclass(frozen=True)
class JobSpec:
    """One job as the lifecycle and the CLI see it: its DAG id, config keys and metrics."""

    job: str
    config: ConfigSpec
    metrics: JobMetrics


def describe_error(exc: BaseException) -> str:
    """Error class, SQLSTATE and the server's primary message; no row data beyond that."""
    sqlstate = getattr(exc, "sqlstate", None)
    diag = getattr(exc, "diag", None)
    message = (getattr(diag, "message_primary", None) if diag is not None else None) or str(exc)
    text = type(exc).__name__
    if sqlstate:
        text += f" {sqlstate}"
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    if first_line:
        text += f": {first_line}"
    return text[:ERROR_TEXT_LIMIT]


class CappedAlerts:
    """Per-row alerts of one run, at most ``cap``; the rest are counted for one summary."""

    def __init__(self, sink: AlertSink, cap: int = MAX_ROW_ALERTS_PER_RUN) -> None:
        self._sink = sink
        self._cap = cap
        self._lock = threading.Lock()
        self.sent = 0
        self.suppressed = 0

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
        self.spec = spec
        self.wall_clock = wall_clock  # the last-success timestamp's clock
        self.telemetry = telemetry
        self.log = telemetry.log
        self.metrics = telemetry.metrics
        self.span = span
        # fields the body has reached so far: they go on a job_failed / job_cancelled line
        self.progress: dict[str, Any] = {}
        self._ended = False

    def started(self, **fields: Any) -> None:
        """Send every counter at 0 and log ``job_started``.

        At 0 first: statsd_exporter creates a series at its first value, and Prometheus sees
        no rise in a series that starts above 0.
        """
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
        """The single-runner lock is held elsewhere: log ``job_skipped``, count the contention
        and alert when the holder has held it past the lease a live run holds it for (a stuck
        worker or a manual session that keeps every run skipping)."""
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
        """Record the run's end: its duration (None for a run that did not run, e.g. a lock
        skip), the last-success gauge, the result on the run span, and ``job_completed``."""
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
    """The span of one run (or of ``phase`` of a run), with its end logged however it ends.

    An exception logs ``job_failed`` with the error's description (a :class:`JobCancelled`
    the body did not announce through :meth:`JobRun.cancelled` logs ``job_cancelled``) and is
    re-raised as it is, so the task fails with the original error.
    """
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
