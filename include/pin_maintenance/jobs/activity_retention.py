"""ActivityRetentionJob (seed 003): delete Inactive sessions past retention, children first.

:func:`prepare` fixes the run's cutoff and deadline, :func:`delete_step` runs once per table of
:data:`TABLES` under the job lock, :func:`report` sums the steps; :func:`run` does all three in
one process (tests, the CLI), the DAG one task each. Design: docs/design/retention.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
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
    M_PACED_PREFIX,
    KeysetWalk,
    StepResult,
)
from include.pin_maintenance.lifecycle import JobMetrics, JobRun, JobSpec, job_run
from include.pin_maintenance.pacing import paced_metrics
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
    config: RetentionConfig
    dry_run: bool = False

    def to_xcom(self) -> dict[str, Any]:
        """One flat JSON object: the config keys beside the plan's own."""
        data = asdict(self)
        config = data.pop("config")
        dates = {"cutoff": self.cutoff.isoformat(), "deadline_at": self.deadline_at.isoformat()}
        return config | data | dates

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> RunPlan:
        """The plan :meth:`to_xcom` wrote, by another version of the code too: a key it lacks
        gets its default (``runners``: 1, one loop), a key this version lacks is dropped."""
        config = {"runners": 1} | {s.name: data[s.name] for s in CONFIG.settings if s.name in data}
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        for key in ("cutoff", "deadline_at"):
            values[key] = datetime.fromisoformat(values[key])
        return cls(config=RetentionConfig(**config), **values)


@dataclass(frozen=True)
class RetentionResult:
    """The seed's result (step 8); ``batches_processed`` counts session batches (the sessions
    step's), ``batches_by_table`` each step's."""

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
        rows = {s.table: s.rows for s in steps}
        batches = {s.table: s.batches for s in steps}
        return cls(
            deleted_sessions=rows.get("sessions", 0),
            deleted_property_object_views=rows.get("property_object_views", 0),
            deleted_action_events=rows.get("action_events", 0),
            batches_processed=batches.get("sessions", 0),
            batches_by_table=batches,
            has_more=any(s.has_more for s in steps),
            dry_run=dry_run,
            paced_ms=sum(s.paced_ms for s in steps),
            steps=steps,
        )

    def as_dict(self) -> dict[str, Any]:
        """The XCom; a dry run's counts are WouldDelete*, its Deleted* stay 0."""
        counts = {
            "Sessions": self.deleted_sessions,
            "PropertyObjectViews": self.deleted_property_object_views,
            "ActionEvents": self.deleted_action_events,
        }
        batches = self.batches_by_table
        out: dict[str, Any] = {f"Deleted{k}": 0 if self.dry_run else n for k, n in counts.items()}
        out |= {
            "BatchesProcessed": self.batches_processed,
            "ActionEventBatches": batches.get("action_events", 0),
            "PropertyObjectViewBatches": batches.get("property_object_views", 0),
            "SessionBatches": batches.get("sessions", 0),
            "HasMore": self.has_more,
            "DryRun": self.dry_run,
            "PacedMs": self.paced_ms,
        }
        if self.dry_run:
            out |= {f"WouldDelete{k}": n for k, n in counts.items()}
        return out


def step_deadline(plan: RunPlan, table: str) -> datetime:
    """When ``table``'s step stops claiming batches (server clock): its share of the run."""
    unused = (1.0 - STEP_DEADLINE_SHARE[table]) * plan.config.max_run_duration_seconds
    return plan.deadline_at - timedelta(seconds=unused)


def lock_lease_seconds(plan: RunPlan) -> float:
    """The advisory lock's lease: a step's share, one batch in hand and the stop grace fit."""
    return plan.config.max_run_duration_seconds + LOCK_TTL_MARGIN_SECONDS


