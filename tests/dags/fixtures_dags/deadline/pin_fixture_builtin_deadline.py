"""Fixture: a DAG with a builtin DAGRUN_QUEUED_AT deadline (shows the upstream bug is generic)."""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DeadlineAlert, DeadlineReference, SyncCallback, dag, task

from include.pin_airflow.dag_support import START_DATE


@dag(
    dag_id="pin_fixture_builtin_deadline",
    schedule=None,
    start_date=START_DATE,
    catchup=False,
    deadline=DeadlineAlert(
        reference=DeadlineReference.DAGRUN_QUEUED_AT,
        interval=timedelta(hours=1),
        callback=SyncCallback("pin_maintenance_plugin.deadlines.on_deadline_missed"),
    ),
    tags=["pin", "fixture"],
)
def pin_fixture_builtin_deadline():
    @task
    def quick() -> str:
        """Finish at once."""
        return "done"

    quick()


pin_fixture_builtin_deadline()
