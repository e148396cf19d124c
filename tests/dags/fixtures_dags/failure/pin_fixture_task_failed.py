"""Fixture: a task that always fails, with the project's failure callback and one retry.

Used by tests/dags/test_deadline_failure_callback.py: the callback must fire once, after the
retry, not on the first failed try.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import dag, task

from include.pin_airflow.alerts import on_task_failed
from include.pin_airflow.dag_support import DEFAULT_ARGS, START_DATE


@dag(
    dag_id="pin_fixture_task_failed",
    schedule=None,
    start_date=START_DATE,
    catchup=False,
    default_args={
        **DEFAULT_ARGS,
        "retries": 1,
        "retry_delay": timedelta(seconds=0),
        "on_failure_callback": on_task_failed,
    },
    tags=["pin", "fixture"],
)
def pin_fixture_task_failed():
    @task
    def fine() -> str:
        """Succeeds: no alert."""
        return "ok"

    @task
    def broken() -> None:
        """Fails on every try."""
        raise RuntimeError("fixture failure: table is locked")

    fine() >> broken()


pin_fixture_task_failed()
