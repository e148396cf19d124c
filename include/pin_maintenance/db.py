"""Postgres plumbing shared by the jobs: session guards that end with each transaction (safe
behind a pooler; the psycopg internals they use are pinned by tests/unit/test_db_guards.py),
the pool-size check, the advisory lock (docs/design/pooler-and-slots.md)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import generators, pq, waiting
from psycopg import sql as psql

from include.pin_maintenance import sql
from include.pin_maintenance.telemetry import Alert

Connect = Callable[[], psycopg.Connection]
"""A factory that opens a new (non-autocommit) psycopg 3 connection to the job's database."""

log = logging.getLogger(__name__)

# psycopg versions whose internals (_exec_command, generators, waiting) the guards were checked on
CHECKED_PSYCOPG = ("3.3.",)


@dataclass(frozen=True)
class SessionSettings:
    """Guards applied inside every transaction (``SET LOCAL``), so no statement or lock wait
    runs away and nothing is left on a pooled server connection."""

    statement_timeout_ms: int = 30_000
    lock_timeout_ms: int = 5_000
    application_name: str = "pin-maintenance"
    synchronous_commit: str | None = None  # None: the server's; "off" for harmless batches

    def local_settings(self) -> dict[str, str]:
        """The settings, as ``set_config`` name -> value, applied in each transaction."""
        values = {
            "statement_timeout": f"{int(self.statement_timeout_ms)}ms",
            "lock_timeout": f"{int(self.lock_timeout_ms)}ms",
            "application_name": self.application_name[:63],
        }
        if self.synchronous_commit is not None:
            values["synchronous_commit"] = str(self.synchronous_commit)
        return values


def _set_local_statement(settings: SessionSettings) -> psql.Composed:
    return psql.SQL("SELECT ") + psql.SQL(", ").join(
        psql.SQL("set_config({}, {}, true)").format(psql.Literal(name), psql.Literal(value))
        for name, value in settings.local_settings().items()
    )


class _GuardedConnection(psycopg.Connection):
    """Applies its settings in every transaction it begins: psycopg sends every ``BEGIN``
    (implicit, ``transaction()`` blocks, two-phase) through ``_exec_command``."""

    _pin_locals: bytes

    def _exec_command(self, command: Any, result_format: pq.Format = pq.Format.TEXT):
        if not (isinstance(command, bytes) and command.startswith(b"BEGIN")):
            return (yield from super()._exec_command(command, result_format))
        if self._pipeline is not None or result_format != pq.Format.TEXT:
            result = yield from super()._exec_command(command, result_format)
            yield from super()._exec_command(self._pin_locals)
            return result
        # One round trip: "BEGIN ...; SELECT set_config(..., true), ..." as a simple query.
        self._check_connection_ok()
        self.pgconn.send_query(command + b"; " + self._pin_locals)
        results = yield from generators.execute(self.pgconn)
        for result in results:
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise psycopg.errors.error_from_result(result, encoding=self.pgconn._encoding)
        if len(results) != 2:
            raise psycopg.InternalError(f"BEGIN with local settings gave {len(results)} results")
        return results[0]


class _GuardedCursor(psycopg.Cursor):
    """Runs an autocommit statement outside a transaction in one of its own, so it gets the
    settings too (so VACUUM or CREATE INDEX CONCURRENTLY cannot run on a job connection)."""

    def execute(self, query, params=None, **kwargs):  # type: ignore[override]
        conn = self.connection
        if conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
            with conn.transaction():
                return super().execute(query, params, **kwargs)
        return super().execute(query, params, **kwargs)


def configure_session(conn: psycopg.Connection, settings: SessionSettings) -> None:
    """Make ``conn`` apply ``settings`` in each of its transactions (one already open gets them
    now), set nothing on the session, and never prepare (a pooler moves the client)."""
    if type(conn) is not psycopg.Connection and not isinstance(conn, _GuardedConnection):
        raise TypeError(f"configure_session: a psycopg.Connection is needed, not {type(conn)}")
    base = psycopg.Connection.__mro__[1]
    if not callable(getattr(base, "_exec_command", None)):
        raise RuntimeError(
            f"psycopg {psycopg.__version__} has no BaseConnection._exec_command: the "
            "per-transaction session guards of include/pin_maintenance/db.py need updating"
        )
    conn.prepare_threshold = None
    conn.__class__ = _GuardedConnection
    conn._pin_locals = _set_local_statement(settings).as_bytes(conn)
    if conn.cursor_factory is psycopg.Cursor:
        conn.cursor_factory = _GuardedCursor
    elif not issubclass(conn.cursor_factory, _GuardedCursor):
        raise TypeError(f"configure_session: unsupported cursor_factory {conn.cursor_factory}")
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        conn.execute(_set_local_statement(settings))


