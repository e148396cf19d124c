"""Helpers for the slot-expiration integration tests (real Postgres, real concurrent sessions).

Two test-only triggers drive the hard cases without sleeps:

* the *gate*: an update of a slot listed in ``public.slot_gate`` waits on advisory lock
  ``GATE_KEY``; a test that holds that lock freezes a batch mid-statement (row locks taken),
  can look at the world from other sessions, interrupt or kill the runner, then let it go;
* the *poison*: an update of a slot listed in ``public.slot_poison`` raises.

The trigger function reads its lists as their owner (``security definer``): the job's role has
no privilege on test tables, and must not be granted one for a test.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from devtools.pg import Database
from include.pin_maintenance.db import Connect, SessionSettings
from include.pin_maintenance.jobs import slot_expiration as se
from include.pin_maintenance.pacing_config import PACING_OFF
from include.pin_maintenance.stopping import StopSignal
from include.pin_maintenance.telemetry import LogOnlyAlerts, RecordingMetrics, Telemetry
from tests.job_db import job_connect, job_telemetry

GATE_KEY = 4242
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
WAIT_LIMIT_SECONDS = 30
# Drain mode: these tests follow a cycle across batches and runners (the default cycle takes
# one batch, seed 002's bound; test_slot_expiration_bounds.py tests that bound itself).
DRAIN = {"max_batches_per_cycle": 1000}
# Tests of a bound or a race that a pause between batches would change (docs/design.md, "Pacing")
UNPACED = PACING_OFF

TEST_TRIGGERS = """
create table public.slot_gate (id uuid primary key);
create table public.slot_poison (id uuid primary key);
create function public.slot_test_trigger() returns trigger language plpgsql security definer as $$
begin
  if exists (select 1 from public.slot_poison p where p.id = old.id) then
    raise exception 'slot % rejected by test trigger', old.id;
  end if;
  if exists (select 1 from public.slot_gate g where g.id = old.id) then
    perform pg_advisory_xact_lock(4242);
  end if;
  return new;
end $$;
create trigger slot_test_trigger before update on calendar.availability_slots
  for each row execute function public.slot_test_trigger();
"""


def install_test_triggers(db: Database) -> None:
    with db.connect() as conn:
        conn.execute(TEST_TRIGGERS)


def insert_due_slots(conn: psycopg.Connection, count: int, *, before: datetime = NOW) -> None:
    """``count`` Available slots that started in the ``count`` seconds before ``before``."""
    conn.execute(
        "insert into calendar.availability_slots (id, tenant_id, consultant_id, start_at,"
        " end_at, status, version, created_at, updated_at) select gen_random_uuid(),"
        " gen_random_uuid(), gen_random_uuid(), %(before)s - make_interval(secs => i),"
        " %(before)s, 'Available', 1, %(before)s, %(before)s from generate_series(1, %(count)s) i",
        {"before": before, "count": count},
    )


def insert_slot(
    conn: psycopg.Connection,
    *,
    status: str = "Available",
    start_at: datetime,
    version: int = 1,
    end_at: datetime | None = None,
) -> uuid.UUID:
    slot_id = uuid.uuid4()
    conn.execute(
        "insert into calendar.availability_slots"
        " (id, tenant_id, consultant_id, start_at, end_at, status, version, created_at,"
        "  updated_at)"
        " values (%(id)s, %(t)s, %(c)s, %(s)s, %(e)s, %(st)s, %(v)s, %(cr)s, %(cr)s)",
        {
            "id": slot_id,
            "t": uuid.uuid4(),
            "c": uuid.uuid4(),
            "s": start_at,
            "e": end_at or start_at + timedelta(minutes=30),
            "st": status,
            "v": version,
            "cr": start_at - timedelta(days=7),
        },
    )
    return slot_id


# A DAG run over the seeded slots below makes several batches and both drain loops.
DAG_CONF = {"batch_size": 2, "max_batches_per_cycle": 100}


def seed_slots_with_poison(db: Database) -> uuid.UUID:
    """Five due slots, one tomorrow, one booked two hours ago, and a poison row (version + 1
    overflows) that a run isolates, reports and still succeeds; the poison row's id."""
    now = datetime.now(UTC)
    with db.connect() as conn:
        for hours in range(1, 6):
            insert_slot(conn, start_at=now - timedelta(hours=hours))
        insert_slot(conn, start_at=now + timedelta(days=1))
        insert_slot(conn, status="Booked", start_at=now - timedelta(hours=2))
        return insert_slot(conn, start_at=now - timedelta(hours=9), version=2**31 - 1)


