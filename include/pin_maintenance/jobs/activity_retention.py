"""ActivityRetentionJob (seed 003): delete Inactive sessions past retention, children first.

What is deleted: ``user_activity.sessions`` with ``status = 'Inactive' and ended_at < cutoff``,
``cutoff = now() - retention_period_days`` on the database server's clock, together with their
``action_events`` and ``property_object_views``. ``property_object_view_stats`` is never read
or written (INV-LVS-002: the aggregate outlives the raw views).

Shape (docs/design.md, "How a run flows"): one run is

1. :func:`prepare`: takes the config validated by ``CONFIG.resolve`` (which raises
   ``ConfigError`` before any connection is opened), computes the cutoff and the run deadline
   ONCE on the server clock and counts the eligible backlog. Its :class:`RunPlan` is a handful
   of scalars (an XCom in the DAG).
2. :func:`delete_step` three times, in FK order: ``action_events``, ``property_object_views``,
   ``sessions``. Each step walks the eligible sessions oldest first in batches of
   ``batch_size`` ids (keyset on ``(ended_at, id)``, ``FOR UPDATE SKIP LOCKED``), one
   transaction per batch, and deletes its own table's rows of that batch by ``session_id``.
   With ``runners`` > 1 (default 3) a step runs that many independent batch loops, one
   connection each (:class:`_Walk` on :func:`~include.pin_maintenance.parallel.run_lanes`):
   only the claim of the next batch is serialised; each loop deletes and commits its batch on
   its own, and no loop ever waits for another with a transaction open. The ``sessions`` step
   deletes only sessions of the batch that have no child rows left (``NOT EXISTS`` on both
   child tables), so it never hits the RESTRICT foreign keys and never removes a session
   whose children an earlier step left behind (bounded, failed or skipped); those stay
   eligible and the next run finishes them (data-driven resume, no checkpoint). That guard is
   why commits need no order: any subset of committed batches is a safe state.
3. :func:`report`: the seed's result ``{DeletedSessions, ..., HasMore}``, the completion log
   line and the run-level metrics.

:func:`run` does all of that in one process under one lock (tests, the CLI); the DAG runs each
step as its own task.

Why a keyset walk instead of "sessions that still have children": every step of a run walks
the same ordered prefix of the eligible set (at most ``max_batches_per_run`` batches), so
the sessions step sees exactly the sessions the child steps cleaned. A filter such as
``EXISTS (children)`` would re-scan, batch after batch, the already cleaned head of the set
(quadratic over a run), while the keyset makes each batch one index range read. Only the last
key of a batch is carried to the next one, and the batch's ids live in memory only while that
batch runs: memory stays flat whatever the backlog.

Time budget: ``max_run_duration_seconds`` bounds the whole run. ``prepare`` fixes the deadline
on the server clock; the budget is split between the steps (:data:`STEP_DEADLINE_SHARE`:
``action_events`` claims for the first fifth of the window, ``property_object_views``
until 50 %, ``sessions`` until the run deadline), and each later step covers no session past
the last one the step before it covered (``after``). So a backlog night deletes whole sessions: what
the first step cleared, the later ones finish. Each step still runs its first batch, so a run
whose earlier tasks (or Airflow's scheduling) used up the budget still makes progress.
``max_batches_per_run`` bounds the batches each step claims, all its loops together, so all
three cover the same prefix of the eligible set.

Clean stop: any exception in any batch loop, ``BaseException`` included (the Task SDK's
``AirflowTaskTimeout`` from ``execution_timeout``), cancels every loop's statement in flight
(``conn.cancel_safe``), rolls back every batch not committed and closes every connection; the
step then raises the original exception. Measured: the step returns within 0.05 s of the
exception; the bound is one cancel round trip per loop (each at most
``CANCEL_TIMEOUT_SECONDS``, sent one after the other: 15 s at the default 3 loops when no
cancel gets through), and the join never waits longer than ``STOP_GRACE_SECONDS`` for a loop
that does not stop.

Why SKIP LOCKED and the advisory lock both: the lock ``job:scheduled:activity-retention`` keeps
a second deployment, a manual ``airflow tasks test`` or an old worker out; the row locks make
even two lock-less runs delete every row exactly once (seed, "Duplicate run"). In the DAG each
delete task takes the lock for itself (tasks are separate processes); a runner slipping in
between two tasks is harmless for the same reasons.

Lock TTL: each delete step holds the lock on its own connection for as long as it runs, as a
lease of ``max_run_duration_seconds + LOCK_TTL_MARGIN_SECONDS``. A step checks its budget
between batches only, so it can overrun the run deadline by at most one batch: two
statements, each bounded by ``statement_timeout`` (:data:`SESSION_SETTINGS`, 2 x 120 s < 300 s
margin); with several loops the batches in flight run side by side and wait for nothing but
their own statements. A holder that hangs longer loses the lock to the server, so it cannot
block later runs. ``lock_held_too_long`` fires only for a holder older than that lease.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from opentelemetry import context as otel_context
from opentelemetry.trace import Span
from psycopg import pq

from include.pin_maintenance import privileges, sql
from include.pin_maintenance.cli_db import add_db_arguments, db_conninfo
from include.pin_maintenance.config import ConfigError
from include.pin_maintenance.db import (
    Connect,
    PoolTooSmall,
    SessionSettings,
    advisory_lock,
    configured,
    lock_held_too_long,
    require_server_connections,
)
from include.pin_maintenance.jobs.activity_retention_config import CONFIG, JOB
from include.pin_maintenance.parallel import Deadline, Lane, run_lanes
from include.pin_maintenance.runloop import (
    JobCancelled,
    StopReason,
    StopSignal,
)
from include.pin_maintenance.telemetry import (
    Alert,
    JobLog,
    Telemetry,
    error_code,
    set_result,
)

LOCK_NAME = "job:scheduled:activity-retention"
LOCK_TTL_MARGIN_SECONDS = 300

# Statements of one batch touch up to batch_size sessions and all their children (RI triggers
# included): allow more than the 30 s default, still far below the lock lease margin.
SESSION_SETTINGS = SessionSettings(
    statement_timeout_ms=120_000,
    lock_timeout_ms=5_000,
    application_name="pin-activity-retention",
)


# Child tables first: the RESTRICT foreign keys on sessions(id) demand it (seed, step 4).
TABLES: tuple[str, ...] = ("action_events", "property_object_views", "sessions")

_DELETE_SQL = {
    "action_events": "retention/delete_action_events",
    "property_object_views": "retention/delete_property_object_views",
    "sessions": "retention/delete_childless_sessions",
}
_COUNT_SQL = {
    "action_events": "retention/count_action_events",
    "property_object_views": "retention/count_property_object_views",
    "sessions": "retention/count_sessions",
}
M_BATCHES = "activity_retention_batches_processed"
M_LOCK_CONTENTION = "activity_retention_lock_contention_total"
M_RUN_DURATION = "activity_retention_run_duration_seconds"
DELETED_METRIC = {
    "action_events": "activity_retention_deleted_action_events",
    "property_object_views": "activity_retention_deleted_property_object_views",
    "sessions": "activity_retention_deleted_sessions",
}
RESULT_FIELD = {
    "action_events": "DeletedActionEvents",
    "property_object_views": "DeletedPropertyObjectViews",
    "sessions": "DeletedSessions",
}

# Keyset start and end: before / after every possible (ended_at, id).
_KEY_START = (datetime(1, 1, 1, tzinfo=UTC), uuid.UUID(int=0))
_KEY_END = (datetime(9999, 12, 31, tzinfo=UTC), uuid.UUID(int=(1 << 128) - 1))

# The run's budget split between the delete steps, as the point of the run's window (from
# prepare to deadline_at) where each step stops claiming. Each later step covers only the
# sessions the step before it covered, so what the first step clears is the night's work, and
# the later steps must be able to finish it: action_events claims for the first fifth;
# property_object_views may run until 50 % (1.5x the first step's time), sessions has at
# least the last 50 % (2.5x), plus whatever the views step did not need. Per batch, a later
# step costs 0.15-1.07x an action_events batch in docs/benchmarks.md's profile (5000
# sessions), and more at small batches on a loaded machine (measured here: views 0.9x,
# sessions 1.5x with one view and one event per session, and sessions 1.9x once in a loaded
# `make test`, which the earlier 25 / 60 % split, 1.6x, did not cover). A step that finishes
# early leaves its time to the next one. Only a backlog larger than the time budget meets
# this split; a run bounded by max_batches_per_run (the usual case at the defaults) never does.
STEP_DEADLINE_SHARE = {"action_events": 0.2, "property_object_views": 0.5, "sessions": 1.0}

# After any exception in a batch loop: a cancel request per loop (psycopg's cancel_safe waits
# at most this long for each; they are sent one after the other), then each loop rolls back
# and closes its connection.
CANCEL_TIMEOUT_SECONDS = 5.0
# The bounded join of the loops (run_lanes' grace): past the step's deadline the batches in
# hand may still run their two statements (claim + delete, each <= statement_timeout); after a
# cancel, loops stop within one cancel round trip. A loop still running after this is reported
# (LanesDidNotStop) instead of waited for.
STOP_GRACE_SECONDS = 2 * SESSION_SETTINGS.statement_timeout_ms / 1000 + 2 * CANCEL_TIMEOUT_SECONDS
# A failed batch's log and alert carry its first/last id, its count and up to this many ids.
FAILED_BATCH_SAMPLE_IDS = 20


@dataclass(frozen=True)
class _Batch:
    """One claimed batch as the claim returns it: the ids stay a ``uuid[]`` literal that goes
    back to the server as is (the client never parses 5000 uuids), plus what the logs need."""

    index: int
    ids: str  # '{...}': the sessions' ids, oldest first
    count: int
    first: uuid.UUID
    last: uuid.UUID

    def log_ids(self) -> dict[str, Any]:
        return {
            "first": str(self.first),
            "last": str(self.last),
            "count": self.count,
            "ids": _sample_ids(self.ids),
        }


class BatchFailed(RuntimeError):
    """A batch failed and was rolled back; earlier batches of the step stay committed."""

    # the task fails with this after it sent retention_batch_failed (with the batch's ids):
    # the task_failed alert names that event, so the two page once (ops/README.md)
    alert_event = "retention_batch_failed"


@dataclass(frozen=True)
class RunPlan:
    """What every task of one run acts on: the same cutoff, deadline and bounds (an XCom)."""

    cutoff: datetime
    deadline_at: datetime
    started_at_unix: float
    retention_period_days: int
    batch_size: int
    max_batches_per_run: int
    max_run_duration_seconds: float
    eligible_backlog: int
    dry_run: bool = False
    runners: int = 1  # batch loops per delete task (an XCom from before the key meant one)

    def to_xcom(self) -> dict[str, Any]:
        data = asdict(self)
        data["cutoff"] = self.cutoff.isoformat()
        data["deadline_at"] = self.deadline_at.isoformat()
        return data

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> RunPlan:
        values = dict(data)
        values["cutoff"] = datetime.fromisoformat(values["cutoff"])
        values["deadline_at"] = datetime.fromisoformat(values["deadline_at"])
        return cls(**values)


@dataclass(frozen=True)
class StepResult:
    """One delete task: rows of its table deleted (or counted, in a dry run) and how it ended."""

    table: str
    rows: int = 0
    batches: int = 0
    stop_reason: str = StopReason.DRAINED.value
    lock_skipped: bool = False
    dry_run: bool = False
    # the keyset position the step reached (the last claimed session): the later steps of the
    # run cover no session past it; None = no batch claimed
    last_ended_at: str | None = None
    last_id: str | None = None

    def covered(self) -> tuple[datetime, uuid.UUID] | None:
        """The last (ended_at, id) this step covered, or None when it covered everything."""
        if self.lock_skipped:
            return _KEY_START  # it covered nothing
        if self.stop_reason == StopReason.DRAINED.value:
            return None
        if self.last_ended_at is None or self.last_id is None:
            return _KEY_START
        return datetime.fromisoformat(self.last_ended_at), uuid.UUID(self.last_id)

    @property
    def has_more(self) -> bool:
        """A bound or a busy lock, not an exhausted eligible set, ended the step."""
        return self.lock_skipped or self.stop_reason != StopReason.DRAINED.value

    def to_xcom(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> StepResult:
        return cls(**data)


@dataclass(frozen=True)
class RetentionResult:
    """The seed's result (step 8). ``batches_processed`` counts session batches as the seed
    defines them (one batch = up to ``batch_size`` sessions with their children): the batches
    the sessions step committed, the same as the activity_retention_batches_processed counter.
    ``batches_by_table`` has each delete step's committed batches beside it.
    """

    deleted_sessions: int = 0
    deleted_property_object_views: int = 0
    deleted_action_events: int = 0
    batches_processed: int = 0
    has_more: bool = False
    dry_run: bool = False
    batches_by_table: dict[str, int] = field(default_factory=dict, compare=False)
    steps: tuple[StepResult, ...] = field(default=(), compare=False)

    def as_dict(self) -> dict[str, Any]:
        counts = {
            "Sessions": self.deleted_sessions,
            "PropertyObjectViews": self.deleted_property_object_views,
            "ActionEvents": self.deleted_action_events,
        }
        # A dry run deletes nothing: its counts are WouldDelete*, the Deleted* keys stay 0
        # (as the slot job's ExpiredCount / WouldExpireCount)
        out: dict[str, Any] = {f"Deleted{k}": 0 if self.dry_run else n for k, n in counts.items()}
        out.update(
            {
                "BatchesProcessed": self.batches_processed,
                "ActionEventBatches": self.batches_by_table.get("action_events", 0),
                "PropertyObjectViewBatches": self.batches_by_table.get("property_object_views", 0),
                "SessionBatches": self.batches_by_table.get("sessions", 0),
                "HasMore": self.has_more,
                "DryRun": self.dry_run,
            }
        )
        if self.dry_run:
            out.update({f"WouldDelete{k}": n for k, n in counts.items()})
        return out


# --------------------------------------------------------------------------------------------
# prepare


def prepare(
    connect: Connect,
    config: dict[str, Any],
    telemetry: Telemetry,
    *,
    dry_run: bool = False,
    wall_clock: Callable[[], float] = time.time,
) -> RunPlan:
    """Fix the run's cutoff and deadline on the server clock and measure the backlog.

    ``config`` must come from ``CONFIG.resolve`` (validated). Reads only, takes no lock: the
    delete steps take it, each for itself, because each runs in its own task process.
    """
    with telemetry.run_span(f"{JOB} prepare") as span:
        plan = _prepare(connect, config, telemetry, dry_run=dry_run, wall_clock=wall_clock)
        set_result(span, plan.to_xcom(), "pin.plan.")
        return plan


def _prepare(
    connect: Connect,
    config: dict[str, Any],
    telemetry: Telemetry,
    *,
    dry_run: bool,
    wall_clock: Callable[[], float],
) -> RunPlan:
    # for all three delete steps: a role without DELETE on sessions must not delete events first
    privileges.require(connect, JOB, telemetry)
    conn = connect()
    try:
        cutoff, deadline_at = conn.execute(
            sql.load("retention/plan_run"),
            {
                "retention_period_days": int(config["retention_period_days"]),
                "max_run_duration_seconds": float(config["max_run_duration_seconds"]),
            },
        ).fetchone()
        backlog = conn.execute(
            sql.load("retention/count_eligible_sessions"), {"cutoff": cutoff}
        ).fetchone()[0]
        conn.rollback()
    finally:
        conn.close()
    plan = RunPlan(
        cutoff=cutoff,
        deadline_at=deadline_at,
        started_at_unix=wall_clock(),
        retention_period_days=int(config["retention_period_days"]),
        batch_size=int(config["batch_size"]),
        max_batches_per_run=int(config["max_batches_per_run"]),
        max_run_duration_seconds=float(config["max_run_duration_seconds"]),
        eligible_backlog=int(backlog),
        dry_run=bool(dry_run),
        runners=int(config["runners"]),
    )
    # Every counter exists at 0 before the run's first event: statsd_exporter creates a series
    # at its first value, and Prometheus sees no rise in a series that starts above 0.
    for counter in (*DELETED_METRIC.values(), M_BATCHES, M_LOCK_CONTENTION):
        telemetry.metrics.incr(counter, 0)
    telemetry.metrics.gauge("activity_retention_eligible_backlog", plan.eligible_backlog)
    telemetry.log.info(
        "started",
        cutoff=plan.cutoff.isoformat(),
        batch_size=plan.batch_size,
        max_batches_per_run=plan.max_batches_per_run,
        max_run_duration_seconds=plan.max_run_duration_seconds,
        runners=plan.runners,
        retention_period_days=plan.retention_period_days,
        eligible_backlog=plan.eligible_backlog,
        dry_run=plan.dry_run,
    )
    return plan


# --------------------------------------------------------------------------------------------
# one delete step


def delete_step(
    connect: Connect,
    plan: RunPlan,
    table: str,
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    lock_name: str | None = LOCK_NAME,
    after: StepResult | None = None,
) -> StepResult:
    """Delete ``table``'s rows of the eligible sessions, batch by batch, under the job lock.

    ``after`` is the result of the step before this one in the run (None for the first): this
    step covers no session past the last one that step covered, so a step bounded by its
    budget leaves the later steps exactly the sessions it cleared. The step stops claiming at
    its share of the run's window (:data:`STEP_DEADLINE_SHARE`) and after
    ``max_batches_per_run`` batches claimed by all its loops together.

    Busy lock: a warning ``lock_skip`` and a no-op result with ``lock_skipped`` (the task
    succeeds; the rows stay eligible for the next run); :func:`report` counts the busy run once
    in ``activity_retention_lock_contention_total``.
    ``lock_name=None`` runs without the advisory lock: only ``run`` (which already holds it)
    and the tests of the SKIP LOCKED isolation use that.

    A failing batch rolls back (batches other loops committed stay committed), is logged with
    its ids and alerted as ``retention_batch_failed``, and the step raises
    :class:`BatchFailed`. Any other exception in any loop (``AirflowTaskTimeout`` included)
    cancels every loop's statement in flight, rolls back every batch not committed and is
    re-raised as is. A stop request ends the step between batches and raises
    :class:`JobCancelled`.
    """
    with telemetry.run_span(f"{JOB} delete {table}") as span:
        step = _delete_step(connect, plan, table, telemetry, stop, lock_name=lock_name, after=after)
        set_result(span, step.to_xcom())
        return step


def step_deadline(plan: RunPlan, table: str) -> datetime:
    """When ``table``'s step stops claiming batches (server clock): its share of the run."""
    share = STEP_DEADLINE_SHARE[table]
    return plan.deadline_at - timedelta(seconds=(1.0 - share) * plan.max_run_duration_seconds)


