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
   With ``runners`` > 1 (default 3) a step runs that many batch loops, one connection each:
   they claim the same batches one loop would, one after the other, delete them side by side
   and commit them in batch order, so the committed state is always one loop's (see
   :class:`_Walk`). The ``sessions`` step deletes only sessions of the batch that have no
   child rows left (``NOT EXISTS`` on both child tables), so it never hits the RESTRICT
   foreign keys and never
   removes a session whose children an earlier step left behind (bounded, failed or skipped);
   those stay eligible and the next run finishes them (data-driven resume, no checkpoint).
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
on the server clock and every step stops between batches once it has passed; each step still
runs its first batch, so a run whose earlier tasks (or Airflow's scheduling) used up the budget
still makes progress. ``max_batches_per_run`` bounds each step, so all three cover the same
prefix of the eligible set.

Why SKIP LOCKED and the advisory lock both: the lock ``job:scheduled:activity-retention`` keeps
a second deployment, a manual ``airflow tasks test`` or an old worker out; the row locks make
even two lock-less runs delete every row exactly once (seed, "Duplicate run"). In the DAG each
delete task takes the lock for itself (tasks are separate processes); a runner slipping in
between two tasks is harmless for the same reasons.

Lock TTL: each delete step holds the lock on its own connection for as long as it runs, as a
lease of ``max_run_duration_seconds + LOCK_TTL_MARGIN_SECONDS``. A step checks its budget
between batches only, so it can overrun the run deadline by at most one batch: two
statements, each bounded by ``statement_timeout`` (:data:`SESSION_SETTINGS`, 2 x 120 s < 300 s
margin); with several loops the batches in flight run side by side, each waiting at most for
the one ahead of it, which started before the deadline too. A holder that hangs longer loses
the lock to the server, so it cannot block later runs.
"""

from __future__ import annotations

import argparse
import contextlib
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

from include.pin_maintenance import sql
from include.pin_maintenance.config import ConfigError
from include.pin_maintenance.db import (
    Connect,
    SessionSettings,
    advisory_lock,
    configured,
    lock_held_too_long,
)
from include.pin_maintenance.jobs.activity_retention_config import CONFIG, JOB
from include.pin_maintenance.runloop import (
    JobCancelled,
    StopReason,
    StopSignal,
)
from include.pin_maintenance.telemetry import (
    Alert,
    JobLog,
    Telemetry,
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

# Keyset start: before every possible (ended_at, id).
_KEY_START = (datetime(1, 1, 1, tzinfo=UTC), uuid.UUID(int=0))


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
        return {"first": str(self.first), "last": str(self.last), "count": self.count}


class BatchFailed(RuntimeError):
    """A batch failed and was rolled back; earlier batches of the step stay committed."""


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
    """The seed's result (step 8). ``batches_processed`` counts committed batch transactions
    of all three delete steps (the same as the activity_retention_batches_processed counter).
    """

    deleted_sessions: int = 0
    deleted_property_object_views: int = 0
    deleted_action_events: int = 0
    batches_processed: int = 0
    has_more: bool = False
    dry_run: bool = False
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
) -> StepResult:
    """Delete ``table``'s rows of the eligible sessions, batch by batch, under the job lock.

    Busy lock: a warning ``lock_skip`` and a no-op result with ``lock_skipped`` (the task
    succeeds; the rows stay eligible for the next run); :func:`report` counts the busy run once
    in ``activity_retention_lock_contention_total``.
    ``lock_name=None`` runs without the advisory lock: only ``run`` (which already holds it)
    and the tests of the SKIP LOCKED isolation use that.

    A failing batch rolls back alone (earlier batches stay committed), is logged with its ids
    and alerted as ``retention_batch_failed``, and the step raises :class:`BatchFailed`.
    A stop request ends the step between batches and raises :class:`JobCancelled`.
    """
    with telemetry.run_span(f"{JOB} delete {table}") as span:
        step = _delete_step(connect, plan, table, telemetry, stop, lock_name=lock_name)
        set_result(span, step.to_xcom())
        return step


def _delete_step(
    connect: Connect,
    plan: RunPlan,
    table: str,
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    lock_name: str | None,
) -> StepResult:
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; expected one of {', '.join(TABLES)}")
    if plan.dry_run:
        return _walk(connect, plan, table, telemetry, stop)
    if lock_name is None:
        return _walk(connect, plan, table, telemetry, stop)
    ttl = plan.max_run_duration_seconds + LOCK_TTL_MARGIN_SECONDS
    with advisory_lock(connect, lock_name, ttl) as held:
        if not held:
            _lock_busy(connect, lock_name, plan, telemetry, table)
            return StepResult(table=table, lock_skipped=True)
        return _walk(connect, plan, table, telemetry, stop)


def _lock_busy(
    connect: Connect, lock_name: str, plan: RunPlan, telemetry: Telemetry, table: str
) -> None:
    """Lock skip: warning log, and an alert if the holder is stuck (``report`` counts the
    contention once per run, however many of its delete tasks found the lock busy)."""
    telemetry.log.warning("lock_skip", lock=lock_name, table=table)
    alert = lock_held_too_long(connect, lock_name, plan.max_run_duration_seconds, job=JOB)
    if alert:
        telemetry.alerts.send(alert)


def _walk(
    connect: Connect, plan: RunPlan, table: str, telemetry: Telemetry, stop: StopSignal
) -> StepResult:
    log = telemetry.log
    conns = [_open(connect)]
    try:
        remaining = (
            conns[0]
            .execute(sql.load("retention/seconds_until"), {"deadline_at": plan.deadline_at})
            .fetchone()[0]
        )
        conns[0].rollback()
        # The first batch always runs, so a run whose earlier tasks used up the budget still
        # makes progress; later batches stop at the run deadline.
        walk = _Walk(plan, table, telemetry, stop, max_duration_seconds=max(float(remaining), 0.0))
        # Side loops' connections are opened here, on the caller's thread (an Airflow hook
        # reads its Connection through the task runner, which is not for side threads).
        for number in range(2, _runner_count(plan) + 1):
            try:
                conns.append(_open(connect))
            except psycopg.Error as exc:  # more loops are an optimisation, not a requirement
                log.warning("runner_not_started", table=table, runner=number, error=str(exc))
                break
        walk.run(conns)
    finally:
        for conn in conns:
            with contextlib.suppress(psycopg.Error):
                conn.close()
    result = StepResult(
        table=table,
        rows=walk.rows,
        batches=walk.batches,
        stop_reason=walk.stop_reason.value,
        dry_run=plan.dry_run,
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


def _open(connect: Connect) -> psycopg.Connection:
    """A batch connection with asynchronous commit.

    A batch commit need not wait for the WAL flush: a commit lost in a server crash only leaves
    its rows in place, still eligible, and the next run deletes them (no events are published,
    nothing downstream saw the delete). Saves a WAL flush per batch.
    """
    conn = connect()
    try:
        conn.execute("select set_config('synchronous_commit', 'off', false)")
        conn.commit()
    except BaseException:
        conn.close()
        raise
    return conn


class _Walk:
    """One step's keyset walk over the eligible sessions, shared by the step's batch loops.

    The claim and the commit are serialised, the deletes run side by side. A loop takes the
    walk's lock, locks the next ``batch_size`` sessions after the last claimed key (``FOR
    UPDATE SKIP LOCKED``, in its own transaction), moves the key on and lets go; it deletes
    its table's rows of that batch while the next loop claims and deletes the next batch; it
    commits when every earlier batch has. So the loops take exactly the batches one loop would
    take (``max_batches_per_run`` counts them, every step covers the same prefix) and commit
    them in the same order: what is committed is always what one loop would have committed.
    A failed batch rolls back with every later one (one loop would not have started them),
    earlier ones commit; after a stop request the batch in hand finishes and later ones roll
    back. Batches of different sessions touch disjoint rows (a session's subtree is its own,
    seed step 4; a cross-session SET NULL reference updates a row that only one batch touches),
    so a loop never waits for a row lock of a batch queued behind it; if something outside
    the schema made it (a foreign trigger), ``lock_timeout`` would fail that batch, not hang.
    State: the last key, the commit turn and running totals, nothing more.
    """

    def __init__(
        self,
        plan: RunPlan,
        table: str,
        telemetry: Telemetry,
        stop: StopSignal,
        *,
        max_duration_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plan, self.table, self.telemetry, self.stop = plan, table, telemetry, stop
        self.max_duration_seconds, self.clock = max_duration_seconds, clock
        self.halt = StopSignal(parent=stop)  # set by a failing loop; follows the run's stop
        self._lock = threading.RLock()  # the claim and the commit order
        self._turn = threading.Condition(self._lock)
        self._settled = 0  # batches done in order (committed, or rolled back after a stop)
        self._failed_at: int | None = None  # the first failed batch: later ones roll back
        self._cancel_from: int | None = None  # stop seen: batches from here on roll back
        self.after_ended_at, self.after_id = _KEY_START
        self.claimed = 0  # batches claimed: the next batch's index
        self.batches = 0  # batches committed (or counted, in a dry run)
        self.rows = 0
        self.stop_reason = StopReason.DRAINED
        self._drained = False
        self._errors: list[BaseException] = []
        self._started = clock()
        self._select = sql.load(
            "retention/peek_session_batch" if plan.dry_run else "retention/claim_session_batch"
        )
        self._act = sql.load(_COUNT_SQL[table] if plan.dry_run else _DELETE_SQL[table])

    def run(self, conns: Sequence[psycopg.Connection]) -> None:
        threads = [
            threading.Thread(
                target=self._side_loop,
                # a thread starts with an empty context: its batch spans join the step's span
                args=(conn, otel_context.get_current()),
                name=f"activity-retention-{self.table}-{number}",
                daemon=True,
            )
            for number, conn in enumerate(conns[1:], start=2)
        ]
        for thread in threads:
            thread.start()
        try:
            self._loop(conns[0])
        except BaseException as exc:
            self._errors.insert(0, exc)
            self.halt.set("a batch loop failed")
        finally:
            for thread in threads:
                thread.join()
        if self._errors:
            raise self._errors[0]

    def _side_loop(self, conn: psycopg.Connection, parent: otel_context.Context) -> None:
        otel_context.attach(parent)  # this thread's own context, gone with the thread
        try:
            self._loop(conn)
        except BaseException as exc:  # raised on the caller's thread once every loop stopped
            self._errors.append(exc)
            self.halt.set("a batch loop failed")

    def _loop(self, conn: psycopg.Connection) -> None:
        while (batch := self._claim(conn)) is not None:
            attributes = {"pin.batch.index": batch.index, "pin.table": self.table}
            with self.telemetry.span(f"{JOB} batch", attributes) as span:
                self._act_on(conn, batch, span)

    def _claim(self, conn: psycopg.Connection) -> _Batch | None:
        """The next batch (its sessions row-locked in ``conn``'s open transaction), or None
        when a bound, a stop, a failure or the end of the set says so."""
        with self._lock:
            if self._drained:
                return None
            if self.halt.is_set():  # the run's stop (or a failed loop: raised by run())
                if self.stop.is_set() and self.stop_reason is StopReason.DRAINED:
                    self.stop_reason = StopReason.CANCELLED
                return None
            if self.claimed >= self.plan.max_batches_per_run:
                self.stop_reason = StopReason.MAX_BATCHES
                return None
            if self.claimed and self.clock() - self._started >= self.max_duration_seconds:
                self.stop_reason = StopReason.MAX_DURATION
                return None
            index = self.claimed
            try:
                count, ids, first, last_ended_at, last_id = conn.execute(
                    self._select,
                    {
                        "cutoff": self.plan.cutoff,
                        "after_ended_at": self.after_ended_at,
                        "after_id": self.after_id,
                        "batch_size": self.plan.batch_size,
                    },
                ).fetchone()
            except psycopg.Error as exc:
                self._fail(conn, index, None, exc)
            if not count:
                conn.rollback()
                self._drained = True
                return None
            self.claimed += 1
            self.after_ended_at, self.after_id = last_ended_at, last_id
            if count < self.plan.batch_size:
                self._drained = True  # a short batch: nothing more is eligible
            return _Batch(index, ids, count, first, last_id)

    def _act_on(self, conn: psycopg.Connection, batch: _Batch, span: Span) -> None:
        index = batch.index
        try:
            cur = conn.execute(self._act, {"session_ids": batch.ids, "cutoff": self.plan.cutoff})
            affected = cur.fetchone()[0] if self.plan.dry_run else cur.rowcount
        except psycopg.Error as exc:
            self._fail(conn, index, batch, exc)
        with self._turn:
            # Commits go in batch order: the committed batches are always a prefix of the
            # walk, as with one loop (a failure at batch N leaves exactly 0..N-1 committed).
            self._turn.wait_for(lambda: self._settled == index or self._failed_before(index))
            if self._failed_before(index) or (
                self._cancel_from is not None and index >= self._cancel_from
            ):
                # One loop would not have started this batch: an earlier one failed, or the
                # stop came before the batch ahead of it was done.
                with contextlib.suppress(psycopg.Error):
                    conn.rollback()
                if not self._failed_before(index):
                    self._settled += 1
                    self.stop_reason = StopReason.CANCELLED
                self._turn.notify_all()
                if span.is_recording():
                    span.set_attributes(
                        {"pin.batch.sessions": batch.count, "pin.batch.outcome": "rolled_back"}
                    )
                return
            try:
                if self.plan.dry_run:
                    conn.rollback()
                else:
                    conn.commit()
            except psycopg.Error as exc:
                self._fail(conn, index, batch, exc)
            self.rows += affected
            self.batches += 1
            if not self.plan.dry_run:
                self.telemetry.metrics.incr(DELETED_METRIC[self.table], affected)
                self.telemetry.metrics.incr(M_BATCHES)
            self._settled += 1
            if self.stop.is_set() and self._cancel_from is None:
                self._cancel_from = index + 1  # batches after this one roll back
            self._turn.notify_all()
        self.telemetry.log.debug(
            "batch",
            table=self.table,
            batch_index=index,
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

    def _failed_before(self, index: int) -> bool:
        return self._failed_at is not None and self._failed_at < index

    def _fail(
        self, conn: psycopg.Connection, index: int, batch: _Batch | None, exc: psycopg.Error
    ) -> None:
        with self._turn:
            self._failed_at = index if self._failed_at is None else min(self._failed_at, index)
            self.halt.set("a batch loop failed")
            self._turn.notify_all()
        # If the connection is gone, the server has rolled the batch back already.
        with contextlib.suppress(psycopg.Error):
            conn.rollback()
        batch_ids = batch.log_ids() if batch is not None else {}
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        self.telemetry.log.error(
            "batch_failed",
            table=self.table,
            batch_index=index,
            batch_ids=json.dumps(batch_ids),
            committed_batches=self.batches,
            error=error,
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
        batches_processed=sum(s.batches for s in steps),
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
    """One whole run in one process: prepare, the three delete steps under one lock, report."""
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
    if dry_run:
        steps = [delete_step(connect, plan, t, telemetry, stop, lock_name=None) for t in TABLES]
        return report(plan, steps, telemetry)
    ttl = plan.max_run_duration_seconds + LOCK_TTL_MARGIN_SECONDS
    with advisory_lock(connect, LOCK_NAME, ttl) as held:
        if not held:
            _lock_busy(connect, LOCK_NAME, plan, telemetry, "all")
            steps = [StepResult(table=t, lock_skipped=True) for t in TABLES]
        else:
            steps = [delete_step(connect, plan, t, telemetry, stop, lock_name=None) for t in TABLES]
    return report(plan, steps, telemetry)


# --------------------------------------------------------------------------------------------
# command line: the job without Airflow (python -m include.pin_maintenance.jobs.activity_retention)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.pin_maintenance.jobs.activity_retention",
        description="Run ActivityRetentionJob once against a database (no Airflow needed).",
    )
    parser.add_argument("--db-url", required=True, help="libpq URL of the user-activity DB")
    parser.add_argument("--config", default="", help='JSON object, e.g. {"batch_size": 100}')
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--run-id", default=f"cli__{uuid.uuid4().hex[:8]}")
    parser.add_argument("--lock-timeout-ms", type=int, default=SESSION_SETTINGS.lock_timeout_ms)
    args = parser.parse_args(argv)
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
    connect = configured(lambda: psycopg.connect(args.db_url), settings)
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
    print(json.dumps(result.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
