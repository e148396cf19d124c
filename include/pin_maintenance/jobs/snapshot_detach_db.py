"""The detach job's database statements: thin functions over ``include/sql/news/*.sql``.

Each function is one short unit of work; the caller owns the connection (autocommit, so every
statement here runs in its own explicit transaction) or passes how to open one.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg

from include.pin_maintenance import sql
from include.pin_maintenance.backoff import Backoff
from include.pin_maintenance.db import Connect
from include.pin_maintenance.jobs.snapshot_detach_rules import ClaimedRow, OutcomePlan


def pg_array(values: Iterable[Any]) -> str:
    """A Postgres array literal (``{...}``) for a list of parameters, cast in the SQL.

    One string per array instead of psycopg's per-element list dumping: the claim and outcome
    statements of a batch carry 3 and 8 arrays of ``batch_size`` elements, and dumping them
    element by element cost the main thread (which also claims ahead) more GIL time than the
    HTTP calls themselves. Elements: None, bool, int, datetime, str (quoted).
    """
    parts = []
    for v in values:
        if v is None:
            parts.append("NULL")
        elif isinstance(v, bool):
            parts.append("t" if v else "f")
        elif isinstance(v, int):
            parts.append(str(v))
        elif isinstance(v, datetime):
            parts.append(f'"{v.isoformat()}"')
        else:
            text = str(v).replace("\\", "\\\\").replace('"', '\\"')
            parts.append(f'"{text}"')
    return "{" + ",".join(parts) + "}"


def claim_due_entries(
    conn: psycopg.Connection,
    *,
    now: datetime,
    batch_size: int,
    in_flight: Sequence[str],
    backoff: Backoff,
    rng: random.Random,
) -> list[ClaimedRow]:
    """Claim up to ``batch_size`` due rows not in ``in_flight`` (one transaction): attempts
    pre-incremented, the next backoff set, ``updated_at = now`` as the claim token."""
    with conn.transaction():
        found = conn.execute(
            sql.load("news/select_due_entries"),
            {"now": now, "batch_size": batch_size, "in_flight": pg_array(in_flight)},
        ).fetchall()
        rows = []
        for rid, snapshot_id, post_id, reason, attempts, next_at, created_at in found:
            n = attempts + 1
            delay = backoff.delay_with_jitter(n, rng.uniform)
            rows.append(
                ClaimedRow(
                    id=str(rid),
                    snapshot_id=str(snapshot_id),
                    post_id=str(post_id),
                    reason=reason,
                    attempts=n,
                    previous_next_attempt_at=next_at,
                    next_attempt_at=now + timedelta(seconds=delay),
                    claimed_at=now,
                    created_at=created_at,
                )
            )
        if rows:
            conn.execute(
                sql.load("news/claim_due_entries"),
                {
                    "now": now,
                    "ids": pg_array(r.id for r in rows),
                    "attempts": pg_array(r.attempts for r in rows),
                    "next_attempt_at": pg_array(r.next_attempt_at for r in rows),
                },
            )
    return rows


def record_detach_outcomes(
    conn: psycopg.Connection, plans: Sequence[OutcomePlan], now: datetime
) -> set[str]:
    """Write ``plans`` in one transaction; returns the ids whose claim still held (a row
    claimed again or requeued since is left alone)."""
    with conn.transaction():
        cur = conn.execute(
            sql.load("news/record_detach_outcomes"),
            {
                "now": now,
                "ids": pg_array(p.row.id for p in plans),
                "claimed_attempts": pg_array(p.row.attempts for p in plans),
                "claimed_at": pg_array(p.row.claimed_at for p in plans),
                "statuses": pg_array(p.status for p in plans),
                "attempts": pg_array(p.attempts for p in plans),
                "next_attempt_at": pg_array(p.next_attempt_at for p in plans),
                "last_errors": pg_array(p.last_error for p in plans),
                "keep_last_error": pg_array(p.keep_last_error for p in plans),
            },
        )
        return {str(r[0]) for r in cur.fetchall()}


def measure_pending_backlog(connect: Connect, now: datetime) -> tuple[int, float]:
    """(Pending rows, age in seconds of the oldest Pending row), on a connection of its own."""
    row = _read_one(connect, "news/measure_pending_backlog", now)
    return int(row[0]), max(float(row[1]), 0.0)


def count_due_entries(connect: Connect, now: datetime) -> int:
    """Rows a run would claim now (the dry run's answer)."""
    row = _read_one(connect, "news/count_due_entries", now)
    return int(row[0]) if row else 0


def _read_one(connect: Connect, query: str, now: datetime) -> Any:
    conn = connect()
    try:
        row = conn.execute(sql.load(query), {"now": now}).fetchone()
        conn.rollback()
        return row
    finally:
        conn.close()
