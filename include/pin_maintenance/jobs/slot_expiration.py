"""SlotExpirationJob (seed 002): Available slots whose start has passed become Expired.

One cycle fixes ``AsOf`` once, then takes batches of the oldest due slots
(``status = 'Available' and start_at <= AsOf``) under ``FOR UPDATE SKIP LOCKED`` and moves each
batch to ``Expired`` (``updated_at = AsOf``, ``version + 1``) in one statement and one
transaction. It keeps going while batches come back full and ``max_run_duration_seconds``
allows; whatever is left waits for the next cycle. There is no global lock: parallel runners
(and in-flight bookings) are kept apart by the row locks alone, so every slot is expired by
exactly one of them. Booked, Expired, Archived and future slots never match the predicate, so a
second pass is a no-op (idempotent by state, no checkpoint).

A cycle is itself up to ``runners`` such parallel runners: when its first batch comes back
full (a backlog), it starts the others, each on its own connection, and they share the backlog
through SKIP LOCKED. Each runner walks the index from the largest ``start_at`` it locked so far
(a keyset), so a long backlog does not rescan what the cycle already expired.

Failures:

* A poison row (a trigger, a constraint or a bad value fails the statement for one slot): the
  batch is retried in a fresh transaction that locks the same selection and bisects it under
  savepoints. The good rows commit together; each poison slot is logged at ERROR with its id,
  counted in ``calendar_slot_expiration_errors_total``, alerted
  (``slot_expiration_poison_row``) and excluded for the rest of the cycle; the next cycle tries
  it again.
* An infrastructure failure (connection lost, statement or lock timeout, server shutdown) rolls
  the batch back and fails the run; the next cycle retries the same, still Available, rows.
  The other runners finish the batch in hand and stop first.
* Cancellation (SIGTERM) is checked between batches: the batch in hand commits or rolls back as
  a whole and its row locks go with the transaction.

Run it without Airflow::

    python -m include.pin_maintenance.jobs.slot_expiration --db-url postgresql://u@h/db [--dry-run]

The password comes from ``PGPASSWORD``, ``~/.pgpass`` / ``PGPASSFILE``, a service in
``.pg_service.conf`` or ``--db-password-env VAR``; a password in ``--db-url`` is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from opentelemetry import context as otel_context
from opentelemetry import trace

from include.pin_maintenance import privileges, sql
from include.pin_maintenance.cli_db import add_db_arguments, db_conninfo
from include.pin_maintenance.config import ConfigError
from include.pin_maintenance.db import (
    Connect,
    SessionSettings,
    configured,
    require_server_connections,
)
from include.pin_maintenance.jobs.slot_expiration_config import (  # noqa: F401 (re-exported)
    CONFIG,
    CONN_ID,
    JOB,
)
from include.pin_maintenance.parallel import Deadline, Lane, run_lanes
from include.pin_maintenance.runloop import JobCancelled, StopReason, StopSignal
from include.pin_maintenance.telemetry import (
    Alert,
    JobLog,
    Telemetry,
    error_code,
    set_result,
)

# One statement never runs longer than this; a slow batch is an infrastructure failure.
# A batch commit need not wait for the WAL flush: a commit lost in a server crash only leaves its
# slots Available, and the next cycle expires them (nothing downstream saw the transition; the
# seed publishes no events). Saves a WAL flush per batch. Like the timeouts it is set in each
# transaction (db.configured), so it never reaches another client of a pooled server connection.
SESSION = SessionSettings(
    statement_timeout_ms=30_000,
    lock_timeout_ms=5_000,
    application_name="pin-slot-expiration",
    synchronous_commit="off",
)

# Metric names are a contract (BRIEF / seed "Наблюдаемость"); do not rename.
M_CYCLE_DURATION = "calendar_slot_expiration_cycle_duration_seconds"
M_ITEMS = "calendar_slot_expiration_items_total"
M_BACKLOG = "calendar_slot_expiration_backlog"
M_SKIP_LOCKED = "calendar_slot_expiration_skip_locked_total"
M_ERRORS = "calendar_slot_expiration_errors_total"
M_LAST_SUCCESS = "calendar_slot_expiration_last_success_timestamp_seconds"

POISON_ALERT = "slot_expiration_poison_row"
# A trigger that rejects every row would otherwise raise one alert per slot; past this many in
# one cycle the rest are only logged and counted (errors_total keeps the true number).
MAX_POISON_ALERTS_PER_CYCLE = 20
ERROR_TEXT_LIMIT = 300
# Counts (backlog, skipped, dry run) stop here so a huge backlog costs a bounded index range
# read; the backlog alert fires at 5000, far below.
COUNT_CAP = 1_000_000
# A batch span names at most this many of the tenants it touched (plus their count).
MAX_SPAN_TENANTS = 20

# SQLSTATE classes that mean "the database or our session is unwell", not "this row is bad":
# connection (08), resources (53), operator intervention incl. statement timeout and shutdown
# (57), system (58), transaction rollback incl. deadlock/serialization (40), internal (XX),
# config/file (F0), plus lock_not_available (55P03, lock_timeout) and syntax/privilege (42:
# a statement that cannot run at all fails every row alike, so bisecting it is pointless).
_INFRASTRUCTURE_CLASSES = frozenset({"08", "40", "42", "53", "57", "58", "F0", "XX"})
_INFRASTRUCTURE_STATES = frozenset({"55P03", "55000", "55006"})


def is_row_error(sqlstate: str | None) -> bool:
    """True when a failed batch statement may be caused by individual rows (isolate them).

    Data exceptions (22: out of range, invalid value), integrity violations (23: check, not
    null, unique, foreign key), exceptions raised by triggers (P0) and other statement-level
    errors are row errors. A missing SQLSTATE means the client lost the server: infrastructure.
    """
    if not sqlstate or len(sqlstate) != 5:
        return False
    if sqlstate in _INFRASTRUCTURE_STATES:
        return False
    return sqlstate[:2] not in _INFRASTRUCTURE_CLASSES


@dataclass(frozen=True)
class PoisonSlot:
    slot_id: str
    error: str  # class, SQLSTATE and the server's message: for the log line
    code: str = ""  # class and SQLSTATE only: for the alert (telemetry.error_code)


@dataclass(frozen=True)
class ExpirationResult:
    """The seed's cycle result ``{ExpiredCount, SkippedLockedCount, DurationMs}`` and context."""

    expired_count: int
    skipped_locked_count: int
    duration_ms: int
    as_of: datetime
    batches: int = 0
    stop_reason: str = StopReason.DRAINED.value
    poison: tuple[PoisonSlot, ...] = ()
    backlog: int | None = None
    dry_run: bool = False
    would_expire_count: int | None = None
    runners: int = 1

    @property
    def errors_count(self) -> int:
        return len(self.poison)

    def as_dict(self) -> dict[str, Any]:
        """The task's return value (XCom) and the CLI's output: small and JSON-safe."""
        out: dict[str, Any] = {
            "ExpiredCount": self.expired_count,
            "SkippedLockedCount": self.skipped_locked_count,
            "DurationMs": self.duration_ms,
            "ErrorsCount": self.errors_count,
            "Backlog": self.backlog,
            "Batches": self.batches,
            "Runners": self.runners,
            "StopReason": self.stop_reason,
            "AsOf": self.as_of.isoformat(),
        }
        if self.dry_run:
            out["DryRun"] = True
            out["WouldExpireCount"] = self.would_expire_count
        return out


