"""The shipped DAGs under the real scheduler (LocalExecutor): one dry run and one real run each,
triggered with params through the CLI and the REST API, and invalid params refused up front.

The runs happen on the git-bundle stack (``bundle_e2e``: the DAGs as a deployment loads them,
manual runs only), the refusals on the scheduled stack (``airflow_e2e``, the DAGs from the
dags folder with the repository on ``PYTHONPATH``). The same scenarios run once more under
CeleryExecutor (``test_celery_executor``): once per executor.
"""

from __future__ import annotations

import uuid

import pytest

from tests.e2e import job_checks as jc
from tests.e2e.stack_fixtures import E2EAirflow

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_slot_expiration_runs_with_trigger_params(bundle_e2e: E2EAirflow) -> None:
    jc.check_slot_expiration(bundle_e2e, dry_run_via="cli", via="api")


def test_retention_runs_with_trigger_params(bundle_e2e: E2EAirflow) -> None:
    jc.check_retention(bundle_e2e, dry_run_via="api", via="cli")


def test_detach_retry_runs_with_trigger_params(bundle_e2e: E2EAirflow) -> None:
    jc.check_detach_retry(bundle_e2e, dry_run_via="cli", via="api")


def test_requeue_moves_the_chosen_quarantined_rows(bundle_e2e: E2EAirflow) -> None:
    jc.check_requeue(bundle_e2e, via="api")


@pytest.mark.parametrize(
    ("dag_id", "conf"),
    [
        (jc.SLOTS, {"batch_size": 0}),
        (jc.SLOTS, {"max_run_duration_seconds": -1}),
        (jc.RETENTION, {"retention_period_days": 0}),
        (jc.RETENTION, {"batch_size": 50001}),
        (jc.DETACH, {"batch_size": 10001}),
        (jc.DETACH, {"backoff_factor": 0.5}),
        (jc.SLOTS, {"batch_size": 1.5}),  # the form clamps ranges; the API refuses, too
        (jc.REQUEUE, {"snapshot_ids": "not-a-list"}),
        (jc.REQUEUE, {"snapshot_ids": ["not-a-uuid"]}),
        (jc.REQUEUE, {"all_quarantined": "yes"}),
    ],
)
def test_invalid_params_are_refused_before_a_run_exists(
    airflow_e2e: E2EAirflow, dag_id: str, conf: dict
) -> None:
    airflow_e2e.wait_dag(dag_id)
    jc.assert_rejected(airflow_e2e, dag_id, conf)


def test_100000_snapshot_ids_are_refused_by_the_run_in_one_short_line(
    airflow_e2e: E2EAirflow,
) -> None:
    """The issue's REST case. Airflow's param schema cannot refuse a count without quoting every
    id (jsonschema prints the whole list: a 400 of 8.5 MB), so the schema leaves the count to
    the task: the API creates the run and its task refuses it at once, before any write."""
    airflow_e2e.wait_dag(jc.REQUEUE)
    airflow_e2e.set_paused(jc.REQUEUE, False)  # manual only: no schedule to keep out of the way
    ids = [str(uuid.UUID(int=n)) for n in range(100_000)]
    run_id = airflow_e2e.new_run_id("api-100k")

    r = airflow_e2e.trigger_api(jc.REQUEUE, {"snapshot_ids": ids}, run_id)

    assert r.status_code == 200, r.text[:1000]
    assert airflow_e2e.wait_run(jc.REQUEUE, run_id)["state"] == "failed"
    task = "requeue_quarantined_snapshots"
    logs = airflow_e2e.api.get(
        f"/dags/{jc.REQUEUE}/dagRuns/{run_id}/taskInstances/{task}/logs/1",
        params={"full_content": True},
        headers={"Accept": "application/json"},
    )
    assert logs.status_code == 200, logs.text[:1000]
    # the log line's message, as the UI shows it (Airflow adds its ids as fields of its own)
    [event] = [
        item["event"]
        for item in logs.json()["content"]
        if "refused bad input" in str(item.get("event"))
    ]
    assert len(event) <= 400, event
    says = "snapshot_ids has 100000 ids (from trigger params); allowed at most 10000 per run"
    assert says in event, event
    assert ids[1] not in logs.text and len(logs.text) < 100_000, len(logs.text)
