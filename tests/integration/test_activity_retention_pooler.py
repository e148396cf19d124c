"""Retention behind a real PgBouncer in transaction mode, with a pool smaller than its loops.

A step holds at most 1 + runners server connections at once: its lock's transaction for the
whole step, and one per batch loop while that loop is inside a batch. Loops never wait for each
other with a transaction open, so a pool of 2 is enough to complete (the loops take turns); a
pool of 1 (only the lock's) fails fast with PoolTooSmall before any batch, instead of waiting
for the pooler's query_wait_timeout.

This module starts its own pgbouncer (Debian's, as the embedded server's OS user, which owns the
socket directory; pgbouncer refuses to run as root) in front of the test's database; the
project-wide pooler fixture is another change. Skipped where pgbouncer is not installed.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from devtools.retention_data import seed_sessions
from include.pin_maintenance.db import configured
from include.pin_maintenance.jobs import activity_retention as job
from include.pin_maintenance.runloop import StopSignal
from include.pin_maintenance.telemetry import JobLog, Telemetry

pytestmark = pytest.mark.integration

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
QUERY_WAIT_TIMEOUT = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dsn_parts(url: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in url.split())


@pytest.fixture
def pooler(db):
    """``pooler(pool_size)`` -> a libpq URL through a fresh transaction-mode pgbouncer."""
    if not Path(PGBOUNCER).exists():
        pytest.skip("pgbouncer is not installed (devtools/ensure_system_packages.sh installs it)")
    parts = _dsn_parts(db.url)
    socket_dir = parts["host"]
    owner = pwd.getpwuid(os.stat(socket_dir).st_uid).pw_name
    procs: list[subprocess.Popen] = []
    homes: list[Path] = []

    def start(pool_size: int) -> str:
        # a directory the server's OS user can enter (pytest's own tmp dirs are root-only)
        home = Path(tempfile.mkdtemp(prefix="pin-pgbouncer-"))
        homes.append(home)
        port = _free_port()
        ini = home / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"pin = host={socket_dir} dbname={parts['dbname']} user={parts['user']}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            "auth_type = any\npool_mode = transaction\n"
            f"default_pool_size = {pool_size}\nmin_pool_size = 0\nreserve_pool_size = 0\n"
            f"max_client_conn = 100\nquery_wait_timeout = {QUERY_WAIT_TIMEOUT}\n"
            f"logfile = {home / 'pgbouncer.log'}\npidfile = {home / 'pgbouncer.pid'}\n"
        )
        os.chmod(home, 0o777)
        args = [PGBOUNCER, str(ini)]
        if os.geteuid() == 0:
            args[1:1] = ["-u", owner]
        with (home / "stderr").open("w") as err:
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)
        procs.append(proc)
        url = f"host=127.0.0.1 port={port} dbname=pin user={parts['user']}"
        until = time.monotonic() + 20
        while True:
            try:
                psycopg.connect(url, connect_timeout=2).close()
                return url
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > until:
                    pytest.skip(f"pgbouncer did not start: {(home / 'stderr').read_text()}")
                time.sleep(0.1)

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)
    for home in homes:
        shutil.rmtree(home, ignore_errors=True)


def _connect(url: str) -> job.Connect:
    # no server-side prepared statements behind a transaction pooler
    return configured(lambda: psycopg.connect(url, prepare_threshold=None), job.SESSION_SETTINGS)


def _telemetry() -> Telemetry:
    return Telemetry.local(JobLog(job.JOB, "pooler"))


def _count(db, sql: str) -> int:
    with db.connect() as conn:
        return conn.execute(sql).fetchone()[0]


@pytest.fixture
def seeded(db):
    with db.connect() as conn:
        seed_sessions(conn, 30, 10, 2, tag="pool")
        conn.commit()
    return db


def test_a_pool_of_two_completes_with_three_loops(pooler, seeded):
    url = pooler(2)
    config = job.CONFIG.resolve(None, {"batch_size": 5, "runners": 3})
    plan = job.prepare(_connect(url), config, _telemetry())
    assert job.server_connections_needed(plan) == 1 + 3  # more than the pool has

    started = time.monotonic()
    result = job.run(_connect(url), config, _telemetry(), StopSignal())
    took = time.monotonic() - started

    assert (result.deleted_sessions, result.deleted_action_events) == (30, 60)
    assert result.has_more is False
    assert took < QUERY_WAIT_TIMEOUT / 2  # the loops took turns; none waited out the pooler
    assert _count(seeded, "select count(*) from user_activity.sessions") == 10


def test_a_pool_of_one_fails_fast_naming_the_pool_size_and_deletes_nothing(pooler, seeded):
    url = pooler(1)
    before = _count(seeded, "select count(*) from user_activity.action_events")

    started = time.monotonic()
    with pytest.raises(job.PoolTooSmall, match="pool of at least 2 server connections"):
        job.run(
            _connect(url),
            job.CONFIG.resolve(None, {"batch_size": 5, "runners": 3}),
            _telemetry(),
            StopSignal(),
        )
    took = time.monotonic() - started

    assert took < job.POOL_PROBE_TIMEOUT_SECONDS + 10  # not the pooler's 120 s
    assert _count(seeded, "select count(*) from user_activity.action_events") == before
