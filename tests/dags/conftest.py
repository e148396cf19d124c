"""Fixtures for the DAG tier: the bundle's DagBag, a migrated Airflow metadata DB and a way to
run a DAG for real.

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
def dagbag():
    """The bundle's ``dags/`` folder as Airflow's DagBag parses it, once per session (per xdist
    worker), in this process. Tests read it; none changes it. A test that needs the files
    parsed under other settings builds its own (tests/dags/test_schedule_settings.py)."""
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(ae.REPO / "dags"))


def dag_of(dagbag, dag_id: str):
    """``dag_id`` from ``dagbag``, its file parsed without an import error."""
    errors = {path: e for path, e in dagbag.import_errors.items() if Path(path).stem == dag_id}
    assert errors == {}
    return dagbag.dags[dag_id]


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return migrated_airflow_home(tmp_path_factory.mktemp("airflow-home"))


RunDag = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_dag(airflow_home: Path) -> RunDag:
    """``run_dag(dag_id, db, conf=..., variables=..., selections_url=..., webhook_url=...)``.

    Through ``ae.airflow`` (forked from a warm interpreter) unless ``console_script``: then the
    venv's ``airflow`` console script as a process of its own, exactly what a user runs.
    """

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
        console_script: bool = False,
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
        if console_script:
            return subprocess.run(
                [str(ae.VENV_BIN / "airflow"), *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        return ae.airflow(args, env, timeout=timeout)

    return run
