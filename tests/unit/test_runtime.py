"""The Airflow glue around a task's job run (include/pin_airflow/runtime.py): the heap frozen
while the job runs."""

from __future__ import annotations

import gc

import pytest

from include.pin_airflow import runtime
from include.pin_maintenance.jobs import slot_expiration_config as slots
from include.pin_maintenance.lifecycle import JobMetrics, JobSpec, job_run
from include.pin_maintenance.telemetry import JobLog, RecordingMetrics, Telemetry

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
