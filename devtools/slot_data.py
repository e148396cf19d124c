"""Set-based generator of calendar availability slots (demo, tests, benchmarks).

One ``INSERT ... SELECT generate_series`` per status, so a million rows take seconds, not
minutes. Slots are spread over tenants and consultants; start times are spaced evenly inside
the requested window so that "oldest first" is observable.

    python -m devtools.slot_data --dsn postgresql:///db --past-available 100000 --future 10000
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg

# Bound parameters only; the status and the window come in as values.
_INSERT = """
insert into calendar.availability_slots
  (id, tenant_id, consultant_id, start_at, end_at, status, version, created_at, updated_at)
select
  gen_random_uuid(),
  ('00000000-0000-4000-8000-' || lpad(to_hex(g %% %(tenants)s), 12, '0'))::uuid,
  ('00000000-0000-4000-9000-' || lpad(to_hex(g %% %(consultants)s), 12, '0'))::uuid,
  %(first_start)s + (g - 1) * %(step)s,
  %(first_start)s + (g - 1) * %(step)s + %(duration)s,
  %(status)s,
  %(version)s,
  %(created_at)s,
  %(created_at)s
from generate_series(1, %(count)s) as g
"""


@dataclass(frozen=True)
class SlotMix:
    """How many slots of each kind to create around ``now``."""

    past_available: int = 0  # due: start_at in [now - past_window, now)
    future_available: int = 0  # not due: start_at in (now, now + future_window]
    booked_past: int = 0
    expired: int = 0
    archived: int = 0
    past_window: timedelta = timedelta(days=30)
    future_window: timedelta = timedelta(days=30)
    duration: timedelta = timedelta(minutes=30)
    tenants: int = 20
    consultants: int = 500


def insert_slots(
    conn: psycopg.Connection,
    *,
    status: str,
    count: int,
    first_start: datetime,
    last_start: datetime,
    version: int = 1,
    duration: timedelta = timedelta(minutes=30),
    tenants: int = 20,
    consultants: int = 500,
) -> int:
    """Insert ``count`` slots with evenly spaced starts in ``[first_start, last_start]``."""
    if count <= 0:
        return 0
    step = (last_start - first_start) / max(count - 1, 1)
    conn.execute(
        _INSERT,
        {
            "count": count,
            "status": status,
            "version": version,
            "first_start": first_start,
            "step": step,
            "duration": duration,
            "created_at": first_start - timedelta(days=7),
            "tenants": max(tenants, 1),
            "consultants": max(consultants, 1),
        },
    )
    return count


def generate(conn: psycopg.Connection, mix: SlotMix, now: datetime | None = None) -> dict[str, int]:
    """Insert the slots of ``mix`` (one statement per kind) and commit; return counts by kind."""
    now = now or datetime.now(UTC)
    second = timedelta(seconds=1)
    past = (now - mix.past_window, now - second)
    future = (now + second * 60, now + mix.future_window)
    common = {
        "duration": mix.duration,
        "tenants": mix.tenants,
        "consultants": mix.consultants,
    }
    done = {
        "past_available": insert_slots(
            conn, status="Available", count=mix.past_available, first_start=past[0],
            last_start=past[1], **common,
        ),
        "future_available": insert_slots(
            conn, status="Available", count=mix.future_available, first_start=future[0],
            last_start=future[1], **common,
        ),
        "booked_past": insert_slots(
            conn, status="Booked", count=mix.booked_past, first_start=past[0],
            last_start=past[1], version=2, **common,
        ),
        "expired": insert_slots(
            conn, status="Expired", count=mix.expired, first_start=past[0], last_start=past[1],
            version=2, **common,
        ),
        "archived": insert_slots(
            conn, status="Archived", count=mix.archived, first_start=past[0],
            last_start=past[1], version=3, **common,
        ),
    }  # fmt: skip
    conn.commit()
    conn.execute("analyze calendar.availability_slots")
    conn.commit()
    return done


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.slot_data", description=__doc__)
    parser.add_argument("--dsn", required=True)
    for kind in ("past-available", "future", "booked", "expired", "archived"):
        parser.add_argument(f"--{kind}", type=int, default=0)
    args = parser.parse_args(argv)
    mix = SlotMix(
        past_available=args.past_available,
        future_available=args.future,
        booked_past=args.booked,
        expired=args.expired,
        archived=args.archived,
    )
    with psycopg.connect(args.dsn) as conn:
        print(generate(conn, mix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
