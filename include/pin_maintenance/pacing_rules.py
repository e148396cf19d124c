"""Pacing's signals (:func:`read`, one probe) and rules, pure functions from readings to a
pause or a batch size, which :mod:`pacing` applies (docs/design.md, "Pacing")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg

from include.pin_maintenance import sql

# others use the database when active (or done in the last 50 ms) in this share of the probes
NEIGHBOURS_WINDOW_SECONDS = 5.0
NEIGHBOURS_SHARE = 0.5
SHARED_BATCH_SECONDS = 0.005  # beside other sessions a batch takes about this long
SHARED_BATCH_MIN = 50  # rows (sessions) a sized batch takes at least
REPLAY_WINDOW_SECONDS = 2.0  # the replica's replay rate is read over this window
WAL_DEBT_MAX_SECONDS = 2.0  # the WAL-rate bucket's depth, in seconds of the budget


@dataclass(frozen=True)
class Reading:
    """One probe of the database, at ``at`` on the monotonic clock."""

    at: float
    wal_bytes: int  # pg_current_wal_lsn() as a byte position
    replay_bytes: int | None  # the slowest streaming replica's replay position (None: none)
    replay_lag_seconds: float | None  # its replay_lag as the server measured it
    others_active: bool  # other client sessions running a statement (or just done with one)


def read(conn: psycopg.Connection, own_pids: Sequence[int], clock: Callable[[], float]) -> Reading:
    """The signals; ``own_pids``, the crew's server processes, are not others."""
    wal, replay, replay_lag, others = fetch(
        conn, "pacing/read_database_health", {"own_pids": list(own_pids)}
    )
    return Reading(
        at=clock(),
        wal_bytes=int(wal),
        replay_bytes=int(replay) if replay is not None else None,
        replay_lag_seconds=float(replay_lag) if replay_lag is not None else None,
        others_active=bool(others),
    )


def fetch(conn: psycopg.Connection, query: str, params: dict | None = None) -> tuple:
    """One row, leaving no transaction open on the loop's idle connection."""
    row = conn.execute(sql.load(query), params).fetchone()
    if not conn.autocommit:
        conn.rollback()
    return row


def replica_lag_seconds(history: Sequence[Reading], reading: Reading) -> float:
    """The slowest replica's lag (0 without one or once it replayed ``reading``'s WAL): the age
    of the oldest WAL seen written and not replayed (``history``, oldest first) or its
    ``replay_lag``, whichever is larger."""
    if reading.replay_bytes is None or reading.replay_bytes >= reading.wal_bytes:
        return 0.0
    lag = max(reading.replay_lag_seconds or 0.0, 0.0)
    for earlier in history:
        if earlier.wal_bytes > reading.replay_bytes:
            return max(lag, reading.at - earlier.at)
    return lag


def replay_seconds(history: Sequence[Reading], reading: Reading) -> float:
    """How long the replica needs to replay what it has not, at its rate over the last
    :data:`REPLAY_WINDOW_SECONDS` (0 without a replica or a rate)."""
    if reading.replay_bytes is None or reading.replay_bytes >= reading.wal_bytes:
        return 0.0
    first = None
    for earlier in reversed(history):
        if reading.at - earlier.at > REPLAY_WINDOW_SECONDS:
            break
        if earlier.replay_bytes is not None:
            first = earlier
    if first is None or reading.at <= first.at:
        return 0.0
    rate = (reading.replay_bytes - first.replay_bytes) / (reading.at - first.at)
    return (reading.wal_bytes - reading.replay_bytes) / rate if rate > 0 else 0.0


def database_shared(others_active: Sequence[bool]) -> bool:
    """Whether other sessions ran statements in enough of the recent probes."""
    return bool(others_active) and sum(others_active) / len(others_active) >= NEIGHBOURS_SHARE


def wal_paid_until(
    paid_until: float, since: float, now: float, new_bytes: int, bytes_per_second: float
) -> float:
    """The WAL-rate leaky bucket: when ``new_bytes`` written since ``since`` are paid for, from
    ``since`` or the earlier WAL's payment, at most :data:`WAL_DEBT_MAX_SECONDS` from now."""
    paid = max(paid_until, since) + max(0, new_bytes) / bytes_per_second
    return min(paid, now + WAL_DEBT_MAX_SECONDS)


def shared_batch_size(seconds_per_row: float | None, batch_size: int) -> int:
    """What takes about :data:`SHARED_BATCH_SECONDS` at the recent batches' pace (at least
    :data:`SHARED_BATCH_MIN`, at most ``batch_size``); the minimum before any batch was timed."""
    floor = min(batch_size, SHARED_BATCH_MIN)
    if not seconds_per_row or seconds_per_row <= 0:
        return floor
    return max(floor, min(batch_size, round(SHARED_BATCH_SECONDS / seconds_per_row)))
