"""SlotExpirationJob (seed 002): Available slots whose start has passed become Expired.

One cycle fixes ``AsOf``, then expires the oldest due slots in ``FOR UPDATE SKIP LOCKED``
batches, one transaction each, on up to ``runners`` loops in drain mode; no global lock. Design:
docs/design/pooler-and-slots.md; one batch and its poison isolation: ``slot_expiration_batch``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from opentelemetry import context as otel_context

from include.pin_maintenance import cli, privileges, sql
from include.pin_maintenance.db import Connect, SessionSettings, require_server_connections
from include.pin_maintenance.jobs.slot_expiration_batch import (
    COUNT_CAP,
    M_ERRORS,
    CycleState,
    KeysetPosition,
    PoisonSlot,
    run_batch,
)
from include.pin_maintenance.jobs.slot_expiration_config import (
    CONFIG,
    JOB,
    STATEMENT_TIMEOUT_SECONDS,
    STOP_GRACE_SECONDS,
    SlotConfig,
)
from include.pin_maintenance.lifecycle import (
    CappedAlerts,
    JobMetrics,
    JobRun,
    JobSpec,
    describe_error,
    job_run,
)
from include.pin_maintenance.pacing import Pacer, paced_metrics
from include.pin_maintenance.parallel import BatchBudget, Deadline, Lane, run_batch_loops
from include.pin_maintenance.stopping import StopReason, StopSignal
from include.pin_maintenance.telemetry import Telemetry

# A commit lost in a crash only leaves its slots Available for the next cycle (the seed
# publishes no events): no WAL flush per batch. Set per transaction, like the timeouts.
SESSION = SessionSettings(
    statement_timeout_ms=STATEMENT_TIMEOUT_SECONDS * 1000,
    lock_timeout_ms=5_000,
    application_name="pin-slot-expiration",
    synchronous_commit="off",
)

# Metric names are a contract; do not rename. M_ERRORS lives with the batch.
M_CYCLE_DURATION = "calendar_slot_expiration_cycle_duration_seconds"
M_ITEMS = "calendar_slot_expiration_items_total"
M_BACKLOG = "calendar_slot_expiration_backlog"
M_SKIP_LOCKED = "calendar_slot_expiration_skip_locked_total"
M_LAST_SUCCESS = "calendar_slot_expiration_last_success_timestamp_seconds"
M_PACED_PREFIX = "calendar_slot_expiration_paced"

SPEC = JobSpec(
    job=JOB,
    config=CONFIG,
    metrics=JobMetrics(
        counters=(M_ITEMS, M_SKIP_LOCKED, M_ERRORS, *paced_metrics(M_PACED_PREFIX)),
        duration=M_CYCLE_DURATION,
        last_success=M_LAST_SUCCESS,
    ),
)


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
    paced_ms: int = 0

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
            "PacedMs": self.paced_ms,
        }
        if self.dry_run:
            out |= {"DryRun": True, "WouldExpireCount": self.would_expire_count}
        return out


def run(
    connect: Connect,
    config: SlotConfig | Mapping[str, Any],
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    dry_run: bool = False,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
    clock: Callable[[], float] = time.monotonic,
) -> ExpirationResult:
    """Run one expiration cycle; return the seed's result. ``config``: ``CONFIG.resolve(...)``
    or a mapping to resolve; ``now`` gives AsOf, ``clock`` measures the duration bound."""
    if not isinstance(config, SlotConfig):
        config = CONFIG.resolve(config, variable_source="config")
    with job_run(SPEC, telemetry) as job:
        started = clock()
        cycle = CycleState(as_of=now(), batch_size=config.batch_size)
        job.started(
            as_of=cycle.as_of.isoformat(),
            batch_size=cycle.batch_size,
            runners=config.runners,
            max_run_duration_seconds=config.max_run_duration_seconds,
            dry_run=dry_run,
        )
        try:
            privileges.require(connect, JOB, telemetry)  # before any write
            with contextlib.closing(_open(connect)) as conn:
                loops: BatchLoops | None = None
                if not dry_run:
                    loops = BatchLoops(connect, cycle, telemetry, stop, config, clock=clock)
                result = _cycle(conn, cycle, loops, started=started, clock=clock, now=now)
        except BaseException as exc:  # the batch in hand rolled back; job_run logs job_failed
            if isinstance(exc, psycopg.Error):
                telemetry.metrics.incr(M_ERRORS)
            job.progress.update(expired_count=cycle.expired, duration_ms=_ms(clock() - started))
            raise
        _completed(job, result)
        if result.stop_reason == StopReason.CANCELLED:
            job.progress.update(expired_count=result.expired_count, duration_ms=result.duration_ms)
            raise job.cancelled(
                stop.reason or StopReason.CANCELLED.value,
                f"{JOB}: {stop.reason}; {result.expired_count} slots expired",
            )
        return result


def _cycle(
    conn: psycopg.Connection,
    cycle: CycleState,
    loops: BatchLoops | None,
    *,
    started: float,
    clock: Callable[[], float],
    now: Callable[[], datetime],
) -> ExpirationResult:
    """The cycle's batches, then what it skipped and what is still due. A dry run (no
    ``loops``) counts what a cycle would expire; it locks and changes nothing."""
    would, reason, skipped = None, StopReason.DRAINED, 0
    if loops is None:
        would = _count(conn, "slots/count_due_slots", cycle.params())
    else:
        reason = loops.run(conn)
        skipped = _count(conn, "slots/count_skipped_slots", loops.skipped_params(reason))
    backlog = _count(conn, "slots/count_backlog", {"now": now(), "count_cap": COUNT_CAP})
    return ExpirationResult(
        expired_count=cycle.expired,
        skipped_locked_count=skipped,
        duration_ms=_ms(clock() - started),
        as_of=cycle.as_of,
        batches=cycle.batches,
        stop_reason=reason.value,
        poison=tuple(cycle.poison),
        backlog=backlog,
        dry_run=loops is None,
        would_expire_count=would,
        runners=len(loops.positions) if loops else 1,  # loops started
        paced_ms=_ms(loops.pacer.paced_total) if loops and loops.pacer else 0,
    )


def _completed(job: JobRun, result: ExpirationResult) -> None:
    """Metrics and ``job_completed``. A dry run is no cycle (no metrics, duration or last
    success); a cancelled cycle reports its committed batches but is no success."""
    if not result.dry_run:
        job.metrics.incr(M_ITEMS, result.expired_count)
        job.metrics.incr(M_SKIP_LOCKED, result.skipped_locked_count)
        job.metrics.gauge(M_BACKLOG, result.backlog)
    job.completed(
        result.as_dict(),
        duration_seconds=None if result.dry_run else result.duration_ms / 1000,
        success=not result.dry_run and result.stop_reason != StopReason.CANCELLED,
        dry_run=result.dry_run,
        would_expire_count=result.would_expire_count,
        expired_count=result.expired_count,
        duration_ms=result.duration_ms,
        skipped_locked_count=result.skipped_locked_count,
        errors_count=result.errors_count,
        batches=result.batches,
        runners=result.runners,
        stop_reason=result.stop_reason,
        backlog=result.backlog,
        paced_ms=result.paced_ms,
    )


class BatchLoops:
    """The cycle's batch loops: the first batch alone; when it comes back full, lane 0 and up
    to ``runners - 1`` side loops under one :class:`BatchBudget`, each with its own keyset
    position (docs/design/pooler-and-slots.md, "Side by side")."""

    def __init__(
        self,
        connect: Connect,
        cycle: CycleState,
        telemetry: Telemetry,
        stop: StopSignal,
        config: SlotConfig,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.connect, self.cycle, self.telemetry, self.stop = connect, cycle, telemetry, stop
        self.deadline = Deadline(config.max_run_duration_seconds, clock=clock)
        self.runners, self.max_batches = config.runners, config.max_batches_per_cycle
        self.pacer: Pacer | None = None
        if self.max_batches > 1 and config.paced:  # one batch a cycle needs no pacing
            self.pacer = Pacer(
                config,
                telemetry,
                paced_metric_prefix=M_PACED_PREFIX,
                deadline_remaining=self.deadline.remaining,
                batch_size=cycle.batch_size,
            )
        self.budget = BatchBudget(self.max_batches, cycle.batch_size)
        # a trigger that rejects every row alerts a capped number of times
        self.alerts = CappedAlerts(telemetry.alerts)
        self.positions = [KeysetPosition(1)]  # one per loop started; the first's is the caller's

    def run(self, conn: psycopg.Connection) -> StopReason:
        if self.stop.is_set():
            return StopReason.CANCELLED
        # a short first batch (the usual cycle) opens no side loop and reads no pacing signal
        self.budget.take()
        if not run_batch(conn, self.cycle, self.positions[0], self.telemetry, self.alerts):
            return StopReason.DRAINED
        side = self._open_side_connections(conn)
        batches = [self._batches(conn, self.positions[0])]
        for number, side_conn in enumerate(side, start=2):
            self.positions.append(KeysetPosition(number))
            batches.append(self._batches(side_conn, self.positions[-1], otel_context.get_current()))
        if self.pacer is not None:
            self.pacer.connections = [conn, *side]
        try:
            return run_batch_loops(
                batches,
                stop=self.stop,
                deadline=self.deadline,
                budget=self.budget,
                grace_seconds=STOP_GRACE_SECONDS,
                pacing=self.pacer,
            )
        finally:
            for side_conn in side:
                side_conn.close()

    def skipped_params(self, reason: StopReason) -> dict[str, Any]:
        """Parameters of count_skipped_slots.sql (docs/design/pooler-and-slots.md, section 3)."""
        walked = [p.after for p in self.positions if p.after is not None]
        return self.cycle.params() | {
            "bounded": reason is not StopReason.DRAINED,
            "before": max(walked) if walked else None,
        }

    def _batches(
        self,
        conn: psycopg.Connection,
        position: KeysetPosition,
        parent: otel_context.Context | None = None,
    ) -> Callable[[Lane, int | None], bool]:
        first = True

        def batch(lane: Lane, size: int | None) -> bool:
            nonlocal first
            if first:
                first = False
                lane.on_cancel(conn.cancel_safe)  # interrupts a statement in flight
                if parent is not None:
                    otel_context.attach(parent)  # a thread starts with an empty context
            return run_batch(conn, self.cycle, position, self.telemetry, self.alerts, size=size)

        return batch

    def _open_side_connections(self, conn: psycopg.Connection) -> list[psycopg.Connection]:
        """Side loops' connections (opened on the caller's thread, where an Airflow hook can read
        its Connection), when runners, the batch bound and the time allow them."""
        if (
            self.runners < 2
            or self.max_batches <= 1
            or self.stop.is_set()
            or self.deadline.expired()
        ):
            return []
        side: list[psycopg.Connection] = []
        for number in range(2, self.runners + 1):
            try:
                side.append(_open(self.connect))
            except psycopg.Error as exc:  # more loops are an optimisation, not a requirement
                self.telemetry.log.warning(
                    "runner_not_started", runner=number, error=describe_error(exc)
                )
                break
        if side:
            try:
                require_server_connections(
                    [conn, *side], job=JOB, what=f"{len(side) + 1} batch loops (runners)"
                )
            except BaseException:
                for side_conn in side:
                    side_conn.close()
                raise
        return side


def _open(connect: Connect) -> psycopg.Connection:
    """A connection in autocommit: every batch is an explicit transaction."""
    conn = connect()
    try:
        conn.autocommit = True
    except BaseException:
        conn.close()
        raise
    return conn


def _count(conn: psycopg.Connection, query: str, params: Mapping[str, Any]) -> int:
    row = conn.execute(sql.load(query), params).fetchone()
    return int(row[0]) if row else 0


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _run(cli_run: cli.CliRun) -> Mapping[str, Any]:
    return run(
        cli_run.connect, cli_run.config, cli_run.telemetry, cli_run.stop, dry_run=cli_run.dry_run
    ).as_dict()


CLI = cli.JobCli(
    spec=SPEC,
    module="include.pin_maintenance.jobs.slot_expiration",
    database="calendar database",
    description="Run SlotExpirationJob once against a database (no Airflow needed).",
    session=SESSION,
    run=_run,
)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: one cycle against ``--db-url``; prints the result as JSON (exit codes: cli.py)."""
    return cli.main(CLI, argv)


if __name__ == "__main__":
    sys.exit(main())
