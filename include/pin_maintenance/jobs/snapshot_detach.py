"""SnapshotDetachRetryJob (seed 000): claim due outbox rows, call the selections detach for each
through the gate, record each answer's outcome (docs/design.md, docs/design/detach.md)."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import psycopg
from opentelemetry import trace
from opentelemetry.trace import Span

from include.pin_maintenance import cli, privileges, sql
from include.pin_maintenance.backoff import Backoff
from include.pin_maintenance.db import (
    Connect,
    SessionSettings,
    advisory_lock,
    require_server_connections,
)
from include.pin_maintenance.jobs.snapshot_detach_answers import Answer, Decision, Verdict, decide
from include.pin_maintenance.jobs.snapshot_detach_config import (
    CONFIG,
    JOB,
    DetachConfig,
    worst_case_run_seconds,
)
from include.pin_maintenance.jobs.snapshot_detach_gate import Breaker, CallGate
from include.pin_maintenance.jobs.snapshot_detach_http import (
    CallWorkers,
    DetachClient,
    HttpDetachClient,
    basic_auth_session,
)
from include.pin_maintenance.lifecycle import CappedAlerts, JobMetrics, JobRun, JobSpec, job_run
from include.pin_maintenance.parallel import Deadline
from include.pin_maintenance.stopping import JobCancelled, StopReason, StopSignal
from include.pin_maintenance.telemetry import (
    Alert,
    AlertSink,
    JobLog,
    Telemetry,
    record_error,
    resumed,
    set_result,
)

LOCK_NAME = "Pin:lock:job:scheduled:news-snapshot-detach-retry"
KNOWN_REASONS = frozenset({"BlockReplaced", "PostDeleted"})
MAX_UNSETTLED_BATCHES = 3  # the pipeline's depth: rows claimed and not yet recorded, in batches
PIPELINE_POLL_SECONDS = 0.02  # how often the main thread looks whether to claim ahead
ALERT_FLUSH_SECONDS = 2.0  # of RUN_MARGIN_SECONDS: undelivered alerts after that are logged
_utc_now = partial(datetime.now, UTC)
GIVEN_BACK = frozenset({Verdict.NOT_CALLED, Verdict.AUTH_FAILED, Verdict.MISROUTED, Verdict.OUTAGE})

QUARANTINED_ALERT = "snapshot_detach_quarantined"
AUTH_ALERT = "selections_auth_failed"
MISROUTE_ALERT = "selections_misrouted"
OUTAGE_ALERT = "selections_unavailable"


class Metric:
    """The detach job's metric names (docs/design.md, "Metrics")."""

    PENDING = "news_snapshot_detach_pending"
    OLDEST_AGE = "news_snapshot_detach_oldest_age_seconds"
    RETRIED = "news_snapshot_detach_retried_total"
    SUCCEEDED = "news_snapshot_detach_succeeded_total"
    FAILED = "news_snapshot_detach_failed_total"
    QUARANTINED = "news_snapshot_detach_quarantined_total"
    LAG = "news_snapshot_detach_lag_seconds"
    RUN_DURATION = "news_snapshot_detach_run_duration_seconds"
    LOCK_CONTENTION = "news_snapshot_detach_lock_contention_total"
    LAST_SUCCESS = "news_snapshot_detach_last_success_timestamp_seconds"
    BREAKER_OPEN = "news_snapshot_detach_breaker_open_total"
    CONCURRENCY = "news_snapshot_detach_concurrency_limit"
    COUNTERS = (RETRIED, SUCCEEDED, FAILED, QUARANTINED, LOCK_CONTENTION, BREAKER_OPEN)


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
class DetachResult:
    """What one run did; :meth:`as_dict` gives the seed's names (also the task's XCom)."""

    lock_acquired: bool = True
    dry_run: bool = False
    due: int | None = None  # dry run only
    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    quarantined: int = 0
    failed: int = 0
    given_back: int = 0
    superseded: int = 0
    batches: int = 0
    stop_reason: str = ""
    auth_failed: bool = False
    breaker_open: bool = False  # the outage breaker opened in this run
    breaker_failures: int = 0  # consecutive failed calls that opened it
    outage_calls: int = 0  # called, failed in the outage, attempt given back
    misrouted: bool = False  # the misroute breaker opened (404s and no 2xx)
    misroute_calls: int = 0  # 404s given back as the misroute's evidence
    calls: int = 0  # detach calls made
    throttled: int = 0  # answers that throttle (429 / 503)
    retry_after_paused_seconds: float = 0.0
    concurrency_limit: int = 0  # adaptive limit at the end of the run
    concurrency_peak: int = 0  # most calls in flight at once
    call_stalls: int = 0  # calls seen in flight past the limit's stall time
    call_retries: int = 0  # calls lost in transport while others were answered, made once more
    pending: int = 0
    oldest_age_seconds: float = 0.0
    duration_ms: int = 0

    @property
    def has_more(self) -> bool:
        return self.stop_reason not in ("", StopReason.DRAINED)

    def as_dict(self) -> dict[str, Any]:
        """``given_back`` -> ``GivenBack``, seconds to the ms, ``HasMore`` after ``Batches``."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            name = "".join(part.capitalize() for part in f.name.split("_"))
            out[name] = round(value, 3) if isinstance(value, float) else value
            if name == "Batches":
                out["HasMore"] = self.has_more
        return out


@dataclass(frozen=True)
class ClaimedRow:
    id: str
    snapshot_id: str
    post_id: str
    reason: str
    attempts: int  # after the pre-increment
    previous_next_attempt_at: datetime
    next_attempt_at: datetime  # as set by the claim
    claimed_at: datetime  # updated_at written by the claim (the claim token)
    created_at: datetime


@dataclass(frozen=True)
class OutcomePlan:
    """The values one row's outcome statement writes (applied only to its own claim)."""

    row: ClaimedRow
    decision: Decision
    status: str
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    keep_last_error: bool = False