def validate(config: Mapping[str, Any]) -> dict[str, Any]:
    """Check an already resolved config again (the job never runs on an unchecked value)."""
    by_name = {s.name: s for s in CONFIG.settings}
    unknown = sorted(set(config) - set(by_name))
    if unknown:
        raise ConfigError(
            f"{JOB}: unknown config key {unknown[0]!r}; allowed keys: {', '.join(sorted(by_name))}"
        )
    values = CONFIG.defaults
    for key, value in config.items():
        try:
            values[key] = by_name[key].check(value, "config")
        except ConfigError as exc:
            raise ConfigError(f"{JOB}: {exc}") from None
    return values


@dataclass
class _Cycle:
    """State of one cycle, shared by its runners (each in its own thread)."""

    as_of: datetime
    batch_size: int
    expired: int = 0
    batches: int = 0
    poison: list[PoisonSlot] = field(default_factory=list)
    alerts_sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def excluded_ids(self) -> list[str]:
        with self._lock:
            return [p.slot_id for p in self.poison]

    def params(self) -> dict[str, Any]:
        return {
            "as_of": self.as_of,
            "batch_size": self.batch_size,
            "excluded_ids": self.excluded_ids,
            "count_cap": COUNT_CAP,
        }

    def batch_done(
        self, expired: int, poison: Sequence[PoisonSlot]
    ) -> tuple[int, list[PoisonSlot]]:
        """Count one batch; return its number in the cycle (1-based) and the poison slots new
        to the cycle (two runners can both meet a slot before either has excluded it)."""
        with self._lock:
            self.expired += expired
            known = {p.slot_id for p in self.poison}
            new = [p for p in poison if p.slot_id not in known]
            self.poison.extend(new)
            self.batches += 1
            return self.batches, new

    def may_alert(self) -> bool:
        with self._lock:
            if self.alerts_sent >= MAX_POISON_ALERTS_PER_CYCLE:
                return False
            self.alerts_sent += 1
            return True


