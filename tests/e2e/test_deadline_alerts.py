"""Deadline alerts under the real scheduler (not ``airflow dags test``).

One stack for the module (:func:`deadline_stack`), two fixture DAGs in its dags folder, one
scenario each:

1. run 1 of a fixture DAG against a 5 s default deadline (no Variable): exactly one
   ``deadline_missed`` alert reaches the loopback webhook, with the default interval;
   the DAG file is edited and re-parsed (a new DAG version) and the Variable
   ``<dag_id>_deadline_seconds`` is set to 40; run 2 is triggered and the file is edited again
   while it runs, re-serialized before run 2's deadline passes (apache/airflow#72471, #68732:
   re-serialization used to drop deadline records): exactly one alert for run 2, with the
   Variable's interval.
2. a run that fails at once, 60 s before its deadline: the failure pages once (``task_failed``)
   and the deadline callback, which the scheduler still runs, stays silent. The fixture triggers
   this run as soon as the stack is up, so its 60 s pass while scenario 1 runs; the test waits
   for whatever is left.

The first fixture's task holds until the test releases its run, which it does only once that
run's alert has arrived: no run can finish before its deadline, however slow the machine (a
sleeping task raced the scheduler there). Run 2's 40 s leave the trigger, the task start and the
re-parse room on a loaded machine; the test still fails if the re-parse did not land before the
deadline. Each test reads only its own DAG's versions, runs and alerts.

Airflow: :class:`devtools.local_airflow.AirflowStack` (the launcher of ``make up`` and the other
e2e tests) with api-server, scheduler and dag-processor only, LocalExecutor, the scratch dags
folder as its ``dags-folder`` bundle, quick re-parsing and the loopback webhook.
Metadata DB: a copy of the session's migrated template on the embedded Postgres (LocalExecutor
needs Postgres). StatsD goes to a loopback UDP listener, to check the scheduler's
``dagrun.duration`` names that ops/statsd/mapping.yml maps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TypeVar

import psycopg
import pytest

from devtools import pg
from devtools.local_airflow import AirflowStack, free_port
from devtools.local_airflow import wait_for as _wait_for
from tests.e2e.loopback import RecordingWebhook, UdpListener
from tests.e2e.stack_fixtures import QUICK_REPARSE, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(360)]

DAG_ID = "pin_fixture_deadline_e2e"
RUN_2_DEADLINE = 40  # s after queueing: room for the task to start and the DAG to be re-parsed
FIXTURE = Path(__file__).resolve().parents[1] / "dags" / "fixtures_dags" / "e2e_deadline"
# re-parse quickly so the "edit the DAG file" steps take seconds (stack_fixtures.QUICK_REPARSE)
DEADLINE_STACK_ENV = {
    **QUICK_REPARSE,
    "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
    # a loaded 2-core machine: the task's calls to the API server took > 5 s (the default) and
    # the task failed before it started (httpx.ReadTimeout); that is not what this test is about
    "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
}

T = TypeVar("T")


def wait_for(probe: Callable[[], T], *, timeout: float, what: str) -> T:
    """Poll every 0.5 s; an error in ``probe`` (a component exited) fails at once."""
    return _wait_for(probe, timeout=timeout, interval=0.5, what=what, retry_errors=False)


@contextmanager
def deadline_airflow(
    tmp_path: Path,
    *,
    admin_url: str,
    database: pg.Database,
    dags: Path,
    webhook_url: str,
    extra_env: dict[str, str],
) -> Iterator[AirflowStack]:
    """The stack for this test (``database`` is already migrated); stopped as ``make down``
    does (task supervisors included) and checked gone after."""
    stack = AirflowStack(
        home=tmp_path / "home",
        run_dir=tmp_path / "run",
        admin_url=admin_url,
        meta_db=database.name,
        job_db=database.name,  # the fixture DAG touches no job table
        job_schema=False,
        port=free_port(),
        components=("api-server", "scheduler", "dag-processor"),
        dags_folder=dags,
        webhook_url=webhook_url,
        start_selections=False,
        paused_at_creation=False,
        extra_env={**DEADLINE_STACK_ENV, **extra_env},
    )
    # the database exists (a copy of the migrated template): nothing to create or migrate
    with running_stack(stack, meta_template=database.name, what="the deadline stack"):
        yield stack


FAILED_DAG_ID = "pin_fixture_deadline_failed_e2e"
FAILED_FIXTURE = FIXTURE.parent / "e2e_deadline_failed"
FAILED_RUN_ID = "e2e_failed_run"


@dataclass
class DeadlineStack:
    af: AirflowStack
    url: str  # the metadata DB (the tests read its tables directly)
    dags: Path  # the stack's dags folder (scenario 1 edits its DAG file there)
    hook: RecordingWebhook
    statsd: UdpListener


@pytest.fixture(scope="module")
def deadline_stack(
    tmp_path_factory: pytest.TempPathFactory, pg_admin_url: str, airflow_meta_template: str
) -> Iterator[DeadlineStack]:
    """The module's stack, both fixture DAGs parsed, the failing run already triggered."""
    tmp = tmp_path_factory.mktemp("deadline")
    dags = tmp / "dags"
    for fixture in (FIXTURE, FAILED_FIXTURE):
        shutil.copytree(fixture, dags, dirs_exist_ok=True)
    name = f"airflow_e2e_deadline_{os.getpid()}"
    database = pg.create_database(pg_admin_url, name, template=airflow_meta_template, drop=True)
    try:
        with (
            RecordingWebhook() as hook,
            UdpListener() as statsd,
            deadline_airflow(
                tmp,
                admin_url=pg_admin_url,
                database=database,
                dags=dags,
                webhook_url=hook.url,
                extra_env=statsd.airflow_env(),
            ) as af,
        ):
            wait_for(
                lambda: (
                    af.check_alive()
                    or (_versions(database.url, DAG_ID) and _versions(database.url, FAILED_DAG_ID))
                ),
                timeout=90,
                what=f"{DAG_ID} and {FAILED_DAG_ID} parsed\n{af.tail_logs()}",
            )
            _cli(af, "dags", "trigger", FAILED_DAG_ID, "--run-id", FAILED_RUN_ID)
            yield DeadlineStack(af, database.url, dags, hook, statsd)
    finally:
        pg.drop_database(pg_admin_url, name)


