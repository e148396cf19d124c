"""Postgres plumbing shared by the jobs: session timeouts and the single-runner advisory lock."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

from include.pin_maintenance import sql
from include.pin_maintenance.telemetry import Alert

Connect = Callable[[], psycopg.Connection]
"""A factory that opens a new (non-autocommit) psycopg 3 connection to the job's database."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionSettings:
    """Per-connection guards so that no job statement or lock wait runs away."""

    statement_timeout_ms: int = 30_000
    lock_timeout_ms: int = 5_000
    application_name: str = "pin-maintenance"


def configure_session(conn: psycopg.Connection, settings: SessionSettings) -> None:
    """Apply ``statement_timeout``, ``lock_timeout`` and ``application_name`` to the session."""
    conn.execute(
        "select set_config('statement_timeout', %(st)s, false),"
        " set_config('lock_timeout', %(lt)s, false),"
        " set_config('application_name', %(app)s, false)",
        {
            "st": f"{int(settings.statement_timeout_ms)}ms",
            "lt": f"{int(settings.lock_timeout_ms)}ms",
            "app": settings.application_name[:63],
        },
    )
    conn.commit()


def configured(connect: Callable[[], psycopg.Connection], settings: SessionSettings) -> Connect:
    """Wrap a raw connection factory so every connection it opens carries ``settings``."""

    def open_configured() -> psycopg.Connection:
        conn = connect()
        try:
            configure_session(conn, settings)
        except BaseException:
            conn.close()
            raise
        return conn

    return open_configured


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for a lock name (same on every client)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big", signed=True)


@contextmanager
def advisory_lock(connect: Connect, name: str, ttl_seconds: float) -> Iterator[bool]:
    """Try to take the job's single-runner lock; yield whether we hold it. Never waits.

    The lock is a transaction-level advisory lock (``pg_try_advisory_xact_lock``) held by an
    open transaction on a dedicated connection that does nothing else. That keeps it correct
    behind a pooler: it cannot leak into a pooled session, and it is released by the rollback at
    exit, by the connection closing, or by the server when the holder dies.
    ``idle_in_transaction_session_timeout = ttl`` turns it into a lease: a holder that hangs
    loses the lock after ``ttl_seconds`` (the seed's LockTtl), so a stuck worker cannot block
    every later run. Jobs keep their own run bounded below the TTL (config validation).
    The holding transaction takes no snapshot between statements and writes nothing, so it
    does not hold back vacuum.
    """
    conn = connect()
    try:
        conn.execute(
            "select set_config('idle_in_transaction_session_timeout', %(ttl)s, true)",
            {"ttl": f"{int(ttl_seconds * 1000)}ms"},
        )
        row = conn.execute(
            "select pg_try_advisory_xact_lock(%(key)s)", {"key": lock_key(name)}
        ).fetchone()
        yield bool(row and row[0])
    finally:
        try:
            conn.rollback()
        except psycopg.Error as exc:  # the lease expired or the server went away: lock is gone
            log.warning("advisory lock %r was already released by the server: %s", name, exc)
        finally:
            conn.close()


@dataclass(frozen=True)
class LockHolder:
    pid: int
    application_name: str
    held_seconds: float


def lock_holder(connect: Connect, name: str) -> LockHolder | None:
    """The session holding advisory lock ``name`` and how long it has held it, if any."""
    unsigned = lock_key(name) & 0xFFFF_FFFF_FFFF_FFFF
    with connect() as conn:
        row = conn.execute(
            sql.load("locks/find_advisory_lock_holder"),
            {"classid": unsigned >> 32, "objid": unsigned & 0xFFFF_FFFF},
        ).fetchone()
    return LockHolder(int(row[0]), str(row[1]), float(row[2])) if row else None


def lock_held_too_long(
    connect: Connect, name: str, limit_seconds: float, *, job: str
) -> Alert | None:
    """A ``lock_held_too_long`` alert when the lock we found busy has been held past the limit.

    Called on the lock-busy path: a holder older than a whole bounded run is a stuck worker
    (or a manual session) that keeps every scheduled run skipping.
    """
    holder = lock_holder(connect, name)
    if holder is None or holder.held_seconds <= limit_seconds:
        return None
    return Alert(
        "lock_held_too_long",
        "warning",
        f"{job}: lock {name!r} held for {holder.held_seconds:.0f}s by pid {holder.pid} "
        f"({holder.application_name or 'no application_name'}); runs skip until it is released",
        {
            "lock": name,
            "pid": holder.pid,
            "application_name": holder.application_name,
            "held_seconds": round(holder.held_seconds),
            "limit_seconds": limit_seconds,
        },
    )
