"""SnapshotDetachRetryJob (seed 000): retry the selections detach for the news action-outbox.

One run, under the single-runner advisory lock ``Pin:lock:job:scheduled:news-snapshot-detach-retry``
(busy = skip, success):

1. **Claim** (one short transaction, committed): up to ``batch_size`` rows with
   ``status = 'Pending' and next_attempt_at <= now``, oldest due first, ``FOR UPDATE SKIP
   LOCKED``; ``attempts += 1``, ``next_attempt_at = now + backoff(attempts)`` (pure function in
   ``pin_maintenance.backoff``), ``updated_at = now`` (the claim token).
2. **Detach**: ``POST /internal/snapshots/{snapshot_id}/detach`` per row, outside any
   transaction, the outbox id as ``Idempotency-Key``. How many calls are in flight adapts
   between ``detach_concurrency_min`` and ``detach_concurrency`` (AIMD: grow while answers are
   healthy and fast, halve on 429/502/503/504/timeouts/connection errors, pause for a
   ``Retry-After``); ``breaker_failure_threshold`` consecutive failed calls open the outage
   circuit breaker (``snapshot_detach_flow`` has the rules).
3. **Outcome** (one short transaction per batch, guarded per row by the claim token):

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

Metrics (names are the contract): ``succeeded_total`` / ``retried_total`` /
``quarantined_total`` count rows by outcome; ``failed_total`` counts calls that were made and
did not succeed (any non-2xx or transport error, incl. 401/403); ``lag_seconds`` is one timing
per Done row (``now - created_at``); the ``pending`` / ``oldest_age_seconds`` gauges are
measured at the end of every run that held the lock (and of a dry run);
``last_success_timestamp_seconds`` is set at the end of every run that ended normally (incl.
no-op and lock-skip runs) but not after a cancellation or an auth failure, so the "no
successful run for 15 min" rule also catches broken credentials.

The outage breaker keeps no state between runs: each run starts half-open, with
``detach_concurrency_min`` calls in flight, so during an outage a run makes at most
``breaker_failure_threshold + detach_concurrency_min - 1`` calls and costs no row an attempt,
and after recovery the first run drains the backlog. ``breaker_open_total`` counts runs whose
breaker opened; ``concurrency_limit`` is the adaptive limit at the end of a run.

Run bound (issue 27, ``docs/design/detach.md``): a run ends within
``max_run_duration_seconds + detach_call_timeout_seconds + RUN_MARGIN_SECONDS`` (5 s). The run
has one :class:`~include.pin_maintenance.parallel.Deadline` at ``max_run_duration_seconds +
detach_call_timeout_seconds``; no batch is claimed and no call started once it no longer allows
a whole call, every wait takes its timeout from it, and claimed rows not called are given back.
Alerts go out on their own thread (:class:`AsyncAlerts`), flushed within the margin.

Cancellation (stop signal) is honoured between rows: calls not yet started are given back,
the batch's outcome transaction commits, then :class:`JobCancelled` is raised. A worker
exception on one row is logged and recorded as a transient error of that row. When the batch
outcome transaction fails, each row is retried in its own transaction so one bad row cannot
lose the others' outcomes.
"""

from __future__ import annotations

import queue
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

import psycopg
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from include.pin_maintenance import privileges, sql
from include.pin_maintenance.backoff import Backoff
from include.pin_maintenance.db import (
    Connect,
    advisory_lock,
    lock_held_too_long,
    require_server_connections,
)
from include.pin_maintenance.jobs.snapshot_detach_client import (
    DETACH_PATH,
    CallOutcome,
    DetachClient,
)
from include.pin_maintenance.jobs.snapshot_detach_config import (  # noqa: F401 (re-exported)
    CONFIG,
    JOB,
    RUN_MARGIN_SECONDS,
    worst_case_run_seconds,
)
from include.pin_maintenance.jobs.snapshot_detach_flow import Breaker, CallGate
from include.pin_maintenance.parallel import Deadline
from include.pin_maintenance.runloop import JobCancelled, StopReason, StopSignal
from include.pin_maintenance.telemetry import Alert, Telemetry, record_error, resumed, set_result

