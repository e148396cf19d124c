"""The jobs on every PostgreSQL major they support, and the refusal of an older one.

The rest of the suite runs on the embedded PostgreSQL 18. Here, for each other supported major
(devtools/pg_majors.py says where its server comes from), a pytest of its own runs on a fresh
server of that major (``PIN_PG_MAJOR``): the SQL-facing tests below, which between them load
and run every statement file under ``include/sql`` (checked: ``PIN_SQL_RECORD``), and one
successful ``airflow dags test`` of each DAG. Why these and not the whole integration tier:
docs/testing.md, "Every supported major".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from devtools import pg, pg_majors
from include.pin_maintenance import sql
from include.pin_maintenance.server_version import SUPPORTED_MAJORS
from tests import environment
from tests.junit import outcomes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
# the other majors: 18, the embedded server's, is every other tier's
OTHER_MAJORS = [major for major in SUPPORTED_MAJORS if major != max(SUPPORTED_MAJORS)]
# Every job, its lock, its privilege check and its pacing signals, run against the server and
# asserted on the rows (tests/integration), and one real DAG run of each job (tests/dags).
SQL_FACING = [
    "tests/integration/test_privileges.py",
    "tests/integration/test_db.py",
    "tests/integration/test_slot_expiration.py",
    "tests/integration/test_activity_retention.py",
    "tests/integration/test_snapshot_detach.py",
    "tests/integration/test_requeue_snapshot_detach.py",
    "tests/integration/test_runbook_sql.py",
    "tests/integration/test_pacing.py::"
    "test_a_retention_run_beside_busy_sessions_sizes_its_child_batches_and_keeps_session_batches",
    "tests/dags/test_calendar_slot_expiration.py::"
    "test_run_expires_due_slots_isolates_a_poison_row_and_exits_zero",
    "tests/dags/test_user_activity_retention.py::"
    "test_a_real_run_deletes_the_eligible_sessions_in_batches",
    "tests/dags/test_news_snapshot_detach.py::test_retry_dag_run_detaches_retries_and_quarantines",
    "tests/dags/test_news_snapshot_detach.py::test_requeue_dag_moves_chosen_rows",
]
# run bounds measured in seconds of sleep, the same on every major: they add time, not SQL
DESELECTED = [
    "tests/integration/test_snapshot_detach.py::test_lock_held_past_its_lease_raises_lock_held_too_long",
    "tests/integration/test_activity_retention.py::"
    "test_a_backlog_night_deletes_whole_sessions_within_its_budget",
]
# applied by every session's template database (tests/conftest.py: pg_template)
SCHEMA_FILES = {"schema/reference_schema", "schema/job_roles"}


@pytest.fixture(autouse=True)
def _the_projects_venv() -> None:
    """Outside the project's .venv (the Astro image) the tier skips, as the e2e tier does."""
    environment.skip_without_embedded_postgres("tests/majors (devtools/pg_majors.py)")


def every_sql_file() -> set[str]:
    return {
        path.relative_to(sql.SQL_DIR).with_suffix("").as_posix()
        for path in sql.SQL_DIR.rglob("*.sql")
    }


