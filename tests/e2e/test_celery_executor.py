"""The distributed executor: the job DAGs and the requeue DAG under CeleryExecutor.

Redis (Debian's redis-server) as the broker on loopback, the Postgres metadata DB as Celery's
result backend, two Celery workers. A representative subset of the LocalExecutor checks: one
real run of each job DAG (after a dry run through the other trigger path) and the requeue DAG.
"""

from __future__ import annotations

import pytest

from devtools.local_airflow import wait_for
from tests.e2e import job_checks as jc
from tests.e2e.celery_fixtures import airflow_celery
from tests.e2e.stack_fixtures import E2EAirflow

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

__all__ = ["airflow_celery"]


def test_two_celery_workers_are_up(airflow_celery: E2EAirflow) -> None:
    def workers() -> list[str] | None:
        done = airflow_celery.stack.cli("celery", "list-workers", "--output", "json")
        if done.returncode != 0:
            return None
        names = sorted(w for w in done.stdout.split('"') if w.startswith("pin-worker-"))
        return names if len(names) == 2 else None

    names = wait_for(workers, timeout=180, interval=3, what="two celery workers")
    assert [n.split("@")[0] for n in names] == ["pin-worker-1", "pin-worker-2"]


def test_params_trigger_runs_on_a_celery_worker(airflow_celery: E2EAirflow) -> None:
    e2e = airflow_celery
    e2e.wait_dag("e2e_params")
    e2e.set_paused("e2e_params", False)
    run_id = jc.trigger(e2e, "e2e_params", {"batch_size": 42}, "api")
    [event] = [ev for ev in e2e.events("e2e_params") if ev["run_id"] == run_id]
    assert event["params"]["batch_size"] == 42
    # the task process ran under one of the two Celery workers (its ancestors' command line)
    assert str(event["celery_worker"]).split("@")[0] in ("pin-worker-1", "pin-worker-2"), event
    [ti] = e2e.task_instances("e2e_params", run_id)
    assert ti["state"] == "success"
    assert ti["queue"] == "default"


def test_slot_expiration_on_celery(airflow_celery: E2EAirflow) -> None:
    jc.check_slot_expiration(airflow_celery, dry_run_via="api", via="cli")


def test_retention_on_celery(airflow_celery: E2EAirflow) -> None:
    jc.check_retention(airflow_celery, dry_run_via="cli", via="api")


def test_detach_retry_on_celery(airflow_celery: E2EAirflow) -> None:
    jc.check_detach_retry(airflow_celery, dry_run_via="api", via="cli")


def test_requeue_on_celery(airflow_celery: E2EAirflow) -> None:
    jc.check_requeue(airflow_celery, via="cli")