def insert_due(db: Database, count: int, *, now: datetime = NOW) -> list[uuid.UUID]:
    """``count`` due Available slots, oldest first in the returned list (1 minute apart)."""
    with db.connect() as conn:
        return [
            insert_slot(conn, start_at=now - timedelta(minutes=count - i)) for i in range(count)
        ]


def table_state(db: Database) -> dict[uuid.UUID, tuple[Any, ...]]:
    with db.connect() as conn:
        rows = conn.execute(
            "select id, status, version, updated_at, start_at from calendar.availability_slots"
        ).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


def statuses(db: Database) -> dict[str, int]:
    with db.connect() as conn:
        rows = conn.execute(
            "select status, count(*) from calendar.availability_slots group by status"
        ).fetchall()
    return {status: n for status, n in rows}


@dataclass
class Run:
    """What one job run reported."""

    telemetry: Telemetry
    metrics: RecordingMetrics
    alerts: LogOnlyAlerts
    stop: StopSignal = field(default_factory=StopSignal)


def new_run(run_id: str = "test-run") -> Run:
    telemetry = job_telemetry(se.JOB, run_id)
    return Run(telemetry, telemetry.metrics, telemetry.alerts)


def connect_for(
    db: Database, app: str = "slots-test", lock_timeout_ms: int = 60_000, url: str | None = None
) -> Connect:
    """The job's connection factory (its role, or ``url``'s), tagged so that a test can find
    its backend."""
    settings = SessionSettings(
        statement_timeout_ms=60_000, lock_timeout_ms=lock_timeout_ms, application_name=app
    )
    return job_connect(db, se.JOB, settings, url=url)


def run_job(
    db: Database,
    config: dict[str, Any] | None = None,
    *,
    run: Run | None = None,
    app: str = "slots-test",
    url: str | None = None,
    **kwargs: Any,
) -> se.ExpirationResult:
    run = run or new_run()
    kwargs.setdefault("now", lambda: NOW)
    connect = connect_for(db, app, url=url)
    return se.run(connect, config or {}, run.telemetry, run.stop, **kwargs)


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Poll until ``predicate()`` holds (bounded; a failure names what never happened)."""
    deadline = time.monotonic() + WAIT_LIMIT_SECONDS
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.02)


def backends_waiting(db: Database, wait_event: str, app: str | None = None) -> int:
    with db.connect(autocommit=True) as conn:
        row = conn.execute(
            "select count(*) from pg_stat_activity"
            " where datname = current_database() and wait_event = %(w)s"
            "   and (%(app)s::text is null or application_name = %(app)s)",
            {"w": wait_event, "app": app},
        ).fetchone()
    return int(row[0]) if row else 0


def backend_pids(db: Database, app: str) -> list[int]:
    with db.connect(autocommit=True) as conn:
        rows = conn.execute(
            "select pid from pg_stat_activity"
            " where datname = current_database() and application_name = %(app)s",
            {"app": app},
        ).fetchall()
    return [r[0] for r in rows]


@contextmanager
def gate(db: Database, *slot_ids: uuid.UUID) -> Iterator[Callable[[], None]]:
    """Hold the gate closed for updates of ``slot_ids``; yields ``release()`` (also at exit)."""
    with db.connect() as conn:
        for slot_id in slot_ids:
            conn.execute("insert into public.slot_gate (id) values (%s)", (slot_id,))
        conn.commit()
    holder = db.connect(autocommit=True)
    holder.execute("select pg_advisory_lock(%s)", (GATE_KEY,))
    released = threading.Event()

    def release() -> None:
        if not released.is_set():
            released.set()
            holder.execute("select pg_advisory_unlock(%s)", (GATE_KEY,))

    try:
        yield release
    finally:
        release()
        holder.close()


def wait_at_gate(db: Database, app: str | None = None) -> None:
    wait_for(lambda: backends_waiting(db, "advisory", app) > 0, "a runner blocked at the gate")


class Background(threading.Thread):
    """Run ``fn`` in a thread; ``.result()`` re-raises its exception in the test."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:
            self.error = exc

    def result(self, timeout: float = WAIT_LIMIT_SECONDS) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "background run did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def lock_all_nowait(db: Database) -> int:
    """Lock every slot with NOWAIT from a fresh session: fails if any row lock was left held."""
    with db.connect() as conn:
        rows = conn.execute(
            "select id from calendar.availability_slots for update nowait"
        ).fetchall()
        conn.rollback()
    return len(rows)