def plan_outcome(row: ClaimedRow, decision: Decision, now: datetime) -> OutcomePlan:
    """What ``decision`` writes to ``row``: given back, attempts and due time as before the
    claim; an outage gives back the attempt but keeps the claim's backoff."""
    verdict = decision.verdict
    status, attempts, next_at, error = "Pending", row.attempts, row.next_attempt_at, decision.error
    if verdict in (Verdict.NOT_CALLED, Verdict.AUTH_FAILED, Verdict.MISROUTED):
        attempts, next_at = row.attempts - 1, row.previous_next_attempt_at
    elif verdict is Verdict.DONE:
        status, error = "Done", None
    elif verdict is Verdict.QUARANTINE:
        status = "Quarantined"
    else:
        if verdict is Verdict.OUTAGE:
            attempts = row.attempts - 1
        if decision.retry_after_seconds is not None:
            next_at = max(next_at, now + timedelta(seconds=decision.retry_after_seconds))
    keep = verdict is Verdict.NOT_CALLED
    return OutcomePlan(row, decision, status, attempts, next_at, error, keep_last_error=keep)


def pg_array(values: Iterable[Any]) -> str:
    """A Postgres array literal of None, bool, int, datetime or str (cast in the SQL)."""
    parts = []
    for v in values:
        if v is None:
            parts.append("NULL")
        elif isinstance(v, bool):
            parts.append("t" if v else "f")
        elif isinstance(v, int):
            parts.append(str(v))
        elif isinstance(v, datetime):
            parts.append(f'"{v.isoformat()}"')
        else:
            text = str(v).replace("\\", "\\\\").replace('"', '\\"')
            parts.append(f'"{text}"')
    return "{" + ",".join(parts) + "}"


