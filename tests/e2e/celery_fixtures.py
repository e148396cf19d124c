"""The same Airflow with CeleryExecutor: Redis broker on loopback, Postgres result backend,
two workers. Skipped, with the reason, when the celery provider or redis-server is missing.

``apache-airflow-providers-celery`` is not in the pinned requirements of the local ``.venv``
unless the lead added it (see docs/deploying.md); ``redis-server`` comes from Debian and is
installed by ``devtools/ensure_system_packages.sh`` when running as root (CI).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest

from devtools.airflow_env import REPO
from devtools.selections_service import SelectionsService
from tests.e2e.stack_fixtures import E2EAirflow, JobServer, e2e_stack, running_e2e

ENSURE = REPO / "devtools" / "ensure_system_packages.sh"
PROVIDER_HINT = (
    "apache-airflow-providers-celery is not installed in this environment; add to "
    "requirements-dev.txt: apache-airflow-providers-celery==3.26.0, celery[redis]==5.6.3, "
    "kombu==5.6.2"
)


def redis_server_or_skip() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    done = subprocess.run(
        ["bash", str(ENSURE), "redis-server"], capture_output=True, text=True, check=False
    )
    found = shutil.which("redis-server")
    if not found:
        pytest.skip(
            "Celery suite skipped: redis-server is not installed and could not be installed "
            f"(needs root and apt-get): {done.stderr.strip()}"
        )
    return found


def celery_provider_or_skip() -> None:
    if find_spec("airflow.providers.celery") is None or find_spec("celery") is None:
        pytest.skip(f"Celery suite skipped: {PROVIDER_HINT}")


@pytest.fixture(scope="module")
def airflow_celery(
    tmp_path_factory: pytest.TempPathFactory,
    pg_admin_url: str,
    airflow_meta_template: str,
    e2e_job_server: JobServer,
    e2e_selections: SelectionsService,
) -> Iterator[E2EAirflow]:
    """CeleryExecutor Airflow for one module; manual runs only (use_job_schedule off)."""
    celery_provider_or_skip()
    redis = redis_server_or_skip()
    tmp: Path = tmp_path_factory.mktemp("e2e-celery")
    e2e = e2e_stack(
        tmp,
        meta_admin_url=pg_admin_url,
        job_server=e2e_job_server,
        selections=e2e_selections,
        executor="CeleryExecutor",
        redis_server=redis,
        scheduled_runs=False,
        name="celery",
    )
    with running_e2e(e2e, meta_template=airflow_meta_template, what="the Celery stack"):
        yield e2e