def _cli(af: AirflowStack, *args: str) -> subprocess.CompletedProcess[str]:
    done = af.cli(*args, timeout=120)
    assert done.returncode == 0, f"airflow {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _scalar(url: str, sql: str, *params: object) -> object:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
    return row[0] if row else None


def _run_state(url: str, run_id: str, dag_id: str = DAG_ID) -> object:
    sql = "select state from dag_run where dag_id = %s and run_id = %s"
    return _scalar(url, sql, dag_id, run_id)


def _versions(url: str, dag_id: str = DAG_ID) -> int:
    return int(_scalar(url, "select count(*) from dag_version where dag_id = %s", dag_id) or 0)


def _edit(dag_file: Path, marker: str) -> None:
    text = dag_file.read_text()
    old = next(line for line in text.splitlines() if line.startswith("EDIT_MARKER = "))
    dag_file.write_text(text.replace(old, f'EDIT_MARKER = "{marker}"'))


def _finish(
    af: AirflowStack, url: str, run_id: str, hook: RecordingWebhook, dags: Path
) -> list[dict]:
    """Wait for the run's alert while its task holds, then release the run and let it end."""
    wait_for(
        lambda: (
            af.check_alive() or [a for a in hook.alerts("deadline_missed") if a["run_id"] == run_id]
        ),
        timeout=120,
        what=f"deadline_missed for {run_id}\n{af.tail_logs()}",
    )
    assert _run_state(url, run_id) == "running"  # the deadline passed while it ran
    (dags / f"release-{run_id}").touch()
    wait_for(
        lambda: af.check_alive() or _run_state(url, run_id) in ("success", "failed"),
        timeout=90,
        what=f"{run_id} to finish",
    )
    assert _run_state(url, run_id) == "success", af.tail_logs()
    return [a for a in hook.alerts("deadline_missed") if a["run_id"] == run_id]


def _interval(alert: dict) -> float:
    details = alert["details"]
    deadline = datetime.fromisoformat(details["deadline_time"])
    queued = datetime.fromisoformat(details["queued_at"].replace("Z", "+00:00"))
    return (deadline - queued).total_seconds()


def _report(hook: RecordingWebhook, t0: float) -> None:
    """Timeline for the record (shown with ``pytest -s``): when each alert of scenario 1 arrived."""
    for alert, at in zip(hook.received, hook.received_at, strict=True):
        if alert.get("alert") != "deadline_missed" or alert.get("dag_id") != DAG_ID:
            continue
        deadline = datetime.fromisoformat(alert["details"]["deadline_time"]).timestamp()
        print(
            "E2E_DEADLINE",
            json.dumps(
                {
                    "run_id": alert["run_id"],
                    "received_s_after_start": round(at - t0, 1),
                    "received_s_after_deadline": round(at - deadline, 1),
                    "interval_s": _interval(alert),
                }
            ),
        )


