"""One delete step's keyset walk over the eligible sessions, shared by independent batch loops
(each a lane of :func:`~include.pin_maintenance.parallel.run_batch_loops`); only the claim is
serialised. Why, and what bounds the stop: docs/design/retention.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psycopg
from opentelemetry import context as otel_context
from opentelemetry.trace import Span
from psycopg import pq

from include.pin_maintenance import sql
from include.pin_maintenance.jobs.activity_retention_config import (
    CANCEL_TIMEOUT_SECONDS,
    JOB,
    STOP_GRACE_SECONDS,
)
from include.pin_maintenance.lifecycle import describe_error
from include.pin_maintenance.pacing import Pacer
from include.pin_maintenance.parallel import BatchBudget, Deadline, Lane, run_batch_loops
from include.pin_maintenance.stopping import StopReason, StopSignal
from include.pin_maintenance.telemetry import Alert, Telemetry, error_code

if TYPE_CHECKING:  # the run's module imports this one
    from include.pin_maintenance.jobs.activity_retention import RunPlan

_SQL = {  # table -> its delete, and its count for a dry run
    "action_events": ("retention/delete_action_events", "retention/count_action_events"),
    "property_object_views": (
        "retention/delete_property_object_views",
        "retention/count_property_object_views",
    ),
    "sessions": ("retention/delete_childless_sessions", "retention/count_sessions"),
}

M_BATCHES = "activity_retention_batches_processed"
M_PACED_PREFIX = "activity_retention_paced"
DELETED_METRIC = {
    "action_events": "activity_retention_deleted_action_events",
    "property_object_views": "activity_retention_deleted_property_object_views",
    "sessions": "activity_retention_deleted_sessions",
}

# before / after every possible (ended_at, id)
KEY_START = (datetime(1, 1, 1, tzinfo=UTC), uuid.UUID(int=0))
KEY_END = (datetime(9999, 12, 31, tzinfo=UTC), uuid.UUID(int=(1 << 128) - 1))
# a failed batch's log and alert carry its first/last id, its count and up to this many ids
FAILED_BATCH_SAMPLE_IDS = 20


@dataclass(frozen=True)
class ClaimedBatch:
    """One claimed batch; its ids stay the ``uuid[]`` literal the server sent (never parsed)."""

    index: int
    ids: str
    count: int
    first: uuid.UUID
    last: uuid.UUID

    def log_ids(self) -> dict[str, Any]:
        first, last, ids = str(self.first), str(self.last), _sample_ids(self.ids)
        return {"first": first, "last": last, "count": self.count, "ids": ids}


@dataclass(frozen=True)
class StepResult:
    """One delete task: rows of its table deleted (or counted, in a dry run) and how it ended."""

    table: str
    rows: int = 0
    batches: int = 0
    stop_reason: str = StopReason.DRAINED.value
    lock_skipped: bool = False
    dry_run: bool = False
    # the last claimed session (None: none): the run's later steps cover no session past it
    last_ended_at: str | None = None
    last_id: str | None = None
    paced_ms: int = 0

    def covered(self) -> tuple[datetime, uuid.UUID] | None:
        """The last (ended_at, id) this step covered, or None when it covered everything."""
        if self.lock_skipped:
            return KEY_START  # it covered nothing
        if self.stop_reason == StopReason.DRAINED.value:
            return None
        if self.last_ended_at is None or self.last_id is None:
            return KEY_START
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


class BatchFailed(RuntimeError):
    """A batch failed and was rolled back; earlier batches of the step stay committed."""

    alert_event = "retention_batch_failed"  # the task_failed alert that follows names it


class KeysetWalk:
    """One step's shared keyset position and the batch every loop repeats. ``after``: the step
    before (None: none); the walk ends at the last key it covered, bounded as it was."""

    def __init__(
        self,
        plan: RunPlan,
        table: str,
        telemetry: Telemetry,
        stop: StopSignal,
        *,
        deadline: Deadline,
        after: StepResult | None = None,
    ) -> None:
        self.plan, self.table, self.telemetry, self.stop = plan, table, telemetry, stop
        self.deadline = deadline
        self.until_ended_at, self.until_id = (after and after.covered()) or KEY_END
        self._bounded_by = StopReason(after.stop_reason if after else StopReason.DRAINED)
        self._claim_lock = threading.Lock()  # the keyset position and the claim count
        self._count_lock = threading.Lock()  # the totals
        self._aborted = threading.Event()  # a loop failed: nothing more commits
        self._lanes: set[int] = set()  # lanes whose cancel hooks are set
        self._parent = otel_context.get_current()
        self.after_ended_at, self.after_id = KEY_START
        # batches claimed (the next one's index), committed (or counted), rows deleted (counted)
        self.claimed = self.batches = self.rows = 0
        self.stop_reason = StopReason.DRAINED
        self._end: StopReason | None = None  # the end of the range, once reached
        self._select = sql.load(
            "retention/peek_session_batch" if plan.dry_run else "retention/claim_session_batch"
        )
        delete, count = _SQL[table]
        self._act = sql.load(count if plan.dry_run else delete)

    def run(self, conns: Sequence[psycopg.Connection]) -> StepResult:
        """Walk with one batch loop per connection; the step's result once every loop stopped."""
        pacer = self._pacer(conns)
        loops = run_batch_loops(
            [functools.partial(self.batch, conn) for conn in conns],
            stop=self.stop,
            deadline=self.deadline,
            budget=BatchBudget(self.plan.config.max_batches_per_run, self.plan.config.batch_size),
            grace_seconds=STOP_GRACE_SECONDS,
            pacing=pacer,
        )
        self.stop_reason = self._reason(loops)
        return StepResult(
            table=self.table,
            rows=self.rows,
            batches=self.batches,
            stop_reason=self.stop_reason.value,
            dry_run=self.plan.dry_run,
            last_ended_at=self.after_ended_at.isoformat() if self.claimed else None,
            last_id=str(self.after_id) if self.claimed else None,
            paced_ms=round(pacer.paced_total * 1000) if pacer is not None else 0,
        )

    def _pacer(self, conns: Sequence[psycopg.Connection]) -> Pacer | None:
        """The step's pacing (docs/design.md, "Pacing"); a dry run only reads. The sessions
        step's batches stay whole (the seed's unit), the child steps' are sized to the load."""
        config = self.plan.config
        if self.plan.dry_run or not config.paced:
            return None
        pacer = Pacer(
            config,
            self.telemetry,
            paced_metric_prefix=M_PACED_PREFIX,
            deadline_remaining=self.deadline.remaining,
            batch_size=None if self.table == "sessions" else config.batch_size,
        )
        pacer.connections = list(conns)
        return pacer

    def _reason(self, loops: StopReason) -> StopReason:
        """Why the step ended; the end of the range wins over what the loops met after it."""
        if self._end is not None:
            return self._end
        if self.stop.is_set():  # the run's stop (SIGTERM)
            return StopReason.CANCELLED
        if loops is StopReason.CANCELLED:  # the join cancelled loops past the deadline + grace
            return StopReason.MAX_DURATION
        return loops

    def batch(self, conn: psycopg.Connection, lane: Lane, size: int | None) -> bool:
        """Claim, delete and commit one batch of ``size`` sessions (None: batch_size) on the
        lane's ``conn``; True when it was full."""
        if lane.index not in self._lanes:
            self._lanes.add(lane.index)
            if lane.index:
                otel_context.attach(self._parent)  # this thread's own context, gone with it
            lane.on_cancel(self._aborted.set)  # first: a batch not committed now rolls back
            lane.on_cancel(functools.partial(conn.cancel_safe, timeout=CANCEL_TIMEOUT_SECONDS))
        size = size or self.plan.config.batch_size
        try:
            batch = self._claim(lane, conn, size)
            if batch is None:
                return False
            attributes = {"pin.batch.index": batch.index, "pin.table": self.table}
            with self.telemetry.span(f"{JOB} batch", attributes) as span:
                self._act_on(conn, batch, span)
            return batch.count >= size
        except BaseException:
            _end_interrupted(conn)
            raise

    def _claim(self, lane: Lane, conn: psycopg.Connection, size: int) -> ClaimedBatch | None:
        """The next batch of at most ``size`` sessions, row-locked in ``conn``'s transaction;
        None at the end of the range, a stop or a failure."""
        with self._claim_lock:  # untimed: see docs/design/retention.md
            # rechecked under the lock: a sibling may have ended, failed or timed out meanwhile
            if (
                self._end is not None
                or self._aborted.is_set()
                or lane.stop.is_set()
                or (self.claimed > 0 and lane.deadline.expired())
            ):
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
                        "batch_size": size,
                    },
                ).fetchone()
            except psycopg.Error as exc:
                if self._aborted.is_set():  # cancelled because a sibling failed
                    return None
                self._fail(conn, index, None, exc)
            if not count:
                conn.rollback()
                self._reached_end()
                return None
            self.claimed += 1
            self.after_ended_at, self.after_id = last_ended_at, last_id
            if count < size:
                self._reached_end()  # a short batch
            return ClaimedBatch(index, ids, count, first, last_id)

    def _reached_end(self) -> None:
        # the end of what a bounded earlier step covered: the same bound (HasMore), not drained
        bounded = self.until_ended_at != KEY_END[0]
        self._end = self._bounded_by if bounded else StopReason.DRAINED

    def _act_on(self, conn: psycopg.Connection, batch: ClaimedBatch, span: Span) -> None:
        done = False
        try:
            cur = conn.execute(self._act, {"session_ids": batch.ids, "cutoff": self.plan.cutoff})
            affected = cur.fetchone()[0] if self.plan.dry_run else cur.rowcount
            if not self._aborted.is_set():  # else a sibling failed: this batch must not commit
                (conn.rollback if self.plan.dry_run else conn.commit)()
                done = True
        except psycopg.Error as exc:
            if not self._aborted.is_set():  # else cancelled because a sibling failed
                self._fail(conn, batch.index, batch, exc)
        if not done:
            with contextlib.suppress(psycopg.Error):
                conn.rollback()
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
            return
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
            attributes = {"pin.batch.sessions": batch.count, "pin.batch.rows": affected}
            span.set_attributes(attributes | {"pin.batch.outcome": outcome})

    def _fail(
        self, conn: psycopg.Connection, index: int, batch: ClaimedBatch | None, exc: psycopg.Error
    ) -> None:
        self._aborted.set()  # first: no sibling commits after this
        with contextlib.suppress(psycopg.Error):
            conn.rollback()
        batch_ids: dict[str, Any] = batch.log_ids() if batch is not None else {}
        error = error_code(exc)  # the alert's: no server text (it may hold row values)
        self.telemetry.log.error(
            "batch_failed",
            table=self.table,
            batch_index=index,
            batch_ids=json.dumps(batch_ids),
            committed_batches=self.batches,
            error=error,
            message=describe_error(exc),
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


def _sample_ids(literal: str, limit: int = FAILED_BATCH_SAMPLE_IDS) -> list[str]:
    """The first ``limit`` ids of a ``uuid[]`` literal '{a,b,...}'."""
    if len(literal) <= 2:
        return []
    return literal[1:-1].split(",", limit)[:limit]


def _end_interrupted(conn: psycopg.Connection) -> None:
    """After an exception psycopg did not handle (AirflowTaskTimeout, a bug): cancel the
    statement still running on the server, then close (the batch rolls back)."""
    with contextlib.suppress(Exception):
        if conn.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
            conn.cancel_safe(timeout=CANCEL_TIMEOUT_SECONDS)
    with contextlib.suppress(Exception):
        conn.close()