LOCK_NAME = "Pin:lock:job:scheduled:news-snapshot-detach-retry"
KNOWN_REASONS = frozenset({"BlockReplaced", "PostDeleted"})
LAST_ERROR_MAX = 512
MAX_UNSETTLED_BATCHES = 3  # claimed and not yet recorded at once (the pipeline's depth)
PIPELINE_POLL_SECONDS = 0.02  # how often the main thread looks whether to claim ahead
MAX_QUARANTINE_ALERTS_PER_RUN = 20  # then one summary alert carries the count
ALERT_FLUSH_SECONDS = 2.0  # of RUN_MARGIN_SECONDS: undelivered alerts after that are logged
MISROUTE_ALERT = "selections_misrouted"


class Metric:
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
    # emitted at 0 at the start of every run (statsd_exporter creates a counter at its first
    # value; a series that first appears above 0 shows Prometheus no rise)
    COUNTERS = (RETRIED, SUCCEEDED, FAILED, QUARANTINED, LOCK_CONTENTION, BREAKER_OPEN)


# --------------------------------------------------------------------------------------------
# Pure rules: classification of one call's outcome
# --------------------------------------------------------------------------------------------


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


# Which 4xx are permanent (issue 26, docs/design/detach.md): the snapshot is unknown or gone,
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
_AUTH_NAMES = {401: "HttpUnauthorized", 403: "HttpForbidden"}


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
    elif code in _AUTH_NAMES:
        final = Decision(Verdict.AUTH_FAILED, f"{_AUTH_NAMES[code]} {code}")
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


# --------------------------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------------------------


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
            "Pending": self.pending,
            "OldestAgeSeconds": round(self.oldest_age_seconds, 3),
            "DurationMs": self.duration_ms,
        }


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


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


@dataclass
class _Batch:
    rows: list[ClaimedRow]
    calls: dict[str, Future]  # row id -> its detach call (rows with a known reason)
    span: Span = trace.INVALID_SPAN  # from its claim until its outcomes are recorded

    def done(self) -> bool:
        return all(f.done() for f in self.calls.values())


@dataclass
class _Applied:
    row: ClaimedRow
    decision: Decision
    status: str
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    keep_last_error: bool


class AsyncAlerts:
    """Alert delivery on its own thread, so a slow webhook never stretches the run (issue 27).

    ``send`` queues and returns at once; :meth:`flush` waits for the queue at most ``seconds``
    and returns how many alerts were not delivered by then (they stay queued on the daemon
    thread, which keeps trying while the process lives).
    """

    def __init__(self, sink: Any, log: Any) -> None:
        self._sink = sink
        self._log = log
        self._queue: queue.Queue[Alert] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._unfinished = 0

    def send(self, alert: Alert) -> None:
        with self._lock:
            self._unfinished += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._deliver, name="detach-alerts", daemon=True
                )
                self._thread.start()
        self._queue.put(alert)

    def _deliver(self) -> None:
        while True:
            alert = self._queue.get()
            try:
                self._sink.send(alert)
            except Exception as exc:  # a sink failure must not lose the alerts behind it
                self._log.error("alert_failed", alert=alert.name, error=type(exc).__name__)
            with self._lock:
                self._unfinished -= 1
                self._idle.notify_all()

    def flush(self, seconds: float) -> int:
        until = time.monotonic() + max(0.0, seconds)
        with self._lock:
            while self._unfinished:
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            return self._unfinished