@pytest.mark.parametrize("major", OTHER_MAJORS)
def test_the_sql_facing_tests_pass_on(major: int, tmp_path: Path) -> None:
    junit, record = tmp_path / "junit.xml", tmp_path / "sql-files.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PIN_PG_URL"))}
    env.update(
        {
            environment.MAJOR_ENV: str(major),
            environment.SQL_RECORD_ENV: str(record),
            "AIRFLOW_HOME": str(tmp_path / "airflow-home"),
        }
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *SQL_FACING,
            *(f"--deselect={node}" for node in DESELECTED),
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            f"--junitxml={junit}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert f"postgres: PostgreSQL {major}" in output, output[:2000]
    ran = outcomes(junit)
    assert [case for case in ran if case[2] != "passed"] == []
    assert len(ran) > 150, f"only {len(ran)} tests ran"
    for node in SQL_FACING:
        module = node.split("::")[0].removesuffix(".py").replace("/", ".")
        assert any(case[0] == module for case in ran), f"{node} did not run"
    missing = every_sql_file() - SCHEMA_FILES - set(record.read_text().split())
    assert missing == set(), f"never run on PostgreSQL {major}: {sorted(missing)}"


def test_a_debian_major_that_cannot_be_installed_gets_its_stand_in(tmp_path, monkeypatch, capsys):
    """Not root and no Debian package (a developer's machine): PyPI's build of the same major
    serves, so `make test` passes there too; CI (``debian_only``) takes no stand-in."""
    major = min(SUPPORTED_MAJORS)
    assert major in pg_majors.DEBIAN and major in pg_majors.DEBIAN_STAND_INS
    refusing = tmp_path / "ensure_system_packages.sh"  # what the real script says when not root
    package = pg_majors.DEBIAN[major][0]
    refusing.write_text(f"echo 'missing {package}; not root, cannot apt-get install' >&2\nexit 1\n")
    monkeypatch.setattr(pg_majors, "ENSURE_PACKAGES", refusing)
    monkeypatch.setattr(pg_majors, "DEBIAN", {major: (package, tmp_path / "no-such-bin")})

    with pytest.raises(pg_majors.MajorUnavailable) as refused:
        pg_majors.bin_dir(major, debian_only=True)
    assert f"PostgreSQL {major}: Debian's {package} is not installed" in str(refused.value)
    assert "not root, cannot apt-get install" in str(refused.value)

    server = pg_majors.start(major)
    try:
        with psycopg.connect(server.primary_url()) as conn:
            version = conn.execute("show server_version_num").fetchone()[0]
    finally:
        server.stop()
    assert int(version) // 10000 == major
    assert pg_majors.DEBIAN_STAND_INS[major].requirement + " stands in" in capsys.readouterr().err


# each job's CLI: its connection, its job name and its arguments
JOB_CLIS = {
    "news_db": (
        "news_snapshot_detach_retry",
        [
            "include.pin_maintenance.jobs.snapshot_detach",
            "--selections-url",
            "http://127.0.0.1:9/x",
        ],
    ),
    "calendar_db": ("calendar_slot_expiration", ["include.pin_maintenance.jobs.slot_expiration"]),
    "user_activity_db": (
        "user_activity_retention",
        ["include.pin_maintenance.jobs.activity_retention"],
    ),
}


@pytest.fixture(scope="module")
def older_server():
    try:
        server = pg_majors.start(pg_majors.UNSUPPORTED_MAJOR)
    except pg_majors.MajorUnavailable as exc:
        pytest.fail(str(exc))  # no silent skip: the refusal is a promise to operators
    try:
        yield server
    finally:
        server.stop()


def test_an_older_server_is_refused_before_the_first_statement(older_server, tmp_path):
    roles = {conn_id: f"{name}_old" for conn_id, name in pg.DEV_ROLE_NAMES.items()}
    admin = older_server.primary_url()
    db = pg.job_database(admin, "pin_old", {c: pg.JobRole(n, "pw-old") for c, n in roles.items()})
    with psycopg.connect(admin, autocommit=True) as conn:
        for name in roles.values():  # every statement the job sends lands in the server log
            conn.execute(f"alter role \"{name}\" set log_statement = 'all'")
    log = older_server.primary.datadir / "server.log"
    for conn_id, (job, (module, *extra)) in JOB_CLIS.items():
        url, password_env = db.job_cli(conn_id)
        logged_before = log.read_text(errors="replace")
        done = subprocess.run(
            [sys.executable, "-m", module, "--db-url", url, *extra],
            cwd=REPO,
            env={**os.environ, **password_env},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stdout == ""
        assert (
            f"UnsupportedServer: {job}: the database runs PostgreSQL "
            f"{pg_majors.UNSUPPORTED_MAJOR}." in done.stderr
        ), done.stderr[-3000:]
        assert "the jobs support PostgreSQL 15 to 18" in done.stderr
        assert "Traceback" not in done.stderr
        alerts = [line for line in done.stderr.splitlines() if "event=alert " in line]
        assert len(alerts) == 1 and "database_server_unsupported" in alerts[0], alerts
        sent = log.read_text(errors="replace")[len(logged_before) :]
        assert "statement:" not in sent, sent[-2000:]
    # and the log does show a statement of a job role: the check above can fail
    with psycopg.connect(db.job_url("news_db")) as conn:
        conn.execute("select 'logged' as probe")
    assert "statement: select 'logged' as probe" in log.read_text(errors="replace")
