"""Under the real scheduler: scheduled ticks run, and max_active_runs=1 holds a slow run alone.

Uses the test-only DAG ``e2e_tick`` (a 5-second ``DeltaTriggerTimetable``) whose runs hold
until the test releases a gate; the shipped DAGs keep their contract schedules.
"""

from __future__ import annotations

import itertools
import time

import pytest

from devtools.local_airflow import wait_for
from tests.e2e.stack_fixtures import E2EAirflow

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DAG = "e2e_tick"
INTERVAL = 5  # the DAG's DeltaTriggerTimetable, seconds


def test_scheduled_ticks_run_one_at_a_time(airflow_e2e: E2EAirflow) -> None:
    e2e = airflow_e2e
    e2e.wait_dag(DAG)
    e2e.set_paused(DAG, False)
    try:
        # a scheduled tick starts a run, which holds at the gate
        first = wait_for(
            lambda: next((ev for ev in e2e.events(DAG) if ev["event"] == "start"), None),
            timeout=180,
            what="the first scheduled run to start",
        )
        holder = e2e.run(DAG, first["run_id"])
        assert holder["run_type"] == "scheduled"

        # let at least three more ticks come due while it is in flight
        wait_for(
            lambda: time.time() > first["t"] + 3 * INTERVAL + 2,
            timeout=120,
            what="three schedule intervals",
        )
        running = [r for r in e2e.runs(DAG) if r["state"] == "running"]
        assert [r["dag_run_id"] for r in running] == [first["run_id"]]
        assert [ev["run_id"] for ev in e2e.events(DAG) if ev["event"] == "start"] == [
            first["run_id"]
        ]

        # release: the held run ends and the next scheduled tick runs
        (e2e.state_dir / f"{DAG}.release").touch()
        assert e2e.wait_run(DAG, first["run_id"])["state"] == "success"
        second = wait_for(
            lambda: next(
                (
                    r
                    for r in e2e.runs(DAG)
                    if r["dag_run_id"] != first["run_id"]
                    and r["run_type"] == "scheduled"
                    and r["state"] == "success"
                ),
                None,
            ),
            timeout=180,
            what="a second scheduled run to succeed",
        )
    finally:
        e2e.set_paused(DAG, True)

    assert second["run_type"] == "scheduled"
    # no two runs ever overlapped: each start comes after the previous run's end
    events = e2e.events(DAG)
    intervals: dict[str, dict[str, float]] = {}
    for ev in events:
        intervals.setdefault(ev["run_id"], {})[ev["event"]] = ev["t"]
    ordered = sorted(intervals.values(), key=lambda iv: iv["start"])
    for earlier, later in itertools.pairwise(ordered):
        assert "end" in earlier, intervals
        assert later["start"] >= earlier["end"], intervals