def pg_array(values: Iterable[Any]) -> str:
    """A Postgres array literal (``{...}``) for a list of parameters, cast in the SQL.

    One string per array instead of psycopg's per-element list dumping: the claim and outcome
    statements of a batch carry 3 and 8 arrays of ``batch_size`` elements, and dumping them
    element by element cost the main thread (which also claims ahead) more GIL time than the
    HTTP calls themselves (issue 27). Elements: None, bool, int, datetime, str (quoted).
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


def utc_now() -> datetime:
    return datetime.now(UTC)


def run(
    connect: Connect,
    config: dict[str, Any],
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
    job = _Run(
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
    return job(dry_run)


class _Run:
    def __init__(
        self,
        *,
        connect: Connect,
        config: dict[str, Any],
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
        self.cfg = config
        self.t = telemetry
        self.log = telemetry.log
        self.stop = stop
        self.client = client
        self.now = now
        self.rng = rng
        self.monotonic = monotonic
        self.backoff = Backoff(
            config["backoff_base_seconds"], config["backoff_factor"], config["backoff_cap_seconds"]
        )
        self.breaker = threading.Event()  # the 401/403 breaker
        self.gate: CallGate | None = None  # adaptive concurrency + outage breaker (per run)
        self.deadline = Deadline(worst_case_run_seconds(config), clock=monotonic)  # reset per run
        self._aborted = False  # the main thread failed: no new call starts
        self._count_lock = threading.Lock()
        self._submitted = 0  # calls queued on the workers
        self._taken = 0  # of them, picked up by a worker
        self.alerts = AsyncAlerts(telemetry.alerts, telemetry.log)
        self._quarantine_alerts = 0  # per-row quarantine alerts sent this run
        self._quarantine_alerts_suppressed = 0
        self.result = DetachResult()
        self.span: Span = trace.INVALID_SPAN  # the run's span, once __call__ opened it

    def __call__(self, dry_run: bool) -> DetachResult:
        with self.t.run_span(f"{JOB} run") as self.span:
            return self._run(dry_run)

    def _run(self, dry_run: bool) -> DetachResult:
        started = self.monotonic()
        self.result.dry_run = dry_run
        for counter in Metric.COUNTERS:
            self.t.metrics.incr(counter, 0)
        self.log.info(
            "job_started",
            dry_run=dry_run,
            batch_size=self.cfg["batch_size"],
            detach_concurrency_min=self.cfg["detach_concurrency_min"],
            detach_concurrency=self.cfg["detach_concurrency"],
            breaker_failure_threshold=self.cfg["breaker_failure_threshold"],
        )
        privileges.require(self.connect, JOB, self.t)  # before the lock and any write
        if dry_run:
            self._dry_run()
            return self._finish(started, success=True)
        with advisory_lock(self.connect, self.lock_name, self.cfg["lock_ttl_seconds"]) as held:
            if not held:
                self.result.lock_acquired = False
                self.t.metrics.incr(Metric.LOCK_CONTENTION)
                self.log.info("job_skipped", reason="lock_busy", lock=self.lock_name)
                # a holder past the lease is stuck: a live run ends before its lease does
                # (lock_ttl_seconds > the worst-case run, checked at validation)
                limit = self.cfg["lock_ttl_seconds"]
                if alert := lock_held_too_long(self.connect, self.lock_name, limit, job=JOB):
                    self.alerts.send(alert)
                return self._finish(started, success=True, lock_busy=True)
            cancelled = self._run_batches()
        healthy = not (cancelled or self.result.auth_failed or self.result.misrouted)
        self._finish(started, success=healthy)
        if cancelled:
            raise JobCancelled(self.stop.reason or "stop requested")
        return self.result

    # -- phases ----------------------------------------------------------------------------

    def _dry_run(self) -> None:
        conn = self.connect()
        try:
            row = conn.execute(sql.load("news/count_due_entries"), {"now": self.now()}).fetchone()
            conn.rollback()
        finally:
            conn.close()
        self.result.due = int(row[0]) if row else 0
        self.log.info("dry_run", due=self.result.due, calls=0, writes=0)

    def _run_batches(self) -> bool:
        """The batch pipeline; returns True when it stopped because of the stop signal.

        Calls stay in flight across batch boundaries (issue 27): the next batch is claimed and
        its calls queued as soon as fewer calls are queued than the limit allows in flight
        (at most :data:`MAX_UNSETTLED_BATCHES` batches claimed and not yet recorded), and a
        batch's outcomes are recorded as soon as all of its calls are in, oldest batch first.
        Each batch still has exactly one claim and one outcome transaction, and every claimed
        batch is recorded before the run ends (also on the deadline, a stop or a breaker).

        Every wait takes its timeout from the run's one :class:`Deadline`
        (``max_run_duration_seconds + detach_call_timeout_seconds`` from now): no batch is
        claimed and no call started once the deadline no longer allows a whole call, so the
        calls still running then end before it, and the last batches settle by then.
        """
        conn = self.connect()
        conn.autocommit = True  # every unit of work is an explicit, short transaction
        require_server_connections([conn], job=JOB, held=1)  # + the lock: pool size 2
        call_seconds = float(self.cfg["detach_call_timeout_seconds"])
        self.deadline = Deadline(
            float(self.cfg["max_run_duration_seconds"]) + call_seconds, clock=self.monotonic
        )
        self.gate = CallGate(
            int(self.cfg["detach_concurrency_min"]),
            int(self.cfg["detach_concurrency"]),
            int(self.cfg["breaker_failure_threshold"]),
            deadline=self.deadline,
            call_seconds=call_seconds,
            stopped=lambda: self.stop.is_set() or self.breaker.is_set() or self._aborted,
            on_open=self._breaker_opened,
            misroute_limit=int(self.cfg["misroute_quarantine_limit"]),
        )
        workers = ThreadPoolExecutor(
            max_workers=int(self.cfg["detach_concurrency"]), thread_name_prefix="detach"
        )
        unsettled: deque[_Batch] = deque()
        try:
            batches, stop_reason = self._pipeline(conn, workers, unsettled)
        except BaseException:
            self._aborted = True  # no new call starts; claimed rows keep their claim
            raise
        finally:
            self.gate.close()
            workers.shutdown(wait=False, cancel_futures=True)
            conn.close()
            for batch in unsettled:  # a failure before their outcomes: end their spans
                batch.span.end()
        self.result.batches = batches
        self.result.stop_reason = str(stop_reason or StopReason.DRAINED)
        self._gate_report()
        if self.breaker.is_set():
            self.result.stop_reason = "auth_failed"
        # a stop that arrived during the last (short) batch still ends the run as cancelled
        return stop_reason is StopReason.CANCELLED or self.stop.is_set()

    def _pipeline(
        self, conn: psycopg.Connection, workers: ThreadPoolExecutor, unsettled: deque[_Batch]
    ) -> tuple[int, StopReason | str | None]:
        batches, stop_reason = 0, None
        while True:
            while unsettled and unsettled[0].done():
                self._settle(conn, unsettled.popleft())
            if stop_reason is None:
                stop_reason = self._stop_reason(batches)
            if stop_reason is None and self._wants_batch(unsettled):
                batch = self._claim_batch(conn, workers, batches, unsettled)
                batches += 1
                if batch.rows:
                    unsettled.append(batch)
                if len(batch.rows) < int(self.cfg["batch_size"]):
                    stop_reason = StopReason.DRAINED
                continue
            if not unsettled:
                return batches, stop_reason
            if self.deadline.expired():  # only a client that ignored its timeout gets here
                self._abandon(unsettled[0])
                continue
            head = [f for f in unsettled[0].calls.values() if not f.done()]
            poll = None if stop_reason is not None else PIPELINE_POLL_SECONDS
            futures.wait(head, timeout=self.deadline.timeout(poll))

    def _stop_reason(self, batches: int) -> StopReason | str | None:
        """Why no further batch is claimed, or None (the first batch is always claimed)."""
        if self.stop.is_set():
            return StopReason.CANCELLED
        if self._calls_stopped():
            return "calls_stopped"  # _gate_report names the breaker
        if batches and self.gate.deadline_reached:
            return StopReason.MAX_DURATION
        return None

    def _wants_batch(self, unsettled: deque[_Batch]) -> bool:
        """Claim ahead while the queued calls would not keep the limit busy."""
        if not unsettled:
            return True
        if len(unsettled) >= MAX_UNSETTLED_BATCHES:
            return False
        with self._count_lock:
            queued = self._submitted - self._taken
        return queued < 2 * self.gate.limit.slots

    def _calls_stopped(self) -> bool:
        """401/403, a breaker, or a Retry-After beyond the run bound: no more calls."""
        gate = self.gate
        return self.breaker.is_set() or (
            gate is not None
            and (gate.is_open or gate.is_misrouted or gate.stats.stopped_by_retry_after)
        )

    def _claim_batch(
        self,
        conn: psycopg.Connection,
        workers: ThreadPoolExecutor,
        index: int,
        unsettled: deque[_Batch],
    ) -> _Batch:
        in_flight = [r.id for b in unsettled for r in b.rows]
        span = self.t.tracer.start_span(f"{JOB} batch", attributes={"pin.batch.index": index})
        try:
            rows = self._claim(conn, in_flight)
        except BaseException as exc:
            record_error(span, type(exc).__name__)
            span.end()
            raise
        span.set_attribute("pin.batch.rows", len(rows))
        self.log.info("batch_claimed", batch_index=index, rows=len(rows))
        self.result.claimed += len(rows)
        calls = [r for r in rows if r.reason in KNOWN_REASONS]
        parent = trace.set_span_in_context(span)  # worker threads do not inherit the context
        with self._count_lock:
            self._submitted += len(calls)
        batch = _Batch(rows, {r.id: workers.submit(self._call, r, parent) for r in calls}, span)
        if not rows:
            span.end()
        return batch

    def _abandon(self, batch: _Batch) -> None:
        """Past the deadline with calls still running (a client that ignored its timeout):
        record them as timed out; the worker thread is left to finish on its own."""
        for row_id, call in list(batch.calls.items()):
            if call.done():
                continue
            replacement: Future = Future()
            if call.cancel():  # never started: not called, its attempt is given back
                replacement.set_result(None)
            else:
                replacement.set_result(CallOutcome(error_class="Timeout"))
                self.log.warning("entry_call_abandoned", outbox_id=row_id)
            batch.calls[row_id] = replacement

    def _settle(self, conn: psycopg.Connection, batch: _Batch) -> None:
        """Record the outcomes of a batch whose calls are all in (one transaction)."""
        with resumed(batch.span) as span:
            decisions = []
            for row in batch.rows:
                if row.reason not in KNOWN_REASONS:
                    decision = Decision(Verdict.QUARANTINE, "UnknownReason")
                else:
                    outcome = batch.calls[row.id].result()
                    if outcome is not None and self.gate.misroute_row(row.id):
                        decision = Decision(Verdict.MISROUTED, "HttpNotFound 404; route suspect")
                    else:
                        decision = classify(
                            outcome,
                            row.attempts,
                            self.cfg["max_attempts"],
                            outage=outcome is not None and self.gate.outage_row(row.id),
                        )
                decisions.append((row, decision))
            self._record(conn, decisions)
            if span.is_recording():
                for verdict in Verdict:
                    n = sum(1 for _, d in decisions if d.verdict is verdict)
                    span.set_attribute(f"pin.batch.outcome.{verdict.value}", n)

    def _claim(self, conn: psycopg.Connection, in_flight: list[str]) -> list[ClaimedRow]:
        now = self.now()
        with conn.transaction():
            found = conn.execute(
                sql.load("news/select_due_entries"),
                {
                    "now": now,
                    "batch_size": int(self.cfg["batch_size"]),
                    "in_flight": pg_array(in_flight),
                },
            ).fetchall()
            rows = []
            for rid, snapshot_id, post_id, reason, attempts, next_at, created_at in found:
                n = attempts + 1
                delay = self.backoff.delay_with_jitter(n, self.rng.uniform)
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

    def _call(self, row: ClaimedRow, parent: Context | None = None) -> CallOutcome | None:
        """Runs on a worker thread: one detach call, or None when we must not call any more.

        The call is a CLIENT span under ``parent`` (its batch's span); the client sends it to
        selections as the W3C ``traceparent``.
        """
        with self._count_lock:
            self._taken += 1
        if self.stop.is_set() or self.breaker.is_set():
            return None
        assert self.gate is not None  # made by _run_batches before any call is queued
        ticket = self.gate.acquire()  # waits for a slot (adaptive limit, Retry-After pause)
        if ticket is None:  # breaker open, stopped, or a Retry-After past the run bound
            return None
        attributes = {
            "http.request.method": "POST",
            "url.template": DETACH_PATH,
            "pin.snapshot_id": row.snapshot_id,
            "pin.post_id": row.post_id,
            "pin.attempts": row.attempts,
        }
        with self.t.span(
            "detach snapshot", attributes, kind=SpanKind.CLIENT, context=parent
        ) as span:
            outcome = self._detach(row)
            if span.is_recording():
                decision = classify(outcome, row.attempts, self.cfg["max_attempts"])
                span.set_attribute("pin.outcome", decision.verdict.value)
                if outcome.status_code is not None:
                    span.set_attribute("http.response.status_code", outcome.status_code)
                if decision.verdict is not Verdict.DONE:
                    record_error(span, str(outcome.status_code or outcome.error_class))
        self.gate.release(ticket, row.id, outcome)
        return outcome

    def _detach(self, row: ClaimedRow) -> CallOutcome:
        assert self.client is not None  # checked in run()
        try:
            outcome = self.client.call(
                row.snapshot_id,
                row.reason,
                row.id,
                # a whole call fitted when it started; never wait past the run's deadline
                max(self.deadline.timeout(float(self.cfg["detach_call_timeout_seconds"])), 0.001),
            )
        except Exception as exc:  # a client bug or infrastructure failure: this row only
            self.log.error(
                "entry_call_failed", snapshot_id=row.snapshot_id, error=type(exc).__name__
            )
            outcome = CallOutcome(error_class=f"ClientError:{type(exc).__name__}")
        if outcome.status_code in _AUTH_NAMES:
            self.breaker.set()
        return outcome

    def _breaker_opened(self, breaker: Breaker, outcome: CallOutcome) -> None:
        """On the worker thread whose call opened the outage breaker: log it (once)."""
        self.log.warning(
            "breaker_open",
            consecutive_failures=breaker.failures_at_open,
            error_code=classify(outcome, 1, 2).error,
        )

    def _gate_report(self) -> None:
        """Breaker state and concurrency into the result, metrics and (once) the alert."""
        gate, r = self.gate, self.result
        if gate is None:
            return
        r.calls = gate.stats.calls
        r.throttled = gate.stats.throttled
        r.retry_after_paused_seconds = gate.stats.paused_seconds
        r.concurrency_limit = gate.limit.slots
        r.concurrency_peak = gate.stats.peak_in_flight
        self.t.metrics.gauge(Metric.CONCURRENCY, r.concurrency_limit)
        if gate.stats.stopped_by_retry_after and not gate.is_open:
            self.result.stop_reason = "retry_after"
            self.log.warning("calls_paused_past_run_bound", throttled=r.throttled)
        if self._quarantine_alerts_suppressed:
            self.alerts.send(
                Alert(
                    "snapshot_detach_quarantined",
                    "warning",
                    f"{r.quarantined} row(s) quarantined in this run; the first "
                    f"{self._quarantine_alerts} alerted one by one, "
                    f"{self._quarantine_alerts_suppressed} more only counted here",
                    {
                        "quarantined": r.quarantined,
                        "alerted": self._quarantine_alerts,
                        "suppressed": self._quarantine_alerts_suppressed,
                    },
                )
            )
        if gate.is_misrouted:
            self._misrouted_report()
        if not gate.is_open:
            return
        r.breaker_open = True
        r.breaker_failures = gate.breaker.failures_at_open
        self.result.stop_reason = "selections_unavailable"
        self.t.metrics.incr(Metric.BREAKER_OPEN)
        self.alerts.send(
            Alert(
                "selections_unavailable",
                "warning",
                f"selections failed {r.breaker_failures} detach calls in a row; calls stopped "
                f"for this run after {r.calls} call(s), {r.outage_calls} of them and every "
                "row not called cost no attempt. The next run probes again.",
                {
                    "consecutive_failures": r.breaker_failures,
                    "calls": r.calls,
                    "outage_calls": r.outage_calls,
                    "given_back": r.given_back,
                },
            )
        )

    def _misrouted_report(self) -> None:
        r = self.result
        r.misrouted = True
        r.stop_reason = "selections_misrouted"
        limit = int(self.cfg["misroute_quarantine_limit"])
        self.log.error(
            MISROUTE_ALERT,
            quarantined_404=self.gate.misroute.quarantined_404s,
            misroute_calls=r.misroute_calls,
            given_back=r.given_back,
        )
        self.alerts.send(
            Alert(
                MISROUTE_ALERT,
                "critical",
                f"selections answered 404 to {self.gate.misroute.quarantined_404s + 1}+ detach "
                "calls and 2xx to none: the selections route looks wrong (base URL, path, "
                f"ingress). At most {limit} row(s) were quarantined; calls stopped for this run "
                "and every other row cost no attempt. Check the selections_api connection.",
                {
                    "quarantined_404": self.gate.misroute.quarantined_404s,
                    "misroute_calls": r.misroute_calls,
                    "given_back": r.given_back,
                    "limit": limit,
                },
            )
        )

    # -- outcomes --------------------------------------------------------------------------

    def _plan(self, row: ClaimedRow, decision: Decision, now: datetime) -> _Applied:
        v = decision.verdict
        if v is Verdict.OUTAGE:  # the attempt is given back; the backoff (or Retry-After) stays
            next_at = row.next_attempt_at
            if decision.retry_after_seconds is not None:
                next_at = max(next_at, now + timedelta(seconds=decision.retry_after_seconds))
            return _Applied(
                row, decision, "Pending", row.attempts - 1, next_at, decision.error, False
            )
        if v in (Verdict.NOT_CALLED, Verdict.AUTH_FAILED, Verdict.MISROUTED):
            return _Applied(
                row,
                decision,
                "Pending",
                row.attempts - 1,
                row.previous_next_attempt_at,
                decision.error,
                keep_last_error=v is Verdict.NOT_CALLED,
            )
        if v is Verdict.DONE:
            return _Applied(row, decision, "Done", row.attempts, row.next_attempt_at, None, False)
        if v is Verdict.QUARANTINE:
            status, error = "Quarantined", decision.error
            return _Applied(row, decision, status, row.attempts, row.next_attempt_at, error, False)
        next_at = row.next_attempt_at
        if decision.retry_after_seconds is not None:
            next_at = max(next_at, now + timedelta(seconds=decision.retry_after_seconds))
        return _Applied(row, decision, "Pending", row.attempts, next_at, decision.error, False)

    def _record(self, conn: psycopg.Connection, decisions: Sequence[tuple[ClaimedRow, Decision]]):
        now = self.now()
        plans = sorted((self._plan(r, d, now) for r, d in decisions), key=lambda p: p.row.id)
        try:
            applied = self._write(conn, plans, now)
        except psycopg.OperationalError:
            raise  # the database is gone: the task fails, Airflow retries it
        except psycopg.Error as exc:
            self.log.error("batch_outcome_failed", rows=len(plans), error=type(exc).__name__)
            applied = set()
            for plan in plans:
                try:
                    applied |= self._write(conn, [plan], now)
                except psycopg.OperationalError:
                    raise
                except psycopg.Error as row_exc:
                    self.log.error(
                        "entry_outcome_failed",
                        snapshot_id=plan.row.snapshot_id,
                        error=type(row_exc).__name__,
                    )
        detached: list[_Applied] = []
        for plan in plans:
            if plan.row.id in applied:
                self._report(plan, now)
                if plan.decision.verdict is Verdict.DONE:
                    detached.append(plan)
            else:
                self.result.superseded += 1
                self.log.warning(
                    "entry_outcome_superseded",
                    snapshot_id=plan.row.snapshot_id,
                    attempts=plan.row.attempts,
                    outcome=plan.decision.verdict,
                )
        if detached:
            # one line per batch, not per row (issue 27: under Airflow every line crosses the
            # task supervisor; 100 lines per batch cost a third of the throughput)
            self.t.metrics.incr(Metric.SUCCEEDED, len(detached))
            self.log.info(
                "entries_detached",
                count=len(detached),
                snapshot_ids=",".join(p.row.snapshot_id for p in detached),
                attempts=",".join(str(p.row.attempts) for p in detached),
            )

    def _write(self, conn: psycopg.Connection, plans: Iterable[_Applied], now: datetime) -> set:
        plans = list(plans)
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

    def _report(self, plan: _Applied, now: datetime) -> None:
        row, decision, m = plan.row, plan.decision, self.t.metrics
        if decision.is_failed_call:
            self.result.failed += 1
            m.incr(Metric.FAILED)
        v = decision.verdict
        if v is Verdict.DONE:
            self.result.succeeded += 1  # counted and logged per batch by _record
            m.timing(Metric.LAG, max(now - row.created_at, timedelta(0)))
            self.log.debug("entry_detached", snapshot_id=row.snapshot_id, attempts=row.attempts)
        elif v is Verdict.RETRY:
            self.result.retried += 1
            m.incr(Metric.RETRIED)
            self.log.info(
                "entry_retry",
                snapshot_id=row.snapshot_id,
                attempts=row.attempts,
                error_code=decision.error,
                next_attempt_at=plan.next_attempt_at.isoformat(),
            )
        elif v is Verdict.QUARANTINE:
            self.result.quarantined += 1
            m.incr(Metric.QUARANTINED)
            self.log.warning(
                "entry_quarantined",
                snapshot_id=row.snapshot_id,
                reason=row.reason,
                attempts=row.attempts,
                error_code=decision.error,
            )
            if self._quarantine_alerts >= MAX_QUARANTINE_ALERTS_PER_RUN:
                self._quarantine_alerts_suppressed += 1
                return
            self._quarantine_alerts += 1
            self.alerts.send(
                Alert(
                    "snapshot_detach_quarantined",
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
        elif v is Verdict.AUTH_FAILED:
            self.result.given_back += 1
            if not self.result.auth_failed:
                self.result.auth_failed = True
                self.log.error("selections_auth_failed", error_code=decision.error)
                self.alerts.send(
                    Alert(
                        "selections_auth_failed",
                        "critical",
                        "selections rejected our credentials "
                        f"({decision.error}); detach calls stopped for this run, no attempts "
                        "consumed. Check the selections_api connection.",
                        {"error": decision.error},
                    )
                )
        elif v is Verdict.MISROUTED:
            self.result.misroute_calls += 1
            self.result.given_back += 1
            self.log.info("entry_misrouted", snapshot_id=row.snapshot_id, attempts=row.attempts - 1)
        elif v is Verdict.OUTAGE:
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

    # -- end of run ------------------------------------------------------------------------

    def _finish(self, started: float, *, success: bool, lock_busy: bool = False) -> DetachResult:
        if not lock_busy:
            self._measure_backlog()
        # alerts went out on their own thread; wait for them only inside the run's bound
        undelivered = self.alerts.flush(self.deadline.timeout() + ALERT_FLUSH_SECONDS)
        if undelivered:
            self.log.warning("alerts_undelivered", alerts=undelivered)
        elapsed = max(self.monotonic() - started, 0.0)
        self.result.duration_ms = int(elapsed * 1000)
        if not lock_busy:  # a skip is no run: its few ms would dilute the duration rules
            self.t.metrics.timing(Metric.RUN_DURATION, timedelta(seconds=elapsed))
        if success:
            self.t.metrics.gauge(Metric.LAST_SUCCESS, time.time())
        r = self.result
        set_result(self.span, r.as_dict())
        self.log.info(
            "job_completed",
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
            stop_reason=r.stop_reason or ("dry_run" if r.dry_run else "lock_busy"),
            pending=r.pending,
            duration_ms=r.duration_ms,
        )
        return r

    def _measure_backlog(self) -> None:
        try:
            conn = self.connect()
            try:
                row = conn.execute(
                    sql.load("news/measure_pending_backlog"), {"now": self.now()}
                ).fetchone()
                conn.rollback()
            finally:
                conn.close()
        except psycopg.Error as exc:  # gauges are best effort at the end of a run
            self.log.warning("backlog_measure_failed", error=type(exc).__name__)
            return
        self.result.pending = int(row[0])
        self.result.oldest_age_seconds = max(float(row[1]), 0.0)
        self.t.metrics.gauge(Metric.PENDING, self.result.pending)
        self.t.metrics.gauge(Metric.OLDEST_AGE, self.result.oldest_age_seconds)
