"""Fixture for tests/e2e/test_deadline_alerts.py: a run that always overshoots its deadline.

The deadline default is 5 s (tunable by the Variable ``pin_fixture_deadline_e2e_deadline_seconds``)
and the task sleeps 15 s. The test copies this file to a scratch dags folder and edits it.
"""

from __future__ import annotations

import time

from airflow.sdk import dag, task

from include.pin_airflow.dag_support import START_DATE
from include.pin_airflow.deadlines import deadline_alert

SLEEP_SECONDS = 15
# The test rewrites this line; it is part of the DAG description, so an edit changes the
# serialized DAG (a new DAG version), which is what re-serialization bugs need.
EDIT_MARKER = "original"


@dag(
    dag_id="pin_fixture_deadline_e2e",
    description=f"deadline e2e fixture ({EDIT_MARKER})",
    schedule=None,
    start_date=START_DATE,
    catchup=False,
    max_active_runs=1,  # like the job DAGs
    deadline=deadline_alert("pin_fixture_deadline_e2e", 5),
    tags=["pin", "fixture"],
)
def pin_fixture_deadline_e2e():
    @task
    def overshoot() -> str:
        """Sleep past the deadline, then succeed."""
        time.sleep(SLEEP_SECONDS)
        return EDIT_MARKER

    overshoot()


pin_fixture_deadline_e2e()