def test_deadline_fires_once_per_late_run_and_survives_reparse(
    deadline_stack: DeadlineStack,
) -> None:
    af, url, dags, hook = (
        deadline_stack.af,
        deadline_stack.url,
        deadline_stack.dags,
        deadline_stack.hook,
    )
    dag_file = dags / f"{DAG_ID}.py"
    t0 = time.time()
    _cli(af, "dags", "trigger", DAG_ID, "--run-id", "e2e_run_1")
    first = _finish(af, url, "e2e_run_1", hook, dags)

    versions = _versions(url)
    _edit(dag_file, "edited-before-run-2")
    wait_for(lambda: _versions(url) > versions, timeout=60, what="re-parse after edit")
    _cli(af, "variables", "set", f"{DAG_ID}_deadline_seconds", str(RUN_2_DEADLINE))
    _cli(af, "dags", "trigger", DAG_ID, "--run-id", "e2e_run_2")
    wait_for(lambda: _run_state(url, "e2e_run_2") == "running", timeout=60, what="run 2")
    versions = _versions(url)
    _edit(dag_file, "edited-during-run-2")
    wait_for(lambda: _versions(url) > versions, timeout=60, what="re-parse during run 2")
    reparsed_at = _scalar(url, "select max(created_at) from dag_version where dag_id = %s", DAG_ID)
    second = _finish(af, url, "e2e_run_2", hook, dags)

    deadlines = _scalar(
        url,
        "select count(*) from deadline d join dag_run r on r.id = d.dagrun_id"
        " where r.dag_id = %s and d.missed",
        DAG_ID,
    )

    _report(hook, t0)
    assert len(first) == 1, first
    assert len(second) == 1, second
    assert deadlines == 2
    for alert in (*first, *second):
        assert alert["severity"] == "warning"
        assert alert["dag_id"] == DAG_ID
        assert alert["details"]["tune_with_variable"] == f"{DAG_ID}_deadline_seconds"
    assert _interval(first[0]) == pytest.approx(5, abs=0.01)  # default: no Variable
    assert _interval(second[0]) == pytest.approx(RUN_2_DEADLINE, abs=0.01)  # Variable, at creation
    # the DAG was re-serialized while run 2's deadline was pending, and the deadline survived
    lead = datetime.fromisoformat(second[0]["details"]["deadline_time"]) - reparsed_at
    print("E2E_REPARSE", json.dumps({"reparsed_s_before_run_2_deadline": lead.total_seconds()}))
    assert lead.total_seconds() > 0
    # nothing else was sent for this DAG (the other scenario's DAG pages on the same webhook)
    assert len([a for a in hook.alerts() if a.get("dag_id") == DAG_ID]) == 2, hook.alerts()
    # the scheduler's own metrics that ops/statsd/mapping.yml maps (airflow.dagrun.duration.*.*)
    lines = deadline_stack.statsd.lines
    durations = [line for line in lines if line.startswith("airflow.dagrun.duration.")]
    assert any(
        line.startswith(f"airflow.dagrun.duration.success.{DAG_ID}:") and line.endswith("|ms")
        for line in durations
    ), durations


def test_a_run_that_failed_before_its_deadline_pages_task_failed_only(
    deadline_stack: DeadlineStack,
) -> None:
    """Airflow 3.3.2 keeps a failed run's deadline (it prunes them on success only) and the
    scheduler runs the callback once the deadline passes; the callback reads the run's state
    from its context and stays silent: the failure paged once, as ``task_failed``."""
    from tests.dags.fixtures_dags.e2e_deadline_failed.pin_fixture_deadline_failed_e2e import (
        DEADLINE_SECONDS,
        SECRET,
    )

    af, url, hook = deadline_stack.af, deadline_stack.url, deadline_stack.hook
    run_id = FAILED_RUN_ID  # triggered by the fixture as soon as the stack was up
    wait_for(
        lambda: af.check_alive() or _run_state(url, run_id, FAILED_DAG_ID) == "failed",
        timeout=90,
        what=f"{run_id} to fail\n{af.tail_logs()}",
    )
    ended_before = _scalar(
        url,
        "select r.end_date < d.deadline_time from deadline d join dag_run r"
        " on r.id = d.dagrun_id where r.dag_id = %s and r.run_id = %s",
        FAILED_DAG_ID,
        run_id,
    )
    # the scheduler handles the deadline as missed and the callback runs to its end
    callback_sql = (
        "select c.state from deadline d join dag_run r on r.id = d.dagrun_id"
        " join callback c on c.id = d.callback_id"
        " where r.dag_id = %s and r.run_id = %s and d.missed"
    )

    def callback_done() -> object:
        af.check_alive()
        state = _scalar(url, callback_sql, FAILED_DAG_ID, run_id)
        return state if state in ("success", "failed") else None

    callback_state = wait_for(
        callback_done,
        timeout=DEADLINE_SECONDS + 90,
        what=f"the deadline callback of {run_id}\n{af.tail_logs()}",
    )
    time.sleep(3)  # a webhook POST the callback made would have arrived by now
    received = [a for a in hook.alerts() if a.get("run_id") == run_id]

    print("E2E_FAILED_RUN", json.dumps({"callback_state": callback_state, "alerts": received}))
    assert ended_before is True, "the run did not end before its deadline (machine too slow?)"
    assert callback_state == "success"
    assert [a["alert"] for a in received] == ["task_failed"], received
    assert SECRET not in json.dumps(hook.alerts())
