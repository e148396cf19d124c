"""Test-only cluster policy of the tests' Airflow homes (copied to ``$AIRFLOW_HOME/config``).

Airflow imports ``airflow_local_settings`` from ``$AIRFLOW_HOME/config`` in every component and
CLI command; the dag-processor (and ``airflow dags test``, which parses the DAG file itself)
applies :func:`task_policy` to each task it parses. The shipped DAGs keep ``retry_delay`` 30 s
(``include/pin_airflow/dag_support.py``; ``tests/unit/test_dag_defaults.py`` says so); under a
test, a task that failed (a Postgres restart, an execution_timeout, a refused delete) is retried
after 2 s instead of idling for 30. Installed by :func:`tests.environment.install_test_policy`
into the e2e stacks' homes and the DAG tier's. Nothing else is changed: the number of retries,
and which task retries, stay the DAGs' own.
"""

from __future__ import annotations

from datetime import timedelta

TEST_RETRY_DELAY = timedelta(seconds=2)


def task_policy(task) -> None:
    task.retry_delay = TEST_RETRY_DELAY
