"""Set-based data generators for the benchmarks (``devtools.bench``), one per job.

Every generator fills a database that already holds the reference schema, with one
``INSERT ... SELECT generate_series`` per table, so that millions of rows take seconds, not
minutes. Ids are derived from the series number (``md5(...)::uuid``): uniformly spread like
random UUIDs, but reproducible, so two datasets of the same size are the same rows.

Secondary indexes and foreign keys cost most of the load time when they are maintained row by
row, so :func:`bulk_load` drops them (read back from the catalog, whatever the reference schema
holds today), loads, then recreates them exactly and runs ``VACUUM ANALYZE``. The result has
the reference schema's shape, indexes and constraints, with fresh statistics and visibility map.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
from psycopg import sql

# ---------------------------------------------------------------------------------------------
# user_activity (retention)

RETENTION_TABLES = (
    "user_activity.sessions",
    "user_activity.property_object_views",
    "user_activity.action_events",
)
VIEWS_PER_SESSION = 6
EVENTS_PER_SESSION = 7
# Views 1..2 point at an event of their own session (apply_filter_event_id); events 3..6 point
# at a view of their own session (property_object_view_id): both FK directions are exercised.
VIEWS_WITH_FILTER_EVENT = 2
EVENTS_WITH_VIEW = range(3, 7)

# Kinds of sessions. Eligible: Inactive, ended 366..400 days ago (retention period 365 days).
# Young: Inactive, ended 1..300 days ago. Active: no ended_at. Only the eligible ones may go.
_INSERT_SESSIONS = """
insert into user_activity.sessions
  (id, user_id, anonymous_id, status, started_at, last_activity_at, ended_at, created_at)
select md5(%(kind)s || g)::uuid,
       case when g %% 3 <> 0 then md5('u' || (g %% 50000))::uuid end,
       case when g %% 3 = 0 then md5('a' || g)::uuid end,
       case when %(kind)s = 'active' then 'Active' else 'Inactive' end,
       e - interval '25 minutes', e - interval '1 minute',
       case when %(kind)s = 'active' then null else e end,
       e - interval '25 minutes'
from generate_series(1, %(n)s) g
cross join lateral (
  select case %(kind)s
           when 'eligible' then now() - interval '366 days' - (g %% 34) * interval '1 day'
                                - (g %% 86400) * interval '1 second'
           when 'young' then now() - interval '1 day' - (g %% 299) * interval '1 day'
           else now() - (g %% 3600) * interval '1 second'
         end as e
) t
"""

_INSERT_VIEWS = """
insert into user_activity.property_object_views
  (id, session_id, property_object_id, apply_filter_event_id, started_at, ended_at, duration_ms)
select md5('v' || %(kind)s || g || '-' || k)::uuid,
       md5(%(kind)s || g)::uuid,
       md5('po' || ((g * 7 + k) %% 20000))::uuid,
       case when k <= %(with_filter)s then md5('e' || %(kind)s || g || '-' || k)::uuid end,
       s.started_at + k * interval '2 minutes',
       s.started_at + k * interval '2 minutes' + interval '90 seconds',
       90000
from generate_series(1, %(n)s) g
cross join generate_series(1, %(views)s) k
cross join lateral (select now() - interval '400 days' as started_at) s
"""

_INSERT_EVENTS = """
insert into user_activity.action_events
  (id, session_id, property_object_view_id, type, occurred_at, payload)
select md5('e' || %(kind)s || g || '-' || k)::uuid,
       md5(%(kind)s || g)::uuid,
       case when k between %(view_from)s and %(view_to)s
            then md5('v' || %(kind)s || g || '-' || (k - 2))::uuid end,
       (array['ApplyFilter', 'OpenCard', 'ViewPropertyObject', 'AddFavourite',
              'Share', 'Call', 'Scroll'])[k],
       now() - interval '400 days' + k * interval '1 minute',
       jsonb_build_object('k', k, 'page', g %% 40, 'filter', 'rooms>=2;price<=15000000')
from generate_series(1, %(n)s) g
cross join generate_series(1, %(events)s) k
"""

_INSERT_VIEW_STATS = """
insert into user_activity.property_object_view_stats
  (property_object_id, views_count, total_duration_ms, updated_at)
