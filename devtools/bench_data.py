"""Benchmark datasets (``devtools.bench``): millions of rows in seconds, set-based.

Retention and slot data come from the jobs' own generators (``devtools.retention_data``,
``devtools.slot_data``: one ``INSERT ... SELECT generate_series`` per table), the outbox from
here. Primary keys, secondary indexes and foreign keys cost most of the load time when they are
maintained row by row, so :func:`bulk_load` drops them (read back from the catalog: whatever
the reference schema holds today), loads, recreates them exactly, then runs
``VACUUM (ANALYZE, FREEZE)``. The result has the reference schema's shape, indexes and
constraints, with fresh statistics and a set visibility map, as a long-lived table would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg
from psycopg import sql

# ---------------------------------------------------------------------------------------------
# user_activity (retention): the retention job's own generator (devtools.retention_data)

RETENTION_TABLES = (
    "user_activity.sessions",
    "user_activity.property_object_views",
    "user_activity.action_events",
)  # property_object_view_stats keeps its key: the generator upserts into it
RETENTION_DAYS = 365


@dataclass(frozen=True)
class RetentionShape:
    """Children per session: every event points at a view of its session; ``apply_filter``
    "first" = each session's first view points back at its first event, "all" = every view
    points at an event of its session (the most ON DELETE SET NULL work per deleted event)."""

    key: str
    views: int
    events: int
    apply_filter: str
    title: str


RETENTION_SHAPES: dict[str, RetentionShape] = {
    shape.key: shape
    for shape in (
        RetentionShape("project", 6, 6, "first", "the project's shape"),
        RetentionShape("few", 1, 1, "first", "few children"),
        RetentionShape("events", 2, 24, "first", "many events"),
        RetentionShape("setnull", 3, 9, "all", "every SET NULL reference set"),
    )
}


@dataclass(frozen=True)
class RetentionDataset:
    eligible: int
    keep: int  # half young Inactive (ended 30 days ago), half Active: both must stay
    shape: RetentionShape = RETENTION_SHAPES["project"]

    @property
    def views_per_session(self) -> int:
        return self.shape.views

    @property
    def events_per_session(self) -> int:
        return self.shape.events

    @property
    def rows_per_session(self) -> int:
        return 1 + self.views_per_session + self.events_per_session

    @property
    def sessions(self) -> int:
        return self.eligible + self.keep

    @property
    def rows(self) -> int:
        return self.sessions * self.rows_per_session

    @property
    def eligible_rows(self) -> int:
        return self.eligible * self.rows_per_session


def retention_dataset(eligible: int, shape: str = "project") -> RetentionDataset:
    """Eligible sessions plus 20% as many that must stay (young Inactive and Active)."""
    return RetentionDataset(
        eligible=eligible, keep=max(eligible // 5, 10), shape=RETENTION_SHAPES[shape]
    )


def load_retention(url: str, ds: RetentionDataset) -> None:
    from devtools.retention_data import seed_sessions

    bulk_load(
        url,
        RETENTION_TABLES,
        lambda conn: seed_sessions(
            conn,
            ds.eligible,
            ds.keep,
            ds.views_per_session,
            events_per_session=ds.events_per_session,
            apply_filter=ds.shape.apply_filter,
            tag="bench",
            retention_days=RETENTION_DAYS,
            n_property_objects=5000,
        ),
    )


RETENTION_ELIGIBLE_LEFT = """
select count(*) from user_activity.sessions
where status = 'Inactive' and ended_at < now() - make_interval(days => %(days)s)
"""
RETENTION_TOTALS = """
select (select count(*) from user_activity.sessions),
       (select count(*) from user_activity.property_object_views),
       (select count(*) from user_activity.action_events),
       (select coalesce(sum(views_count), 0) from user_activity.property_object_view_stats)
