"""The Airflow glue around a task's job run: the run bound checked against the task's
``execution_timeout``, and the heap frozen while the job runs (include/pin_airflow/runtime.py).

The refusal in a real run: tests/dags/test_calendar_slot_expiration.py.
"""

from __future__ import annotations

import functools
import gc
import json
import re
from datetime import timedelta
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from include.pin_airflow import runtime
from include.pin_maintenance.config import ConfigError
from include.pin_maintenance.jobs import activity_retention_config as retention
from include.pin_maintenance.jobs import slot_expiration_config as slots
from include.pin_maintenance.jobs import snapshot_detach_config as detach
from include.pin_maintenance.lifecycle import JobMetrics, JobSpec, job_run
from include.pin_maintenance.telemetry import JobLog, RecordingMetrics, Telemetry


def test_a_slot_cycle_takes_its_run_duration_plus_the_stop_grace():
    assert slots.STOP_GRACE_SECONDS == 35  # statement_timeout 30 s + 5 s
    assert slots.worst_case_run_seconds(slots.CONFIG.defaults) == 30 + 35
    long_run = slots.CONFIG.resolve(None, {"max_run_duration_seconds": 3600})
    assert slots.worst_case_run_seconds(long_run) == 3635


def test_a_detach_run_takes_its_run_duration_plus_one_call_and_the_margin():
    assert detach.worst_case_run_seconds(detach.CONFIG.defaults) == 240 + 5 + 5


def test_a_retention_delete_task_takes_its_share_of_the_run_plus_the_stop_grace():
    assert retention.STOP_GRACE_SECONDS == 250  # 2 statements of 120 s + 2 cancels of 5 s
    config = retention.CONFIG.defaults  # max_run_duration_seconds 1800
    by_table = {
        t: retention.worst_case_step_seconds(config, t) for t in retention.STEP_DEADLINE_SHARE
    }
    assert by_table == {"action_events": 610, "property_object_views": 1150, "sessions": 2050}


class FakeTask(SimpleNamespace):
    pass


def context(timeouts: dict[str, float | None], running: str, params=None) -> dict:
    """A task context whose DAG holds tasks with these execution_timeouts (seconds)."""
    tasks = {
        task_id: FakeTask(
            task_id=task_id,
            execution_timeout=None if seconds is None else timedelta(seconds=seconds),
        )
        for task_id, seconds in timeouts.items()
    }
    dag = SimpleNamespace(get_task=tasks.__getitem__)
    for task in tasks.values():
        task.dag = dag
    return {"ti": SimpleNamespace(task_id=running, task=tasks[running]), "params": params or {}}


@pytest.fixture
def variable(monkeypatch):
    values: dict[str, str] = {}
    monkeypatch.setattr(runtime, "read_variable_json", values.get)
    return values


def test_a_run_duration_the_timeout_cannot_hold_is_refused_naming_both(variable):
    variable[slots.JOB] = json.dumps({"max_run_duration_seconds": 3600})
    ctx = context({"expire_slots": 600}, "expire_slots")
    with pytest.raises(runtime.InvalidConfig) as refused:
        runtime.resolve_config(slots.CONFIG, ctx, slots.worst_case_run_seconds)
    assert str(refused.value) == (
        "calendar_slot_expiration: max_run_duration_seconds = 3600 (from Variable "
        "calendar_slot_expiration) needs up to 3635 s in task expire_slots, more than its "
        "execution_timeout of 600 s; allowed: <= 565"
    )
    assert isinstance(refused.value, AirflowFailException)  # no retry
    assert isinstance(refused.value, ConfigError)


def test_a_run_duration_that_fits_passes(variable):
    ctx = context({"expire_slots": 600}, "expire_slots", {"max_run_duration_seconds": 565})
    config = runtime.resolve_config(slots.CONFIG, ctx, slots.worst_case_run_seconds)
    assert config.max_run_duration_seconds == 565
    ctx = context({"expire_slots": None}, "expire_slots", {"max_run_duration_seconds": 1e6})
    assert runtime.resolve_config(slots.CONFIG, ctx, slots.worst_case_run_seconds)


def test_the_detach_bound_names_what_the_call_timeout_leaves(variable):
    params = {"max_run_duration_seconds": 600, "lock_ttl_seconds": 900}
    ctx = context({"detach_pending_snapshots": 600}, "detach_pending_snapshots", params)
    with pytest.raises(
        runtime.InvalidConfig, match=re.escape("(from trigger params) needs up to 610 s")
    ) as refused:
        runtime.resolve_config(detach.CONFIG, ctx, detach.worst_case_run_seconds)
    assert str(refused.value).endswith("allowed: <= 590")


def test_prepare_checks_each_later_delete_task_by_its_share(variable):
    timeouts = {"prepare": 600, **{f"delete_{t}": 2000 for t in retention.STEP_DEADLINE_SHARE}}
    rules = {
        f"delete_{t}": functools.partial(retention.worst_case_step_seconds, table=t)
        for t in retention.STEP_DEADLINE_SHARE
    }
    ok = runtime.resolve_config(
        retention.CONFIG, context(timeouts, "prepare", {"max_run_duration_seconds": 1750}), rules
    )
    # 1750 + 250 s fits; prepare's own 600 s is not what the delete tasks need
    assert ok.max_run_duration_seconds == 1750
    with pytest.raises(runtime.InvalidConfig) as refused:
        runtime.resolve_config(retention.CONFIG, context(timeouts, "prepare"), rules)
    assert str(refused.value) == (
        "user_activity_retention: max_run_duration_seconds = 1800 (default) needs up to 2050 s "
        "in task delete_sessions, more than its execution_timeout of 2000 s; allowed: <= 1750"
    )


def test_a_timeout_shorter_than_the_grace_allows_no_value(variable):
    ctx = context({"expire_slots": 20}, "expire_slots")
    with pytest.raises(
        runtime.InvalidConfig,
        match=re.escape("allowed: none until the execution_timeout exceeds 35 s"),
    ):
        runtime.resolve_config(slots.CONFIG, ctx, slots.worst_case_run_seconds)


SPEC = JobSpec(
    job="toy_job",
    config=slots.CONFIG,
    metrics=JobMetrics(counters=(), duration=None, last_success=None),
)


def telemetry() -> Telemetry:
    return Telemetry.local(JobLog(SPEC.job, "run-1"), RecordingMetrics())


def test_a_task_keeps_the_heap_it_started_with_out_of_the_collectors_scans():
    gc.unfreeze()  # a process starts with nothing frozen
    with runtime.frozen_heap(), job_run(SPEC, telemetry()):
        assert gc.get_freeze_count() > 0  # the objects alive at the start, at least this test's
        with runtime.frozen_heap(), job_run(SPEC, telemetry(), "delete"):  # a second run
            pass
        assert gc.get_freeze_count() > 0  # still frozen until the first run ends
    with pytest.raises(KeyError), runtime.frozen_heap(), job_run(SPEC, telemetry()):
        raise KeyError("boom")
    assert gc.get_freeze_count() == 0
    gc.freeze()  # frozen by the process (Airflow freezes around a fork): left as found
    try:
        with runtime.frozen_heap(), job_run(SPEC, telemetry()):
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