@dataclass
class _Runner:
    """One batch loop of a cycle and its keyset: the largest start_at it locked so far."""

    number: int
    after: datetime | None = None


def run(
    connect: Connect,
    config: Mapping[str, Any],
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    dry_run: bool = False,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
    clock: Callable[[], float] = time.monotonic,
) -> ExpirationResult:
    """Run one expiration cycle; return the seed's result.

    ``now`` is the wall clock (AsOf, backlog), ``clock`` the monotonic clock of the duration
    bound. Raises :class:`ConfigError` before touching the database when ``config`` is invalid,
    :class:`JobCancelled` after a clean stop between batches, and the database error after
    rolling back the batch in hand when the database fails.
    """
    with telemetry.run_span(f"{JOB} run") as span:
        result = _cycle(connect, config, telemetry, stop, dry_run=dry_run, now=now, clock=clock)
        set_result(span, result.as_dict())
        return result


def _cycle(
    connect: Connect,
    config: Mapping[str, Any],
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    dry_run: bool,
    now: Callable[[], datetime],
    clock: Callable[[], float],
) -> ExpirationResult:
    values = validate(config)
    log, metrics = telemetry.log, telemetry.metrics
    started = clock()
    as_of = now()
    cycle = _Cycle(as_of=as_of, batch_size=int(values["batch_size"]))
    log.info(
        "cycle_started",
        as_of=as_of.isoformat(),
        batch_size=cycle.batch_size,
        runners=values["runners"],
        max_run_duration_seconds=values["max_run_duration_seconds"],
        dry_run=dry_run,
    )
    # Every counter exists at 0 before the cycle's first event: statsd_exporter creates a
    # series at its first value, and Prometheus sees no rise in a series that starts above 0.
    for counter in (M_ITEMS, M_SKIP_LOCKED, M_ERRORS):
        metrics.incr(counter, 0)

    try:
        privileges.require(connect, JOB, telemetry)  # before any write
        with _session(connect) as conn:
            if dry_run:
                return _dry_run(conn, cycle, telemetry, started=started, clock=clock, now=now)
            team = _Team(
                connect,
                cycle,
                telemetry,
                stop,
                deadline=Deadline(float(values["max_run_duration_seconds"]), clock=clock),
                runners=int(values["runners"]),
                max_batches=int(values["max_batches_per_cycle"]),
            )
            stop_reason = team.run(conn)
            skipped = _count(conn, "slots/count_skipped_slots", team.skipped_params(stop_reason))
            backlog = _count(conn, "slots/count_backlog", {"now": now(), "count_cap": COUNT_CAP})
    except psycopg.Error as exc:  # infrastructure: the batch in hand was rolled back
        metrics.incr(M_ERRORS)
        log.error(
            "cycle_failed",
            error=_describe(exc),
            expired_count=cycle.expired,
            duration_ms=_ms(clock() - started),
        )
        raise

    duration = clock() - started
    result = ExpirationResult(
        expired_count=cycle.expired,
        skipped_locked_count=skipped,
        duration_ms=_ms(duration),
        as_of=as_of,
        batches=cycle.batches,
        stop_reason=stop_reason.value,
        poison=tuple(cycle.poison),
        backlog=backlog,
        runners=team.started,
    )
    metrics.timing(M_CYCLE_DURATION, timedelta(seconds=duration))
    metrics.incr(M_ITEMS, result.expired_count)
    metrics.incr(M_SKIP_LOCKED, result.skipped_locked_count)
    metrics.gauge(M_BACKLOG, backlog)
    log.info(
        "cycle_completed",
        expired_count=result.expired_count,
        duration_ms=result.duration_ms,
        skipped_locked_count=result.skipped_locked_count,
        errors_count=result.errors_count,
        batches=result.batches,
        runners=result.runners,
        stop_reason=result.stop_reason,
        backlog=backlog,
    )
    if stop_reason is StopReason.CANCELLED:
        set_result(trace.get_current_span(), result.as_dict())
        raise JobCancelled(f"{JOB}: {stop.reason}; {result.expired_count} slots expired")
    metrics.gauge(M_LAST_SUCCESS, time.time())
    return result


