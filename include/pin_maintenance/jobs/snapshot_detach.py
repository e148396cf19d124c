"""SnapshotDetachRetryJob (seed 000): retry the selections detach for the news action-outbox.

One run, under the single-runner advisory lock ``Pin:lock:job:scheduled:news-snapshot-detach-retry``
(busy = skip, success):

1. **Claim** (one short transaction, committed): up to ``batch_size`` rows with
   ``status = 'Pending' and next_attempt_at <= now``, oldest due first, ``FOR UPDATE SKIP
   LOCKED``; ``attempts += 1``, ``next_attempt_at = now + backoff(attempts)`` (pure function in
   ``pin_maintenance.backoff``), ``updated_at = now`` (the claim token).
2. **Detach**: ``POST /internal/snapshots/{snapshot_id}/detach`` per row, outside any
   transaction, the outbox id as ``Idempotency-Key``. How many calls are in flight adapts
   between ``detach_concurrency_min`` and ``detach_concurrency`` (``snapshot_detach_gate``:
   follow the service's knee by the mean latency of each window of answers, halve on
   429/502/503/504/timeouts/connection errors/stalled calls, pause for a ``Retry-After``);
   ``breaker_failure_threshold`` consecutive failed calls open the outage circuit breaker,
   a 401/403 or a misrouting stops calling too (``snapshot_detach_gate``).
3. **Outcome** (one short transaction per batch, or per part of a batch that a slow call holds
   back, guarded per row by the claim token): what each answer means is the answer table in
   ``snapshot_detach_answers``; ``snapshot_detach_outcomes`` writes it and counts, logs and
   alerts it.

The modules: ``snapshot_detach_answers`` (pure: the answer table, verdicts),
``snapshot_detach_gate`` (the gate every call passes: limit, pause, deadline, breakers),
``snapshot_detach_workers`` (the calls on worker threads), ``snapshot_detach_outcomes``
(claiming, outcome plans and recording a batch, the result), ``snapshot_detach_client`` (the
HTTP call), ``snapshot_detach_config`` (the keys), this one (the run: its lifecycle and the
batch pipeline), ``snapshot_detach_cli`` (its command line).

Metrics (names are the contract): ``succeeded_total`` / ``retried_total`` /
``quarantined_total`` count rows by outcome; ``failed_total`` counts calls that were made and
did not succeed (any non-2xx or transport error, incl. 401/403); ``lag_seconds`` is one timing
per Done row (``now - created_at``); the ``pending`` / ``oldest_age_seconds`` gauges are
measured at the end of every run that held the lock (and of a dry run);
``last_success_timestamp_seconds`` is set at the end of every run that ended normally (incl.
no-op and lock-skip runs) but not after a cancellation or an auth failure, so the "no
successful run for 15 min" rule also catches broken credentials.

``breaker_open_total`` counts runs whose outage breaker opened; ``concurrency_limit`` is the
adaptive limit at the end of a run.

Run bound (docs/design/detach.md): a run ends within ``max_run_duration_seconds +
detach_call_timeout_seconds + RUN_MARGIN_SECONDS`` (5 s). The run's one
:class:`~include.pin_maintenance.parallel.Deadline` ends ``RUN_MARGIN_SECONDS`` before that:
no batch is claimed and no call started once it no longer allows a whole call, every wait
takes its timeout from it, and claimed rows not called are given back. Alerts go out on their
own thread (:class:`~include.pin_maintenance.lifecycle.BackgroundAlerts`), flushed within the
margin.

Cancellation (stop signal) is honoured between rows: calls not yet started are given back,
the batch's outcome transaction commits, then ``JobCancelled`` is raised. A worker
exception on one row is logged and recorded as a transient error of that row. When the batch
outcome transaction fails, each row is retried in its own transaction so one bad row cannot
lose the others' outcomes.
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import psycopg
from opentelemetry import trace
from opentelemetry.trace import Span

from include.pin_maintenance import privileges
from include.pin_maintenance.backoff import Backoff
from include.pin_maintenance.db import Connect, advisory_lock, require_server_connections
from include.pin_maintenance.jobs.snapshot_detach_answers import Decision, Verdict
from include.pin_maintenance.jobs.snapshot_detach_client import DetachClient
from include.pin_maintenance.jobs.snapshot_detach_config import (
    CONFIG,
    JOB,
    DetachConfig,
    worst_case_run_seconds,
)
from include.pin_maintenance.jobs.snapshot_detach_outcomes import (
    KNOWN_REASONS,
    ClaimedRow,
    DetachResult,
    Metric,
    OutcomeRecorder,
    claim_due_entries,
    count_due_entries,
    measure_pending_backlog,
)
from include.pin_maintenance.jobs.snapshot_detach_workers import CallWorkers
from include.pin_maintenance.lifecycle import (
    BackgroundAlerts,
    JobMetrics,
    JobRun,
    JobSpec,
    job_run,
)
from include.pin_maintenance.parallel import Deadline
from include.pin_maintenance.stopping import JobCancelled, StopReason, StopSignal
from include.pin_maintenance.telemetry import Telemetry, record_error, resumed, set_result

LOCK_NAME = "Pin:lock:job:scheduled:news-snapshot-detach-retry"
# The pipeline's depth: rows claimed and not yet recorded, in batches. When a slow call would
# keep the pipeline full, the answered rows of its batch are recorded, so a stalled call (a
# connection attempt dropped by a full accept queue, retried by TCP a second later) holds
# back only its own row, not the claims behind it.
MAX_UNSETTLED_BATCHES = 3
PIPELINE_POLL_SECONDS = 0.02  # how often the main thread looks whether to claim ahead
ALERT_FLUSH_SECONDS = 2.0  # of RUN_MARGIN_SECONDS: undelivered alerts after that are logged

SPEC = JobSpec(
    job=JOB,
    config=CONFIG,
    metrics=JobMetrics(
        counters=Metric.COUNTERS,
        duration=Metric.RUN_DURATION,
        last_success=Metric.LAST_SUCCESS,
        lock_contention=Metric.LOCK_CONTENTION,
    ),
)


@dataclass
class _Batch:
    rows: list[ClaimedRow]  # claimed and not yet recorded
    calls: dict[str, Future]  # row id -> its detach call (rows with a known reason)
    span: Span = trace.INVALID_SPAN  # from its claim until its last outcome is recorded
    recorded: Counter[Verdict] = field(default_factory=Counter)  # outcomes written so far

    def done(self) -> bool:
        return all(f.done() for f in self.calls.values())

    def answered(self) -> list[ClaimedRow]:
        """Rows whose call is in (or that were never called)."""
        return [r for r in self.rows if r.id not in self.calls or self.calls[r.id].done()]


def utc_now() -> datetime:
    return datetime.now(UTC)


def run(
    connect: Connect,
    config: DetachConfig,
    telemetry: Telemetry,
    stop: StopSignal,
    client: DetachClient | None,
    *,
    dry_run: bool = False,
    now: Callable[[], datetime] = utc_now,
    rng: random.Random | None = None,
    monotonic: Callable[[], float] = time.monotonic,
    lock_name: str = LOCK_NAME,
) -> DetachResult:
    """One run of the job (see the module docstring). ``config`` is ``CONFIG.resolve(...)``.

    ``client`` may be None for a dry run (which calls nothing and writes nothing).
    ``lock_name`` exists for tests that defeat the single-runner lock on purpose (to show the
    row-level ``SKIP LOCKED`` defence on its own); production always uses :data:`LOCK_NAME`.
    """
    if client is None and not dry_run:
        raise ValueError("a detach client is required unless dry_run")
    detach_run = _Run(
        connect=connect,
        config=config,
        telemetry=telemetry,
        stop=stop,
        client=client,
        now=now,
        rng=rng or random.Random(),
        monotonic=monotonic,
        lock_name=lock_name,
    )
    with job_run(SPEC, telemetry) as lifecycle:
        return detach_run(lifecycle, dry_run)


class _Run:
    """One run: its lifecycle, the batch pipeline (claim ahead, call, record) and its end."""

    def __init__(
        self,
        *,
        connect: Connect,
        config: DetachConfig,
        telemetry: Telemetry,
        stop: StopSignal,
        client: DetachClient | None,
        now: Callable[[], datetime],
        rng: random.Random,
        monotonic: Callable[[], float],
        lock_name: str,
    ) -> None:
        self.lock_name = lock_name
        self.connect = connect
        self.config = config
        self.telemetry = telemetry
        self.log = telemetry.log
        self.tracer = telemetry.tracer
        self.metrics = telemetry.metrics
        self.stop = stop
        self.client = client
        self.now = now
        self.rng = rng
        self.monotonic = monotonic
        self.backoff = Backoff(
            config.backoff_base_seconds, config.backoff_factor, config.backoff_cap_seconds
        )
        self.workers: CallWorkers | None = None  # made when the pipeline starts
        self.deadline = Deadline(worst_case_run_seconds(config), clock=monotonic)  # reset per run
        self.alerts = BackgroundAlerts(telemetry.alerts, telemetry)
        self.result = DetachResult()
        self.outcomes = OutcomeRecorder(
            self.result, log=self.log, metrics=self.metrics, alerts=self.alerts, now=now
        )
        self.lifecycle: JobRun | None = None

    def __call__(self, lifecycle: JobRun, dry_run: bool) -> DetachResult:
        self.lifecycle = lifecycle
        started = self.monotonic()
        self.result.dry_run = dry_run
        lifecycle.started(
            dry_run=dry_run,
            batch_size=self.config.batch_size,
            detach_concurrency_min=self.config.detach_concurrency_min,
            detach_concurrency=self.config.detach_concurrency,
            breaker_failure_threshold=self.config.breaker_failure_threshold,
        )
        privileges.require(self.connect, JOB, lifecycle.telemetry)  # before the lock, any write
        if dry_run:
            self.result.due = count_due_entries(self.connect, self.now())
            self.log.info("dry_run", due=self.result.due, calls=0, writes=0)
            return self._finish(started, success=True)
        lease = self.config.lock_ttl_seconds
        with advisory_lock(self.connect, self.lock_name, lease) as held:
            if not held:
                self.result.lock_acquired = False
                # a holder past the lease is stuck: a live run ends before its lease does
                # (lock_ttl_seconds > the worst-case run, checked at validation)
                lifecycle.skipped_lock_busy(self.connect, self.lock_name, lease, alerts=self.alerts)
                return self._finish(started, success=True, lock_busy=True)
            cancelled = self._run_batches()
        if cancelled:
            raise self._finish_cancelled(started)
        healthy = not (self.result.auth_failed or self.result.misrouted)
        return self._finish(started, success=healthy)

    # -- the batch pipeline ----------------------------------------------------------------

    def _run_batches(self) -> bool:
        """The batch pipeline; returns True when it stopped because of the stop signal.

        Calls stay in flight across batch boundaries: the next batch is claimed and its calls
        queued as soon as fewer calls are queued than the limit allows in flight (at most
        :data:`MAX_UNSETTLED_BATCHES` batches claimed and not yet recorded), and a batch's
        outcomes are recorded as soon as all of its calls are in, oldest batch first. Each
        batch still has exactly one claim and one outcome transaction, and every claimed
        batch is recorded before the run ends (also on the deadline, a stop or a breaker).

        Every wait takes its timeout from the run's one :class:`Deadline`
        (``max_run_duration_seconds + detach_call_timeout_seconds`` from now): no batch is
        claimed and no call started once the deadline no longer allows a whole call, so the
        calls still running then end before it, and the last batches settle by then.
        """
        conn = self.connect()
        conn.autocommit = True  # every unit of work is an explicit, short transaction
        require_server_connections([conn], job=JOB, held=1)  # + the lock: pool size 2
        self.deadline = Deadline(
            self.config.max_run_duration_seconds + self.config.detach_call_timeout_seconds,
            clock=self.monotonic,
        )
        workers = self.workers = CallWorkers(
            self.config,
            client=self.client,
            deadline=self.deadline,
            stopped=self.stop.is_set,
            telemetry=self.telemetry,
            alerts=self.alerts,
            result=self.result,
            outcomes=self.outcomes,
        )
        unsettled: deque[_Batch] = deque()
        try:
            batches, stop_reason = self._pipeline(conn, unsettled)
        except BaseException:
            workers.abort()  # no new call starts; claimed rows keep their claim
            raise
        finally:
            workers.close()
            conn.close()
            for batch in unsettled:  # a failure before their outcomes: end their spans
                batch.span.end()
        self.result.batches = batches
        workers.report(stop_reason)
        # a stop that arrived during the last (short) batch still ends the run as cancelled
        return stop_reason is StopReason.CANCELLED or self.stop.is_set()

    def _pipeline(
        self, conn: psycopg.Connection, unsettled: deque[_Batch]
    ) -> tuple[int, StopReason | str | None]:
        batches, stop_reason = 0, None
        while True:
            self._settle_answered(conn, unsettled)
            if stop_reason is None:
                stop_reason = self._why_no_more_batches(batches)
            if stop_reason is None and self._wants_batch(unsettled):
                batch = self._claim_batch(conn, batches, unsettled)
                batches += 1
                if batch.rows:
                    unsettled.append(batch)
                if len(batch.rows) < self.config.batch_size:
                    stop_reason = StopReason.DRAINED
                continue
            if not unsettled:
                return batches, stop_reason
            if self.deadline.expired():  # only a client that ignored its timeout gets here
                self.workers.abandon(unsettled[0].calls)
                continue
            head = [f for f in unsettled[0].calls.values() if not f.done()]
            # batches settle in any order: while others are out, look again for them too
            poll = None if stop_reason and len(unsettled) == 1 else PIPELINE_POLL_SECONDS
            futures.wait(head, timeout=self.deadline.timeout(poll))

    def _why_no_more_batches(self, batches: int) -> StopReason | str | None:
        """Why no further batch is claimed, or None (the first batch is always claimed)."""
        if self.stop.is_set():
            return StopReason.CANCELLED
        if self.workers.calls_stopped:
            return "calls_stopped"  # CallWorkers.report names why
        if batches and self.workers.deadline_reached:
            return StopReason.MAX_DURATION
        return None

    def _wants_batch(self, unsettled: deque[_Batch]) -> bool:
        """Claim ahead while the queued calls would not keep the limit busy."""
        if not unsettled:
            return True
        if self._pipeline_full(unsettled):
            return False
        return self.workers.queued() < 2 * self.workers.slots

    def _pipeline_full(self, unsettled: deque[_Batch]) -> bool:
        """No room for another batch's rows within the pipeline's depth."""
        rows = sum(len(b.rows) for b in unsettled)
        return rows > (MAX_UNSETTLED_BATCHES - 1) * self.config.batch_size

    def _claim_batch(
        self, conn: psycopg.Connection, index: int, unsettled: deque[_Batch]
    ) -> _Batch:
        in_flight = [r.id for b in unsettled for r in b.rows]
        span = self.tracer.start_span(f"{JOB} batch", attributes={"pin.batch.index": index})
        try:
            rows = claim_due_entries(
                conn,
                now=self.now(),
                batch_size=self.config.batch_size,
                in_flight=in_flight,
                backoff=self.backoff,
                rng=self.rng,
            )
        except BaseException as exc:
            record_error(span, type(exc).__name__)
            span.end()
            raise
        span.set_attribute("pin.batch.rows", len(rows))
        self.log.info("batch_claimed", batch_index=index, rows=len(rows))
        self.result.claimed += len(rows)
        parent = trace.set_span_in_context(span)  # worker threads do not inherit the context
        batch = _Batch(rows, self.workers.submit(rows, parent), span)
        if not rows:
            span.end()
        return batch

    def _settle_answered(self, conn: psycopg.Connection, unsettled: deque[_Batch]) -> None:
        """Record every batch whose calls are all in, oldest first, and end its span; while the
        pipeline is still full, record the answered rows of the batches left, oldest first."""
        for batch in [b for b in unsettled if b.done()]:
            unsettled.remove(batch)
            with resumed(batch.span) as span:
                self._settle(conn, batch, batch.rows)
                if span.is_recording():
                    for verdict in Verdict:
                        n = batch.recorded[verdict]
                        span.set_attribute(f"pin.batch.outcome.{verdict.value}", n)
        for batch in list(unsettled):
            if not self._pipeline_full(unsettled):
                break
            if answered := batch.answered():
                with trace.use_span(batch.span, end_on_exit=False):
                    self._settle(conn, batch, answered)

    def _settle(self, conn: psycopg.Connection, batch: _Batch, rows: list[ClaimedRow]) -> None:
        """Record the outcomes of ``rows`` of ``batch``, whose calls are in (one transaction)."""
        if not rows:
            return
        decisions = [(row, self._decide(row, batch)) for row in rows]
        self.outcomes.record(conn, decisions)
        batch.recorded.update(d.verdict for _, d in decisions)
        recorded = {row.id for row in rows}
        batch.rows = [r for r in batch.rows if r.id not in recorded]
        for row_id in recorded:
            batch.calls.pop(row_id, None)

    def _decide(self, row: ClaimedRow, batch: _Batch) -> Decision:
        if row.reason not in KNOWN_REASONS:  # never called
            return Decision(Verdict.QUARANTINE, "UnknownReason")
        return self.workers.decide(row, batch.calls)

    # -- end of run ------------------------------------------------------------------------

    def _end_measurements(self, started: float, *, lock_busy: bool) -> float:
        """Backlog gauges (a run that held the lock), the bounded alert flush, the duration."""
        if not lock_busy:
            self._measure_backlog()
        # alerts went out on their own thread; wait for them only inside the run's bound
        undelivered = self.alerts.flush(self.deadline.timeout() + ALERT_FLUSH_SECONDS)
        if undelivered:
            self.log.warning("alerts_undelivered", alerts=undelivered)
        elapsed = max(self.monotonic() - started, 0.0)
        self.result.duration_ms = int(elapsed * 1000)
        return elapsed

    def _finish(self, started: float, *, success: bool, lock_busy: bool = False) -> DetachResult:
        elapsed = self._end_measurements(started, lock_busy=lock_busy)
        r = self.result
        self.lifecycle.completed(
            r.as_dict(),
            duration_seconds=None if lock_busy else elapsed,
            success=success,
            succeeded=r.succeeded,
            retried=r.retried,
            quarantined=r.quarantined,
            failed=r.failed,
            given_back=r.given_back,
            claimed=r.claimed,
            batches=r.batches,
            calls=r.calls,
            breaker="open" if r.breaker_open else "closed",
            breaker_failures=r.breaker_failures,
            outage_calls=r.outage_calls,
            throttled=r.throttled,
            concurrency_limit=r.concurrency_limit,
            concurrency_peak=r.concurrency_peak,
            call_stalls=r.call_stalls,
            call_retries=r.call_retries,
            stop_reason=r.stop_reason or ("dry_run" if r.dry_run else "lock_busy"),
            pending=r.pending,
            duration_ms=r.duration_ms,
        )
        return r

    def _finish_cancelled(self, started: float) -> JobCancelled:
        """A stopped run: its measurements and result as for any run, then ``job_cancelled``;
        returns the exception to raise (no last-success: a cancelled run did not succeed)."""
        elapsed = self._end_measurements(started, lock_busy=False)
        r = self.result
        self.metrics.timing(Metric.RUN_DURATION, timedelta(seconds=elapsed))
        set_result(self.lifecycle.span, r.as_dict())
        reason = self.stop.reason or "stop requested"
        return self.lifecycle.cancelled(
            reason,
            reason,
            succeeded=r.succeeded,
            given_back=r.given_back,
            claimed=r.claimed,
            batches=r.batches,
            calls=r.calls,
            pending=r.pending,
            duration_ms=r.duration_ms,
        )

    def _measure_backlog(self) -> None:
        try:
            pending, oldest_age = measure_pending_backlog(self.connect, self.now())
        except psycopg.Error as exc:  # gauges are best effort at the end of a run
            self.log.warning("backlog_measure_failed", error=type(exc).__name__)
            return
        self.result.pending = pending
        self.result.oldest_age_seconds = oldest_age
        self.metrics.gauge(Metric.PENDING, pending)
        self.metrics.gauge(Metric.OLDEST_AGE, oldest_age)