def lock_lease_seconds(plan: RunPlan) -> float:
    """The advisory lock's lease: a step holds it at most its share of the run plus one batch
    in hand (<= 2 statements of statement_timeout) and the stop grace, all inside the margin."""
    return plan.max_run_duration_seconds + LOCK_TTL_MARGIN_SECONDS


def _delete_step(
    connect: Connect,
    plan: RunPlan,
    table: str,
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    lock_name: str | None,
    after: StepResult | None,
) -> StepResult:
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; expected one of {', '.join(TABLES)}")
    until = after.covered() if after is not None else None
    bounded_by = after.stop_reason if after is not None else StopReason.DRAINED.value
    if until == _KEY_START:  # the step before covered nothing (its lock was busy)
        telemetry.log.info("step_skipped", table=table, reason="the step before covered nothing")
        return StepResult(table=table, stop_reason=StopReason.MAX_BATCHES.value)
    # The loops' connections are opened before the lock is taken: opening one may need a
    # server connection of a pooler for a moment, and the lock's transaction pins one for the
    # whole step (with a pool of one, the opening would wait for the pooler's timeout).
    conns = _open_loops(connect, plan, telemetry, table)
    try:
        if plan.dry_run or lock_name is None:
            return _walk(
                conns,
                plan,
                table,
                telemetry,
                stop,
                until=until,
                bounded_by=bounded_by,
                locked=False,
            )
        with advisory_lock(connect, lock_name, lock_lease_seconds(plan)) as held:
            if not held:
                _lock_busy(connect, lock_name, plan, telemetry, table)
                return StepResult(table=table, lock_skipped=True)
            return _walk(
                conns, plan, table, telemetry, stop, until=until, bounded_by=bounded_by, locked=True
            )
    finally:
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()


