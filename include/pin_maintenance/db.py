"""Postgres plumbing shared by the jobs: per-transaction guards, the pool-size check and the
single-runner advisory lock.

Every job connection is opened through :func:`configured` and is safe behind a pooler in
transaction mode (PgBouncer): nothing the job sets outlives its own transaction, so another
client of the same pool never sees it (docs/deploying.md, "Behind a pooler").

- ``statement_timeout``, ``lock_timeout``, ``application_name`` and (optionally)
  ``synchronous_commit`` are applied with ``set_config(..., true)`` (``SET LOCAL``) inside every
  transaction the connection opens: the implicit one of a non-autocommit connection, every
  ``conn.transaction()`` block, and a one-statement transaction around each statement run in
  autocommit mode. Job code calls nothing per transaction. The local settings go in the same
  round trip as psycopg's own ``BEGIN`` (one simple-query string). (So a statement that cannot
  run in a transaction block, ``VACUUM`` or ``CREATE INDEX CONCURRENTLY``, cannot run on a job
  connection; the jobs have none.)
- ``application_name`` is per transaction too, not a startup parameter: PgBouncer 1.18 applies
  a client's startup ``application_name`` to the server connection with a session ``SET`` and
  leaves it there, so a later client that sends none sees the job's name (checked here).
- No server-side prepared statements (``prepare_threshold = None``): a pooler in transaction
  mode moves a client between server connections, where psycopg's auto-prepared ``_pg3_N``
  either already exists (42P05) or does not (26000).

This relies on one psycopg internal, ``BaseConnection._exec_command`` (the generator that sends
psycopg's own commands, ``BEGIN`` among them); ``tests/unit/test_db_guards.py`` pins the psycopg
version it was checked with, and :func:`configured` refuses to run when the hook is missing.
"""

from __future__ import annotations

import hashlib
import logging
import select
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import generators, pq
from psycopg import sql as psql

from include.pin_maintenance import sql
from include.pin_maintenance.telemetry import Alert

Connect = Callable[[], psycopg.Connection]
"""A factory that opens a new (non-autocommit) psycopg 3 connection to the job's database."""

log = logging.getLogger(__name__)

# psycopg versions whose ``_exec_command`` the per-transaction guard was checked against.
CHECKED_PSYCOPG = ("3.3.",)


@dataclass(frozen=True)
class SessionSettings:
    """Guards applied inside every transaction, so that no job statement or lock wait runs
    away, and nothing is left on a pooled server connection afterwards."""

    statement_timeout_ms: int = 30_000
    lock_timeout_ms: int = 5_000
    application_name: str = "pin-maintenance"
    # None keeps the server's setting; "off" for batches whose loss in a crash is harmless
    synchronous_commit: str | None = None

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
    """A psycopg connection that applies its settings in every transaction it begins.

    Only ``_exec_command`` is overridden: psycopg sends every ``BEGIN`` through it (implicit
    transactions, ``transaction()`` blocks, two-phase). The class is swapped onto connections
    the caller's factory made (a PostgresHook's, a plain ``psycopg.connect``).
    """

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
    """In autocommit mode a statement outside any transaction runs in a transaction of its
    own, so that it gets the local settings too (three round trips instead of one). The jobs
    use ``execute`` only."""

    def execute(self, query, params=None, **kwargs):  # type: ignore[override]
        conn = self.connection
        if conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
            with conn.transaction():
                return super().execute(query, params, **kwargs)
        return super().execute(query, params, **kwargs)


def configure_session(conn: psycopg.Connection, settings: SessionSettings) -> None:
    """Make ``conn`` apply ``settings`` in each of its transactions, and never prepare.

    Nothing is set on the session itself. A transaction already open gets the settings now.
    """
    if type(conn) is not psycopg.Connection and not isinstance(conn, _GuardedConnection):
        raise TypeError(f"configure_session: a psycopg.Connection is needed, not {type(conn)}")
    base = psycopg.Connection.__mro__[1]
    if not callable(getattr(base, "_exec_command", None)):
        raise RuntimeError(
            f"psycopg {psycopg.__version__} has no BaseConnection._exec_command: the "
            "per-transaction session guards of include/pin_maintenance/db.py need updating"
        )
    conn.prepare_threshold = None  # no server-side prepared statements (pooler-safe)
    conn.__class__ = _GuardedConnection
    conn._pin_locals = _set_local_statement(settings).as_bytes(conn)
    if conn.cursor_factory is psycopg.Cursor:
        conn.cursor_factory = _GuardedCursor
    elif not issubclass(conn.cursor_factory, _GuardedCursor):
        raise TypeError(f"configure_session: unsupported cursor_factory {conn.cursor_factory}")
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        conn.execute(_set_local_statement(settings))


