"""
### news_snapshot_detach_retry

**Purpose.** Safety net of the news service's snapshot-detach outbox
(`news.snapshot_detach_outbox`, seed 000 SnapshotDetachRetryJob). When the synchronous detach
of a selection snapshot failed after set-blocks / delete-post, the owner left a `Pending` row;
this DAG retries `POST /internal/snapshots/{id}/detach` on the selections internal API with
exponential backoff until it succeeds (`Done`) or the row is poison (`Quarantined` + alert
`snapshot_detach_quarantined`).

**Owner.** PIN Engagement (news). **Schedule.** every 5 minutes, UTC (the seed's polling
interval; the environment setting `PIN_NEWS_SNAPSHOT_DETACH_RETRY_SCHEDULE` on the dag processor
changes the cron). One run handles due rows in batches of `batch_size` until a batch comes back
short or `max_run_duration_seconds` passes; no call starts after that, so a run ends within
`max_run_duration_seconds` + `detach_call_timeout_seconds` + 5 s (250 s by default) whatever
selections' latency does, and claimed rows not called get their attempt back.

**Safe to rerun?** Yes, at any time. A run takes the Postgres advisory lock
`Pin:lock:job:scheduled:news-snapshot-detach-retry` (busy = skipped, success); rows are claimed
with `FOR UPDATE SKIP LOCKED` and attempts are pre-incremented, so a crash costs a row one
backoff step, never a lost or double-applied outcome; selections' detach is idempotent
(INV-SNP-005) and every call carries the outbox id as `Idempotency-Key`.

**Connections.** `news_db` (postgres), `selections_api` (http; host = base URL; basic auth
from login/password, or no login and `{"Authorization": "Bearer <token>"}` in the extra).

**Params** (empty = Airflow Variable `news_snapshot_detach_retry` (JSON) or the default):
`batch_size` (100), `max_run_duration_seconds` (240), `max_attempts` (12),
`backoff_base_seconds` / `backoff_factor` / `backoff_cap_seconds` (60 / 2.0 / 1800),
`detach_call_timeout_seconds` (5), `lock_ttl_seconds` (360, > the worst-case run),
`detach_concurrency` (32, 1..64: most calls in flight), `detach_concurrency_min` (1: calls in
flight when a run starts; the run grows while answers are healthy and halves on 429 / 503 /
timeouts), `breaker_failure_threshold` (5: failed calls in a row that stop calling for the
run), `misroute_quarantine_limit` (5: 404s quarantined in a run before any 2xx), `dry_run`
(report how many rows are due; call nothing, write nothing).

**Result** (task return value and the `job_completed` log line): `LockAcquired` (false: another
run held the lock, this one skipped), `DryRun`, `Due` (dry run: rows due), `Claimed`,
`Succeeded` (Done), `Retried` (still Pending), `Quarantined`, `Failed`, `GivenBack` (claimed
rows whose attempt was given back), `Superseded` (outcomes not written: another run had claimed
the row since), `Batches`,
`HasMore`, `StopReason`; the service's health as the run saw it: `AuthFailed`, `BreakerOpen`,
`BreakerFailures`, `OutageCalls`, `Misrouted`, `MisrouteCalls`, `Calls`, `Throttled` (429 /
503), `RetryAfterPausedSeconds`, `ConcurrencyLimit` (calls in flight allowed at the end),
`ConcurrencyPeak`, `CallStalls`, `CallRetries`; the backlog after the run: `Pending`,
`OldestAgeSeconds`; and `DurationMs`.

**Outcomes.** 2xx -> Done. 5xx / 408 / 409 / 423 / 425 / 429 / other 4xx / timeout / connection
error -> stays Pending (429 and 503 honour `Retry-After`); on attempt `max_attempts` ->
Quarantined. 400, 404, 410, 422 -> Quarantined at once (at most 20 alerts per run, then a
summary). 404s with no 2xx in the run past `misroute_quarantine_limit` -> critical alert
`selections_misrouted`, calls stop for the run, no further row loses an attempt. 401/403 ->
critical alert `selections_auth_failed`, calls stop for the run and no row loses an attempt.
`breaker_failure_threshold` failed calls in a row (selections down) -> warning alert
`selections_unavailable`, calls stop for the run, and those calls and every row not called cost
no attempt (an outage never quarantines); the next run probes again with a few calls. Unknown
`reason` -> Quarantined (`UnknownReason`) without a call. Rows with an unknown status are never
selected.

**Runbook.**
- *Dry run first*: on an unpaused DAG, trigger it with `dry_run` on (it waits for a running
  cycle, `max_active_runs=1`). A **paused** DAG runs nothing until it is unpaused, and
  unpausing it (the trigger dialog's "Unpause <dag> on trigger" is ticked by default) starts
  its latest scheduled tick at once, a real run ahead of the dry run (`catchup=False`;
  `run_immediately` does not change that). Preview a paused DAG in-process instead (one run,
  the DAG stays paused): `airflow dags test news_snapshot_detach_retry --conf '{"dry_run": true}'`.
- *pending / oldest_age_seconds grow*, *selections_unavailable*: check the selections internal
  API (5xx of its client, `last_error` of Pending rows); once it is back the backlog drains by
  itself (no requeue needed: the outage cost no row an attempt).
- *quarantined_total > 0*: read `last_error` of the Quarantined rows; after fixing the cause,
  trigger `news_snapshot_detach_requeue` with `snapshot_ids` (or `all_quarantined: true`),
  first with `dry_run: true`.
- *selections_auth_failed*: fix the `selections_api` connection's credentials; nothing else to
  do, no attempts were consumed.
- *selections_misrouted*: fix the `selections_api` base URL / ingress route, then requeue the
  few rows quarantined before the run stopped (docs/runbooks/snapshot-detach-misrouted.md).
- *no successful run for 15 min* (`news_snapshot_detach_last_success_timestamp_seconds`): check
  the scheduler, this DAG's recent task logs, and a stuck lock holder
  (`pg_locks` where `locktype = 'advisory'`; the lease ends after `lock_ttl_seconds`).
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
from include.pin_maintenance.jobs.snapshot_detach_config import CONFIG, worst_case_run_seconds

NEWS_DB_CONN_ID = "news_db"
# Seed 000's PollingInterval: every 5 min, UTC; PIN_NEWS_SNAPSHOT_DETACH_RETRY_SCHEDULE changes
# the cron (a bad value is an import error naming it).
SCHEDULE = dag_schedule(CONFIG.job, "*/5 * * * *", "UTC")


@dag(
    dag_id="news_snapshot_detach_retry",
    schedule=SCHEDULE.timetable(),
    start_date=START_DATE,
    catchup=False,  # a missed tick has nothing to catch up: the next run takes every due row
    # one run at a time: overlapping runs would only fight over the same advisory lock
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    params={**config_params(CONFIG), "dry_run": dry_run_param()},
    tags=["pin", "postgres-maintenance", "news"],
    doc_md=__doc__,
    # SLA: deadline_missed alert when a run is late; tune with Variable <dag_id>_deadline_seconds
    deadline=deadline_alert("news_snapshot_detach_retry"),
    # backstop above the 10-min deadline: two tries of the 10-min execution_timeout + retry_delay
    dagrun_timeout=timedelta(minutes=25),
)
def news_snapshot_detach_retry():
    # A run ends within max_run_duration_seconds + detach_call_timeout_seconds + 5 s (default
    # 250 s); the timeout only catches a hung worker, and a run bound past it is refused.
    @task(execution_timeout=timedelta(minutes=10), multiple_outputs=False)
    def detach_pending_snapshots() -> dict:
        """Claim due outbox rows, call selections detach, record each outcome (bounded run)."""
        from airflow.sdk import get_current_context

        from include.pin_airflow.runtime import (
            frozen_heap,
            postgres_connect,
            resolve_config,
            telemetry_for,
        )
        from include.pin_airflow.selections import selections_detach_client
        from include.pin_maintenance.db import SessionSettings
        from include.pin_maintenance.jobs import snapshot_detach
        from include.pin_maintenance.stopping import StopSignal

        context = get_current_context()
        params = context["params"]
        # Fails here, before any call or write; a bad value fails without a retry.
        config = resolve_config(CONFIG, context, worst_case_run_seconds)
        dry_run = bool(params.get("dry_run"))
        telemetry = telemetry_for(CONFIG.job, context)
        connect = postgres_connect(NEWS_DB_CONN_ID, SessionSettings(application_name=CONFIG.job))
        client = None if dry_run else selections_detach_client()
        try:
            with frozen_heap(), StopSignal().on_sigterm() as stop:
                result = snapshot_detach.run(
                    connect, config, telemetry, stop, client, dry_run=dry_run
                )
        finally:
            if client is not None:
                client.close()
        return result.as_dict()

    detach_pending_snapshots()


news_snapshot_detach_retry()