def _open_loops(
    connect: Connect, plan: RunPlan, telemetry: Telemetry, table: str
) -> list[psycopg.Connection]:
    """One connection per batch loop, opened on the caller's thread (an Airflow hook reads its
    Connection through the task runner, which is not for side threads)."""
    conns = [connect()]
    for number in range(2, _runner_count(plan) + 1):
        try:
            conns.append(connect())
        except psycopg.Error as exc:  # more loops are an optimisation, not a requirement
            telemetry.log.warning("runner_not_started", table=table, runner=number, error=str(exc))
            break
    return conns


def server_connections_needed(plan: RunPlan) -> int:
    """Server connections one delete step holds at most at once: the lock's transaction for
    the whole step, plus one per batch loop while that loop is inside a batch."""
    return 1 + _runner_count(plan)


def _lock_busy(
    connect: Connect, lock_name: str, plan: RunPlan, telemetry: Telemetry, table: str
) -> None:
    """Lock skip: warning log, and an alert if the holder is stuck (``report`` counts the
    contention once per run, however many of its delete tasks found the lock busy).

    Stuck means held longer than the lease a live step holds it for (``lock_lease_seconds``):
    a step of a legitimate run that holds the lock for up to that long never alerts."""
    telemetry.log.warning("lock_skip", lock=lock_name, table=table)
    alert = lock_held_too_long(connect, lock_name, lock_lease_seconds(plan), job=JOB)
    if alert:
        telemetry.alerts.send(alert)