"""


def retention_state(url: str, retention_days: int = RETENTION_DAYS) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        (left,) = conn.execute(RETENTION_ELIGIBLE_LEFT, {"days": retention_days}).fetchone()
        sessions, views, events, stats = conn.execute(RETENTION_TOTALS).fetchone()
    return {
        "eligible_left": left,
        "sessions": sessions,
        "views": views,
        "events": events,
        "stats_views": int(stats),
    }


# ---------------------------------------------------------------------------------------------
# calendar (slot expiration): the slot job's own generator (devtools.slot_data)

SLOT_TABLES = ("calendar.availability_slots",)
# Future slots start this far ahead, so they stay not-due for the length of a benchmark.
FUTURE_OFFSET = timedelta(hours=2)


def load_slots(url: str, total: int, due: int) -> None:
    """``due`` Available slots in the past; of the rest 60% past and not Available (Booked,
    Expired, Archived), 40% Available in the future."""
    from devtools.slot_data import SlotMix, generate

    if due > total:
        raise ValueError(f"due={due} > total={total}")
    rest = total - due
    past = rest * 6 // 10
    booked, expired = past // 3, past // 2
    past_mix = SlotMix(
        past_available=due,
        booked_past=booked,
        expired=expired,
        archived=past - booked - expired,
        tenants=300,
        consultants=20_000,
    )
    future_mix = SlotMix(future_available=rest - past, tenants=300, consultants=20_000)

    def load(conn: psycopg.Connection) -> None:
        now = datetime.now(UTC)
        generate(conn, past_mix, now=now)
        generate(conn, future_mix, now=now + FUTURE_OFFSET)

    bulk_load(url, SLOT_TABLES, load)


SLOTS_DUE = """
select count(*) from calendar.availability_slots where status = 'Available' and start_at <= now()
"""
SLOTS_BY_STATUS = "select status, count(*) from calendar.availability_slots group by status"


def slots_state(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        (due,) = conn.execute(SLOTS_DUE).fetchone()
        by_status = dict(conn.execute(SLOTS_BY_STATUS).fetchall())
    return {"due": due, **{k.lower(): v for k, v in by_status.items()}}


# ---------------------------------------------------------------------------------------------
# news (snapshot detach outbox): the detach job's own generator (devtools.outbox_data)

OUTBOX_TABLES = ("news.snapshot_detach_outbox",)


def load_outbox(url: str, due: int) -> None:
    """``due`` Pending rows due now, beside history: 5x Done, 0.5x Pending backing off into
    the future (not due), 0.1x Quarantined."""
    from devtools.outbox_data import generate_outbox

    def load(conn: psycopg.Connection) -> None:
        generate_outbox(conn, due)
        generate_outbox(conn, 5 * due, status="Done", attempts=1, age=timedelta(days=3))
        generate_outbox(
            conn,
            due // 2,
            attempts=3,
            due_in=FUTURE_OFFSET,
            last_error="HttpServerError 503",
        )
        generate_outbox(
            conn,
            due // 10,
            status="Quarantined",
            attempts=12,
            last_error="HttpNotFound 404",
        )

    bulk_load(url, OUTBOX_TABLES, load)


OUTBOX_BY_STATUS = "select status, count(*) from news.snapshot_detach_outbox group by status"
OUTBOX_DUE = """
select count(*) from news.snapshot_detach_outbox
where status = 'Pending' and next_attempt_at <= now()
"""


def outbox_state(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        (due,) = conn.execute(OUTBOX_DUE).fetchone()
        by_status = dict(conn.execute(OUTBOX_BY_STATUS).fetchall())
    return {"due": due, **{k.lower(): v for k, v in by_status.items()}}


# ---------------------------------------------------------------------------------------------
# bulk loading with indexes and constraints rebuilt afterwards

_CONSTRAINTS = """
select c.conrelid::regclass::text, c.conname, c.contype, pg_get_constraintdef(c.oid)
from pg_constraint c
where c.conrelid = any(%(tables)s::regclass[]) and c.contype in ('p', 'u', 'f')
order by case c.contype when 'f' then 2 else 1 end, c.conname
"""
_INDEXES = """
select i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid)
from pg_index i
where i.indrelid = any(%(tables)s::regclass[])
  and not exists (select 1 from pg_constraint c where c.conindid = i.indexrelid)
order by 1
"""


@dataclass(frozen=True)
class _Saved:
    constraints: list[tuple[str, str, str, str]]
    indexes: list[tuple[str, str]]


def _save_and_drop(conn: psycopg.Connection, tables: tuple[str, ...]) -> _Saved:
    params = {"tables": list(tables)}
    saved = _Saved(
        constraints=conn.execute(_CONSTRAINTS, params).fetchall(),
        indexes=conn.execute(_INDEXES, params).fetchall(),
    )
    # foreign keys first (they depend on the primary keys), then the rest
    for table, name, _kind, _definition in sorted(saved.constraints, key=lambda c: c[2] != "f"):
        conn.execute(
            sql.SQL("alter table {} drop constraint {}").format(
                sql.SQL(table), sql.Identifier(name)
            )
        )
    for index, _definition in saved.indexes:
        conn.execute(sql.SQL("drop index {}").format(sql.SQL(index)))
    return saved


def _recreate(conn: psycopg.Connection, saved: _Saved) -> None:
    for table, name, kind, definition in saved.constraints:
        if kind != "f":
            conn.execute(
                sql.SQL("alter table {} add constraint {} {}").format(
                    sql.SQL(table), sql.Identifier(name), sql.SQL(definition)
                )
            )
    for _index, definition in saved.indexes:
        conn.execute(sql.SQL(definition))
    for table, name, kind, definition in saved.constraints:
        if kind == "f":
            conn.execute(
                sql.SQL("alter table {} add constraint {} {}").format(
                    sql.SQL(table), sql.Identifier(name), sql.SQL(definition)
                )
            )


def bulk_load(
    url: str, tables: tuple[str, ...], load: Callable[[psycopg.Connection], object]
) -> None:
    """Drop the tables' keys/indexes/FKs, run ``load``, rebuild them, then VACUUM ANALYZE."""
    with psycopg.connect(url) as conn:
        conn.execute("set maintenance_work_mem = '256MB'")
        saved = _save_and_drop(conn, tables)
        load(conn)
        _recreate(conn, saved)
        conn.commit()
    with psycopg.connect(url, autocommit=True) as conn:
        for table in tables:
            conn.execute(sql.SQL("vacuum (analyze, freeze) {}").format(sql.SQL(table)))