def server_connections(config: Mapping[str, Any]) -> int:
    """Server connections a cycle holds at once with ``config`` (docs/deploying.md, "Behind a
    pooler"): one per batch loop; the side loops exist only when a cycle may take more than one
    batch. No lock connection (the seed has no global lock)."""
    values = validate(config)
    if int(values["max_batches_per_cycle"]) <= 1:
        return 1
    return int(values["runners"])


# A lane still in a statement when the cycle is cancelled stops within the statement timeout
# (the cancel hook interrupts it at once; this is the bound if the server does not answer).
STOP_GRACE_SECONDS = SESSION.statement_timeout_ms / 1000 + 5


class _Budget:
    """The cycle's bound on batches (``max_batches_per_cycle``), shared by its loops."""

    def __init__(self, limit: int) -> None:
        self.limit, self.taken = limit, 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.taken >= self.limit:
                return False
            self.taken += 1
            return True


class _Team:
    """The cycle's batch loops: the first on the caller's connection and thread; when its
    first batch comes back full and ``max_batches_per_cycle`` allows more, up to
    ``runners - 1`` more on their own connections, run with :func:`parallel.run_lanes`.

    The loops are parallel instances in the seed's sense: SKIP LOCKED alone keeps them apart,
    so each slot is taken by exactly one of them, and each keeps its own keyset. Their
    connections are opened on the caller's thread (an Airflow hook reads its Connection through
    the task runner, which is not for side threads), and checked against the pool size before
    the second batch (:func:`db.require_server_connections`). Any exception in any loop,
    ``BaseException`` included, stops the others: their stop signal is set and the statement
    each may be in is cancelled (its batch rolls back whole); committed batches stay; the cycle
    fails with the first exception.
    """

    def __init__(
        self,
        connect: Connect,
        cycle: _Cycle,
        telemetry: Telemetry,
        stop: StopSignal,
        *,
        deadline: Deadline,
        runners: int,
        max_batches: int,
    ) -> None:
        self.connect, self.cycle, self.telemetry, self.stop = connect, cycle, telemetry, stop
        self.deadline, self.runners = deadline, runners
        self.budget = _Budget(max_batches)
        self.started = 1  # loops started: the first runs on the caller's thread
        self.loops: list[_Runner] = [_Runner(1)]

    def run(self, conn: psycopg.Connection) -> StopReason:
        first = self.loops[0]
        if self.stop.is_set():
            return StopReason.CANCELLED
        self.budget.take()
        if not _run_batch(conn, self.cycle, first, self.telemetry):
            return StopReason.DRAINED
        side = self._open_side_connections(conn)
        if not side:
            return self._loop(conn, first, self.stop)
        try:
            lanes = [self._lane(conn, first)] + [
                self._lane(c, self._add_runner(i + 2), otel_context.get_current())
                for i, c in enumerate(side)
            ]
            self.started = len(lanes)
            reasons = run_lanes(
                lanes, stop=self.stop, deadline=self.deadline, grace_seconds=STOP_GRACE_SECONDS
            )
        except BaseException as exc:
            self.telemetry.log.warning("runner_failed", error=_describe(exc))
            raise
        finally:
            for c in side:
                c.close()
        return _combined(reasons)

    def skipped_params(self, reason: StopReason) -> dict[str, Any]:
        """Parameters of count_skipped_slots.sql (SkippedLockedCount).

        Drained: every loop ended on a short batch, so it took every due slot it could lock;
        whatever is still due (and not poison) was locked by someone else when the loops passed
        (a booking in flight, another instance). Stopped by a bound (batches, time) or a stop:
        only the due slots before the furthest point a loop's index walk reached were passed
        over; the rest is backlog the loops never reached, not skipped.
        """
        walked = [r.after for r in self.loops if r.after is not None]
        bounded = reason is not StopReason.DRAINED
        return self.cycle.params() | {
            "bounded": bounded,
            "before": max(walked) if walked else None,
        }

    def _add_runner(self, number: int) -> _Runner:
        runner = _Runner(number)
        self.loops.append(runner)
        return runner

    def _lane(
        self,
        conn: psycopg.Connection,
        runner: _Runner,
        parent: otel_context.Context | None = None,
    ) -> Callable[[Lane], StopReason]:
        def lane(lane: Lane) -> StopReason:
            lane.on_cancel(conn.cancel_safe)  # interrupts a statement in flight
            if parent is not None:
                otel_context.attach(parent)  # a thread starts with an empty context
            return self._loop(conn, runner, lane.stop)

        return lane

    def _loop(self, conn: psycopg.Connection, runner: _Runner, stop: StopSignal) -> StopReason:
        while True:
            if stop.is_set():
                return StopReason.CANCELLED
            if self.deadline.expired():
                return StopReason.MAX_DURATION
            if not self.budget.take():
                return StopReason.MAX_BATCHES
            if not _run_batch(conn, self.cycle, runner, self.telemetry):
                return StopReason.DRAINED

    def _open_side_connections(self, conn: psycopg.Connection) -> list[psycopg.Connection]:
        """Side loops' connections, when runners, the batch bound and the time allow them."""
        if self.runners < 2 or self.budget.limit <= 1:
            return []
        if self.stop.is_set() or self.deadline.expired():
            return []
        side: list[psycopg.Connection] = []
        for number in range(2, self.runners + 1):
            try:
                side.append(_open(self.connect))
            except psycopg.Error as exc:  # more loops are an optimisation, not a requirement
                self.telemetry.log.warning(
                    "runner_not_started", runner=number, error=_describe(exc)
                )
                break
        if side:
            try:
                require_server_connections(
                    [conn, *side], job=JOB, what=f"{len(side) + 1} batch loops (runners)"
                )
            except BaseException:
                for c in side:
                    c.close()
                raise
        return side