def claim_due_entries(
    conn: psycopg.Connection,
    *,
    now: datetime,
    batch_size: int,
    in_flight: Sequence[str],
    backoff: Backoff,
    rng: random.Random,
) -> list[ClaimedRow]:
    """Claim up to ``batch_size`` due rows not in ``in_flight`` (one transaction)."""
    with conn.transaction():
        found = conn.execute(
            sql.load("news/select_due_entries"),
            {"now": now, "batch_size": batch_size, "in_flight": pg_array(in_flight)},
        ).fetchall()
        rows = []
        for rid, snapshot_id, post_id, reason, attempts, next_at, created_at in found:
            due = now + timedelta(seconds=backoff.delay_with_jitter(attempts + 1, rng.uniform))
            rows.append(
                ClaimedRow(
                    id=str(rid),
                    snapshot_id=str(snapshot_id),
                    post_id=str(post_id),
                    reason=reason,
                    attempts=attempts + 1,
                    previous_next_attempt_at=next_at,
                    next_attempt_at=due,
                    claimed_at=now,
                    created_at=created_at,
                )
            )
        if rows:
            conn.execute(
                sql.load("news/claim_due_entries"),
                {
                    "now": now,
                    "ids": pg_array(r.id for r in rows),
                    "attempts": pg_array(r.attempts for r in rows),
                    "next_attempt_at": pg_array(r.next_attempt_at for r in rows),
                },
            )
    return rows


def record_detach_outcomes(
    conn: psycopg.Connection, plans: Sequence[OutcomePlan], now: datetime
) -> set[str]:
    """Write ``plans`` in one transaction; returns the ids whose claim still held."""
    with conn.transaction():
        cur = conn.execute(
            sql.load("news/record_detach_outcomes"),
            {
                "now": now,
                "ids": pg_array(p.row.id for p in plans),
                "claimed_attempts": pg_array(p.row.attempts for p in plans),
                "claimed_at": pg_array(p.row.claimed_at for p in plans),
                "statuses": pg_array(p.status for p in plans),
                "attempts": pg_array(p.attempts for p in plans),
                "next_attempt_at": pg_array(p.next_attempt_at for p in plans),
                "last_errors": pg_array(p.last_error for p in plans),
                "keep_last_error": pg_array(p.keep_last_error for p in plans),
            },
        )
        return {str(r[0]) for r in cur.fetchall()}


def _read_one(connect: Connect, query: str, now: datetime) -> Any:
    conn = connect()
    try:
        row = conn.execute(sql.load(query), {"now": now}).fetchone()
        conn.rollback()
        return row
    finally:
        conn.close()


class PoolAlerts:
    """Alerts sent on the run's call pool, so a slow webhook never stretches the run."""

    def __init__(self, sink: AlertSink, pool: ThreadPoolExecutor, log: JobLog) -> None:
        self._sink, self._pool, self._log = sink, pool, log
        self._sent: list[Future] = []

    def send(self, alert: Alert) -> None:
        self._sent.append(self._pool.submit(self._deliver, alert))

    def _deliver(self, alert: Alert) -> None:
        try:
            self._sink.send(alert)
        except Exception as exc:  # a failing sink is logged, the other alerts still go out
            self._log.error("alert_failed", alert=alert.name, error=type(exc).__name__)

    def flush(self, seconds: float) -> int:
        """Wait at most ``seconds``; how many alerts were not delivered by then."""
        return len(futures.wait(self._sent, timeout=max(0.0, seconds)).not_done)


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


