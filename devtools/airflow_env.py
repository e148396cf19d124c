"""The environment that runs this bundle through Airflow the standard way
(docs/design.md, "Running a DAG the standard way").

Used by the demo, the DAG tests, ``make up`` and the benchmarks, so that they all run the DAGs
exactly as ``airflow dags test <dag_id>`` with ``AIRFLOW_CONN_*`` variables would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from devtools import airflow_forkserver
from devtools.pg import airflow_conn_json

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
JOB_CONN_IDS = ("news_db", "calendar_db", "user_activity_db")


def airflow_env(
    home: Path,
    *,
    job_db_url: str | Mapping[str, str],
    selections_url: str | None = None,
    selections_login: str = "pin-maintenance",
    selections_password: str = "local-dev-secret",
    webhook_url: str | None = None,
    metadata_url: str | None = None,
    variables: dict[str, object] | None = None,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """A full environment for an Airflow CLI subprocess (``os.environ`` plus our settings).

    ``job_db_url``: one URL for every job connection, or one per connection id (each job's role:
    ``Database.job_urls()``).
    """
    env = dict(os.environ)
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "PYTHONPATH": str(REPO),
            # airflow standalone / the scheduler spawn `airflow` by name
            "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        }
    )
    for conn_id in JOB_CONN_IDS:
        url = job_db_url if isinstance(job_db_url, str) else job_db_url[conn_id]
        env[f"AIRFLOW_CONN_{conn_id.upper()}"] = airflow_conn_json(url)
    if selections_url:
        env["AIRFLOW_CONN_SELECTIONS_API"] = json.dumps(
            {
                "conn_type": "http",
                "host": selections_url,
                "login": selections_login,
                "password": selections_password,
            }
        )
    if webhook_url:
        env["AIRFLOW_CONN_ALERTS_WEBHOOK"] = json.dumps({"conn_type": "http", "host": webhook_url})
    if metadata_url:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = metadata_url
    for key, value in (variables or {}).items():
        env[f"AIRFLOW_VAR_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    env.update(extra or {})
    return env


def airflow_cli(*args: str) -> list[str]:
    """The venv's ``airflow`` CLI as the tests and tools run it: the console script's ``main``,
    without the interpreter's last garbage collection (devtools/airflow_cli.py)."""
    return [str(VENV_BIN / "python"), str(REPO / "devtools" / "airflow_cli.py"), *args]


def airflow(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess[str]:
    """Run the venv's ``airflow`` CLI with ``env``; output captured as text.

    Forked from a warm interpreter (devtools/airflow_forkserver.py) unless ``kwargs`` asks for
    more of :func:`subprocess.run` than a timeout, or ``PIN_AIRFLOW_FORKSERVER=0`` is set.
    """
    if set(kwargs) <= {"timeout"} and os.environ.get("PIN_AIRFLOW_FORKSERVER") != "0":
        return airflow_forkserver.run(airflow_cli(*args), list(args), env, **kwargs)
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    return subprocess.run(airflow_cli(*args), env=env, check=False, **kwargs)


def migrate(env: dict[str, str]) -> None:
    """``airflow db migrate`` (idempotent); raises with Airflow's output when it fails."""
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    done = airflow(["db", "migrate"], env)
    if done.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{done.stdout}\n{done.stderr}")
