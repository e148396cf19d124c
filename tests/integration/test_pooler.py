"""The jobs through a real PgBouncer (Debian's pgbouncer, its own process on loopback).

Transaction pooling hands a client's transactions to whichever server connection is free, so a
job must leave nothing on a server connection after its transaction (settings, prepared
statements), and must not need more server connections at once than the pool has. After each
run a canary client visits every server connection of the pool and checks it shows the
server's defaults (tests/pooler.py). The jobs log in to the pooler as their own roles, each
with a pool of its own; the canary visits that pool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from devtools import bench_data as bd
from devtools.pg import Database
from devtools.retention_data import seed_sessions
from include.pin_maintenance.db import (
    PoolTooSmall,
    SessionSettings,
    configured,
    require_server_connections,
)
from include.pin_maintenance.jobs import slot_expiration as se
from tests.job_db import conn_id_of, job_cli
from tests.pooler import assert_pool_is_clean, canary, server_defaults

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def role_of(db: Database, job: str) -> str:
    """The job's role: its pool in the pooler is that role's."""
    return db.roles[conn_id_of(job)].name


def run_cli(
    module: str, pooled: Database, job: str, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """The job's CLI through the pooler (``pooled``: ``PgBouncer.db()``), as the job's role."""
    url, env = job_cli(pooled, job)
    return subprocess.run(
        [sys.executable, "-m", module, "--db-url", url, *args],
        cwd=REPO,
        env={**os.environ, **env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_canary_sees_a_leaked_setting_and_a_prepared_statement(db: Database, pgbouncer):
    """The check can fail: a client that sets a session value and prepares (psycopg's default
    after 5 runs) leaves both on its server connection, and the canary reports them."""
    bouncer = pgbouncer(db, pool_size=1)
    with bouncer.connect() as conn:  # plain psycopg: session-level set_config, auto-prepare
        conn.execute("select set_config('statement_timeout', '30s', false)")
        for _ in range(6):
            conn.execute("select %s::int", (1,))
        conn.commit()
    (view,) = canary(bouncer)
    assert view.settings["statement_timeout"] == "30s"
    assert view.prepared_statements >= 1
    with pytest.raises(AssertionError, match="statement_timeout"):
        assert_pool_is_clean(bouncer)


def test_configured_connections_leave_nothing_on_pooled_servers(db: Database, pgbouncer):
    """Every kind of transaction a job runs, many times over, on two pooled servers."""
    bouncer = pgbouncer(db, pool_size=2)
    settings = SessionSettings(1234, 567, "pin-test", synchronous_commit="off")
    connect = configured(lambda: psycopg.connect(bouncer.url()), settings)
    with connect() as a, connect() as b:
        for _ in range(10):
            assert a.execute("show statement_timeout").fetchone() == ("1234ms",)
            b.execute("select %s::int", (1,)).fetchone()
            a.commit()
            b.rollback()
        b.autocommit = True
        for _ in range(10):
            assert b.execute("show synchronous_commit").fetchone() == ("off",)
            with b.transaction():
                assert b.execute("show application_name").fetchone() == ("pin-test",)
    views = assert_pool_is_clean(bouncer)
    assert len({v.pid for v in views}) == 2


def test_slot_cli_drains_a_20k_backlog_through_transaction_pooling(db: Database, pgbouncer):
    """Today's failure: 42P05 "_pg3_0 already exists" after 7,500 of 20,000 slots."""
    bd.load_slots(db.url, 22_000, 20_000)
    bouncer = pgbouncer(db, pool_size=2)
    done = run_cli(
        se.__name__,
        bouncer.db(),
        se.JOB,
        "--config",
        json.dumps(
            {
                "batch_size": 500,
                "runners": 2,
                "max_batches_per_cycle": 100,
                "max_run_duration_seconds": 120,
            }
        ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ExpiredCount"] == 20_000
    assert bd.slots_state(db.url)["due"] == 0
    assert_pool_is_clean(bouncer, role_of(db, se.JOB))


def test_session_pooling_with_reset_query_runs_the_slot_job_alike(db: Database, pgbouncer):
    bd.load_slots(db.url, 3_000, 2_000)
    bouncer = pgbouncer(db, pool_mode="session", pool_size=2)
    done = run_cli(
        se.__name__,
        bouncer.db(),
        se.JOB,
        "--config",
        json.dumps({"batch_size": 500, "max_batches_per_cycle": 10}),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["ExpiredCount"] == 2_000
    assert_pool_is_clean(bouncer, role_of(db, se.JOB))


def test_a_pool_smaller_than_needed_fails_fast_and_names_the_size(db: Database, pgbouncer):
    bouncer = pgbouncer(db, pool_size=2, query_wait_timeout=60)
    connect = configured(lambda: psycopg.connect(bouncer.url()), SessionSettings())
    conns = [connect() for _ in range(3)]
    try:
        started = time.monotonic()
        with pytest.raises(PoolTooSmall, match="needs 3 server connections") as caught:
            require_server_connections(conns, job="test_job", wait_seconds=2)
        assert time.monotonic() - started < 5  # not the pooler's 60 s query_wait_timeout
        assert (caught.value.needed, caught.value.got) == (3, 2)
        assert "at least 3" in str(caught.value)
        # the connections that got a server gave it back: a client of the pool is served
        with bouncer.connect() as other:
            assert other.execute("select 1").fetchone() == (1,)
        # with as many as the pool has, it passes
        require_server_connections(conns[:2], job="test_job", wait_seconds=2)
    finally:
        for conn in conns:
            conn.close()


def test_the_pool_check_counts_a_held_lock_connection(db: Database, pgbouncer):
    bouncer = pgbouncer(db, pool_size=2)
    connect = configured(lambda: psycopg.connect(bouncer.url()), SessionSettings())
    with connect() as lock, connect() as a, connect() as b:
        lock.execute("select pg_try_advisory_xact_lock(1)")  # pins one server connection
        with pytest.raises(PoolTooSmall, match=r"needs 3 .*\(1 lock \+ 2 runners\)"):
            require_server_connections(
                [a, b], job="test_job", held=1, what="1 lock + 2 runners", wait_seconds=1
            )
        lock.rollback()


def test_retention_with_more_runners_than_the_pool_completes_or_fails_fast(db: Database, pgbouncer):
    """lock + 3 runners on a pool of 3: either the whole backlog goes, or the run fails
    within seconds naming the pool size, with no batch half deleted (before: it hung in the
    pooler's queue until query_wait_timeout, after deleting part of the backlog)."""
    from include.pin_maintenance.jobs import activity_retention as ar

    with psycopg.connect(db.url) as conn:
        seed_sessions(conn, 600, 20, 2, tag="pool")
        conn.commit()
    bouncer = pgbouncer(db, pool_size=3, query_wait_timeout=20)
    started = time.monotonic()
    done = run_cli(
        ar.__name__,
        bouncer.db(),
        ar.JOB,
        "--config",
        json.dumps({"batch_size": 50, "runners": 3}),
        timeout=120,
    )
    elapsed = time.monotonic() - started
    with psycopg.connect(db.url) as conn:
        (orphans,) = conn.execute(
            "select count(*) from user_activity.sessions s where s.status = 'Inactive'"
            " and s.ended_at < now() - interval '365 days' and not exists ("
            "  select 1 from user_activity.action_events e where e.session_id = s.id)"
            " and exists (select 1 from user_activity.property_object_views v"
            "  where v.session_id = s.id)"
        ).fetchone()
        (left,) = conn.execute(
            "select count(*) from user_activity.sessions where status = 'Inactive'"
            " and ended_at < now() - interval '365 days'"
        ).fetchone()
    if done.returncode == 0:
        assert left == 0
    else:
        assert elapsed < 15, f"took {elapsed:.0f}s: hung on the pooler's queue"
        assert "needs 4 server connections" in done.stderr + done.stdout
    assert orphans == 0 or done.returncode == 0
    assert_pool_is_clean(bouncer, role_of(db, ar.JOB))


def test_server_defaults_are_what_a_direct_session_sees(db: Database):
    """The canary's reference values (what a fresh session of the same role gets)."""
    defaults = server_defaults(db)
    assert defaults["application_name"] == ""
    assert set(defaults) >= {"statement_timeout", "lock_timeout", "synchronous_commit"}


def test_detach_retry_on_a_one_connection_pool_fails_fast_and_claims_nothing(
    db: Database, pgbouncer
):
    """lock + batch connection = 2: on a pool of 1 the lock takes the only server; the batch
    connection's check fails within seconds, before any claim (no attempt spent)."""
    from devtools.selections_service import SelectionsService
    from tests.integration.snapshot_detach_fixtures import insert_entries, rows, run_job

    entries = insert_entries(db, 3)
    before = rows(db)
    bouncer = pgbouncer(db, pool_size=1, query_wait_timeout=60)
    with SelectionsService() as svc:
        started = time.monotonic()
        with pytest.raises(PoolTooSmall, match="needs 2 server connections"):
            run_job(bouncer.db(), svc)
        assert time.monotonic() - started < 15
        assert svc.calls == []
    assert rows(db) == before
    assert all(rows(db)[e.snapshot_id].attempts == 0 for e in entries)
    with psycopg.connect(db.url) as conn:  # the lock went with the run
        (locks,) = conn.execute(
            "select count(*) from pg_locks where locktype = 'advisory' and database = "
            "(select oid from pg_database where datname = current_database())"
        ).fetchone()
    assert locks == 0
    # PgBouncer reads no more from a client waiting for a server, so it notices the closed
    # waiting connection only when the lock's server frees up: it hands it that server and then
    # closes it ("client disconnect while server was not ready"). What the pool has is clean.
    role = role_of(db, "news_snapshot_detach_retry")
    expected = server_defaults(db, role)
    assert all(view.settings == expected for view in canary(bouncer, role))