def _runner_count(plan: RunPlan) -> int:
    """Loops worth starting: no more than the batches the backlog (at prepare) can fill."""
    if plan.dry_run:
        return 1  # counts only: one reader is enough
    batches = max(1, -(-plan.eligible_backlog // plan.config.batch_size))
    return max(1, min(plan.config.runners, batches, plan.config.max_batches_per_run))


def prepare(
    connect: Connect,
    config: RetentionConfig,
    telemetry: Telemetry,
    *,
    dry_run: bool = False,
    wall_clock: Callable[[], float] = time.time,
) -> RunPlan:
    """Fix the run's cutoff and deadline on the server clock and measure the backlog (no lock:
    each delete step takes its own)."""
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
        plan = RunPlan(cutoff, deadline_at, wall_clock(), int(backlog), config, bool(dry_run))
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
    """Delete ``table``'s rows of the eligible sessions, batch by batch, under the job lock
    (busy: a ``lock_skipped`` no-op; ``lock_name=None``, for tests: none), covering no session
    past the last one ``after``, the run's step before, covered (docs/design/retention.md)."""
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
    if after is not None and after.covered() == KEY_START:  # its lock was busy
        run.log.info("step_skipped", table=table, reason="the step before covered nothing")
        return StepResult(table=table, stop_reason=StopReason.MAX_BATCHES.value)
    # One connection per loop, opened on the caller's thread (an Airflow hook reads its
    # Connection through the task runner) and before the lock: opening may need a pooler's
    # server connection for a moment, and the lock's transaction pins one for the whole step.
    conns = [connect()]
    for number in range(2, _runner_count(plan) + 1):
        try:
            conns.append(connect())
        except psycopg.Error as exc:  # more loops are an optimisation, not a requirement
            run.log.warning("runner_not_started", table=table, runner=number, error=str(exc))
            break
    lease = lock_lease_seconds(plan)
    unlocked = plan.dry_run or lock_name is None
    lock = contextlib.nullcontext(None) if unlocked else advisory_lock(connect, lock_name, lease)
    try:
        with lock as held:  # None: no lock taken
            if held is False:  # report counts the contention, once per run
                run.skipped_lock_busy(
                    connect, lock_name, lease, count_contention=False, table=table
                )
                return StepResult(table=table, lock_skipped=True)
            return _walk(run, conns, plan, table, stop, after=after, held=1 if held else 0)
    finally:
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()


def _walk(
    run: JobRun,
    conns: list[psycopg.Connection],
    plan: RunPlan,
    table: str,
    stop: StopSignal,
    *,
    after: StepResult | None,
    held: int = 0,
) -> StepResult:
    # fail fast when a pooler cannot serve every loop beside the lock (docs/deploying.md)
    require_server_connections(
        conns, job=JOB, held=held, what=f"{held} lock + {len(conns)} batch loops"
    )
    query = sql.load("retention/seconds_until")
    remaining = conns[0].execute(query, {"deadline_at": step_deadline(plan, table)}).fetchone()[0]
    conns[0].rollback()
    # the first batch always runs: a step whose earlier tasks used up its share still progresses
    deadline = Deadline(max(float(remaining), 0.0))
    walk = KeysetWalk(plan, table, run.telemetry, stop, deadline=deadline, after=after)
    result = walk.run(conns)
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


def report(
    plan: RunPlan,
    steps: Sequence[StepResult],
    telemetry: Telemetry,
    *,
    wall_clock: Callable[[], float] = time.time,
) -> RetentionResult:
    """Sum the steps into the seed's result; log ``job_completed`` and the run's metrics (the
    duration from ``prepare``'s start, on worker wall clocks: their skew is small)."""
    with job_run(SPEC, telemetry, "report", wall_clock=wall_clock) as run:
        result = RetentionResult.of_steps(tuple(steps), dry_run=plan.dry_run)
        duration = max(wall_clock() - plan.started_at_unix, 0.0)
        lock_busy = any(s.lock_skipped for s in steps)
        if lock_busy:  # once per run, and no duration: a skip is no run
            telemetry.metrics.incr(M_LOCK_CONTENTION)
        out = result.as_dict()
        run.completed(
            out,
            duration_seconds=None if lock_busy else duration,
            deleted_sessions=out["DeletedSessions"],
            deleted_property_object_views=out["DeletedPropertyObjectViews"],
            deleted_action_events=out["DeletedActionEvents"],
            would_delete_sessions=out.get("WouldDeleteSessions"),
            would_delete_property_object_views=out.get("WouldDeletePropertyObjectViews"),
            would_delete_action_events=out.get("WouldDeleteActionEvents"),
            batches_processed=result.batches_processed,
            has_more=result.has_more,
            dry_run=result.dry_run,
            lock_skipped_steps=",".join(s.table for s in steps if s.lock_skipped) or "none",
            eligible_backlog=plan.eligible_backlog,
            duration_ms=round(duration * 1000),
        )
        return result


def run(
    connect: Connect,
    config: RetentionConfig,
    telemetry: Telemetry,
    stop: StopSignal,
    *,
    dry_run: bool = False,
) -> RetentionResult:
    """One whole run in one process: prepare, the three delete steps in FK order (each taking
    the lock for itself, as the DAG's tasks do), report."""
    with telemetry.run_span(f"{JOB} run"):
        plan = prepare(connect, config, telemetry, dry_run=dry_run)
        steps: list[StepResult] = []
        for table in TABLES:
            after = steps[-1] if steps else None
            steps.append(delete_step(connect, plan, table, telemetry, stop, after=after))
        return report(plan, steps, telemetry)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lock-timeout-ms",
        type=int,
        default=SESSION_SETTINGS.lock_timeout_ms,
        help="lock_timeout of the job's statements (default %(default)s)",
    )


def _run(cli_run: cli.CliRun) -> dict[str, Any]:
    return run(
        cli_run.connect, cli_run.config, cli_run.telemetry, cli_run.stop, dry_run=cli_run.dry_run
    ).as_dict()


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
