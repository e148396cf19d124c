"""
### calendar_slot_expiration: expire past Available slots (SlotExpirationJob, seed 002)

**Purpose.** Availability slots whose start has passed and that nobody booked stop counting as
free: `Available` slots with `start_at <= AsOf` become `Expired` (`updated_at = AsOf`,
`version + 1`), oldest first, in batches of `batch_size` under `FOR UPDATE SKIP LOCKED`, at most
`max_batches_per_cycle` batches per cycle (1 by default: the seed's bound of `batch_size` rows
per cycle; the backlog waits for the next cycles). Booked,
Expired, Archived and future slots are never touched. Tier-3 hygiene: booking correctness does
not depend on this job (booking guards reject past slots on their own).

**Owner.** PIN Platform (backend), calendar context.

**Schedule.** Every 5 minutes (`*/5 * * * *`, UTC; the environment setting
`PIN_CALENDAR_SLOT_EXPIRATION_SCHEDULE` on the dag processor changes the cron). One run at a
time (`max_active_runs=1`): the next tick waits for the running cycle. There is **no global
lock**; a second runner (another deployment, a manual `airflow tasks test`) is safe because each
batch locks its rows with `SKIP LOCKED`, so every slot is expired by exactly one runner. In drain
mode (`max_batches_per_cycle` above 1) the cycle uses this itself: when its first batch comes
back full it starts up to `runners - 1` more batch loops, each on its own connection, that share
the backlog the same way (the cycle then holds `runners` server connections at once).

**Safe to rerun?** Yes, at any time. The selection takes only `Available` rows, so a committed
batch is never selected again and a second pass is a no-op. A failed run has rolled back only
the batch in hand; the next cycle picks the same rows up.

**Params** (empty = the Variable `calendar_slot_expiration` JSON, else the default):
`batch_size` (500, 1..10000), `max_batches_per_cycle` (1, 1..100000; raise it to drain a
backlog), `runners` (2, 1..8 batch loops in drain mode, one connection each; 1 = one loop
on one connection), `max_run_duration_seconds` (30, > 0; no new batch starts after it, the rest
waits for the next cycle), the pacing keys (README, "Pacing"):
`max_replica_lag_seconds` (2: hold while a streaming replica replays further behind;
0 = off), `max_wal_mb_per_second` (4: while others use the database, hold its WAL rate to this;
0 = off), `dry_run` (count what would expire, change nothing).

**Result** (task return value and the `job_completed` log line): `ExpiredCount`,
`SkippedLockedCount` (due slots a batch passed over because an in-flight booking or another
instance held them; when the cycle stops on a bound, only those before the furthest point its
index walk reached, never the backlog it did not reach),
`DurationMs`, plus `ErrorsCount`, `Backlog`, `Batches`, `Runners`, `StopReason`, `AsOf` (the
cycle's cutoff), `PacedMs` (time the cycle held back for others); a dry run adds `DryRun` and
`WouldExpireCount`.

**Metrics.** `calendar_slot_expiration_cycle_duration_seconds`, `_items_total`, `_backlog`
(Available slots already started, after the cycle), `_skip_locked_total`, `_errors_total`,
`_last_success_timestamp_seconds`.

**Runbook.**
- *Dry run first*: on an unpaused DAG, trigger it with `dry_run` on (it waits for a running
  cycle, `max_active_runs=1`). A **paused** DAG runs nothing until it is unpaused, and
  unpausing it (the trigger dialog's "Unpause <dag> on trigger" is ticked by default) starts
  its latest scheduled tick at once, a real run ahead of the dry run (`catchup=False`;
  `run_immediately` does not change that). Preview a paused DAG in-process instead (one run,
  the DAG stays paused): `airflow dags test calendar_slot_expiration --conf '{"dry_run": true}'`.
- *Backlog grows / `_backlog` > 5000 for long*: check the task log's `job_completed` line.
  `stop_reason=max_batches` every cycle means the backlog grows faster than `batch_size` per
  cycle: raise `max_batches_per_cycle` (drain mode, with `runners`) or `batch_size` in the
  Variable; `stop_reason=max_duration` means raise `max_run_duration_seconds`; check the
  `calendar_db` load and that `ix_availability_slots_status_start` exists.
- *Poison slot* (alert `slot_expiration_poison_row`, `event=item_failed slot_id=...` at ERROR):
  one slot fails its update (a trigger, a constraint, a bad value such as `version` at the
  integer limit). The rest of its batch is committed; the slot stays `Available` and is tried
  again every cycle. Fix the row (or the trigger), or archive it by hand; then the next cycle
  expires it. `errors_total` rising steadily means it is still failing.
- *Task failed* (connection lost, statement or lock timeout): the batch in hand was rolled
  back, nothing is half-updated; the next cycle retries (it also counts in `_errors_total`).
  Repeated failures: check the database. An invalid config fails at once, without a retry,
  naming the key: fix the Variable or the trigger params.
- *No successful cycle for 30 min*: `_last_success_timestamp_seconds` stops moving; look for a
  stuck or failing run in the UI.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import dag, task

from include.pin_airflow.dag_support import (
    DEFAULT_ARGS,
    START_DATE,
    config_params,
    dry_run_param,
)
from include.pin_airflow.deadlines import deadline_alert
from include.pin_airflow.schedules import dag_schedule
from include.pin_maintenance.jobs.slot_expiration_config import (
    CONFIG,
    CONN_ID,
    JOB,
    worst_case_run_seconds,
)

# Seed 002: every 5 min, UTC; PIN_CALENDAR_SLOT_EXPIRATION_SCHEDULE changes the cron (a bad
# value is an import error naming it).
SCHEDULE = dag_schedule(JOB, "*/5 * * * *", "UTC")


@dag(
    dag_id=JOB,
    schedule=SCHEDULE.timetable(),
    start_date=START_DATE,
    catchup=False,
    # The seed: the next tick never starts while a cycle runs. Runners would stay correct
    # side by side (SKIP LOCKED), but overlapping cycles only compete for the same rows.
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    params={**config_params(CONFIG), "dry_run": dry_run_param()},
    tags=["pin", "postgres-maintenance", "calendar"],
    doc_md=__doc__,
    # SLA: deadline_missed alert when a run is late; tune with Variable <dag_id>_deadline_seconds
    deadline=deadline_alert("calendar_slot_expiration"),
    # backstop above the 10-min deadline: two tries of the 10-min execution_timeout + retry_delay
    dagrun_timeout=timedelta(minutes=25),
)
def calendar_slot_expiration():
    # A cycle is bounded by max_run_duration_seconds (default 30 s) plus one batch statement
    # (statement_timeout 30 s); the timeout is only the backstop for a hung connection, and a
    # max_run_duration_seconds that would outlast it is refused before the cycle starts.
    @task(execution_timeout=timedelta(minutes=10), multiple_outputs=False)
    def expire_slots(**context) -> dict:
        """Run one expiration cycle; return {ExpiredCount, SkippedLockedCount, DurationMs, ...}."""
        from include.pin_airflow.runtime import (
            frozen_heap,
            postgres_connect,
            resolve_config,
            telemetry_for,
        )
        from include.pin_maintenance.jobs import slot_expiration
        from include.pin_maintenance.stopping import StopSignal

        params = context["params"]
        # before any write; bad values (one the timeout cannot hold too) fail, no retry
        config = resolve_config(CONFIG, context, worst_case_run_seconds)
        connect = postgres_connect(CONN_ID, slot_expiration.SESSION)
        with frozen_heap(), StopSignal().on_sigterm() as stop:
            result = slot_expiration.run(
                connect,
                config,
                telemetry_for(JOB, context),
                stop,
                dry_run=bool(params.get("dry_run")),
            )
        return result.as_dict()

    expire_slots()


calendar_slot_expiration()
