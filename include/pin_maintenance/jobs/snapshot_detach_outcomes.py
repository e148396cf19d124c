"""A detach batch's outcomes: the claimed rows, what each verdict writes, the statements that
claim and write them, and the accounting of every outcome in the run's :class:`DetachResult`.

:func:`plan_outcome` turns a claimed row and its
:class:`~include.pin_maintenance.jobs.snapshot_detach_answers.Decision` into the values its
outcome statement writes (:class:`OutcomePlan`, pure). The statements are thin functions over
``include/sql/news/*.sql``, each one short unit of work on an autocommit connection the caller
owns (or opens). :meth:`OutcomeRecorder.record` writes a batch's plans in one transaction (row
by row when that transaction fails, so one bad row cannot lose the others' outcomes) and
accounts for each outcome that applied: the run's result, its metrics, its log line and, for a
quarantine or refused credentials, its alert.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

import psycopg

from include.pin_maintenance import sql
from include.pin_maintenance.backoff import Backoff
from include.pin_maintenance.db import Connect
from include.pin_maintenance.jobs.snapshot_detach_answers import Decision, Verdict
from include.pin_maintenance.lifecycle import CappedAlerts
from include.pin_maintenance.stopping import StopReason
from include.pin_maintenance.telemetry import Alert, AlertSink, JobLog, MetricsSink

KNOWN_REASONS = frozenset({"BlockReplaced", "PostDeleted"})


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
    throttled: int = 0  # 429 / 503 answers
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
        """Each field under its seed name (``given_back`` -> ``GivenBack``), seconds rounded to
        the millisecond, and ``HasMore`` after ``Batches``."""
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
    """What ``decision`` writes to ``row`` (pure).

    Given back (not called, 401/403, misrouted): attempts and due time as before the claim.
    Outage: the attempt is given back but the claim's backoff (or a later Retry-After) stays,
    so the row does not hammer a service that is down.
    """
    verdict = decision.verdict
    given_back = row.attempts - 1
    if verdict is Verdict.OUTAGE:
        next_at = _not_before_retry_after(row.next_attempt_at, decision, now)
        return OutcomePlan(row, decision, "Pending", given_back, next_at, decision.error)
    if verdict in (Verdict.NOT_CALLED, Verdict.AUTH_FAILED, Verdict.MISROUTED):
        return OutcomePlan(
            row,
            decision,
            "Pending",
            given_back,
            row.previous_next_attempt_at,
            decision.error,
            keep_last_error=verdict is Verdict.NOT_CALLED,
        )
    if verdict is Verdict.DONE:
        return OutcomePlan(row, decision, "Done", row.attempts, row.next_attempt_at, None)
    if verdict is Verdict.QUARANTINE:
        return OutcomePlan(
            row, decision, "Quarantined", row.attempts, row.next_attempt_at, decision.error
        )
    next_at = _not_before_retry_after(row.next_attempt_at, decision, now)
    return OutcomePlan(row, decision, "Pending", row.attempts, next_at, decision.error)


def _not_before_retry_after(next_at: datetime, decision: Decision, now: datetime) -> datetime:
    if decision.retry_after_seconds is None:
        return next_at
    return max(next_at, now + timedelta(seconds=decision.retry_after_seconds))


def pg_array(values: Iterable[Any]) -> str:
    """A Postgres array literal (``{...}``) for a list of parameters, cast in the SQL.

    One string per array instead of psycopg's per-element list dumping: the claim and outcome
    statements of a batch carry 3 and 8 arrays of ``batch_size`` elements, and dumping them
    element by element cost the main thread (which also claims ahead) more GIL time than the
    HTTP calls themselves. Elements: None, bool, int, datetime, str (quoted).
    """
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
    """Claim up to ``batch_size`` due rows not in ``in_flight`` (one transaction): attempts
    pre-incremented, the next backoff set, ``updated_at = now`` as the claim token."""
    with conn.transaction():
        found = conn.execute(
            sql.load("news/select_due_entries"),
            {"now": now, "batch_size": batch_size, "in_flight": pg_array(in_flight)},
        ).fetchall()
        rows = []
        for rid, snapshot_id, post_id, reason, attempts, next_at, created_at in found:
            n = attempts + 1
            delay = backoff.delay_with_jitter(n, rng.uniform)
            rows.append(
                ClaimedRow(
                    id=str(rid),
                    snapshot_id=str(snapshot_id),
                    post_id=str(post_id),
                    reason=reason,
                    attempts=n,
                    previous_next_attempt_at=next_at,
                    next_attempt_at=now + timedelta(seconds=delay),
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
    """Write ``plans`` in one transaction; returns the ids whose claim still held (a row
    claimed again or requeued since is left alone)."""
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


def measure_pending_backlog(connect: Connect, now: datetime) -> tuple[int, float]:
    """(Pending rows, age in seconds of the oldest Pending row), on a connection of its own."""
    row = _read_one(connect, "news/measure_pending_backlog", now)
    return int(row[0]), max(float(row[1]), 0.0)


def count_due_entries(connect: Connect, now: datetime) -> int:
    """Rows a run would claim now (the dry run's answer)."""
    row = _read_one(connect, "news/count_due_entries", now)
    return int(row[0]) if row else 0


def _read_one(connect: Connect, query: str, now: datetime) -> Any:
    conn = connect()
    try:
        row = conn.execute(sql.load(query), {"now": now}).fetchone()
        conn.rollback()
        return row
    finally:
        conn.close()


QUARANTINED_ALERT = "snapshot_detach_quarantined"
AUTH_ALERT = "selections_auth_failed"


class Metric:
    """The detach job's metric names (the contract: docs/design.md, "Metrics")."""

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
    # sent at 0 when a run starts (lifecycle.JobRun.started)
    COUNTERS = (RETRIED, SUCCEEDED, FAILED, QUARANTINED, LOCK_CONTENTION, BREAKER_OPEN)


class OutcomeRecorder:
    """Writes each batch's outcomes and accounts for them in the run's ``result``.

    Runs on the run's main thread only. ``alerts`` delivers off that thread; per-row
    quarantine alerts go through ``quarantine_alerts`` (capped per run, see
    :meth:`summarize_quarantines`).
    """

    def __init__(
        self,
        result: DetachResult,
        *,
        log: JobLog,
        metrics: MetricsSink,
        alerts: AlertSink,
        now: Callable[[], datetime],
    ) -> None:
        self.result = result
        self.log = log
        self.metrics = metrics
        self.alerts = alerts
        self.quarantine_alerts = CappedAlerts(alerts)
        self.now = now

    def record(self, conn: psycopg.Connection, decisions: Sequence[tuple[ClaimedRow, Decision]]):
        """Write the batch's outcomes, then account for those whose claim still held."""
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
        if detached:
            # one line per batch, not per row: under Airflow every line crosses the task
            # supervisor, and 100 lines per batch cost a third of the throughput
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
        """The ids written: the batch in one transaction, or row by row when it failed."""
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
        row, decision = plan.row, plan.decision
        if decision.is_failed_call:
            self.result.failed += 1
            self.metrics.incr(Metric.FAILED)
        verdict = decision.verdict
        if verdict is Verdict.DONE:
            self.result.succeeded += 1  # counted and logged per batch by record()
            self.metrics.timing(Metric.LAG, max(now - row.created_at, timedelta(0)))
            self.log.debug("entry_detached", snapshot_id=row.snapshot_id, attempts=row.attempts)
        elif verdict is Verdict.RETRY:
            self.result.retried += 1
            self.metrics.incr(Metric.RETRIED)
            self.log.info(
                "entry_retry",
                snapshot_id=row.snapshot_id,
                attempts=row.attempts,
                error_code=decision.error,
                next_attempt_at=plan.next_attempt_at.isoformat(),
            )
        elif verdict is Verdict.QUARANTINE:
            self._quarantined(row, decision)
        elif verdict is Verdict.AUTH_FAILED:
            self.result.given_back += 1
            self._auth_failed(decision)
        elif verdict is Verdict.MISROUTED:
            self.result.misroute_calls += 1
            self.result.given_back += 1
            self.log.info("entry_misrouted", snapshot_id=row.snapshot_id, attempts=row.attempts - 1)
        elif verdict is Verdict.OUTAGE:
            self.result.outage_calls += 1
            self.result.given_back += 1
            self.log.info(
                "entry_outage",
                snapshot_id=row.snapshot_id,
                attempts=row.attempts - 1,
                error_code=decision.error,
                next_attempt_at=plan.next_attempt_at.isoformat(),
            )
        else:
            self.result.given_back += 1
            self.log.info(
                "entry_not_called", snapshot_id=row.snapshot_id, attempts=row.attempts - 1
            )

    def _quarantined(self, row: ClaimedRow, decision: Decision) -> None:
        self.result.quarantined += 1
        self.metrics.incr(Metric.QUARANTINED)
        self.log.warning(
            "entry_quarantined",
            snapshot_id=row.snapshot_id,
            reason=row.reason,
            attempts=row.attempts,
            error_code=decision.error,
        )
        self.quarantine_alerts.send(
            Alert(
                QUARANTINED_ALERT,
                "warning",
                f"snapshot {row.snapshot_id} quarantined after {row.attempts} attempt(s): "
                f"{decision.error}",
                {
                    "snapshot_id": row.snapshot_id,
                    "post_id": row.post_id,
                    "reason": row.reason,
                    "attempts": row.attempts,
                },
            )
        )

    def _auth_failed(self, decision: Decision) -> None:
        """The first refused call of the run logs and alerts; the rest are only counted."""
        if self.result.auth_failed:
            return
        self.result.auth_failed = True
        self.log.error("selections_auth_failed", error_code=decision.error)
        self.alerts.send(
            Alert(
                AUTH_ALERT,
                "critical",
                f"selections rejected our credentials ({decision.error}); detach calls "
                "stopped for this run, no attempts consumed. Check the selections_api "
                "connection.",
                {"error": decision.error},
            )
        )

    def summarize_quarantines(self) -> None:
        """One summary alert when the run quarantined more rows than it alerted one by one."""
        quarantined = self.result.quarantined
        self.quarantine_alerts.summarize(
            lambda sent, suppressed: Alert(
                QUARANTINED_ALERT,
                "warning",
                f"{quarantined} row(s) quarantined in this run; the first {sent} alerted one "
                f"by one, {suppressed} more only counted here",
                {"quarantined": quarantined, "alerted": sent, "suppressed": suppressed},
            )
        )
