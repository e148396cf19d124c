"""Manual triggers with params, as a user makes them: the CLI and the REST API (the UI's calls).

Uses the test-only DAG ``e2e_params`` (params built by ``config_params`` like the job DAGs'),
which records what each run received. The job DAGs' own triggers are in ``test_job_dags``.
"""

from __future__ import annotations

import pytest

from tests.e2e.stack_fixtures import E2EAirflow

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DAG = "e2e_params"


@pytest.fixture(scope="module")
def params_dag(airflow_e2e: E2EAirflow) -> E2EAirflow:
    airflow_e2e.wait_dag(DAG)
    airflow_e2e.set_paused(DAG, False)
    return airflow_e2e


def _recorded(e2e: E2EAirflow, run_id: str) -> list[dict]:
    return [e for e in e2e.events(DAG) if e["run_id"] == run_id]


def test_cli_trigger_runs_once_with_the_params(params_dag: E2EAirflow) -> None:
    run_id = params_dag.new_run_id("cli")
    done = params_dag.trigger_cli(DAG, {"batch_size": 7, "dry_run": True}, run_id)
    assert done.returncode == 0, done.stdout + done.stderr

    run = params_dag.wait_run(DAG, run_id)

    assert run["state"] == "success", params_dag.run_logs(DAG, run_id)
    assert run["run_type"] == "manual"
    assert run["conf"] == {"batch_size": 7, "dry_run": True}
    [event] = _recorded(params_dag, run_id)
    assert event["params"]["batch_size"] == 7
    assert event["params"]["dry_run"] is True
    assert event["params"]["max_run_duration_seconds"] is None  # not given = default later


def test_rest_trigger_with_a_jwt_runs_once_with_the_params(params_dag: E2EAirflow) -> None:
    run_id = params_dag.new_run_id("api")
    r = params_dag.trigger_api(DAG, {"batch_size": 9999, "max_run_duration_seconds": 0.5}, run_id)
    assert r.status_code == 200, r.text
    assert r.json()["dag_run_id"] == run_id

    run = params_dag.wait_run(DAG, run_id)

    assert run["state"] == "success", params_dag.run_logs(DAG, run_id)
    [event] = _recorded(params_dag, run_id)
    assert event["params"]["batch_size"] == 9999
    assert event["params"]["max_run_duration_seconds"] == 0.5
    assert event["params"]["dry_run"] is False  # the Param's default


def test_rest_api_refuses_a_request_without_a_token(params_dag: E2EAirflow) -> None:
    import httpx

    r = httpx.post(
        f"{params_dag.stack.url}/api/v2/dags/{DAG}/dagRuns",
        json={"logical_date": None, "conf": {}},
        timeout=30,
    )
    assert r.status_code == 401


INVALID = [
    pytest.param({"batch_size": 0}, id="below-minimum"),
    pytest.param({"batch_size": 10001}, id="above-maximum"),
    pytest.param({"batch_size": "ten"}, id="wrong-type"),
    pytest.param({"max_run_duration_seconds": 0}, id="exclusive-minimum"),
    pytest.param({"dry_run": "yes"}, id="not-a-boolean"),
]


@pytest.mark.parametrize("conf", INVALID)
def test_rest_api_rejects_invalid_params_before_a_run_exists(
    params_dag: E2EAirflow, conf: dict
) -> None:
    run_id = params_dag.new_run_id("api-bad")

    r = params_dag.trigger_api(DAG, conf, run_id)

    assert r.status_code == 400, r.text
    key = next(iter(conf))
    # the error names the key (Airflow: "Invalid input for param <key>: <jsonschema error>")
    assert f"Invalid input for param {key}:" in r.json()["detail"], r.text
    assert params_dag.run(DAG, run_id) is None
    assert _recorded(params_dag, run_id) == []


@pytest.mark.parametrize("conf", INVALID[:2])
def test_cli_rejects_invalid_params_before_a_run_exists(params_dag: E2EAirflow, conf: dict) -> None:
    run_id = params_dag.new_run_id("cli-bad")

    done = params_dag.trigger_cli(DAG, conf, run_id)

    assert done.returncode != 0, done.stdout + done.stderr
    assert f"Invalid input for param {next(iter(conf))}:" in done.stdout + done.stderr
    assert params_dag.run(DAG, run_id) is None
