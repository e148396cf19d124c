"""Fixture: a one-task DAG with the project's deadline alert (for `airflow dags test` tests)."""

from __future__ import annotations

from airflow.sdk import dag, task

from include.pin_airflow.dag_support import START_DATE
from include.pin_airflow.deadlines import deadline_alert


@dag(
    dag_id="pin_fixture_deadline",
    schedule=None,
    start_date=START_DATE,
    catchup=False,
    deadline=deadline_alert("pin_fixture_deadline", 3600),
    tags=["pin", "fixture"],
)
def pin_fixture_deadline():
    @task
    def quick() -> str:
        """Finish at once, well within the deadline."""
        return "done"

    quick()


pin_fixture_deadline()
