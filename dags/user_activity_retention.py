"""### user_activity_retention: physical cleanup of expired user activity (seed 003)

**Purpose.** Deletes `Inactive` sessions of `user_activity` whose `ended_at` is older than
`retention_period_days` (default 365), together with their `action_events` and
`property_object_views`, in batches and in FK order:
`prepare >> delete_action_events >> delete_property_object_views >> delete_sessions >> report`.
`property_object_view_stats` is never touched (the aggregate outlives the raw views).

**Owner.** PIN Engagement (user-activity), operated by pin-platform.

**Schedule.** `0 3 * * *` Europe/Moscow (nightly window, 00:00 UTC), `max_active_runs=1`, no
catchup. The environment settings `PIN_USER_ACTIVITY_RETENTION_SCHEDULE` (cron) and
`PIN_USER_ACTIVITY_RETENTION_TIMEZONE` (IANA zone) on the dag processor change it. The timetable
carries the timezone; the UI shows times in UTC (or the zone picked in the UI), so Next Run
reads 00:00 UTC. The Details tab's "Timezone" is the server's `[core] default_timezone` for
every DAG in Airflow 3.3.2 (the API reads it from there), not this schedule's.

**Safe to rerun?** Yes, at any time. The cutoff is computed once per run (in `prepare`, on the
database clock) and every delete task acts on that same eligible set. Each batch is one
transaction; a crash, a failed batch or a bound (`max_batches_per_run`,
`max_run_duration_seconds`) leaves only rows that are still eligible, and the next run (or a
manual rerun) finishes them. `delete_sessions` deletes only sessions with no children left, so
it never hits the RESTRICT foreign keys. A Postgres advisory lock
(`job:scheduled:activity-retention`) keeps a second runner out: a task that finds it busy logs
`job_skipped` (`reason=lock_busy`) and succeeds without doing anything; `report` counts
`activity_retention_lock_contention_total` once for such a run and records no run duration.

**Params** (empty = the Variable `user_activity_retention` (JSON) or the default):
`retention_period_days` (>= 1), `batch_size` (1..50000), `runners` (3, 1..8 independent
batch loops per delete task, one connection each; each claims, deletes and commits its own
batches; 1 = one loop; a task holds up to 1 + runners server connections),
`max_batches_per_run` (>= 1, session batches per run: each delete task claims at most this
many, all its loops together), `max_run_duration_seconds` (> 0, the whole run, split between
the delete tasks: `delete_action_events` claims for the first 20 %, then
`delete_property_object_views` until 50 %, `delete_sessions` until 100 %; each later task covers
only the sessions the one before it covered), the pacing keys (README, "Pacing"):
`max_replica_lag_seconds` (2: hold while a streaming replica replays further behind;
0 = off), `max_wal_mb_per_second` (4: while others use the database, hold its WAL rate to this;
0 = off), `dry_run` (count per table what would be deleted; delete nothing). An invalid value
fails `prepare` before any delete, naming the key, its value and the allowed range.

**Result** (XCom of `report`): `DeletedSessions`, `DeletedPropertyObjectViews`,
`DeletedActionEvents`, `BatchesProcessed` (session batches: `batch_size` sessions with their
children), beside it `ActionEventBatches`, `PropertyObjectViewBatches`, `SessionBatches` (each
task's committed batches), `HasMore`, `DryRun`, `PacedMs` (time the delete tasks held back for
others); a dry run reports 0 deleted
and what it would delete as `WouldDeleteSessions`, `WouldDeletePropertyObjectViews`,
`WouldDeleteActionEvents`.

**Runbook.**
- *Dry run first*: on an unpaused DAG, trigger it with `dry_run` on (it waits for a running
  cycle, `max_active_runs=1`). A **paused** DAG runs nothing until it is unpaused, and
  unpausing it (the trigger dialog's "Unpause <dag> on trigger" is ticked by default) starts
  its latest scheduled tick at once, a real run ahead of the dry run (`catchup=False`;
  `run_immediately` does not change that). Preview a paused DAG in-process instead (one run,
  the DAG stays paused): `airflow dags test user_activity_retention --conf '{"dry_run": true}'`.
- *Backlog grows* (`activity_retention_eligible_backlog` up several days in a row, or `HasMore`
  every night): raise `batch_size` / `max_batches_per_run` in the Variable; check table sizes
  and autovacuum on `user_activity`.
- *A batch fails* (alert `retention_batch_failed`, log `event=batch_failed` with the batch's
  first/last session id, count and up to 20 ids): batches committed before are final, the
  batches other loops had in hand roll back; find the row that blocks the
  delete (unexpected FK, trigger, lock timeout) from the error, fix it, rerun the DAG.
- *Lock never free* (`job_skipped` every night): find the holder in `pg_locks` (advisory lock,
  key = `lock_key("job:scheduled:activity-retention")`) and its backend in `pg_stat_activity`;
  the lease ends by itself after `max_run_duration_seconds + 300` s of idleness, or end the
  backend with `pg_terminate_backend`.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import Any

from airflow.sdk import dag, task

from include.pin_airflow.dag_support import (
    DEFAULT_ARGS,
    START_DATE,
    config_params,
    dry_run_param,
)
from include.pin_airflow.deadlines import deadline_alert
from include.pin_airflow.schedules import dag_schedule
from include.pin_maintenance.jobs.activity_retention_config import CONFIG, JOB

CONN_ID = "user_activity_db"
# Seed 003's RetentionSchedule: 03:00 Europe/Moscow; PIN_USER_ACTIVITY_RETENTION_SCHEDULE and
# PIN_USER_ACTIVITY_RETENTION_TIMEZONE change it (a bad value is an import error naming it).
SCHEDULE = dag_schedule(JOB, "0 3 * * *", "Europe/Moscow", timezone_settable=True)

# A delete task runs at most its share of max_run_duration_seconds (1800 by default) plus one
# batch (activity_retention_config.worst_case_step_seconds); the timeout is the backstop for a
# task that hangs outside any statement_timeout, and prepare refuses a max_run_duration_seconds
# it could not hold. The environment variable PIN_RETENTION_DELETE_TIMEOUT_SECONDS replaces it
# (read when the file is parsed: Airflow needs execution_timeout at parse time, where a Variable
# would mean metadata access). A bad value is an import error.
DELETE_TIMEOUT_ENV = "PIN_RETENTION_DELETE_TIMEOUT_SECONDS"


def _delete_timeout() -> timedelta:
    raw = os.environ.get(DELETE_TIMEOUT_ENV, "").strip()
    if not raw:
        return timedelta(hours=2)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):  # NaN compares False too
        raise ValueError(f"{DELETE_TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0")
    return timedelta(seconds=seconds)


DELETE_TIMEOUT = _delete_timeout()
PREPARE_TIMEOUT = timedelta(minutes=10)


def _delete(
    table: str,
    plan: dict[str, Any],
    after: dict[str, Any] | None,
    context: dict[str, Any],
) -> dict[str, Any]:
    from include.pin_airflow.runtime import frozen_heap, postgres_connect, telemetry_for
    from include.pin_maintenance.jobs import activity_retention as job
    from include.pin_maintenance.stopping import StopSignal

    telemetry = telemetry_for(JOB, context)
    connect = postgres_connect(CONN_ID, job.SESSION_SETTINGS)
    previous = job.StepResult.from_xcom(after) if after else None
    with frozen_heap(), StopSignal().on_sigterm() as stop:
        step = job.delete_step(
            connect, job.RunPlan.from_xcom(plan), table, telemetry, stop, after=previous
        )
    return step.to_xcom()


@dag(
    dag_id=JOB,
    # The zone on the timetable itself, not through start_date: the start date then reads
    # 2026-01-01 00:00 in the UI's Details (a Moscow start date showed as 2025-12-31 21:00).
    schedule=SCHEDULE.timetable(),
    start_date=START_DATE,
    description=f"Nightly ({SCHEDULE.describe()}): delete Inactive sessions older "
    "than retention_period_days with their views and events.",
    catchup=False,
    # One run at a time: the three delete tasks of a run share one cutoff and walk the eligible
    # set in order; a second run in parallel would only contend for the same rows (the advisory
    # lock would make it skip anyway).
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    params={**config_params(CONFIG), "dry_run": dry_run_param()},
    tags=["pin", "postgres-maintenance", "user-activity"],
    doc_md=__doc__,
    # SLA: deadline_missed alert when a run is late; tune with Variable <dag_id>_deadline_seconds
    deadline=deadline_alert("user_activity_retention"),
    # backstop above the 45-min deadline: a nightly run still going after 6 h is stuck
    dagrun_timeout=timedelta(hours=6),
)
def user_activity_retention() -> None:
    @task(execution_timeout=PREPARE_TIMEOUT, multiple_outputs=False)
    def prepare(**context: Any) -> dict[str, Any]:
        """Validate the config, fix the run's cutoff on the DB clock, gauge the backlog."""
        from include.pin_airflow.runtime import postgres_connect, resolve_config, telemetry_for
        from include.pin_maintenance.jobs import activity_retention as job
        from include.pin_maintenance.jobs.activity_retention_config import (
            STEP_DEADLINE_SHARE,
            worst_case_step_seconds,
        )

        params = context["params"]
        # Before anything touches the DB; a bad value fails the task without a retry, and so
        # does a run bound a delete task's execution_timeout cannot hold.
        config = resolve_config(
            job.CONFIG,
            context,
            {
                f"delete_{table}": functools.partial(worst_case_step_seconds, table=table)
                for table in STEP_DEADLINE_SHARE
            },
        )
        connect = postgres_connect(CONN_ID, job.SESSION_SETTINGS)
        telemetry = telemetry_for(JOB, context)
        plan = job.prepare(connect, config, telemetry, dry_run=bool(params.get("dry_run")))
        return plan.to_xcom()

    @task(execution_timeout=DELETE_TIMEOUT, multiple_outputs=False)
    def delete_action_events(plan: dict[str, Any], **context: Any) -> dict[str, Any]:
        """Delete the action_events of the eligible sessions (first: RESTRICT FKs)."""
        return _delete("action_events", plan, None, context)

    @task(execution_timeout=DELETE_TIMEOUT, multiple_outputs=False)
    def delete_property_object_views(
        plan: dict[str, Any], action_events: dict[str, Any], **context: Any
    ) -> dict[str, Any]:
        """Delete the property_object_views of the sessions delete_action_events covered."""
        return _delete("property_object_views", plan, action_events, context)

    @task(execution_timeout=DELETE_TIMEOUT, multiple_outputs=False)
    def delete_sessions(
        plan: dict[str, Any], property_object_views: dict[str, Any], **context: Any
    ) -> dict[str, Any]:
        """Delete covered eligible sessions that have no children left (never hits RESTRICT)."""
        return _delete("sessions", plan, property_object_views, context)

    @task(execution_timeout=timedelta(minutes=5), multiple_outputs=False)
    def report(
        plan: dict[str, Any],
        action_events: dict[str, Any],
        property_object_views: dict[str, Any],
        sessions: dict[str, Any],
        **context: Any,
    ) -> dict[str, Any]:
        """The seed's result {DeletedSessions, ..., HasMore}; completion log and metrics."""
        from include.pin_airflow.runtime import telemetry_for
        from include.pin_maintenance.jobs import activity_retention as job

        steps = [
            job.StepResult.from_xcom(s) for s in (action_events, property_object_views, sessions)
        ]
        result = job.report(job.RunPlan.from_xcom(plan), steps, telemetry_for(JOB, context))
        return result.as_dict()

    planned = prepare()
    events = delete_action_events(planned)
    # each later step covers only the sessions the step before it covered (its XCom)
    views = delete_property_object_views(planned, events)
    sessions = delete_sessions(planned, views)
    report(planned, events, views, sessions)


user_activity_retention()
