"""Fixture for tests/e2e/test_deadline_alerts.py: a run that fails well before its deadline.

The task fails at once without a retry (the project's ``task_failed`` callback pages), and the
run's deadline (60 s after queueing) passes later. Airflow 3.3.2 prunes a run's deadlines only
when the run succeeds, so the scheduler still handles this run's deadline as missed and runs the
callback; the callback must stay silent (one event, one page). The exception text carries a
made-up secret, which must reach no alert.
"""

from __future__ import annotations

from airflow.sdk import dag, task

from include.pin_airflow.dag_support import DEFAULT_ARGS, START_DATE
from include.pin_airflow.deadlines import deadline_alert

# room for the task to start and fail first on a loaded machine (20 s was too little once,
# at load 15 on 2 cores: the run was still running at its deadline, a real miss)
DEADLINE_SECONDS = 60
SECRET = "fixture-secret-4f1c"


@dag(
    dag_id="pin_fixture_deadline_failed_e2e",
    schedule=None,
    start_date=START_DATE,
    catchup=False,
    max_active_runs=1,
    default_args={**DEFAULT_ARGS, "retries": 0},
    deadline=deadline_alert("pin_fixture_deadline_failed_e2e", DEADLINE_SECONDS),
    tags=["pin", "fixture"],
)
def pin_fixture_deadline_failed_e2e():
    @task
    def fail_at_once() -> None:
        """Fail on the first try, long before the deadline."""
        raise RuntimeError(f"fixture failure: password={SECRET}")

    fail_at_once()


pin_fixture_deadline_failed_e2e()
