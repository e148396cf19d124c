"""What pacing reads and decides: the database's **signals** (:func:`read`, one probe) and the
**rules**, pure functions from readings to a pause or a batch size, unit-tested on recorded
readings. :mod:`pacing` applies them to a crew of batch loops (docs/design.md, "Pacing").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg

from include.pin_maintenance import sql

# Others use the database when they ran a statement (or finished one in the last 50 ms) in at
# least this share of the probes of the window: a service's short transactions are caught by
# nearly every probe, a monitor polling a few times a second by one in five.
NEIGHBOURS_WINDOW_SECONDS = 5.0
NEIGHBOURS_SHARE = 0.5
# Beside other sessions a batch is sized to take about this long (pt-archiver's --chunk-time):
# a service transaction that meets a batch waits less behind a short one (docs/benchmarks.md).
SHARED_BATCH_SECONDS = 0.005
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
    """The slowest replica's replay lag in seconds (0 without a replica): the age of the oldest
    WAL position seen written and not replayed (``history``, oldest first), or the server's
    own ``replay_lag`` if larger. A replica that replayed all of ``reading``'s WAL is not
    behind, whatever ``replay_lag`` still shows (it keeps its last value a while)."""
    if reading.replay_bytes is None or reading.replay_bytes >= reading.wal_bytes:
        return 0.0
    lag = max(reading.replay_lag_seconds or 0.0, 0.0)
    for earlier in history:
        if earlier.wal_bytes > reading.replay_bytes:
            return max(lag, reading.at - earlier.at)
    return lag


def replay_seconds(history: Sequence[Reading], reading: Reading) -> float:
    """How long the replica needs to replay what it has not, at the rate it replayed since the
    oldest reading of the last :data:`REPLAY_WINDOW_SECONDS` (0 without a replica or a rate):
    the lag it will show once that WAL is replayed, which :func:`replica_lag_seconds` sees
    only as it happens."""
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
    """The WAL-rate leaky bucket: when all WAL written so far is paid for. ``new_bytes`` were
    written between ``since`` and ``now``; they pay from ``since`` or from when the earlier WAL
    was paid, whichever is later. An idle minute buys no burst, and the debt is at most
    :data:`WAL_DEBT_MAX_SECONDS` (a burst of the services' own is not the drain's to repay)."""
    paid = max(paid_until, since) + max(0, new_bytes) / bytes_per_second
    return min(paid, now + WAL_DEBT_MAX_SECONDS)


def shared_batch_size(seconds_per_row: float | None, batch_size: int) -> int:
    """What takes about :data:`SHARED_BATCH_SECONDS` at the recent batches' pace (at least
    :data:`SHARED_BATCH_MIN`, at most ``batch_size``); the minimum before any batch was timed."""
    floor = min(batch_size, SHARED_BATCH_MIN)
    if not seconds_per_row or seconds_per_row <= 0:
        return floor
    return max(floor, min(batch_size, round(SHARED_BATCH_SECONDS / seconds_per_row)))