def _combined(reasons: Sequence[StopReason]) -> StopReason:
    """The cycle's stop reason: cancelled if any loop was, else a bound if any hit one."""
    for reason in (StopReason.CANCELLED, StopReason.MAX_DURATION, StopReason.MAX_BATCHES):
        if reason in reasons:
            return reason
    return StopReason.DRAINED


def _open(connect: Connect) -> psycopg.Connection:
    """A connection set up for batches: every batch is an explicit transaction (autocommit
    outside them); its settings, asynchronous commit included, come from ``connect``."""
    conn = connect()
    try:
        conn.autocommit = True
    except BaseException:
        conn.close()
        raise
    return conn


@contextmanager
def _session(connect: Connect) -> Iterator[psycopg.Connection]:
    """The cycle's first connection, closed at the end whatever happens."""
    conn = _open(connect)
    try:
        yield conn
    finally:
        conn.close()


def _run_batch(
    conn: psycopg.Connection, cycle: _Cycle, runner: _Runner, telemetry: Telemetry
) -> bool:
    """One batch in one transaction (a span); True when it was full (more may be due)."""
    attributes = {"pin.runner": runner.number}
    with telemetry.span(f"{JOB} batch", attributes) as span:
        return _expire_batch(conn, cycle, runner, telemetry, span)


