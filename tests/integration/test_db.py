"""Session guards and the advisory lock, on a real Postgres with concurrent sessions."""

from __future__ import annotations

import time

import psycopg
import pytest

from include.pin_maintenance.db import (
    SessionSettings,
    advisory_lock,
    configure_session,
    configured,
    lock_held_too_long,
    lock_key,
)

pytestmark = pytest.mark.integration


SHOW_GUARDS = (
    "select current_setting('statement_timeout'), current_setting('lock_timeout'),"
    " current_setting('application_name'), current_setting('synchronous_commit')"
)
GUARDED = ("1234ms", "567ms", "pin:test", "off")


def test_configure_session_sets_timeouts_and_name(db):
    with db.connect() as conn:
        configure_session(conn, SessionSettings(1234, 567, "pin:test"))
        assert conn.execute("show statement_timeout").fetchone()[0] == "1234ms"
        assert conn.execute("show lock_timeout").fetchone()[0] == "567ms"
        assert conn.execute("show application_name").fetchone()[0] == "pin:test"


def test_settings_apply_in_every_kind_of_transaction_and_never_on_the_session(db):
    """Implicit transaction, transaction() block, savepoint, a bare autocommit statement: each
    sees the guards; after commit or rollback the session is back at the server defaults."""
    settings = SessionSettings(1234, 567, "pin:test", synchronous_commit="off")
    with configured(db.connect, settings)() as conn:
        assert conn.execute(SHOW_GUARDS).fetchone() == GUARDED  # implicit transaction
        conn.commit()
        conn.execute("select 1")
        conn.rollback()
        conn.autocommit = True
        assert conn.execute(SHOW_GUARDS).fetchone() == GUARDED  # a transaction of its own
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with conn.transaction():
            assert conn.execute(SHOW_GUARDS).fetchone() == GUARDED
            with conn.transaction():  # a savepoint keeps them
                assert conn.execute(SHOW_GUARDS).fetchone() == GUARDED
        # the session itself: read through the raw protocol, outside any transaction
        result = conn.pgconn.exec_(SHOW_GUARDS.encode())
        session = tuple(result.get_value(0, i).decode() for i in range(4))
        assert session != GUARDED
        assert session[0] == "0" and session[1] == "0" and session[2] == ""


def test_no_server_side_prepared_statements(db):
    """psycopg prepares a query after 5 runs by default; a pooled connection must never."""
    with configured(db.connect, SessionSettings())() as conn:
        for _ in range(12):
            conn.execute("select 1 where %s::int = 1", (1,)).fetchone()
        assert conn.execute("select count(*) from pg_prepared_statements").fetchone()[0] == 0
        conn.rollback()
        conn.autocommit = True
        for _ in range(12):
            conn.execute("select 1 where %s::int = 1", (1,)).fetchone()
        assert conn.execute("select count(*) from pg_prepared_statements").fetchone()[0] == 0


def test_statement_timeout_cancels_a_runaway_statement(db):
    connect = configured(db.connect, SessionSettings(statement_timeout_ms=200))
    with connect() as conn, pytest.raises(psycopg.errors.QueryCanceled):
        conn.execute("select pg_sleep(5)")


def test_lock_key_is_stable_and_signed_64_bit():
    key = lock_key("job:scheduled:activity-retention")
    assert key == lock_key("job:scheduled:activity-retention")
    assert key != lock_key("job:scheduled:other")
    assert -(2**63) <= key < 2**63


def test_second_holder_is_refused_without_waiting_then_lock_is_free_again(db):
    connect = db.connect
    with advisory_lock(connect, "job:x", ttl_seconds=30) as first:
        assert first is True
        started = time.monotonic()
        with advisory_lock(connect, "job:x", ttl_seconds=30) as second:
            assert second is False
        assert time.monotonic() - started < 5  # try-lock: no queueing behind the holder
        with advisory_lock(connect, "job:other", ttl_seconds=30) as other:
            assert other is True
    with advisory_lock(connect, "job:x", ttl_seconds=30) as again:
        assert again is True


def test_lock_is_released_when_the_holding_connection_dies(db):
    holder = db.connect()
    with advisory_lock(lambda: holder, "job:y", ttl_seconds=30) as got:
        assert got
        pid = holder.info.backend_pid
        with db.connect(autocommit=True) as admin:
            # with a timeout it returns once the backend is gone (its locks with it)
            admin.execute("select pg_terminate_backend(%s, 10000)", [pid])
        with advisory_lock(db.connect, "job:y", ttl_seconds=30) as other:
            assert other is True


def test_lock_is_a_lease_a_hung_holder_loses_it_after_ttl(db):
    with advisory_lock(db.connect, "job:z", ttl_seconds=0.5) as got:
        assert got
        deadline = time.monotonic() + 10
        freed = False
        while time.monotonic() < deadline and not freed:
            time.sleep(0.2)
            with advisory_lock(db.connect, "job:z", ttl_seconds=30) as other:
                freed = other
        assert freed, "the idle holder should lose the lock once its TTL passed"


def test_lock_does_not_leak_into_a_reused_connection(db):
    conn = db.connect()
    try:
        with advisory_lock(lambda: psycopg.connect(db.url), "job:w", ttl_seconds=30) as got:
            assert got
        held = conn.execute(
            "select count(*) from pg_locks where locktype = 'advisory' and granted and database = "
            "(select oid from pg_database where datname = current_database())"
        ).fetchone()[0]
        assert held == 0
    finally:
        conn.close()


def holder(db, name: str):
    """The alert for any holder of lock ``name`` (a limit no hold is under), or None."""
    return lock_held_too_long(db.connect, name, -1, job="j")


def test_lock_holder_names_the_holding_session_and_its_age(db):
    assert holder(db, "job:h") is None
    opened = []

    def connect():
        conn = db.connect()
        opened.append(conn)
        return conn

    with advisory_lock(connect, "job:h", ttl_seconds=30) as got:
        assert got
        [lock_conn] = opened  # the lock's own, dedicated connection
        alert = holder(db, "job:h")
        assert alert is not None
        assert alert.details["pid"] == lock_conn.info.backend_pid
        assert 0 <= alert.details["held_seconds"] < 60
        assert holder(db, "job:other") is None
    assert holder(db, "job:h") is None


def test_lock_held_too_long_alerts_only_past_the_limit(db):
    with advisory_lock(db.connect, "job:stuck", ttl_seconds=30):
        time.sleep(0.3)
        assert lock_held_too_long(db.connect, "job:stuck", 60, job="j") is None
        alert = lock_held_too_long(db.connect, "job:stuck", 0.1, job="j")
    assert alert is not None
    assert alert.name == "lock_held_too_long"
    assert alert.details["lock"] == "job:stuck"
    assert alert.details["held_seconds"] >= 0
    assert alert.details["limit_seconds"] == 0.1


def test_lock_holder_finds_a_session_level_lock_too(db):
    with db.connect(autocommit=True) as other:
        other.execute("select pg_advisory_lock(%s)", [lock_key("job:session")])
        alert = holder(db, "job:session")
        assert alert is not None and alert.details["pid"] == other.info.backend_pid
