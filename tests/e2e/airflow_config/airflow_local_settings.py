"""Test-only cluster policy of the e2e stacks (copied to ``$AIRFLOW_HOME/config`` of each).

Airflow imports ``airflow_local_settings`` from ``$AIRFLOW_HOME/config`` in every component; the
dag-processor applies :func:`task_policy` to each task it parses, so the serialized DAGs the
scheduler reads carry the shorter delay. The shipped DAGs keep ``retry_delay`` 30 s
(``include/pin_airflow/dag_support.py``; ``tests/unit/test_dag_defaults.py`` says so); under a
test, a task that a Postgres restart failed is retried after 2 s instead of idling for 30.
Nothing else is changed: the number of retries, and which task retries, stay the DAGs' own.
"""

from __future__ import annotations

from datetime import timedelta

E2E_RETRY_DELAY = timedelta(seconds=2)


def task_policy(task) -> None:
    task.retry_delay = E2E_RETRY_DELAY