def configured(connect: Callable[[], psycopg.Connection], settings: SessionSettings) -> Connect:
    """Wrap a raw connection factory so every connection it opens is guarded by ``settings``."""

    def open_configured() -> psycopg.Connection:
        conn = connect()
        try:
            configure_session(conn, settings)
        except BaseException:
            conn.close()
            raise
        return conn

    return open_configured


class PoolTooSmall(psycopg.OperationalError):
    """The job could not get the server connections it holds at once; raised before it writes."""

    def __init__(self, message: str, *, needed: int, got: int) -> None:
        super().__init__(message)
        self.needed, self.got = needed, got


def require_server_connections(
    connections: Sequence[psycopg.Connection],
    *,
    job: str,
    held: int = 0,
    what: str = "",
    wait_seconds: float = 5.0,
) -> None:
    """Fail fast unless the idle ``connections`` each get a server connection at once while the
    run holds ``held`` more: each opens a transaction, kept until all have one, then all roll
    back. The first still queued after ``wait_seconds`` is closed and :class:`PoolTooSmall`
    names the pool size needed; ``what`` says what the connections are for."""
    needed = held + len(connections)
    deadline = time.monotonic() + wait_seconds
    begun: list[psycopg.Connection] = []
    try:
        for conn in connections:
            if not _begin_within(conn, deadline):
                conn.close()  # its BEGIN waits in the pooler's queue: leave the queue
                got = held + len(begun)
                raise PoolTooSmall(
                    f"{job}: needs {needed} server connections at once"
                    f"{f' ({what})' if what else ''} but got only {got} within "
                    f"{wait_seconds:g}s: make the pooler's pool for this database and user at "
                    f"least {needed} (PgBouncer pool_size / default_pool_size), or lower the "
                    "job's runners",
                    needed=needed,
                    got=got,
                )
            begun.append(conn)
    finally:
        for conn in begun:
            if not conn.closed:
                conn.rollback()


def _begin_within(conn: psycopg.Connection, deadline: float) -> bool:
    """Open a transaction on ``conn`` unless the server (or pooler) does not answer in time."""
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise psycopg.ProgrammingError("require_server_connections: connection not idle")
    conn.pgconn.send_query(b"BEGIN; SELECT 1")
    gen = generators.execute(conn.pgconn)
    try:
        results = waiting.wait(gen, conn.pgconn.socket, 0.1, max(0.0, deadline - time.monotonic()))
    except psycopg.errors._WaitTimeout:
        return False
    errors = [r.error_message for r in results if r.status == pq.ExecStatus.FATAL_ERROR]
    if errors:
        message = (errors[0] or b"").decode(errors="replace").strip()
        raise psycopg.OperationalError(f"require_server_connections: {message}")
    return True


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for a lock name (same on every client)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big", signed=True)


@contextmanager
def advisory_lock(connect: Connect, name: str, ttl_seconds: float) -> Iterator[bool]:
    """Try to take the job's single-runner lock, a transaction lock on a connection of its own
    leased by ``idle_in_transaction_session_timeout`` (docs/design.md, "Bounds and single
    runners"); yield whether we hold it. Never waits."""
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


def lock_held_too_long(
    connect: Connect, name: str, limit_seconds: float, *, job: str
) -> Alert | None:
    """A ``lock_held_too_long`` alert when lock ``name``'s holder has held it past the limit
    (none when pg_stat_activity hides the holder's times from our role)."""
    unsigned = lock_key(name) & 0xFFFF_FFFF_FFFF_FFFF
    with connect() as conn:
        row = conn.execute(
            sql.load("locks/find_advisory_lock_holder"),
            {"classid": unsigned >> 32, "objid": unsigned & 0xFFFF_FFFF},
        ).fetchone()
    if row is None or row[2] is None or float(row[2]) <= limit_seconds:
        return None
    pid, application_name, held_seconds = int(row[0]), str(row[1]), float(row[2])
    return Alert(
        "lock_held_too_long",
        "warning",
        f"{job}: lock {name!r} held for {held_seconds:.0f}s by pid {pid} "
        f"({application_name or 'no application_name'}); runs skip until it is released",
        {
            "lock": name,
            "pid": pid,
            "application_name": application_name,
            "held_seconds": round(held_seconds),
            "limit_seconds": limit_seconds,
        },
    )


# SQLSTATEs of an unwell database or session, not a bad row: connection, read-only, deadlock,
# syntax/privilege, resources, timeout/shutdown, system, config, internal; lock timeout, state
_DATABASE_FAULTS = frozenset({"08", "25", "40", "42", "53", "57", "58", "F0", "XX"})
_DATABASE_FAULT_STATES = frozenset({"55P03", "55000", "55006"})


def is_row_error(sqlstate: str | None) -> bool:
    """True when a failed statement may be caused by its rows (worth isolating them); False
    without a SQLSTATE (the server is lost) or for a database fault."""
    if not sqlstate or len(sqlstate) != 5 or sqlstate in _DATABASE_FAULT_STATES:
        return False
    return sqlstate[:2] not in _DATABASE_FAULTS
