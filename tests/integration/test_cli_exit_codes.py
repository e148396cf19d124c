"""The job CLIs as the README shows them: usage names the module, exit codes mean what they say.

Run as subprocesses (``python -m ...``), exactly as pasted; the database is the test's own,
logged in to as the job's role. Exit code 1 = the database failed (slots: unreachable server;
retention: a batch the database rejects), nothing else done; 2 = refused before any write (a bad
config, a password on the command line, a database privilege the role lacks).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from devtools.retention_data import insert_session
from tests.job_db import job_cli

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
README_MODULES = sorted(
    set(
        re.findall(
            r"python -m (include\.pin_maintenance\.jobs\.\w+)", (REPO / "README.md").read_text()
        )
    )
)


def cli(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def test_readme_shows_the_three_job_clis() -> None:
    assert len(README_MODULES) == 3, README_MODULES


@pytest.mark.parametrize("module", README_MODULES)
def test_help_names_the_module_to_run(module: str) -> None:
    done = cli(module, "--help")
    assert done.returncode == 0, done.stderr
    assert re.match(rf"usage: python -m {re.escape(module)}\s", done.stdout), done.stdout[:200]
    assert "--db-url" in done.stdout


def _closed_port_url() -> str:
    with socket.socket() as s:  # a port the OS just handed out and nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql://nobody@127.0.0.1:{port}/nowhere?connect_timeout=5"


def test_slot_cli_exits_1_when_the_database_fails() -> None:
    done = cli("include.pin_maintenance.jobs.slot_expiration", "--db-url", _closed_port_url())
    assert done.returncode == 1, done.stderr
    assert "event=job_started" in done.stderr
    assert done.stdout == ""  # no result printed


def test_slot_cli_exits_2_on_a_bad_config_before_connecting() -> None:
    done = cli(
        "include.pin_maintenance.jobs.slot_expiration",
        "--db-url",
        _closed_port_url(),
        "--config",
        '{"batch_size": 0}',
    )
    assert done.returncode == 2
    assert "batch_size" in done.stderr


def test_detach_cli_exits_2_on_a_bad_config_naming_key_value_and_source() -> None:
    done = cli(
        "include.pin_maintenance.jobs.snapshot_detach",
        "--db-url",
        _closed_port_url(),
        "--selections-url",
        "http://127.0.0.1:9",
        "--config",
        '{"batch_size": 0}',
    )
    assert done.returncode == 2, done.stderr
    assert "event=config_invalid" in done.stderr
    assert "batch_size = 0 (from --config) is out of range" in done.stderr
    assert "Traceback" not in done.stderr and "Variable" not in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("module", "job", "revoke", "names"),
    [
        (
            "include.pin_maintenance.jobs.slot_expiration",
            "calendar_slot_expiration",
            "revoke update on calendar.availability_slots from {role}",
            "lacks UPDATE on calendar.availability_slots column",
        ),
        (
            "include.pin_maintenance.jobs.activity_retention",
            "user_activity_retention",
            "revoke delete on user_activity.sessions from {role}",
            "lacks DELETE on user_activity.sessions (the sessions delete step)",
        ),
    ],
    ids=["slots", "retention"],
)
def test_a_cli_exits_2_naming_a_missing_privilege_before_any_write(
    db, module: str, job: str, revoke: str, names: str
) -> None:
    url, db_env = job_cli(db, job)
    role = conninfo_to_dict(url)["user"]
    with db.connect() as conn:
        conn.execute(revoke.format(role=role))
    done = cli(module, "--db-url", url, env={**os.environ, **db_env})
    assert done.returncode == 2, done.stderr
    assert f"MissingPrivileges: {job}: role {role} {names}" in done.stderr
    assert "event=privileges_missing" in done.stderr
    assert "alert=database_privileges_missing" in done.stderr
    assert done.stdout == ""


def test_retention_cli_exits_1_on_a_failed_batch(db) -> None:
    with db.connect() as conn:
        conn.execute(
            "create table user_activity.session_notes (id uuid primary key, session_id uuid not"
            " null references user_activity.sessions (id) on delete restrict)"
        )
        sid = insert_session(conn, ended_at=datetime.now(UTC) - timedelta(days=800))
        conn.execute("insert into user_activity.session_notes values (%s, %s)", (uuid.uuid4(), sid))
    url, db_env = job_cli(db, "user_activity_retention")
    done = cli(
        "include.pin_maintenance.jobs.activity_retention",
        "--db-url",
        url,
        env={**os.environ, **db_env},
    )
    assert done.returncode == 1, done.stderr
    assert "BatchFailed: sessions: batch 0 (1 sessions" in done.stderr
    assert "event=batch_failed" in done.stderr
    assert done.stdout == ""
    with db.connect() as conn:
        left = conn.execute("select count(*) from user_activity.sessions").fetchone()[0]
    assert left == 1  # rolled back, nothing half-done


# ---------------------------------------------------------------------------------------------
# no password on a command line (any local user reads it in ps): refused, with what to use


SECRET = "pw-on-argv-7d2e"


@pytest.mark.parametrize("module", README_MODULES)
@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://pin:{SECRET}@127.0.0.1:5432/pin",
        f"postgresql://pin@127.0.0.1:5432/pin?password={SECRET}",
        f"host=127.0.0.1 user=pin password={SECRET} dbname=pin",
    ],
    ids=["userinfo", "query", "keyword"],
)
def test_a_password_in_db_url_is_refused_before_connecting(module: str, url: str) -> None:
    args = ["--selections-url", "http://127.0.0.1:1"] if module.endswith("snapshot_detach") else []
    done = cli(module, "--db-url", url, *args)
    assert done.returncode == 2, done.stderr
    assert "--db-url must not carry a password" in done.stderr
    for source in ("PGPASSWORD", "PGPASSFILE", "pg_service.conf", "--db-password-env"):
        assert source in done.stderr, source
    assert SECRET not in done.stderr + done.stdout  # never echoed back
    assert "event=" not in done.stderr  # refused before the job started


def _slot_cli(db, url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return cli(
        "include.pin_maintenance.jobs.slot_expiration", "--db-url", url, "--dry-run", env=env
    )


def test_the_password_comes_from_libpq_sources_or_a_named_variable(db, tmp_path) -> None:
    """The CLI connects through libpq's sources as they are (PGPASSWORD when the suite's
    server has a password; a service file) and through --db-password-env; a named variable
    that is not set is refused. (The embedded server trusts local connections, so which
    password reaches it is checked in tests/unit/test_cli_db.py.)"""
    base, db_env = job_cli(db, "calendar_slot_expiration")
    env = {**os.environ, **db_env}
    # PGPASSWORD (libpq's own variable; the test server's own password, if it has one)
    done = _slot_cli(db, base, env)
    assert done.returncode == 0, done.stderr
    # a connection service: --db-url "service=NAME" with PGSERVICEFILE

    params = conninfo_to_dict(base)
    service = tmp_path / "pg_service.conf"
    service.write_text(
        "[pin_test]\n" + "".join(f"{k}={v}\n" for k, v in params.items() if k != "password")
    )
    done = _slot_cli(db, "service=pin_test", {**env, "PGSERVICEFILE": str(service)})
    assert done.returncode == 0, done.stderr
    # --db-password-env VAR
    password = db_env.get("PGPASSWORD", "unused-by-a-trusting-server")
    no_pgpassword = {k: v for k, v in env.items() if k != "PGPASSWORD"}
    done = cli(
        "include.pin_maintenance.jobs.slot_expiration",
        "--db-url",
        base,
        "--db-password-env",
        "PIN_TEST_DB_PASSWORD",
        "--dry-run",
        env={**no_pgpassword, "PIN_TEST_DB_PASSWORD": password},
    )
    assert done.returncode == 0, done.stderr
    # ... and the variable must exist
    done = cli(
        "include.pin_maintenance.jobs.slot_expiration",
        "--db-url",
        base,
        "--db-password-env",
        "PIN_TEST_NO_SUCH_VARIABLE",
        "--dry-run",
        env={k: v for k, v in env.items() if k != "PIN_TEST_NO_SUCH_VARIABLE"},
    )
    assert done.returncode == 2
    assert "PIN_TEST_NO_SUCH_VARIABLE" in done.stderr