def run(
    connect: Connect,
    config: DetachConfig,
    telemetry: Telemetry,
    stop: StopSignal,
    client: DetachClient | None,
    *,
    dry_run: bool = False,
    now: Callable[[], datetime] = _utc_now,
    rng: random.Random | None = None,
    monotonic: Callable[[], float] = time.monotonic,
    lock_name: str = LOCK_NAME,
) -> DetachResult:
    """One run; ``config`` is ``CONFIG.resolve(...)``, ``client`` may be None for a dry run.
    ``lock_name`` is for tests that defeat the single-runner lock on purpose."""
    if client is None and not dry_run:
        raise ValueError("a detach client is required unless dry_run")
    rng = rng or random.Random()
    detach_run = _Run(connect, config, telemetry, stop, client, now, rng, monotonic, lock_name)
    try:
        with job_run(SPEC, telemetry) as lifecycle:
            return detach_run(lifecycle, dry_run)
    finally:
        # alerts not sent by now are dropped; a call or an alert still running ends on its own
        detach_run.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Outcomes:
    """What a run records of its calls: the rows' outcomes, the result's counters, and each
    outcome's metrics, log line and alert."""

    result: DetachResult
    telemetry: Telemetry
    alerts: PoolAlerts
    now: Callable[[], datetime]

    def __post_init__(self) -> None:
        self.log, self.metrics = self.telemetry.log, self.telemetry.metrics
        self.quarantine_alerts = CappedAlerts(self.alerts)

    def record(
        self, conn: psycopg.Connection, decisions: Sequence[tuple[ClaimedRow, Decision]]
    ) -> None:
        """Write the outcomes, then account for those whose claim still held."""
        now = self.now()
        plans = sorted(
            (plan_outcome(row, decision, now) for row, decision in decisions),
            key=lambda p: p.row.id,
        )
        applied = self._write_all_or_each(conn, plans, now)
        detached: list[OutcomePlan] = []
        for plan in plans:
            if plan.row.id not in applied:
                self.result.superseded += 1
                self.log.warning(
                    "entry_outcome_superseded",
                    snapshot_id=plan.row.snapshot_id,
                    attempts=plan.row.attempts,
                    outcome=plan.decision.verdict,
                )
                continue
            self._account_for(plan, now)
            if plan.decision.verdict is Verdict.DONE:
                detached.append(plan)
        if detached:  # one line per batch: under Airflow every line crosses the supervisor
            self.metrics.incr(Metric.SUCCEEDED, len(detached))
            self.log.info(
                "entries_detached",
                count=len(detached),
                snapshot_ids=",".join(p.row.snapshot_id for p in detached),
                attempts=",".join(str(p.row.attempts) for p in detached),
            )

    def _write_all_or_each(
        self, conn: psycopg.Connection, plans: Sequence[OutcomePlan], now: datetime
    ) -> set[str]:
        """The ids written: in one transaction, or row by row when that failed."""
        try:
            return record_detach_outcomes(conn, plans, now)
        except psycopg.OperationalError:
            raise  # the database is gone: the task fails, Airflow retries it
        except psycopg.Error as exc:
            self.log.error("batch_outcome_failed", rows=len(plans), error=type(exc).__name__)
        applied: set[str] = set()
        for plan in plans:
            try:
                applied |= record_detach_outcomes(conn, [plan], now)
            except psycopg.OperationalError:
                raise
            except psycopg.Error as row_exc:
                self.log.error(
                    "entry_outcome_failed",
                    snapshot_id=plan.row.snapshot_id,
                    error=type(row_exc).__name__,
                )
        return applied

    def _account_for(self, plan: OutcomePlan, now: datetime) -> None:
        """One written outcome: the result's counters, its metrics, log line and alert."""
        row, decision, r = plan.row, plan.decision, self.result
        verdict, error = decision.verdict, decision.error
        if decision.is_failed_call:
            r.failed += 1
            self.metrics.incr(Metric.FAILED)
        r.given_back += verdict in GIVEN_BACK
        if verdict is Verdict.DONE:
            r.succeeded += 1  # counted and logged per batch by record()
            self.metrics.timing(Metric.LAG, max(now - row.created_at, timedelta(0)))
            self.log.debug("entry_detached", snapshot_id=row.snapshot_id, attempts=row.attempts)
        elif verdict is Verdict.RETRY:
            r.retried += 1
            self.metrics.incr(Metric.RETRIED)
            self.log.info(
                "entry_retry",
                snapshot_id=row.snapshot_id,
                attempts=row.attempts,
                error_code=error,
                next_attempt_at=plan.next_attempt_at.isoformat(),
            )
        elif verdict is Verdict.OUTAGE:
            r.outage_calls += 1
            self.log.info(
                "entry_outage",
                snapshot_id=row.snapshot_id,
                attempts=row.attempts - 1,
                error_code=error,
                next_attempt_at=plan.next_attempt_at.isoformat(),
            )
        elif verdict is Verdict.MISROUTED:
            r.misroute_calls += 1
            self.log.info("entry_misrouted", snapshot_id=row.snapshot_id, attempts=row.attempts - 1)
        elif verdict is Verdict.NOT_CALLED:
            self.log.info(
                "entry_not_called", snapshot_id=row.snapshot_id, attempts=row.attempts - 1
            )
        elif verdict is Verdict.QUARANTINE:
            r.quarantined += 1
            self.metrics.incr(Metric.QUARANTINED)
            self.log.warning(
                "entry_quarantined",
                snapshot_id=row.snapshot_id,
                reason=row.reason,
                attempts=row.attempts,
                error_code=error,
            )
            details = {
                "snapshot_id": row.snapshot_id,
                "post_id": row.post_id,
                "reason": row.reason,
                "attempts": row.attempts,
            }
            text = (
                f"snapshot {row.snapshot_id} quarantined after {row.attempts} attempt(s): {error}"
            )
            self.quarantine_alerts.send(Alert(QUARANTINED_ALERT, "warning", text, details))
        elif not r.auth_failed:  # the first refused call of the run logs and alerts
            r.auth_failed = True
            self.log.error("selections_auth_failed", error_code=error)
            text = (
                f"selections rejected our credentials ({error}); detach calls stopped for this "
                "run, no attempts consumed. Check the selections_api connection."
            )
            self.alerts.send(Alert(AUTH_ALERT, "critical", text, {"error": error}))


