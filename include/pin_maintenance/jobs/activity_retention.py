"""ActivityRetentionJob (seed 003): delete Inactive sessions past retention, children first.

What is deleted: ``user_activity.sessions`` with ``status = 'Inactive' and ended_at < cutoff``,
``cutoff = now() - retention_period_days`` on the database server's clock, together with their
``action_events`` and ``property_object_views``. ``property_object_view_stats`` is never read
or written (INV-LVS-002: the aggregate outlives the raw views).

One run is

1. :func:`prepare`: takes the config validated by ``CONFIG.resolve`` (which raises
   ``ConfigError`` before any connection is opened), computes the cutoff and the run deadline
   ONCE on the server clock and counts the eligible backlog. Its :class:`RunPlan` is a handful
   of scalars (an XCom in the DAG).
2. :func:`delete_step` three times, in FK order: ``action_events``, ``property_object_views``,
   ``sessions``. Each step walks the eligible sessions oldest first in batches of
   ``batch_size`` ids (keyset on ``(ended_at, id)``, ``FOR UPDATE SKIP LOCKED``), one
   transaction per batch, with ``runners`` independent batch loops
   (:class:`~include.pin_maintenance.jobs.activity_retention_walk.KeysetWalk`). The
   ``sessions`` step deletes only sessions of the batch that have no child rows left, so it
   never hits the RESTRICT foreign keys, and any subset of committed batches is a safe state:
   what a bounded, failed or skipped step left stays eligible for the next run (data-driven
   resume, no checkpoint).
3. :func:`report`: the seed's result ``{DeletedSessions, ..., HasMore}``, the
   ``job_completed`` line and the run-level metrics.

Each is one phase of the run's lifecycle (``job_run``): ``prepare`` logs ``job_started``,
``report`` ``job_completed``. :func:`run` does all of it in one process (tests, the CLI); the
DAG runs each step as its own task, each taking the advisory lock
``job:scheduled:activity-retention`` for itself, as a lease of
``max_run_duration_seconds + LOCK_TTL_MARGIN_SECONDS``; the row locks alone already make two
lock-less runs delete every row exactly once (seed, "Duplicate run").

Every step of a run walks the same ordered prefix of the eligible set (at most
``max_batches_per_run`` batches, and each later step covers no session past the last one the
step before it covered), so the sessions step sees exactly the sessions the child steps
cleaned. The run's time budget is split between the steps (:data:`STEP_DEADLINE_SHARE`); each
step still runs its first batch, so a run always makes progress. Why the loops, the budget
split, the stop bound and the lock lease are as they are: docs/design/retention.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime, timedelta
from typing import Any

import psycopg

from include.pin_maintenance import cli, privileges, sql
from include.pin_maintenance.db import (
    Connect,
    SessionSettings,
    advisory_lock,
    require_server_connections,
)
from include.pin_maintenance.jobs.activity_retention_config import (
    CONFIG,
    JOB,
    STATEMENT_TIMEOUT_SECONDS,
    STEP_DEADLINE_SHARE,
    RetentionConfig,
)
from include.pin_maintenance.jobs.activity_retention_walk import (
    DELETED_METRIC,
    KEY_START,
    M_BATCHES,
    KeysetWalk,
    StepResult,
)
from include.pin_maintenance.lifecycle import JobMetrics, JobRun, JobSpec, job_run
from include.pin_maintenance.pacing import Pacer, paced_metrics
from include.pin_maintenance.parallel import Deadline
from include.pin_maintenance.stopping import StopReason, StopSignal
from include.pin_maintenance.telemetry import Telemetry, set_result

LOCK_NAME = "job:scheduled:activity-retention"
LOCK_TTL_MARGIN_SECONDS = 300

SESSION_SETTINGS = SessionSettings(
    statement_timeout_ms=STATEMENT_TIMEOUT_SECONDS * 1000,
    lock_timeout_ms=5_000,
    application_name="pin-activity-retention",
)

# Child tables first: the RESTRICT foreign keys on sessions(id) demand it (seed, step 4).
TABLES: tuple[str, ...] = ("action_events", "property_object_views", "sessions")

M_LOCK_CONTENTION = "activity_retention_lock_contention_total"
M_RUN_DURATION = "activity_retention_run_duration_seconds"
M_ELIGIBLE_BACKLOG = "activity_retention_eligible_backlog"
# time the loops spent paced, one counter per reason (pacing.paced_metrics)
M_PACED_PREFIX = "activity_retention_paced"

SPEC = JobSpec(
    job=JOB,
    config=CONFIG,
    metrics=JobMetrics(
        counters=(
            *DELETED_METRIC.values(),
            M_BATCHES,
            M_LOCK_CONTENTION,
            *paced_metrics(M_PACED_PREFIX),
        ),
        duration=M_RUN_DURATION,
        last_success="activity_retention_last_success_timestamp_seconds",
        lock_contention=M_LOCK_CONTENTION,
    ),
)


@dataclass(frozen=True)
class RunPlan:
    """What every task of one run acts on: the same cutoff, deadline and config (an XCom)."""

    cutoff: datetime
    deadline_at: datetime
    started_at_unix: float
    eligible_backlog: int
    config: RetentionConfig  # as prepare resolved it: every task of the run uses the same
    dry_run: bool = False

    def to_xcom(self) -> dict[str, Any]:
        """One flat JSON object: the config keys beside the plan's own."""
        data = {**asdict(self.config), **asdict(self)}
        del data["config"]
        data["cutoff"] = self.cutoff.isoformat()
        data["deadline_at"] = self.deadline_at.isoformat()
        return data

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> RunPlan:
        """The plan :meth:`to_xcom` wrote. A config key missing from it (a plan from before
        the key existed) gets its default, except ``runners``: there one loop was the run."""
        keys = {s.name for s in CONFIG.settings}
        config = {key: data[key] for key in keys & data.keys()}
        # a plan written by another version of the code may hold keys this one no longer has
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        config.setdefault("runners", 1)
        values["cutoff"] = datetime.fromisoformat(values["cutoff"])
        values["deadline_at"] = datetime.fromisoformat(values["deadline_at"])
        return cls(config=RetentionConfig(**config), **values)


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
    paced_ms: int = 0
    batches_by_table: dict[str, int] = field(default_factory=dict, compare=False)
    steps: tuple[StepResult, ...] = field(default=(), compare=False)

    @classmethod
    def of_steps(cls, steps: tuple[StepResult, ...], *, dry_run: bool) -> RetentionResult:
        """The run's result: each table's rows from its step, session batches as the seed's."""
        by_table = {s.table: s for s in steps}

        def step(table: str) -> StepResult:
            return by_table.get(table, StepResult(table))

        return cls(
            deleted_sessions=step("sessions").rows,
            deleted_property_object_views=step("property_object_views").rows,
            deleted_action_events=step("action_events").rows,
            batches_processed=step("sessions").batches,
            batches_by_table={s.table: s.batches for s in steps},
            has_more=any(s.has_more for s in steps),
            dry_run=dry_run,
            paced_ms=sum(s.paced_ms for s in steps),
            steps=steps,
        )

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
                "PacedMs": self.paced_ms,
            }
        )
        if self.dry_run:
            out.update({f"WouldDelete{k}": n for k, n in counts.items()})
        return out