select md5('po' || g)::uuid, 100 + g, 9000000 + g, now()
from generate_series(0, 19999) g
on conflict do nothing
"""


@dataclass(frozen=True)
class RetentionDataset:
    eligible: int
    young: int
    active: int

    @property
    def sessions(self) -> int:
        return self.eligible + self.young + self.active

    @property
    def eligible_children(self) -> int:
        return self.eligible * (VIEWS_PER_SESSION + EVENTS_PER_SESSION)

    @property
    def rows(self) -> int:
        return self.sessions * (1 + VIEWS_PER_SESSION + EVENTS_PER_SESSION)


def retention_dataset(eligible: int) -> RetentionDataset:
    """The default mix: every eligible session has keepers beside it (10% young, 10% Active)."""
    keep = max(eligible // 10, 10)
    return RetentionDataset(eligible=eligible, young=keep, active=keep)


def load_retention(url: str, ds: RetentionDataset) -> None:
    """Sessions of the three kinds, each with 6 views + 7 events and cross references."""

    def load(conn: psycopg.Connection) -> None:
        for kind, n in (("eligible", ds.eligible), ("young", ds.young), ("active", ds.active)):
            if not n:
                continue
            conn.execute(_INSERT_SESSIONS, {"kind": kind, "n": n})
            conn.execute(
                _INSERT_VIEWS,
                {
                    "kind": kind,
                    "n": n,
                    "views": VIEWS_PER_SESSION,
                    "with_filter": VIEWS_WITH_FILTER_EVENT,
                },
            )
            conn.execute(
                _INSERT_EVENTS,
                {
                    "kind": kind,
                    "n": n,
                    "events": EVENTS_PER_SESSION,
                    "view_from": EVENTS_WITH_VIEW.start,
                    "view_to": EVENTS_WITH_VIEW.stop - 1,
                },
            )
        conn.execute(_INSERT_VIEW_STATS)

    bulk_load(url, RETENTION_TABLES, load)


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


def retention_state(url: str, retention_days: int = 365) -> dict[str, int]:
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
# calendar (slot expiration)

SLOT_TABLES = ("calendar.availability_slots",)

# Rows 1..due are Available with start_at in the past (due). The others: 60% past and not
# Available (Expired / Booked / Archived), 40% in the future (Available or Booked), starting at
# least two hours from now so that they stay not-due for the length of a benchmark.
_INSERT_SLOTS = """
insert into calendar.availability_slots
  (id, tenant_id, consultant_id, start_at, end_at, status, version, created_at, updated_at)
select md5('slot' || g)::uuid,
       md5('tenant' || (g %% 300))::uuid,
       md5('consultant' || (g %% 20000))::uuid,
       t.start_at, t.start_at + interval '30 minutes', t.status, 1,
       t.start_at - interval '14 days', t.start_at - interval '14 days'
from generate_series(1, %(total)s) g
cross join lateral (
  select case
           when g <= %(due)s then now() - interval '1 minute' - (g %% 20160) * interval '1 minute'
           when g %% 10 < 6 then now() - interval '1 hour' - (g %% 525600) * interval '1 minute'
           else now() + interval '2 hours' + (g %% 129600) * interval '1 minute'
         end as start_at,
         case
           when g <= %(due)s then 'Available'
           when g %% 10 < 6 then (array['Expired', 'Booked', 'Archived', 'Expired'])[g %% 4 + 1]
           when g %% 10 < 9 then 'Available'
           else 'Booked'
         end as status
) t
"""

SLOTS_DUE = """
select count(*) from calendar.availability_slots where status = 'Available' and start_at <= now()
"""
SLOTS_BY_STATUS = "select status, count(*) from calendar.availability_slots group by status"


def load_slots(url: str, total: int, due: int) -> None:
    if due > total:
        raise ValueError(f"due={due} > total={total}")
    bulk_load(
        url,
        SLOT_TABLES,
        lambda conn: conn.execute(_INSERT_SLOTS, {"total": total, "due": due}),
    )


def slots_state(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        (due,) = conn.execute(SLOTS_DUE).fetchone()
        by_status = dict(conn.execute(SLOTS_BY_STATUS).fetchall())
    return {"due": due, **{k.lower(): v for k, v in by_status.items()}}


# ---------------------------------------------------------------------------------------------
# news (snapshot detach outbox)

OUTBOX_TABLES = ("news.snapshot_detach_outbox",)

# Rows 1..due: Pending and due now (0..3 earlier attempts). Then history: Done rows (5x due),
# a few Quarantined, and Pending rows backing off into the future (not due).
_INSERT_OUTBOX = """
insert into news.snapshot_detach_outbox
  (id, snapshot_id, post_id, reason, attempts, next_attempt_at, status, last_error,
   created_at, updated_at)
select md5('outbox' || g)::uuid,
       md5('snapshot' || g)::uuid,
       md5('post' || (g / 3))::uuid,
       case when g %% 4 = 0 then 'PostDeleted' else 'BlockReplaced' end,
       t.attempts, t.next_attempt_at, t.status,
       case when t.attempts > 0 and t.status <> 'Done' then 'http_status:503' end,
       now() - interval '1 hour' - (g %% 600) * interval '1 second',
       now() - interval '1 minute'
from generate_series(1, %(due)s + %(history)s) g
cross join lateral (
  select case when g <= %(due)s then g %% 4
              when g %% 50 = 0 then 12
              else 1 end as attempts,
         case when g <= %(due)s then now() - interval '1 minute' - (g %% 300) * interval '1 second'
              when g %% 10 = 1 then now() + interval '2 hours'
              else now() - interval '1 hour' end as next_attempt_at,
         case when g <= %(due)s then 'Pending'
              when g %% 50 = 0 then 'Quarantined'
              when g %% 10 = 1 then 'Pending'
              else 'Done' end as status
) t
"""

OUTBOX_BY_STATUS = "select status, count(*) from news.snapshot_detach_outbox group by status"
OUTBOX_DUE = """
select count(*) from news.snapshot_detach_outbox where status = 'Pending' and next_attempt_at <= now()
"""


def load_outbox(url: str, due: int, history: int | None = None) -> None:
    params = {"due": due, "history": 5 * due if history is None else history}
    bulk_load(url, OUTBOX_TABLES, lambda conn: conn.execute(_INSERT_OUTBOX, params))


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


@contextmanager
def timed() -> Iterator[list[float]]:
    """``with timed() as t: ...`` then ``t[0]`` holds the elapsed seconds."""
    box: list[float] = []
    started = time.perf_counter()
    try:
        yield box
    finally:
        box.append(time.perf_counter() - started)