@dataclass
class _Run:
    """One run: its lifecycle, the batch pipeline (claim ahead, call, record) and its end."""

    connect: Connect
    config: DetachConfig
    telemetry: Telemetry
    stop: StopSignal
    client: DetachClient | None
    now: Callable[[], datetime]
    rng: random.Random
    monotonic: Callable[[], float]
    lock_name: str

    def __post_init__(self) -> None:
        config, telemetry = self.config, self.telemetry
        self.log, self.metrics = telemetry.log, telemetry.metrics
        self.backoff = Backoff(
            config.backoff_base_seconds, config.backoff_factor, config.backoff_cap_seconds
        )
        self.pool = ThreadPoolExecutor(config.detach_concurrency, thread_name_prefix="detach")
        self.alerts = PoolAlerts(telemetry.alerts, self.pool, telemetry.log)
        self.deadline = Deadline(worst_case_run_seconds(config), clock=self.monotonic)
        self.gate: CallGate | None = None  # made when the pipeline starts
        self.calls: CallWorkers | None = None
        self.aborted = False  # the main thread failed: no new call starts
        self.result = DetachResult()
        self.outcomes = _Outcomes(self.result, telemetry, self.alerts, self.now)
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
            due = _read_one(self.connect, "news/count_due_entries", self.now())
            self.result.due = int(due[0]) if due else 0
            self.log.info("dry_run", due=self.result.due, calls=0, writes=0)
            return self._finish(started, success=True)
        lease = self.config.lock_ttl_seconds
        with advisory_lock(self.connect, self.lock_name, lease) as held:
            if not held:
                self.result.lock_acquired = False
                lifecycle.skipped_lock_busy(self.connect, self.lock_name, lease, alerts=self.alerts)
                return self._finish(started, success=True, lock_busy=True)
            cancelled = self._run_batches()
        if cancelled:
            raise self._finish_cancelled(started)
        healthy = not (self.result.auth_failed or self.result.misrouted)
        return self._finish(started, success=healthy)

    # -- the batch pipeline ----------------------------------------------------------------

    def _run_batches(self) -> bool:
        """The batch pipeline (docs/design/detach.md, "Batch pipelining"); True when the stop
        signal ended it."""
        conn = self.connect()
        conn.autocommit = True  # every unit of work is an explicit, short transaction
        require_server_connections([conn], job=JOB, held=1)  # + the lock: pool size 2
        self.deadline = Deadline(
            self.config.max_run_duration_seconds + self.config.detach_call_timeout_seconds,
            clock=self.monotonic,
        )
        gate = self.gate = CallGate(
            self.config,
            deadline=self.deadline,
            stopped=lambda: self.stop.is_set() or self.aborted,
            on_open=self._log_outage_breaker_open,
        )
        self.calls = CallWorkers(self.pool, gate, self.client, self.config, self.telemetry)
        unsettled: deque[_Batch] = deque()
        try:
            batches, stop_reason = self._pipeline(conn, unsettled)
        except BaseException:
            self.aborted = True  # no new call starts; claimed rows keep their claim
            raise
        finally:
            gate.close()  # wakes every waiting call
            conn.close()
            for batch in unsettled:  # a failure before their outcomes
                for call in batch.calls.values():
                    call.cancel()
                batch.span.end()
        self.result.batches = batches
        self._report(stop_reason)
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
                self.calls.abandon(unsettled[0].calls)
                continue
            head = [f for f in unsettled[0].calls.values() if not f.done()]
            # batches settle in any order: while others are out, look again for them too
            poll = None if stop_reason and len(unsettled) == 1 else PIPELINE_POLL_SECONDS
            futures.wait(head, timeout=self.deadline.timeout(poll))

    def _why_no_more_batches(self, batches: int) -> StopReason | str | None:
        """Why no further batch is claimed, or None (the first batch is always claimed)."""
        if self.stop.is_set():
            return StopReason.CANCELLED
        if self.gate.stop_reason:
            return self.gate.stop_reason
        if batches and self.gate.deadline_reached:
            return StopReason.MAX_DURATION
        return None

    def _wants_batch(self, unsettled: deque[_Batch]) -> bool:
        """Claim ahead while the queued calls would not keep the limit busy."""
        full = self._pipeline_full(unsettled)
        return not unsettled or (not full and self.calls.queued() < 2 * self.gate.limit.slots)

    def _pipeline_full(self, unsettled: deque[_Batch]) -> bool:
        rows = sum(len(b.rows) for b in unsettled)
        return rows > (MAX_UNSETTLED_BATCHES - 1) * self.config.batch_size

    def _claim_batch(
        self, conn: psycopg.Connection, index: int, unsettled: deque[_Batch]
    ) -> _Batch:
        in_flight = [r.id for b in unsettled for r in b.rows]
        span = self.telemetry.tracer.start_span(
            f"{JOB} batch", attributes={"pin.batch.index": index}
        )
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
        known = [r for r in rows if r.reason in KNOWN_REASONS]
        batch = _Batch(rows, self.calls.submit(known, parent), span)
        if not rows:
            span.end()
        return batch

    def _settle_answered(self, conn: psycopg.Connection, unsettled: deque[_Batch]) -> None:
        """Record every batch whose calls are all in and end its span; while the pipeline is
        still full, record the answered rows of the batches left, oldest first."""
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
        """A row's verdict, with what the gate learnt about the run (outage, misroute)."""
        if row.reason not in KNOWN_REASONS:  # never called
            return Decision(Verdict.QUARANTINE, "UnknownReason")
        answer = batch.calls[row.id].result()
        return decide(
            answer,
            row.attempts,
            self.config.max_attempts,
            outage=answer is not None and self.gate.outage_row(row.id),
            misrouted=answer is not None and self.gate.misroute_row(row.id),
        )

    def _log_outage_breaker_open(self, breaker: Breaker, answer: Answer) -> None:
        """On the worker thread whose call opened the outage breaker (once)."""
        self.log.warning(
            "breaker_open", consecutive_failures=breaker.failures_at_open, error_code=answer.error
        )

    # -- after the last batch --------------------------------------------------------------

    def _report(self, pipeline_reason: StopReason | str | None) -> None:
        """What the gate saw into the result, the run's stop reason and its summary alerts."""
        gate, r = self.gate, self.result
        for name, value in asdict(gate.stats).items():
            setattr(r, name, value)
        r.concurrency_limit = gate.limit.slots
        r.misrouted = gate.misroute.is_open
        r.breaker_open = gate.outage_breaker.is_open
        r.breaker_failures = gate.outage_breaker.failures_at_open
        self.metrics.gauge(Metric.CONCURRENCY, r.concurrency_limit)
        # why calls stopped, if they did, else why claiming did
        r.stop_reason = gate.stop_reason or str(pipeline_reason or StopReason.DRAINED)
        if gate.retry_after_stopped and not r.breaker_open:
            self.log.warning("calls_paused_past_run_bound", throttled=r.throttled)
        quarantined = r.quarantined
        self.outcomes.quarantine_alerts.summarize(
            lambda sent, suppressed: Alert(
                QUARANTINED_ALERT,
                "warning",
                f"{quarantined} row(s) quarantined in this run; the first {sent} alerted one "
                f"by one, {suppressed} more only counted here",
                {"quarantined": quarantined, "alerted": sent, "suppressed": suppressed},
            )
        )
        if gate.misroute.is_open:
            limit = self.config.misroute_quarantine_limit
            quarantined_404 = gate.misroute.quarantined_404s
            self.log.error(
                MISROUTE_ALERT,
                quarantined_404=quarantined_404,
                misroute_calls=r.misroute_calls,
                given_back=r.given_back,
            )
            text = (
                f"selections answered 404 to {quarantined_404 + 1}+ detach calls and 2xx to none: "
                "the selections route looks wrong (base URL, path, ingress). At most "
                f"{limit} row(s) were quarantined; calls stopped for this run and every other "
                "row cost no attempt. Check the selections_api connection."
            )
            details = {
                "quarantined_404": quarantined_404,
                "misroute_calls": r.misroute_calls,
                "given_back": r.given_back,
                "limit": limit,
            }
            self.alerts.send(Alert(MISROUTE_ALERT, "critical", text, details))
        if r.breaker_open:
            self.metrics.incr(Metric.BREAKER_OPEN)
            text = (
                f"selections failed {r.breaker_failures} detach calls in a row; calls stopped "
                f"for this run after {r.calls} call(s), {r.outage_calls} of them and every row "
                "not called cost no attempt. The next run probes again."
            )
            details = {
                "consecutive_failures": r.breaker_failures,
                "calls": r.calls,
                "outage_calls": r.outage_calls,
                "given_back": r.given_back,
            }
            self.alerts.send(Alert(OUTAGE_ALERT, "warning", text, details))

    # -- end of run ------------------------------------------------------------------------

    def _end_measurements(self, started: float, *, lock_busy: bool) -> float:
        """Backlog gauges (a run that held the lock), the bounded alert wait, the duration."""
        if not lock_busy:
            self._measure_backlog()
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
        """A stopped run's measurements and result, then ``job_cancelled`` (no last-success)."""
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
            row = _read_one(self.connect, "news/measure_pending_backlog", self.now())
        except psycopg.Error as exc:  # gauges are best effort at the end of a run
            self.log.warning("backlog_measure_failed", error=type(exc).__name__)
            return
        pending, oldest_age = int(row[0]), max(float(row[1]), 0.0)
        self.result.pending, self.result.oldest_age_seconds = pending, oldest_age
        self.metrics.gauge(Metric.PENDING, pending)
        self.metrics.gauge(Metric.OLDEST_AGE, oldest_age)


