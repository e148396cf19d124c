"""Fixture: retention's prepare and its first delete task, the task under a 4 s
``execution_timeout``.

user_activity_retention refuses such a timeout in prepare (a delete task needs up to its share
of the run plus 250 s). The timeout still fires for a hang that bound cannot see, and then the
step must stop cleanly: tests/dags/test_user_activity_retention.py::
test_execution_timeout_mid_step_stops_the_step_cleanly makes it fire here, mid-statement.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import dag, task

from include.pin_airflow.dag_support import DEFAULT_ARGS, START_DATE

CONN_ID = "user_activity_db"


@dag(
    dag_id="pin_fixture_retention_timeout",
    schedule=None,
    start_date=START_DATE,
    catchup=False,
    default_args=DEFAULT_ARGS,
    tags=["pin", "fixture"],
)
def pin_fixture_retention_timeout():
    @task(execution_timeout=timedelta(minutes=10), multiple_outputs=False)
    def prepare(**context: Any) -> dict[str, Any]:
        from include.pin_airflow.runtime import postgres_connect, telemetry_for
        from include.pin_maintenance.jobs import activity_retention as job

        connect = postgres_connect(CONN_ID, job.SESSION_SETTINGS)
        config = job.CONFIG.resolve(None, {"batch_size": 5})
        return job.prepare(connect, config, telemetry_for(job.JOB, context)).to_xcom()

    # the same body as user_activity_retention's delete tasks
    @task(execution_timeout=timedelta(seconds=4), multiple_outputs=False)
    def delete_action_events(plan: dict[str, Any], **context: Any) -> dict[str, Any]:
        from include.pin_airflow.runtime import frozen_heap, postgres_connect, telemetry_for
        from include.pin_maintenance.jobs import activity_retention as job
        from include.pin_maintenance.stopping import StopSignal

        telemetry = telemetry_for(job.JOB, context)
        connect = postgres_connect(CONN_ID, job.SESSION_SETTINGS)
        with frozen_heap(), StopSignal().on_sigterm() as stop:
            step = job.delete_step(
                connect, job.RunPlan.from_xcom(plan), "action_events", telemetry, stop
            )
        return step.to_xcom()

    delete_action_events(prepare())


pin_fixture_retention_timeout()