def _expire_batch(
    conn: psycopg.Connection,
    cycle: _Cycle,
    runner: _Runner,
    telemetry: Telemetry,
    span: trace.Span,
) -> bool:
    tracing = span.is_recording()
    params = cycle.params() | {
        "after": runner.after,
        "with_tenants": tracing,
        "max_tenants": MAX_SPAN_TENANTS,
    }
    tenants: list[uuid.UUID] | None = None
    tenant_count = 0
    poison: list[tuple[uuid.UUID, psycopg.Error]] = []
    try:
        with conn.transaction():
            row = conn.execute(sql.load("slots/expire_due_slots"), params).fetchone()
            selected, expired, last_start_at, missed, tenants, tenant_count = row
            if missed:  # see expire_due_slots.sql: updated concurrently before our lock
                expired += conn.execute(
                    sql.load("slots/expire_slots_by_id"), {"ids": missed, "as_of": cycle.as_of}
                ).rowcount
    except psycopg.Error as exc:
        if not is_row_error(exc.sqlstate) or conn.closed:
            raise
        # Nothing of this batch was written (the whole transaction rolled back). Lock the same
        # selection again and find the offending rows under savepoints.
        telemetry.log.warning(
            "batch_isolating",
            runner=runner.number,
            batch_size=cycle.batch_size,
            error=_describe(exc),
        )
        with conn.transaction():
            rows = conn.execute(sql.load("slots/lock_due_slots"), params).fetchall()
            selected = len(rows)
            last_start_at = max((start_at for _, start_at in rows), default=None)
            expired, poison = _expire_isolating(conn, [id_ for id_, _ in rows], cycle.as_of)
    if last_start_at is not None:
        runner.after = last_start_at
    found = [
        PoisonSlot(str(slot_id), _describe(error), error_code(error)) for slot_id, error in poison
    ]
    number, found = cycle.batch_done(expired, found)
    for slot in found:
        _report_poison(cycle, slot, telemetry)
        if tracing:  # seed 002: item failed (SlotId, exception), here its class only
            error_type = slot.error.split(":", 1)[0]
            span.add_event("item_failed", {"pin.slot_id": slot.slot_id, "error.type": error_type})
    if tracing:
        span.set_attributes(
            {
                "pin.batch.index": number,
                "pin.batch.rows": selected,
                "pin.batch.expired": expired,
                "pin.batch.poison": len(poison),
                "pin.batch.outcome": "isolated" if tenants is None else "committed",
            }
        )
        if tenants is not None:  # the isolating path does not read the tenants
            span.set_attribute("pin.tenant_ids", sorted(str(t) for t in tenants))
            span.set_attribute("pin.tenant_count", tenant_count)
    telemetry.log.info(
        "batch_selected", batch_index=number, runner=runner.number, count=selected, expired=expired
    )
    return selected >= cycle.batch_size


def _expire_isolating(
    conn: psycopg.Connection, ids: Sequence[uuid.UUID], as_of: datetime
) -> tuple[int, list[tuple[uuid.UUID, psycopg.Error]]]:
    """Expire ``ids`` (locked by this transaction) by halves under savepoints.

    A group that fails is split until the failing rows stand alone; with k poison rows in a
    batch of n this costs about 2·k·log2(n) statements instead of n. Returns (expired, poison).
    """
    expired = 0
    poison: list[tuple[uuid.UUID, psycopg.Error]] = []
    query = sql.load("slots/expire_slots_by_id")
    stack = [list(ids)]
    while stack:
        part = stack.pop()
        if not part:
            continue
        try:
            with conn.transaction():  # a savepoint inside the batch transaction
                expired += conn.execute(query, {"ids": part, "as_of": as_of}).rowcount
        except psycopg.Error as exc:
            if not is_row_error(exc.sqlstate) or conn.closed:
                raise
            if len(part) == 1:
                poison.append((part[0], exc))
            else:
                mid = len(part) // 2
                stack.append(part[mid:])
                stack.append(part[:mid])
    return expired, poison


