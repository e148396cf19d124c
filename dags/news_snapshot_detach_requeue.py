"""
### news_snapshot_detach_requeue

**Purpose.** Runbook action for `news.snapshot_detach_outbox` (seed 000, runbook
"quarantined_total > 0"): moves chosen `Quarantined` rows back to `Pending` with
`attempts = 0`, due now, so `news_snapshot_detach_retry` calls selections for them again on its
next run. `last_error` keeps the old cause, prefixed with `requeued:`. Nothing else is touched.

**Owner.** PIN Engagement (news). **Schedule.** none: manual trigger only.

**Params** (exactly one choice):
- `snapshot_ids`: list of snapshot uuids (e.g. `["0b5c...", "..."]`), or
- `all_quarantined`: `true` to requeue every Quarantined row;
- `dry_run`: `true` lists what would move and changes nothing. Try it first.

An id that is not a uuid is refused by the trigger form and the REST API before a run exists
(the param's schema). Neither or both choices (the form cannot tell), more than 10,000 ids or an
id longer than 64 characters (Airflow's schema error would quote them all) fail the run at once,
before touching anything, with one short line that names the problem, the count or the value cut
short, the limit and the source; as bad input of a manual run it raises `task_failed` as a
warning, not a critical page.

**Result** (task return value and log line): `DryRun`, `Choice` (what was asked), the count
`RequeuedCount` (or `WouldRequeueCount` on a dry run), `SnapshotIds` (the first 100 moved),
`Truncated` (more moved than listed), `Skipped` (requested ids that did not move, with their
status or "not found").

**Safe to rerun?** Yes: only `Quarantined` rows move, so a second run finds nothing to do.
No lock is needed: the retry DAG never selects Quarantined rows and its outcome updates only
apply to the claim they belong to.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import dag, task

from include.pin_airflow.dag_support import (
    DEFAULT_ARGS,
    START_DATE,
    dry_run_param,
    flag_param,
    uuid_list_param,
)

NEWS_DB_CONN_ID = "news_db"


@dag(
    dag_id="news_snapshot_detach_requeue",
    schedule=None,  # manual runbook action
    start_date=START_DATE,
    catchup=False,
    max_active_runs=1,  # two requeues at once would only race over the same rows' report
    default_args={**DEFAULT_ARGS, "retries": 0},  # a person triggers it and reads the result
    params={
        # a malformed id is refused before a run exists; more than MAX_SNAPSHOT_IDS by the task
        "snapshot_ids": uuid_list_param(
            "snapshot_ids",
            "Snapshot uuids of Quarantined rows to requeue, one per line (or use all_quarantined).",
            max_items=10_000,  # snapshot_requeue.MAX_SNAPSHOT_IDS (not imported at parse)
        ),
        "all_quarantined": flag_param(
            "all_quarantined",
            "Requeue every Quarantined row (do not combine with snapshot_ids).",
        ),
        "dry_run": dry_run_param(),
    },
    tags=["pin", "postgres-maintenance", "news"],
    doc_md=__doc__,
)
def news_snapshot_detach_requeue():
    # multiple_outputs=False: the report is one XCom (return_value), not one per key
    @task(execution_timeout=timedelta(minutes=10), multiple_outputs=False)
    def requeue_quarantined_snapshots() -> dict:
        """Validate the choice, then move the chosen Quarantined rows to Pending (or list them)."""
        from airflow.sdk import get_current_context

        from include.pin_airflow.runtime import postgres_connect, refuse, telemetry_for
        from include.pin_maintenance.db import SessionSettings
        from include.pin_maintenance.jobs import snapshot_requeue

        context = get_current_context()
        params = context["params"]
        try:  # what the form cannot check: both or neither choice (one line, no retry)
            choice = snapshot_requeue.parse_choice(
                params.get("snapshot_ids"), params.get("all_quarantined")
            )
        except snapshot_requeue.RequeueRequestError as exc:
            raise refuse(exc) from None
        connect = postgres_connect(
            NEWS_DB_CONN_ID, SessionSettings(application_name=snapshot_requeue.JOB)
        )
        result = snapshot_requeue.requeue(
            connect,
            telemetry_for(snapshot_requeue.JOB, context),
            choice,
            dry_run=bool(params.get("dry_run")),
        )
        return result.as_dict()

    requeue_quarantined_snapshots()


news_snapshot_detach_requeue()