# the job without Airflow: python -m include.pin_maintenance.jobs.snapshot_detach

CLI_DESCRIPTION = """\
Run SnapshotDetachRetryJob once against the news database (no Airflow needed).
The selections password is read from the variable --password-env names, never from the
command line (which any local user can see in ps). SIGTERM stops the run between rows (exit 3).
"""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--selections-url", required=True, help="base URL of selections")
    parser.add_argument("--login", default=None, help="basic auth login (none: no auth)")
    parser.add_argument(
        "--password-env",
        default="SELECTIONS_PASSWORD",
        help="environment variable holding the basic auth password",
    )


def _run(cli_run: cli.CliRun) -> Mapping[str, Any]:
    args = cli_run.args
    password = os.environ.get(args.password_env)
    client = HttpDetachClient(args.selections_url, lambda: basic_auth_session(args.login, password))
    with client:
        result = run(
            cli_run.connect,
            cli_run.config,
            cli_run.telemetry,
            cli_run.stop,
            client,
            dry_run=cli_run.dry_run,
        )
    return result.as_dict()


CLI = cli.JobCli(
    spec=SPEC,
    module="include.pin_maintenance.jobs.snapshot_detach",
    database="news database",
    description=CLI_DESCRIPTION,
    session=SessionSettings(application_name="detach-cli"),
    run=_run,
    add_arguments=_add_arguments,
    cancelled_output={"cancelled": True},  # what the crash test and scripts read on exit 3
)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(CLI, argv)


if __name__ == "__main__":
    sys.exit(main())