def _report_poison(cycle: _Cycle, slot: PoisonSlot, telemetry: Telemetry) -> None:
    telemetry.log.error("item_failed", slot_id=slot.slot_id, error=slot.error)
    telemetry.metrics.incr(M_ERRORS)
    if cycle.may_alert():
        telemetry.alerts.send(
            Alert(
                POISON_ALERT,
                "warning",
                f"slot {slot.slot_id} cannot be expired; left Available for the next cycle",
                {"slot_id": slot.slot_id, "error": slot.code or "unknown"},
            )
        )


def _dry_run(
    conn: psycopg.Connection,
    cycle: _Cycle,
    telemetry: Telemetry,
    *,
    started: float,
    clock: Callable[[], float],
    now: Callable[[], datetime],
) -> ExpirationResult:
    """Count what a cycle would expire; lock and change nothing."""
    would = _count(conn, "slots/count_due_slots", cycle.params())
    backlog = _count(conn, "slots/count_backlog", {"now": now(), "count_cap": COUNT_CAP})
    result = ExpirationResult(
        expired_count=0,
        skipped_locked_count=0,
        duration_ms=_ms(clock() - started),
        as_of=cycle.as_of,
        backlog=backlog,
        dry_run=True,
        would_expire_count=would,
    )
    telemetry.log.info(
        "cycle_completed",
        dry_run=True,
        would_expire_count=would,
        expired_count=0,
        duration_ms=result.duration_ms,
        skipped_locked_count=0,
        backlog=backlog,
    )
    return result


def _count(conn: psycopg.Connection, query: str, params: Mapping[str, Any]) -> int:
    row = conn.execute(sql.load(query), params).fetchone()
    return int(row[0]) if row else 0


def _describe(exc: BaseException) -> str:
    """Error class, SQLSTATE and the server's primary message; no row data beyond that."""
    sqlstate = getattr(exc, "sqlstate", None)
    diag = getattr(exc, "diag", None)
    message = (diag.message_primary if diag is not None else None) or str(exc)
    text = f"{type(exc).__name__}"
    if sqlstate:
        text += f" {sqlstate}"
    text += f": {message.strip()}"
    return text[:ERROR_TEXT_LIMIT]


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: one cycle against ``--db-url``; prints the result as JSON.

    Exit codes: 0 done, 2 invalid config or a database privilege missing (nothing written), 3
    cancelled by SIGTERM after a clean stop, 1 database failure.
    """
    # Not __name__: under ``python -m`` that is "__main__" (the usage line must be pasteable).
    parser = argparse.ArgumentParser(
        prog="python -m include.pin_maintenance.jobs.slot_expiration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_db_arguments(parser, what="calendar database")
    parser.add_argument("--config", help='JSON object of config keys, e.g. {"batch_size": 100}')
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--run-id", default=f"cli__{datetime.now(UTC):%Y%m%dT%H%M%S}")
    args = parser.parse_args(argv)
    conninfo = db_conninfo(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    log = JobLog(JOB, args.run_id)
    try:
        config = CONFIG.resolve(args.config)
    except ConfigError as exc:
        log.error("config_invalid", error=str(exc))
        return 2
    telemetry = Telemetry.local(log)
    connect = configured(lambda: psycopg.connect(conninfo), SESSION)
    stop = StopSignal()
    try:
        with stop.on_sigterm():
            result = run(connect, config, telemetry, stop, dry_run=args.dry_run)
    except JobCancelled as exc:
        log.warning("cycle_cancelled", reason=str(exc))
        return 3
    except privileges.MissingPrivileges as exc:
        print(f"MissingPrivileges: {exc}", file=sys.stderr)
        return 2
    except psycopg.Error:
        return 1
    print(json.dumps(result.as_dict(), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
