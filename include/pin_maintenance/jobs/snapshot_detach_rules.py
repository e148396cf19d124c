"""The detach job's rules, without I/O: what a call's answer means for its outbox row.

:func:`classify` turns one call's outcome into a :class:`Decision` (table-tested in
``tests/unit/test_snapshot_detach_rules.py``), :func:`plan_outcome` turns a claimed row and its
decision into the values its outcome statement writes (:class:`OutcomePlan`), and
:class:`DetachResult` is what a run reports (the task's XCom, the CLI's output).

========================================  ==========================================
answer                                    outcome
========================================  ==========================================
2xx (incl. already detached)              ``Done``, ``last_error = null``
5xx, 408, 409, 423, 425, other 4xx,      stays ``Pending`` (backoff set at claim)
timeout, connection error
429                                       as 5xx; ``Retry-After`` pushes
                                          ``next_attempt_at`` further when longer
transient and ``attempts >= max_attempts``  ``Quarantined`` + alert
404, 410                                  ``Quarantined`` at once + alert (selections
                                          keeps snapshots forever: unknown = permanent),
                                          except a 404 past ``misroute_quarantine_limit``
                                          in a run without a 2xx: attempt given back,
                                          calls stop, ``selections_misrouted`` (critical)
400, 422                                  ``Quarantined`` at once + alert: the same
                                          request gets the same answer; fix, then requeue
401, 403                                  ``selections_auth_failed`` (critical); no more
                                          calls this run (circuit breaker); the attempt
                                          is given back to that row and to every claimed
                                          row not yet called
transient failure that opened the outage  stays ``Pending``, ``last_error`` set, backoff
breaker (or failed in flight after it)    as set at claim, but the attempt is given back
                                          (never quarantined by an outage); no more
                                          calls this run; ``selections_unavailable``
                                          (warning) once; rows not yet called are given
                                          back
unexpected (1xx, 3xx)                     transient (redirects are not followed)
reason not BlockReplaced / PostDeleted    not called; ``Quarantined``, ``UnknownReason``
========================================  ==========================================

*Given back* means ``attempts`` and ``next_attempt_at`` return to their values before the
claim (``last_error`` unchanged): a broken credential or a cancelled run costs no row an
attempt. Rows with a status other than Pending/Done/Quarantined are never selected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from include.pin_maintenance.jobs.snapshot_detach_client import CallOutcome
from include.pin_maintenance.runloop import StopReason

KNOWN_REASONS = frozenset({"BlockReplaced", "PostDeleted"})
LAST_ERROR_MAX = 512


class Verdict(StrEnum):
    DONE = "Done"
    RETRY = "Retry"  # stays Pending, backoff as set at claim (or Retry-After)
    QUARANTINE = "Quarantined"
    AUTH_FAILED = "AuthFailed"  # attempt given back, circuit breaker opens
    NOT_CALLED = "NotCalled"  # attempt given back (cancelled / breaker open)
    OUTAGE = "Outage"  # called, failed as part of an outage: attempt given back, error kept
    MISROUTED = "Misrouted"  # a 404 after the misroute breaker opened: attempt given back


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    error: str | None = None  # last_error text (class + code), None for Done / not called
    retry_after_seconds: float | None = None

    @property
    def is_failed_call(self) -> bool:
        """A call was made and did not succeed (news_snapshot_detach_failed_total)."""
        failed = (
            Verdict.RETRY,
            Verdict.QUARANTINE,
            Verdict.AUTH_FAILED,
            Verdict.OUTAGE,
            Verdict.MISROUTED,
        )
        return self.verdict in failed and self.error != "UnknownReason"


# Which 4xx are permanent (docs/design/detach.md): the snapshot is unknown or gone,
# or the request itself is refused (the same request gets the same answer). Every other 4xx
# (409, 423, 405, 418, ...) is transient: it says nothing definite about the row, a retry is
# free (detach is idempotent) and max_attempts still quarantines a row that never resolves.
_PERMANENT_NAMES = {
    400: "HttpBadRequest",
    404: "HttpNotFound",
    410: "HttpGone",
    422: "HttpUnprocessable",
}
_TRANSIENT_4XX = {
    408: "HttpRequestTimeout",
    409: "HttpConflict",
    423: "HttpLocked",
    425: "HttpTooEarly",
    429: "HttpTooManyRequests",
}
AUTH_NAMES = {401: "HttpUnauthorized", 403: "HttpForbidden"}


def classify(
    outcome: CallOutcome | None, attempts: int, max_attempts: int, *, outage: bool = False
) -> Decision:
    """What to do with a row after its call; ``None`` = not called. Pure, table-tested.

    ``outage``: the call's failure is part of the streak that opened the outage breaker (or
    came after it); a transient answer then costs the row nothing, whatever its attempts.
    """
    final, transient = _classify_answer(outcome)
    if final is not None:
        return final
    assert transient is not None
    if outage:
        return Decision(Verdict.OUTAGE, transient.error, transient.retry_after_seconds)
    if attempts >= max_attempts:
        return Decision(
            Verdict.QUARANTINE, f"{transient.error}; max_attempts {max_attempts} reached"
        )
    return transient


def _classify_answer(outcome: CallOutcome | None) -> tuple[Decision | None, Decision | None]:
    """(final decision, None) or (None, transient decision subject to max_attempts)."""
    if outcome is None:
        return Decision(Verdict.NOT_CALLED), None
    code = outcome.status_code
    ra = outcome.retry_after_seconds
    final = transient = None
    if code is None:
        transient = Decision(Verdict.RETRY, clean_error(outcome.error_class or "UnknownError"))
    elif 200 <= code < 300:
        final = Decision(Verdict.DONE)
    elif code in AUTH_NAMES:
        final = Decision(Verdict.AUTH_FAILED, f"{AUTH_NAMES[code]} {code}")
    elif code in _PERMANENT_NAMES:
        final = Decision(Verdict.QUARANTINE, f"{_PERMANENT_NAMES[code]} {code}")
    elif code in _TRANSIENT_4XX or code == 503:
        name = _TRANSIENT_4XX.get(code, "HttpServerError")
        suffix = f" retry_after={ra:g}s" if ra is not None else ""
        transient = Decision(Verdict.RETRY, f"{name} {code}{suffix}", ra)
    elif 400 <= code < 500:
        transient = Decision(Verdict.RETRY, f"HttpClientError {code}")
    elif 500 <= code < 600:
        transient = Decision(Verdict.RETRY, f"HttpServerError {code}")
    else:
        transient = Decision(Verdict.RETRY, f"HttpUnexpectedStatus {code}")
    return final, transient


_UNSAFE = re.compile(r"[^A-Za-z0-9 _.:;=()/-]")


def clean_error(text: str) -> str:
    """Bound ``last_error`` to the column and to a harmless alphabet (no quotes, no '@')."""
    return _UNSAFE.sub("?", text)[:LAST_ERROR_MAX]


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
