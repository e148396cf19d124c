"""Each job DAG's deadline (Airflow 3's SLA): its default interval, on the installed reference.

The mechanism (the deadline reference, the Variable lookup, the callback) is scheduler-side code
in the installed distribution ``pin_maintenance_plugin`` (scheduler_plugin/). Only the numbers
live here, in the bundle, so tuning a default is a DAG change, not an image rebuild; operators
override them per DAG with the Variable ``<dag_id>_deadline_seconds`` without any change.
"""

from __future__ import annotations

from airflow.sdk import DeadlineAlert

from include.pin_airflow.scheduler_side import deadlines as _mechanism

# Defaults (seconds from the moment the run is queued), per DAG.
#
# Detach retry: the seed's SLO is detach lag p99 <= 2 x PollingInterval (10 min). A run is
# bounded by max_run_duration 240 s (lock TTL 360 s); one that is not done 10 min after it was
# queued has blown both and the SLO with it.
DETACH_DEADLINE_SECONDS = 600
# Slot expiration: target cycle < 30 s every 5 min; the seed's liveness threshold (no successful
# cycle for 30 min, a soft tier-3 alert) lives in Prometheus. A run still not done after 10 min
# (20 x the cycle budget) has made the scheduler skip at least one tick (max_active_runs=1), so
# it is stuck, not slow; waiting 30 min would duplicate the liveness rule and tell nobody more.
SLOTS_DEADLINE_SECONDS = 600
# Retention: max_run_duration 1800 s, plus 15 min for the three chained tasks' start-up, an
# infrastructure retry (retry_delay 30 s) and queueing. Past that the nightly window is lost.
RETENTION_DEADLINE_SECONDS = 2700

DEFAULT_DEADLINE_SECONDS: dict[str, int] = {
    "news_snapshot_detach_retry": DETACH_DEADLINE_SECONDS,
    "calendar_slot_expiration": SLOTS_DEADLINE_SECONDS,
    "user_activity_retention": RETENTION_DEADLINE_SECONDS,
}


def deadline_alert(dag_id: str, default_seconds: int | None = None) -> DeadlineAlert:
    """The DAG's deadline; ``default_seconds`` defaults to :data:`DEFAULT_DEADLINE_SECONDS`."""
    if default_seconds is None:
        default_seconds = DEFAULT_DEADLINE_SECONDS[dag_id]
    return _mechanism.deadline_alert(dag_id, default_seconds)
