"""Fixtures for the DAG tier: a migrated Airflow metadata DB and a way to run a DAG for real.

``run_dag`` runs ``airflow dags test <dag_id>`` in a subprocess, exactly as docs/design.md,
"Running a DAG the standard way" describes (``AIRFLOW_CONN_*`` for the connections,
``AIRFLOW_VAR_*`` for Variables), against the test's own database, each job connection logging
in as its job role (``Database.job_urls()``), never as the owner. The metadata DB is SQLite in
a per-session temp dir (migrated once, ~3 s), with the tests' cluster policy
(tests/airflow_config: a failed task is retried after 2 s, not the DAGs' 30 s).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from devtools import airflow_env as ae
from devtools.pg import Database
from tests.environment import migrated_airflow_home


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return migrated_airflow_home(tmp_path_factory.mktemp("airflow-home"))


RunDag = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_dag(airflow_home: Path) -> RunDag:
    """``run_dag(dag_id, db, conf=..., variables=..., selections_url=..., webhook_url=...)``."""

    def run(
        dag_id: str,
        db: Database,
        *,
        conf: dict | None = None,
        variables: dict[str, object] | None = None,
        selections_url: str | None = None,
        webhook_url: str | None = None,
        extra_env: dict[str, str] | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        env = ae.airflow_env(
            airflow_home,
            # no roles: a placeholder database that the fixture DAGs never open
            job_db_url=db.job_urls() if db.roles else db.url,
            selections_url=selections_url,
            webhook_url=webhook_url,
            variables=variables,
            extra=extra_env,
        )
        args = ["dags", "test", dag_id]
        if conf is not None:
            args += ["--conf", json.dumps(conf)]
        return ae.airflow(args, env, timeout=timeout)

    return run