def _walk(
    conns: list[psycopg.Connection],
    plan: RunPlan,
    table: str,
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    until: tuple[datetime, uuid.UUID] | None,
    bounded_by: str,
    locked: bool,
) -> StepResult:
    log = telemetry.log
    # Fail fast, before any batch, when a pooler cannot give every loop a server connection
    # while the lock holds one (docs/deploying.md, "Behind a pooler"): the loops would
    # otherwise wait in the pooler's queue until its query_wait_timeout.
    held = 1 if locked else 0
    require_server_connections(
        conns, job=JOB, held=held, what=f"{held} lock + {len(conns)} batch loops"
    )
    try:
        remaining = (
            conns[0]
            .execute(
                sql.load("retention/seconds_until"),
                {"deadline_at": step_deadline(plan, table)},
            )
            .fetchone()[0]
        )
        conns[0].rollback()
        # The first batch always runs, so a step whose earlier tasks used up their share still
        # makes progress; later batches stop at the step's deadline.
        walk = _Walk(
            plan,
            table,
            telemetry,
            stop,
            deadline=Deadline(max(float(remaining), 0.0)),
            until=until,
            bounded_by=bounded_by,
        )
        walk.run(conns)
    finally:
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()
    result = StepResult(
        table=table,
        rows=walk.rows,
        batches=walk.batches,
        stop_reason=walk.stop_reason.value,
        dry_run=plan.dry_run,
        last_ended_at=walk.last_ended_at.isoformat() if walk.claimed else None,
        last_id=str(walk.after_id) if walk.claimed else None,
    )
    log.info(
        "step_completed",
        table=table,
        rows=result.rows,
        batches=result.batches,
        stop_reason=result.stop_reason,
        has_more=result.has_more,
        runners=len(conns),
        dry_run=plan.dry_run,
    )
    if walk.stop_reason is StopReason.CANCELLED:
        log.warning("cancelled", table=table, batches=walk.batches, reason=stop.reason)
        raise JobCancelled(
            f"{table}: stopped between batches after {walk.batches} committed batch(es) "
            f"({stop.reason})"
        )
    return result


