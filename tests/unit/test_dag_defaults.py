"""The defaults every shipped DAG starts from (include/pin_airflow/dag_support.py).

The tests' Airflow homes (the e2e stacks, the DAG tier) shorten ``retry_delay`` with a
test-only cluster policy (``tests/airflow_config/airflow_local_settings.py``); the product
keeps 30 s, and the DAG tier checks every parsed task too (``tests/dags/test_dag_policy.py``).
"""

from __future__ import annotations

from datetime import timedelta

from include.pin_airflow.dag_support import DEFAULT_ARGS


def test_one_infrastructure_retry_after_30_seconds():
    assert DEFAULT_ARGS["retries"] == 1
    assert DEFAULT_ARGS["retry_delay"] == timedelta(seconds=30)


def test_the_e2e_policy_is_test_only():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    # nothing the image or a deployment reads carries a local-settings policy: the bundle's
    # folders, the installed distribution and the repository root (the image's build context)
    shipped = [repo / d for d in ("dags", "include", "plugins", "scheduler_plugin")]
    found = [p for d in shipped for p in d.rglob("airflow_local_settings.py")]
    found += list(repo.glob("airflow_local_settings.py"))
    assert found == []
    assert (repo / "tests" / "airflow_config" / "airflow_local_settings.py").is_file()
