"""The detach job's rules, without I/O: what a verdict writes to its outbox row.

:func:`plan_outcome` turns a claimed row and its decision (``snapshot_detach_answers``) into the
values its outcome statement writes (:class:`OutcomePlan`), and :class:`DetachResult` is what a
run reports (the task's XCom, the CLI's output).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from include.pin_maintenance.jobs.snapshot_detach_answers import Decision, Verdict
from include.pin_maintenance.runloop import StopReason

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
        return {
            "LockAcquired": self.lock_acquired,
            "DryRun": self.dry_run,
            "Due": self.due,
            "Claimed": self.claimed,
            "Succeeded": self.succeeded,
            "Retried": self.retried,
            "Quarantined": self.quarantined,
            "Failed": self.failed,
            "GivenBack": self.given_back,
            "Superseded": self.superseded,
            "Batches": self.batches,
            "HasMore": self.has_more,
            "StopReason": self.stop_reason,
            "AuthFailed": self.auth_failed,
            "BreakerOpen": self.breaker_open,
            "BreakerFailures": self.breaker_failures,
            "OutageCalls": self.outage_calls,
            "Misrouted": self.misrouted,
            "MisrouteCalls": self.misroute_calls,
            "Calls": self.calls,
            "Throttled": self.throttled,
            "RetryAfterPausedSeconds": round(self.retry_after_paused_seconds, 3),
            "ConcurrencyLimit": self.concurrency_limit,
            "ConcurrencyPeak": self.concurrency_peak,
            "CallStalls": self.call_stalls,
            "CallRetries": self.call_retries,
            "Pending": self.pending,
            "OldestAgeSeconds": round(self.oldest_age_seconds, 3),
            "DurationMs": self.duration_ms,
        }


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
