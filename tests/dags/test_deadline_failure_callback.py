"""``on_task_failed`` wired through ``default_args`` alerts once, after the retries, via webhook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devtools.pg import Database
from tests.e2e.loopback import RecordingWebhook

pytestmark = pytest.mark.dags

FIXTURES = Path(__file__).resolve().parent / "fixtures_dags" / "failure"
NO_JOB_DB = Database(url="postgresql:///unused", name="unused")  # the fixture touches no DB


def test_task_failed_alert_after_retries(run_dag) -> None:
    with RecordingWebhook() as hook:
        done = run_dag(
            "pin_fixture_task_failed",
            NO_JOB_DB,
            webhook_url=hook.url,
            extra_env={"AIRFLOW__CORE__DAGS_FOLDER": str(FIXTURES)},
        )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output  # the run failed
    # one alert: none for the retried first try, none for the task that succeeded
    assert len(hook.received) == 1, (hook.received, output[-3000:])
    [alert] = hook.received
    assert alert["alert"] == "task_failed"
    assert alert["severity"] == "critical"
    assert alert["dag_id"] == "pin_fixture_task_failed"
    assert alert["run_id"].startswith("manual__")
    details = alert["details"]
    assert details["task_id"] == "broken"
    assert (details["try_number"], details["max_tries"]) == (2, 1)  # after the retry
    assert details["error"] == "RuntimeError"  # class only: the text stays in the task log
    assert "table is locked" not in json.dumps(alert)
    assert "broken" in alert["summary"]
    assert "PIN_ALERT" in output