def step_deadline(plan: RunPlan, table: str) -> datetime:
    """When ``table``'s step stops claiming batches (server clock): its share of the run."""
    share = STEP_DEADLINE_SHARE[table]
    return plan.deadline_at - timedelta(
        seconds=(1.0 - share) * plan.config.max_run_duration_seconds
    )


def lock_lease_seconds(plan: RunPlan) -> float:
    """The advisory lock's lease: a step holds it at most its share of the run plus one batch
    in hand (<= 2 statements of statement_timeout) and the stop grace, all inside the margin."""
    return plan.config.max_run_duration_seconds + LOCK_TTL_MARGIN_SECONDS


def _runner_count(plan: RunPlan) -> int:
    """Loops worth starting: no more than the batches the backlog (at prepare) can fill."""
    if plan.dry_run:
        return 1  # counts only: one reader is enough
    batches = max(1, -(-plan.eligible_backlog // plan.config.batch_size))
    return max(1, min(plan.config.runners, batches, plan.config.max_batches_per_run))


# --------------------------------------------------------------------------------------------
# prepare


def prepare(
    connect: Connect,
    config: RetentionConfig,
    telemetry: Telemetry,
    *,
    dry_run: bool = False,
    wall_clock: Callable[[], float] = time.time,
) -> RunPlan:
    """Fix the run's cutoff and deadline on the server clock and measure the backlog.

    ``config`` must come from ``CONFIG.resolve`` (validated). Reads only, takes no lock: the
    delete steps take it, each for itself, because each runs in its own task process.
    """
    with job_run(SPEC, telemetry, "prepare") as run:
        # for all three delete steps: a role without DELETE on sessions must not delete events
        privileges.require(connect, JOB, telemetry)
        conn = connect()
        try:
            cutoff, deadline_at = conn.execute(
                sql.load("retention/plan_run"),
                {
                    "retention_period_days": config.retention_period_days,
                    "max_run_duration_seconds": config.max_run_duration_seconds,
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
            eligible_backlog=int(backlog),
            config=config,
            dry_run=bool(dry_run),
        )
        telemetry.metrics.gauge(M_ELIGIBLE_BACKLOG, plan.eligible_backlog)
        run.started(
            cutoff=plan.cutoff.isoformat(),
            batch_size=config.batch_size,
            max_batches_per_run=config.max_batches_per_run,
            max_run_duration_seconds=config.max_run_duration_seconds,
            runners=config.runners,
            retention_period_days=config.retention_period_days,
            eligible_backlog=plan.eligible_backlog,
            dry_run=plan.dry_run,
        )
        set_result(run.span, plan.to_xcom(), "pin.plan.")
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

    Busy lock: ``job_skipped`` (reason ``lock_busy``, with the table) and a no-op result with
    ``lock_skipped`` (the task succeeds; the rows stay eligible for the next run);
    :func:`report` counts the busy run once in ``activity_retention_lock_contention_total``.
    ``lock_name=None`` runs without the advisory lock: only the tests of the SKIP LOCKED
    isolation use that.

    A failing batch rolls back (batches other loops committed stay committed), is logged with
    its ids and alerted as ``retention_batch_failed``, and the step raises
    :class:`BatchFailed`. Any other exception in any loop (``AirflowTaskTimeout`` included)
    cancels every loop's statement in flight, rolls back every batch not committed and is
    re-raised as is. A stop request ends the step between batches and raises
    :class:`JobCancelled`.
    """
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; expected one of {', '.join(TABLES)}")
    with job_run(SPEC, telemetry, f"delete {table}") as run:
        step = _delete_step(run, connect, plan, table, stop, lock_name=lock_name, after=after)
        set_result(run.span, step.to_xcom())
        return step


def _delete_step(
    run: JobRun,
    connect: Connect,
    plan: RunPlan,
    table: str,
    stop: StopSignal,
    *,
    lock_name: str | None,
    after: StepResult | None,
) -> StepResult:
    until = after.covered() if after is not None else None
    bounded_by = after.stop_reason if after is not None else StopReason.DRAINED.value
    if until == KEY_START:  # the step before covered nothing (its lock was busy)
        run.log.info("step_skipped", table=table, reason="the step before covered nothing")
        return StepResult(table=table, stop_reason=StopReason.MAX_BATCHES.value)
    # The loops' connections are opened before the lock is taken: opening one may need a
    # server connection of a pooler for a moment, and the lock's transaction pins one for the
    # whole step (with a pool of one, the opening would wait for the pooler's timeout).
    conns = _open_loops(connect, plan, run.telemetry, table)
    try:
        if plan.dry_run or lock_name is None:
            return _walk(run, conns, plan, table, stop, until=until, bounded_by=bounded_by)
        with advisory_lock(connect, lock_name, lock_lease_seconds(plan)) as held:
            if not held:
                # report counts the contention once per run, however many tasks found it busy
                run.skipped_lock_busy(
                    connect,
                    lock_name,
                    lock_lease_seconds(plan),
                    count_contention=False,
                    table=table,
                )
                return StepResult(table=table, lock_skipped=True)
            return _walk(run, conns, plan, table, stop, until=until, bounded_by=bounded_by, held=1)
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


def _walk(
    run: JobRun,
    conns: list[psycopg.Connection],
    plan: RunPlan,
    table: str,
    stop: StopSignal,
    *,
    until: tuple[datetime, uuid.UUID] | None,
    bounded_by: str,
    held: int = 0,
) -> StepResult:
    # Fail fast, before any batch, when a pooler cannot give every loop a server connection
    # while the lock holds one (docs/deploying.md, "Behind a pooler"): the loops would
    # otherwise wait in the pooler's queue until its query_wait_timeout.
    require_server_connections(
        conns, job=JOB, held=held, what=f"{held} lock + {len(conns)} batch loops"
    )
    remaining = (
        conns[0]
        .execute(sql.load("retention/seconds_until"), {"deadline_at": step_deadline(plan, table)})
        .fetchone()[0]
    )
    conns[0].rollback()
    # The first batch always runs, so a step whose earlier tasks used up their share still
    # makes progress; later batches stop at the step's deadline.
    deadline = Deadline(max(float(remaining), 0.0))
    walk = KeysetWalk(
        plan, table, run.telemetry, stop, deadline=deadline, until=until, bounded_by=bounded_by
    )
    result = walk.run(conns, pacer=_pacer(plan, table, run, conns, deadline))
    run.log.info(
        "step_completed",
        table=table,
        rows=result.rows,
        batches=result.batches,
        stop_reason=result.stop_reason,
        has_more=result.has_more,
        runners=len(conns),
        dry_run=plan.dry_run,
        paced_ms=result.paced_ms,
    )
    if walk.stop_reason is StopReason.CANCELLED:
        raise run.cancelled(
            stop.reason,
            f"{table}: stopped between batches after {walk.batches} committed batch(es) "
            f"({stop.reason})",
            table=table,
            batches=walk.batches,
        )
    return result


def _pacer(
    plan: RunPlan, table: str, run: JobRun, conns: list[psycopg.Connection], deadline: Deadline
) -> Pacer | None:
    """The step's pacing (docs/design.md, "Pacing"), started by its batch loops;
    a dry run only reads and is not paced. The child steps' batches are sized while others use
    the database; the sessions step's stay whole: a session batch is the seed's unit
    (``BatchesProcessed``), and its statements write little WAL."""
    if plan.dry_run or not plan.config.paced:
        return None
    pacer = Pacer(
        plan.config,
        run.telemetry,
        paced_metric_prefix=M_PACED_PREFIX,
        deadline_remaining=deadline.remaining,
        batch_size=None if table == "sessions" else plan.config.batch_size,
    )
    pacer.connections = list(conns)
    return pacer


# --------------------------------------------------------------------------------------------
# report and the whole run


def report(
    plan: RunPlan,
    steps: Sequence[StepResult],
    telemetry: Telemetry,
    *,
    wall_clock: Callable[[], float] = time.time,
) -> RetentionResult:
    """Sum the steps into the seed's result; complete the run (``job_completed``, its metrics).

    The run duration is measured on worker wall clocks (``prepare``'s start to now): in the DAG
    the tasks may run on different workers, whose clock skew is small next to a run.
    """
    with job_run(SPEC, telemetry, "report", wall_clock=wall_clock) as run:
        result = RetentionResult.of_steps(tuple(steps), dry_run=plan.dry_run)
        duration = max(wall_clock() - plan.started_at_unix, 0.0)
        lock_busy = any(s.lock_skipped for s in steps)
        if lock_busy:
            # one busy run counts once (the alert rule thinks in nightly runs, not delete
            # tasks), and records no duration: a skip is no run and would dilute the near-max
            # rule
            telemetry.metrics.incr(M_LOCK_CONTENTION)
        _complete(run, plan, result, duration, lock_busy=lock_busy)
        return result


def _complete(
    run: JobRun, plan: RunPlan, result: RetentionResult, duration: float, *, lock_busy: bool
) -> None:
    # the result's keys in snake_case (docs/design.md, "Log vocabulary"); a dry run reports
    # would_delete_* and its deleted_* stay 0, as in the result
    skipped = ",".join(s.table for s in result.steps if s.lock_skipped) or "none"
    run_duration = None if lock_busy else duration
    if result.dry_run:
        run.completed(
            result.as_dict(),
            duration_seconds=run_duration,
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
        run.completed(
            result.as_dict(),
            duration_seconds=run_duration,
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


def run(
    connect: Connect,
    config: RetentionConfig,
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    dry_run: bool = False,
) -> RetentionResult:
    """One whole run in one process: prepare, the three delete steps in FK order (each under
    the job's lock, as in the DAG, and each covering what the one before it covered), report."""
    with telemetry.run_span(f"{JOB} run"):
        plan = prepare(connect, config, telemetry, dry_run=dry_run)
        # Each step takes the lock for itself, as the DAG's tasks do (one lock connection per
        # step, never one held across steps while another step opens connections).
        steps: list[StepResult] = []
        for table in TABLES:
            after = steps[-1] if steps else None
            steps.append(delete_step(connect, plan, table, telemetry, stop, after=after))
        return report(plan, steps, telemetry)


# --------------------------------------------------------------------------------------------
# command line: the job without Airflow (python -m include.pin_maintenance.jobs.activity_retention)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lock-timeout-ms",
        type=int,
        default=SESSION_SETTINGS.lock_timeout_ms,
        help="lock_timeout of the job's statements (default %(default)s)",
    )


def _run(args: cli.CliRun) -> dict[str, Any]:
    return run(args.connect, args.config, args.telemetry, args.stop, dry_run=args.dry_run).as_dict()


CLI = cli.JobCli(
    spec=SPEC,
    module="include.pin_maintenance.jobs.activity_retention",
    database="user-activity database",
    description="Run ActivityRetentionJob once against a database (no Airflow needed).",
    session=SESSION_SETTINGS,
    run=_run,
    add_arguments=_add_arguments,
    session_for=lambda args: replace(SESSION_SETTINGS, lock_timeout_ms=args.lock_timeout_ms),
)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(CLI, argv)


if __name__ == "__main__":
    sys.exit(main())