def configured(connect: Callable[[], psycopg.Connection], settings: SessionSettings) -> Connect:
    """Wrap a raw connection factory so every connection it opens carries ``settings`` in each
    of its transactions (and none on the session: safe behind a transaction pooler)."""

    def open_configured() -> psycopg.Connection:
        conn = connect()
        try:
            configure_session(conn, settings)
        except BaseException:
            conn.close()
            raise
        return conn

    return open_configured


# -- pool size -------------------------------------------------------------------------------

# How long the check waits for the pooler to hand each connection a server connection. Other
# clients' transactions are short; a pool that cannot give one in this time is too small.
POOL_WAIT_SECONDS = 5.0


class PoolTooSmall(psycopg.OperationalError):
    """The job could not get the server connections it holds at once (a pooler's pool is
    smaller than that, or taken by others). Raised before the job writes anything."""

    def __init__(self, message: str, *, needed: int, got: int) -> None:
        super().__init__(message)
        self.needed, self.got = needed, got


def require_server_connections(
    connections: Sequence[psycopg.Connection],
    *,
    job: str,
    held: int = 0,
    what: str = "",
    wait_seconds: float = POOL_WAIT_SECONDS,
) -> None:
    """Fail fast unless every connection in ``connections`` can get a server connection at
    the same time, while the run already holds ``held`` more (e.g. its lock connection).

    Each connection opens a transaction (``BEGIN; SELECT 1``) and keeps it open until all have
    one, then all roll back. On a direct connection or a big enough pool this takes one round
    trip each. Behind a pooler whose pool is smaller than ``held + len(connections)`` the
    pooler queues the last ones: after ``wait_seconds`` the waiting connection is closed and
    :class:`PoolTooSmall` names the pool size the run needs, before the job has written
    anything. (Waiting instead would hang until the pooler's ``query_wait_timeout`` while the
    connections already served hold their server connections.)

    ``connections`` must be idle (no transaction open). ``what`` says what the connections are
    for, in the error (e.g. "1 lock + 3 batch loops").
    """
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
    pgconn = conn.pgconn
    pgconn.send_query(b"BEGIN; SELECT 1")
    while pgconn.flush() != 0:
        if not _wait(pgconn.socket, deadline, write=True):
            return False
    while True:
        pgconn.consume_input()
        if not pgconn.is_busy():
            break
        if not _wait(pgconn.socket, deadline):
            return False
    error = None
    while (result := pgconn.get_result()) is not None:
        if result.status == pq.ExecStatus.FATAL_ERROR and error is None:
            error = (result.error_message or b"").decode(errors="replace").strip()
    if error is not None:
        raise psycopg.OperationalError(f"require_server_connections: {error}")
    return True


def _wait(fileno: int, deadline: float, *, write: bool = False) -> bool:
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    ready = select.select([] if write else [fileno], [fileno] if write else [], [], left)
    return bool(ready[0] or ready[1])


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

    Behind a pooler in transaction mode the open transaction pins one server connection for the
    whole run (the lock belongs to that server session, and the pooler cannot hand it to anyone
    else until the rollback): correct, and it counts in the job's pool size.
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


def lock_held_too_long(
    connect: Connect, name: str, limit_seconds: float, *, job: str
) -> Alert | None:
    """A ``lock_held_too_long`` alert when the session holding advisory lock ``name`` has held
    it past the limit.

    Called on the lock-busy path: a holder older than a whole bounded run is a stuck worker
    (or a manual session) that keeps every scheduled run skipping. A holder of another role
    may hide its times from ours (pg_stat_activity shows them only to the same role, a
    superuser or a member of pg_read_all_stats): no alert then.
    """
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


# SQLSTATE classes that mean "the database or our session is unwell", not "this row is bad":
# connection (08), read-only transaction incl. a failover in progress (25), transaction
# rollback incl. deadlock/serialization (40), syntax/privilege (42: a statement that cannot run
# at all fails every row alike), resources (53), operator intervention incl. statement timeout
# and shutdown (57), system (58), config/file (F0), internal (XX); plus lock_not_available
# (55P03, lock_timeout) and object state (55000, 55006).
_DATABASE_FAULT_CLASSES = frozenset({"08", "25", "40", "42", "53", "57", "58", "F0", "XX"})
_DATABASE_FAULT_STATES = frozenset({"55P03", "55000", "55006"})


def is_row_error(sqlstate: str | None) -> bool:
    """True when a failed statement may be caused by individual rows (worth isolating them).

    Data exceptions (22), integrity violations (23), exceptions raised by triggers (P0) and
    other statement-level errors are row errors. A missing SQLSTATE means the client lost the
    server, and every class above means the database, not the row: both fail the run.
    """
    if not sqlstate or len(sqlstate) != 5:
        return False
    if sqlstate in _DATABASE_FAULT_STATES:
        return False
    return sqlstate[:2] not in _DATABASE_FAULT_CLASSES
