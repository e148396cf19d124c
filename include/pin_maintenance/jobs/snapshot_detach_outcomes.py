"""Recording a detach batch's outcomes: write them, then count, log and alert each one.

:meth:`OutcomeRecorder.record` takes a batch's decisions, turns them into
:class:`~include.pin_maintenance.jobs.snapshot_detach_rules.OutcomePlan` s, writes them in one
transaction (row by row when that transaction fails, so one bad row cannot lose the others'
outcomes) and accounts for each outcome that applied: the run's result, its metrics, its log
line and, for a quarantine or refused credentials, its alert.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

import psycopg

from include.pin_maintenance.jobs.snapshot_detach_db import record_detach_outcomes
from include.pin_maintenance.jobs.snapshot_detach_rules import (
    ClaimedRow,
    Decision,
    DetachResult,
    OutcomePlan,
    Verdict,
    plan_outcome,
)
from include.pin_maintenance.lifecycle import CappedAlerts
from include.pin_maintenance.telemetry import Alert, AlertSink, JobLog, MetricsSink

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