def _runner_count(plan: RunPlan) -> int:
    """Loops worth starting: no more than the batches the backlog (at prepare) can fill."""
    if plan.dry_run:
        return 1  # counts only: one reader is enough
    batches = max(1, -(-plan.eligible_backlog // plan.batch_size))
    return max(1, min(plan.runners, batches, plan.max_batches_per_run))


def _sample_ids(literal: str, limit: int = FAILED_BATCH_SAMPLE_IDS) -> list[str]:
    """The first ``limit`` ids of a ``uuid[]`` literal '{a,b,...}' (without parsing them all)."""
    if len(literal) <= 2:
        return []
    return literal[1:-1].split(",", limit)[:limit]


def _end_interrupted(conn: psycopg.Connection) -> None:
    """After an exception that psycopg did not handle (AirflowTaskTimeout, a bug): cancel a
    statement still running on the server, then close, which ends the batch's transaction
    (rolled back) at once. psycopg itself cancels only on KeyboardInterrupt/SystemExit."""
    with contextlib.suppress(Exception):
        if conn.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
            conn.cancel_safe(timeout=CANCEL_TIMEOUT_SECONDS)
    with contextlib.suppress(Exception):
        conn.close()


class _Walk:
    """One step's keyset walk over the eligible sessions, shared by independent batch loops.

    Each loop (a lane of :func:`run_lanes`, one connection each) repeats: claim the next batch,
    delete its table's rows, commit. Only the claim is serialised: a loop takes the walk's
    claim lock, locks the next ``batch_size`` sessions after the shared keyset position
    (``FOR UPDATE SKIP LOCKED``, in its own transaction), moves the position on and lets go.
    Its delete and commit then run on their own: no loop ever waits for another loop with a
    transaction open, and no loop holds a transaction open between batches (a pooler in
    transaction mode can always hand its server connection to the loop that needs one).

    Commits are not ordered: with a failure the committed batches are any subset of the
    claimed ones. That is safe: every batch is atomic, the sessions step deletes only
    sessions without children, and the next run finishes what is left (data-driven resume).

    Stops. A bound (``max_batches_per_run`` claimed, the step's deadline) or a stop request
    (SIGTERM) ends claiming; the batches in hand finish and commit. Any exception in any loop,
    ``BaseException`` included, cancels the crew: every loop's statement in flight is
    cancelled on the server (``conn.cancel_safe``), every batch not yet committed rolls back,
    and :func:`run_lanes` re-raises the first exception once every loop has stopped.
    """

    def __init__(
        self,
        plan: RunPlan,
        table: str,
        telemetry: Telemetry,
        stop: StopSignal,
        *,
        deadline: Deadline,
        until: tuple[datetime, uuid.UUID] | None = None,
        bounded_by: str = StopReason.DRAINED.value,
    ) -> None:
        self.plan, self.table, self.telemetry, self.stop = plan, table, telemetry, stop
        self.deadline = deadline
        self.until_ended_at, self.until_id = until or _KEY_END
        self._bounded_by = StopReason(bounded_by)
        self._claim_lock = threading.Lock()  # the keyset position and the claim count
        self._count_lock = threading.Lock()  # the totals
        self._aborted = threading.Event()  # a loop failed: nothing more commits
        self.after_ended_at, self.after_id = _KEY_START
        self.last_ended_at = _KEY_START[0]
        self.claimed = 0  # batches claimed: the next batch's index
        self.batches = 0  # batches committed (or counted, in a dry run)
        self.rows = 0
        self.stop_reason = StopReason.DRAINED
        self._drained = False
        self._select = sql.load(
            "retention/peek_session_batch" if plan.dry_run else "retention/claim_session_batch"
        )
        self._act = sql.load(_COUNT_SQL[table] if plan.dry_run else _DELETE_SQL[table])

    def run(self, conns: Sequence[psycopg.Connection]) -> None:
        parent = otel_context.get_current()  # side lanes' batch spans join the step's span
        lanes = [lambda lane, conn=conn: self._lane(lane, conn, parent) for conn in conns]
        run_lanes(
            lanes,
            stop=self.stop,
            deadline=self.deadline,
            grace_seconds=STOP_GRACE_SECONDS,
        )

    def abort(self) -> None:
        self._aborted.set()

    def _lane(self, lane: Lane, conn: psycopg.Connection, parent: otel_context.Context) -> None:
        if lane.index:
            otel_context.attach(parent)  # this thread's own context, gone with the thread
        lane.on_cancel(self.abort)  # first: a batch that has not committed now rolls back
        # interrupts this loop's statement in flight (a cancel that cannot get through gives
        # up after CANCEL_TIMEOUT_SECONDS instead of psycopg's default 30 s)
        lane.on_cancel(functools.partial(conn.cancel_safe, timeout=CANCEL_TIMEOUT_SECONDS))
        try:
            while (batch := self._claim(lane, conn)) is not None:
                attributes = {"pin.batch.index": batch.index, "pin.table": self.table}
                with self.telemetry.span(f"{JOB} batch", attributes) as span:
                    self._act_on(conn, batch, span)
        except BaseException:
            _end_interrupted(conn)
            raise

    def _acquire(self, lane: Lane) -> bool:
        """The claim lock, or False once the crew stopped (never an unbounded wait: the
        holder's statement is itself cancelled by the crew's stop)."""
        while not self._claim_lock.acquire(timeout=0.05):
            if self._aborted.is_set():
                return False
        return True

    def _claim(self, lane: Lane, conn: psycopg.Connection) -> _Batch | None:
        """The next batch (its sessions row-locked in ``conn``'s open transaction), or None
        when a bound, a stop, a failure or the end of the set says so."""
        if not self._acquire(lane):
            return None
        try:
            if self._must_stop(lane):
                return None
            index = self.claimed
            try:
                _, count, ids, first, last_ended_at, last_id = conn.execute(
                    self._select,
                    {
                        "cutoff": self.plan.cutoff,
                        "after_ended_at": self.after_ended_at,
                        "after_id": self.after_id,
                        "until_ended_at": self.until_ended_at,
                        "until_id": self.until_id,
                        "batch_size": self.plan.batch_size,
                    },
                ).fetchone()
            except psycopg.Error as exc:
                if self._aborted.is_set():  # cancelled because a sibling failed
                    return None
                self._fail(conn, index, None, exc)
            if not count:
                conn.rollback()
                self._drained = True
                self._end_of_range()
                return None
            self.claimed += 1
            self.after_ended_at, self.after_id = last_ended_at, last_id
            self.last_ended_at = last_ended_at
            if count < self.plan.batch_size:
                self._drained = True  # a short batch: nothing more in this step's range
                self._end_of_range()
            return _Batch(index, ids, count, first, last_id)
        finally:
            self._claim_lock.release()

    def _must_stop(self, lane: Lane) -> bool:
        """Whether claiming ends here (called under the claim lock); records why."""
        if self._drained or self._aborted.is_set():
            return True
        if lane.stop.is_set():  # the run's stop (SIGTERM); a failed loop raises anyway
            if self.stop.is_set() and self.stop_reason is StopReason.DRAINED:
                self.stop_reason = StopReason.CANCELLED
            return True
        if self.claimed >= self.plan.max_batches_per_run:
            self.stop_reason = StopReason.MAX_BATCHES
            return True
        if self.claimed and self.deadline.expired():
            self.stop_reason = StopReason.MAX_DURATION
            return True
        return False

    def _end_of_range(self) -> None:
        # the walk ran into the end of the range an earlier, bounded step covered: this step
        # is bounded by the same bound (HasMore), not drained
        if self.until_ended_at != _KEY_END[0] and self.stop_reason is StopReason.DRAINED:
            self.stop_reason = self._bounded_by

    def _act_on(self, conn: psycopg.Connection, batch: _Batch, span: Span) -> None:
        try:
            cur = conn.execute(self._act, {"session_ids": batch.ids, "cutoff": self.plan.cutoff})
            affected = cur.fetchone()[0] if self.plan.dry_run else cur.rowcount
            if self._aborted.is_set():  # a sibling failed: this batch must not commit
                conn.rollback()
                self._rolled_back(span, batch)
                return
            if self.plan.dry_run:
                conn.rollback()
            else:
                conn.commit()
        except psycopg.Error as exc:
            if self._aborted.is_set():  # cancelled on the server because a sibling failed
                with contextlib.suppress(psycopg.Error):
                    conn.rollback()
                self._rolled_back(span, batch)
                return
            self._fail(conn, batch.index, batch, exc)
        with self._count_lock:
            self.rows += affected
            self.batches += 1
        if not self.plan.dry_run:
            self.telemetry.metrics.incr(DELETED_METRIC[self.table], affected)
            if self.table == "sessions":  # a session batch is done when its sessions are
                self.telemetry.metrics.incr(M_BATCHES)
        self.telemetry.log.debug(
            "batch",
            table=self.table,
            batch_index=batch.index,
            sessions=batch.count,
            rows=affected,
            dry_run=self.plan.dry_run,
        )
        if span.is_recording():
            outcome = "counted" if self.plan.dry_run else "committed"
            span.set_attributes(
                {
                    "pin.batch.sessions": batch.count,
                    "pin.batch.rows": affected,
                    "pin.batch.outcome": outcome,
                }
            )

    def _rolled_back(self, span: Span, batch: _Batch) -> None:
        self.telemetry.log.warning(
            "batch_rolled_back",
            table=self.table,
            batch_index=batch.index,
            reason="another batch loop failed",
            batch_ids=json.dumps(batch.log_ids()),
        )
        if span.is_recording():
            span.set_attributes(
                {"pin.batch.sessions": batch.count, "pin.batch.outcome": "rolled_back"}
            )

    def _fail(
        self, conn: psycopg.Connection, index: int, batch: _Batch | None, exc: psycopg.Error
    ) -> None:
        self.abort()  # before anything else: no sibling commits after this
        # If the connection is gone, the server has rolled the batch back already.
        with contextlib.suppress(psycopg.Error):
            conn.rollback()
        batch_ids: dict[str, Any] = batch.log_ids() if batch is not None else {}
        # the alert carries class + SQLSTATE only (a trigger's RAISE text may hold row values);
        # the task log keeps the server's first line for whoever debugs it
        error = error_code(exc)
        message = str(exc).splitlines()[0] if str(exc) else ""
        self.telemetry.log.error(
            "batch_failed",
            table=self.table,
            batch_index=index,
            batch_ids=json.dumps(batch_ids),
            committed_batches=self.batches,
            error=error,
            message=message[:300],
        )
        self.telemetry.alerts.send(
            Alert(
                name="retention_batch_failed",
                severity="warning",
                summary=(
                    f"activity retention: batch {index} of {self.table} failed and was rolled "
                    f"back; {self.batches} other batch(es) of the task are committed"
                ),
                details={"table": self.table, "batch_ids": batch_ids, "error": error},
            )
        )
        raise BatchFailed(
            f"{self.table}: batch {index} ({batch_ids.get('count', 0)} sessions, "
            f"first {batch_ids.get('first')}, "
            f"last {batch_ids.get('last')}) failed and was rolled back: {error}"
        ) from exc


# --------------------------------------------------------------------------------------------
# report and the whole run


def report(
    plan: RunPlan,
    steps: Sequence[StepResult],
    telemetry: Telemetry,
    *,
    wall_clock: Callable[[], float] = time.time,
) -> RetentionResult:
    """Sum the steps into the seed's result, log ``completed``, emit the run-level metrics.

    The run duration is measured on worker wall clocks (``prepare``'s start to now): in the DAG
    the tasks may run on different workers, whose clock skew is small next to a run.
    """
    with telemetry.run_span(f"{JOB} report") as span:
        result = _report(plan, steps, telemetry, wall_clock=wall_clock)
        set_result(span, result.as_dict())
        return result


def _report(
    plan: RunPlan,
    steps: Sequence[StepResult],
    telemetry: Telemetry,
    *,
    wall_clock: Callable[[], float],
) -> RetentionResult:
    by_table = {s.table: s for s in steps}
    result = RetentionResult(
        deleted_sessions=by_table.get("sessions", StepResult("sessions")).rows,
        deleted_property_object_views=by_table.get(
            "property_object_views", StepResult("property_object_views")
        ).rows,
        deleted_action_events=by_table.get("action_events", StepResult("action_events")).rows,
        batches_processed=by_table.get("sessions", StepResult("sessions")).batches,
        batches_by_table={s.table: s.batches for s in steps},
        has_more=any(s.has_more for s in steps),
        dry_run=plan.dry_run,
        steps=tuple(steps),
    )
    duration = max(wall_clock() - plan.started_at_unix, 0.0)
    if any(s.lock_skipped for s in steps):
        # one busy run counts once (the alert rule thinks in nightly runs, not delete tasks),
        # and records no duration: a skip is no run and would dilute the near-max rule
        telemetry.metrics.incr(M_LOCK_CONTENTION)
    else:
        telemetry.metrics.timing(M_RUN_DURATION, timedelta(seconds=duration))
    telemetry.metrics.gauge("activity_retention_last_success_timestamp_seconds", wall_clock())
    # the result's keys in snake_case (docs/design.md, "Log vocabulary"); a dry run reports
    # would_delete_* and its deleted_* stay 0, as in the result
    skipped = ",".join(s.table for s in steps if s.lock_skipped) or "none"
    if result.dry_run:
        telemetry.log.info(
            "completed",
            deleted_sessions=0,
            deleted_property_object_views=0,
            deleted_action_events=0,
            would_delete_sessions=result.deleted_sessions,
            would_delete_property_object_views=result.deleted_property_object_views,
            would_delete_action_events=result.deleted_action_events,
            batches_processed=result.batches_processed,
            has_more=result.has_more,
            dry_run=True,
            lock_skipped_steps=skipped,
            eligible_backlog=plan.eligible_backlog,
            duration_ms=round(duration * 1000),
        )
    else:
        telemetry.log.info(
            "completed",
            deleted_sessions=result.deleted_sessions,
            deleted_property_object_views=result.deleted_property_object_views,
            deleted_action_events=result.deleted_action_events,
            batches_processed=result.batches_processed,
            has_more=result.has_more,
            dry_run=False,
            lock_skipped_steps=skipped,
            eligible_backlog=plan.eligible_backlog,
            duration_ms=round(duration * 1000),
        )
    return result


def run(
    connect: Connect,
    config: dict[str, Any],
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    dry_run: bool = False,
) -> RetentionResult:
    """One whole run in one process: prepare, the three delete steps (each under the job's
    lock, as in the DAG), report."""
    with telemetry.run_span(f"{JOB} run"):
        return _run(connect, config, telemetry, stop, dry_run=dry_run)


def _run(
    connect: Connect,
    config: dict[str, Any],
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    dry_run: bool,
) -> RetentionResult:
    plan = prepare(connect, config, telemetry, dry_run=dry_run)
    # Each step takes the lock for itself, as the DAG's tasks do (one lock connection per
    # step, never one held across steps while another step opens connections).
    lock_name = None if dry_run else LOCK_NAME
    return report(plan, _chain(connect, plan, telemetry, stop, lock_name), telemetry)


def _chain(
    connect: Connect,
    plan: RunPlan,
    telemetry: Telemetry,
    stop: StopSignal,
    lock_name: str | None,
) -> list[StepResult]:
    """The three delete steps in FK order, each covering what the one before it covered."""
    steps: list[StepResult] = []
    for table in TABLES:
        after = steps[-1] if steps else None
        steps.append(
            delete_step(connect, plan, table, telemetry, stop, lock_name=lock_name, after=after)
        )
    return steps


# --------------------------------------------------------------------------------------------
# command line: the job without Airflow (python -m include.pin_maintenance.jobs.activity_retention)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.pin_maintenance.jobs.activity_retention",
        description="Run ActivityRetentionJob once against a database (no Airflow needed).",
    )
    add_db_arguments(parser, what="user-activity database")
    parser.add_argument("--config", default="", help='JSON object, e.g. {"batch_size": 100}')
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--run-id", default=f"cli__{uuid.uuid4().hex[:8]}")
    parser.add_argument("--lock-timeout-ms", type=int, default=SESSION_SETTINGS.lock_timeout_ms)
    args = parser.parse_args(argv)
    conninfo = db_conninfo(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)

    try:
        config = CONFIG.resolve(args.config or None, None)
    except ConfigError as exc:
        print(f"ConfigError: {exc}", file=sys.stderr)
        return 2
    settings = SessionSettings(
        statement_timeout_ms=SESSION_SETTINGS.statement_timeout_ms,
        lock_timeout_ms=args.lock_timeout_ms,
        application_name=SESSION_SETTINGS.application_name,
    )
    connect = configured(lambda: psycopg.connect(conninfo), settings)
    log = JobLog(JOB, args.run_id)
    telemetry = Telemetry.local(log)
    stop = StopSignal()
    try:
        with stop.on_sigterm():
            result = run(connect, config, telemetry, stop, dry_run=args.dry_run)
    except JobCancelled as exc:
        print(f"JobCancelled: {exc}", file=sys.stderr)
        return 3
    except BatchFailed as exc:
        print(f"BatchFailed: {exc}", file=sys.stderr)
        return 1
    except PoolTooSmall as exc:
        print(f"PoolTooSmall: {exc}", file=sys.stderr)
        return 1
    except privileges.MissingPrivileges as exc:
        print(f"MissingPrivileges: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
