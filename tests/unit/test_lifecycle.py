"""The run lifecycle every job shares and the CLI entry every job uses (pure; no DB)."""

from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass

import pytest

from include.pin_maintenance import cli
from include.pin_maintenance.config import ConfigError, ConfigSpec, JobConfig, setting
from include.pin_maintenance.db import SessionSettings, is_row_error
from include.pin_maintenance.lifecycle import (
    CappedAlerts,
    JobMetrics,
    JobSpec,
    describe_error,
    job_run,
)
from include.pin_maintenance.stopping import JobCancelled
from include.pin_maintenance.telemetry import Alert, JobLog, RecordingMetrics, Telemetry


@dataclass(frozen=True, kw_only=True)
class ToyConfig(JobConfig):
    batch_size: int = setting(10, minimum=1)


SPEC = JobSpec(
    job="toy_job",
    config=ConfigSpec(job="toy_job", config_class=ToyConfig),
    metrics=JobMetrics(
        counters=("toy_items_total", "toy_errors_total"),
        duration="toy_run_duration_seconds",
        last_success="toy_last_success_timestamp_seconds",
        lock_contention="toy_lock_contention_total",
    ),
)


def telemetry() -> Telemetry:
    return Telemetry.local(JobLog(SPEC.job, "run-1"), RecordingMetrics())


def events(caplog) -> list[str]:
    return [r.getMessage().split()[0] for r in caplog.records if "job=toy_job" in r.getMessage()]


def test_a_run_sends_its_counters_at_zero_then_logs_start_and_completion(caplog):
    caplog.set_level(logging.INFO)
    t = telemetry()
    with job_run(SPEC, t) as run:
        run.started(batch_size=10)
        assert t.metrics.counters == {"toy_items_total": 0, "toy_errors_total": 0}
        run.completed({"Items": 3}, duration_seconds=1.5, items=3)
    assert events(caplog) == ["event=job_started", "event=job_completed"]
    assert t.metrics.timings == {"toy_run_duration_seconds": [1.5]}
    assert "toy_last_success_timestamp_seconds" in t.metrics.gauges


def test_a_failed_run_sets_no_success_and_records_no_duration_when_told():
    t = telemetry()
    with job_run(SPEC, t) as run:
        run.completed({}, duration_seconds=None, success=False)
    assert t.metrics.timings == {}
    assert t.metrics.gauges == {}


def test_an_exception_logs_job_failed_with_the_progress_and_is_raised_as_is(caplog):
    caplog.set_level(logging.INFO)
    with pytest.raises(KeyError), job_run(SPEC, telemetry(), "delete") as run:
        run.progress["expired_count"] = 7
        raise KeyError("boom")
    line = caplog.records[-1].getMessage()
    assert line.startswith("event=job_failed ")
    assert "error=\"KeyError: 'boom'\"" in line
    assert "phase=delete" in line and "expired_count=7" in line


def test_a_cancellation_logs_job_cancelled_once(caplog):
    caplog.set_level(logging.INFO)
    with pytest.raises(JobCancelled, match="3 done"), job_run(SPEC, telemetry()) as run:
        raise run.cancelled("SIGTERM received", "toy_job: SIGTERM received; 3 done", items=3)
    assert events(caplog) == ["event=job_cancelled"]
    assert 'reason="SIGTERM received"' in caplog.records[-1].getMessage()


def test_a_run_leaves_the_processs_garbage_collector_alone():
    # freezing the heap is the Airflow glue's (include/pin_airflow/runtime.py, frozen_heap)
    gc.unfreeze()
    with job_run(SPEC, telemetry()):
        assert gc.get_freeze_count() == 0


def test_capped_alerts_send_up_to_the_cap_then_one_summary():
    t = telemetry()
    capped = CappedAlerts(t.alerts, cap=2)
    sent = [capped.send(Alert("toy_row", "warning", f"row {i}")) for i in range(5)]
    capped.summarize(lambda n, more: Alert("toy_row", "warning", f"{n} sent, {more} more"))
    assert sent == [True, True, False, False, False]
    assert [a.summary for a in t.alerts.sent] == ["row 0", "row 1", "2 sent, 3 more"]


def test_describe_error_keeps_class_sqlstate_and_the_first_line_only():
    class Failed(Exception):
        sqlstate = "23514"

    text = describe_error(Failed("new row violates check\nDETAIL: Failing row contains (secret)"))
    assert text == "Failed 23514: new row violates check"
    assert len(describe_error(ValueError("x" * 1000))) == 300


@pytest.mark.parametrize(
    ("sqlstate", "row_error"),
    [
        ("23514", True),  # check violation: a row
        ("22003", True),  # numeric out of range: a row
        ("P0001", True),  # a trigger's RAISE: a row
        ("25006", False),  # read-only transaction: a failover, not a row
        ("08006", False),  # connection failure
        ("57014", False),  # statement timeout / cancel
        ("55P03", False),  # lock timeout
        ("42501", False),  # insufficient privilege: every row alike
        (None, False),  # the client lost the server
    ],
)
def test_the_database_not_the_row(sqlstate, row_error):
    assert is_row_error(sqlstate) is row_error


# -- the CLI ---------------------------------------------------------------------------------


def toy_cli(body) -> cli.JobCli:
    return cli.JobCli(
        spec=SPEC,
        module="tests.toy_job",
        database="toy database",
        description="a toy job",
        session=SessionSettings(application_name="toy"),
        run=body,
    )


def run_cli(body, *args: str) -> int:
    # connections are opened lazily by the body, so a closed port is never dialled here
    return cli.main(toy_cli(body), ["--db-url", "postgresql://nobody@127.0.0.1:1/x", *args])


def test_cli_prints_the_result_and_exits_0(capsys):
    assert (
        run_cli(lambda run: {"Items": run.config.batch_size}, "--config", '{"batch_size": 4}') == 0
    )
    assert json.loads(capsys.readouterr().out) == {"Items": 4}


def test_cli_names_the_bad_key_its_value_and_its_source_and_exits_2(capsys, caplog):
    caplog.set_level(logging.INFO)
    assert run_cli(lambda run: {}, "--config", '{"batch_size": 0}') == 2
    line = caplog.records[-1].getMessage()
    assert line.startswith("event=config_invalid ")
    assert "batch_size = 0 (from --config)" in line
    assert capsys.readouterr().out == ""


def test_cli_refuses_config_that_is_not_json_naming_the_flag(caplog):
    assert run_cli(lambda run: {}, "--config", "{batch_size: 4}") == 2
    assert "--config is not valid JSON" in caplog.records[-1].getMessage()


def test_cli_exits_1_on_a_failure_and_prints_no_result(capsys):
    def body(run):
        raise RuntimeError("database went away")

    assert run_cli(body) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert "RuntimeError: database went away" in out.err


def test_cli_exits_3_when_cancelled(capsys):
    def body(run):
        raise JobCancelled("SIGTERM received")

    assert run_cli(body) == 3
    assert capsys.readouterr().out == ""


def test_cli_exits_2_on_a_config_error_found_by_the_job():
    def body(run):
        raise ConfigError("toy_job: batch_size = 3 (config) is out of range")

    assert run_cli(body) == 2
