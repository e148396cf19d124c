"""Fixture for tests/e2e/test_deadline_alerts.py: a run that always overshoots its deadline.

The deadline default is 5 s (tunable by the Variable ``pin_fixture_deadline_e2e_deadline_seconds``)
and the task holds until the test releases it (a ``release-<run_id>`` file next to this one),
which the test does only after the run's deadline alert arrived: however slow the machine, the
run is still running when its deadline passes. The test copies this file to a scratch dags
folder and edits it.
"""

from __future__ import annotations

import time
from pathlib import Path

from airflow.sdk import dag, task

from include.pin_airflow.dag_support import START_DATE
from include.pin_airflow.deadlines import deadline_alert

MAX_HOLD_SECONDS = 300  # a test that never releases still ends the task
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
    def overshoot(**context) -> str:
        """Hold past the deadline until the test releases this run, then succeed."""
        gate = Path(__file__).with_name(f"release-{context['run_id']}")
        give_up = time.monotonic() + MAX_HOLD_SECONDS
        while not gate.exists():
            if time.monotonic() > give_up:
                raise TimeoutError(f"{gate} did not appear within {MAX_HOLD_SECONDS}s")
            time.sleep(0.2)
        return EDIT_MARKER

    overshoot()


pin_fixture_deadline_e2e()
