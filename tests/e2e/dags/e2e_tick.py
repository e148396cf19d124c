"""Test-only DAG (end-to-end suite): a 5-second schedule and a run that waits for a gate.

Checks under the real scheduler that scheduled ticks run and that ``max_active_runs=1`` keeps a
second run from starting while a slow one is in flight. Each run records its start and end in
``$PIN_E2E_STATE_DIR/e2e_tick.jsonl`` and holds until the test creates ``e2e_tick.release``.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DeltaTriggerTimetable, dag, task

from include.pin_airflow.dag_support import START_DATE


@dag(
    dag_id="e2e_tick",
    doc_md=__doc__,
    schedule=DeltaTriggerTimetable(timedelta(seconds=5)),
    start_date=START_DATE,
    catchup=False,
    max_active_runs=1,  # the property under test
    tags=["pin-e2e"],
)
def e2e_tick():
    @task(execution_timeout=timedelta(minutes=10))
    def hold(**context) -> None:
        """Record the start, wait for the gate file, record the end."""
        from tests.e2e.probe import hold_until_released

        hold_until_released("e2e_tick", context["run_id"], timeout=540)

    hold()


e2e_tick()
