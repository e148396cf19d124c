"""Realistic ``user_activity`` data for the retention job: sessions with children, set-based.

``seed_sessions(conn, n_eligible, n_young, children_per_session)`` inserts, with a handful of
``INSERT ... SELECT generate_series`` statements (no row-by-row round trips):

- ``n_eligible`` Inactive sessions that ended 1 hour to ~``spread_days`` days before the
  retention cutoff (distinct ``ended_at`` values, oldest first by index);
- ``n_young`` sessions that must survive: half Inactive and ended ``young_age_days`` ago, half
  Active (``ended_at`` null);
- per session ``children_per_session`` property_object_views and as many action_events (or
  ``events_per_session`` events); every event points at a view of its own session
  (``property_object_view_id``, event j at view ((j - 1) mod views) + 1), and the first view of
  a session points back at the session's first event (``apply_filter_event_id``), or with
  ``apply_filter="all"`` view k at event k for every view that has one: the circular SET NULL
  references of the schema;
- one ``property_object_view_stats`` row per property object (``n_property_objects`` of them),
  which the job must never change.

Ids are derived from ``tag`` (md5-based UUIDs) so several calls do not collide; the caller
commits. Used by the retention tests, the demo and the benchmarks.

A test that needs particular rows (an exact ``ended_at``, a status, a child to point a trigger
at) writes them with :func:`insert_session`, :func:`insert_view` and :func:`insert_event`:
one row each, random ids, the caller commits.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

import psycopg


@dataclass(frozen=True)
class SeededSessions:
    tag: str
    eligible_sessions: int
    young_sessions: int
    property_object_views: int
    action_events: int


_SESSIONS = """
insert into user_activity.sessions
  (id, user_id, anonymous_id, status, started_at, last_activity_at, ended_at, created_at)
select md5(%(tag)s || ':s:' || i)::uuid,
       case when i %% 2 = 0 then md5(%(tag)s || ':u:' || (i %% 997))::uuid end,
       case when i %% 2 = 1 then md5(%(tag)s || ':a:' || i)::uuid end,
       case when i > %(n_eligible)s and i %% 2 = 0 then 'Active' else 'Inactive' end,
       e - interval '30 minutes', e, case
         when i > %(n_eligible)s and i %% 2 = 0 then null else e end,
       e - interval '30 minutes'
-- ::int: psycopg binds an int under 32768 as a smallint, and i's arithmetic would overflow it
from generate_series(1, %(n_sessions)s::int) as i
cross join lateral (
  select case
    when i <= %(n_eligible)s then
      now() - make_interval(days => %(retention_days)s) - interval '1 hour'
        - make_interval(secs => (%(n_eligible)s - i) * %(step_seconds)s)
    else now() - make_interval(days => %(young_age_days)s)
        - make_interval(secs => i - %(n_eligible)s)
  end as e
) as t
"""

_VIEWS = """
insert into user_activity.property_object_views
  (id, session_id, property_object_id, apply_filter_event_id, started_at, ended_at, duration_ms)
select md5(%(tag)s || ':v:' || i || ':' || j)::uuid,
       md5(%(tag)s || ':s:' || i)::uuid,
       md5(%(tag)s || ':p:' || ((i * 31 + j) %% %(n_property_objects)s))::uuid,
       null, now() - interval '400 days', now() - interval '400 days', 1000 * j
from generate_series(1, %(n_sessions)s) as i, generate_series(1, %(children)s) as j
"""

_EVENTS = """
insert into user_activity.action_events
  (id, session_id, property_object_view_id, type, occurred_at, payload)
select md5(%(tag)s || ':e:' || i || ':' || j)::uuid,
       md5(%(tag)s || ':s:' || i)::uuid,
       md5(%(tag)s || ':v:' || i || ':' || ((j - 1) %% %(views)s + 1))::uuid,
       case when j = 1 then 'ApplyFilter' else 'ViewPropertyObject' end,
       now() - interval '400 days',
       jsonb_build_object('n', j)
from generate_series(1, %(n_sessions)s) as i, generate_series(1, %(events)s) as j
"""

# Views and events reference each other: views go in without an event, events next, then this
# sets the views' back references (view k -> event k of the same session, k <= linked).
_BACK_REFERENCES = """
update user_activity.property_object_views v
set apply_filter_event_id = md5(%(tag)s || ':e:' || i || ':' || k)::uuid
from generate_series(1, %(n_sessions)s) as i, generate_series(1, %(linked)s) as k
where v.id = md5(%(tag)s || ':v:' || i || ':' || k)::uuid
"""

_STATS = """
insert into user_activity.property_object_view_stats
  (property_object_id, views_count, total_duration_ms, updated_at)
select md5(%(tag)s || ':p:' || k)::uuid, 100 + k, 100000 + k, now() - interval '1 day'
from generate_series(0, %(n_property_objects)s - 1) as k
on conflict (property_object_id) do nothing
"""


def session_id(tag: str, i: int) -> uuid.UUID:
    """The id ``seed_sessions`` gave session number ``i`` (1-based; eligible ones come first)."""
    import hashlib

    return uuid.UUID(hashlib.md5(f"{tag}:s:{i}".encode()).hexdigest())


def seed_sessions(
    conn: psycopg.Connection,
    n_eligible: int,
    n_young: int,
    children_per_session: int,
    *,
    tag: str | None = None,
    retention_days: int = 365,
    young_age_days: int = 30,
    step_seconds: int = 60,
    n_property_objects: int = 100,
    events_per_session: int | None = None,
    apply_filter: str = "first",
) -> SeededSessions:
    """Insert the data described in the module docstring; the caller commits."""
    views = children_per_session
    events = children_per_session if events_per_session is None else events_per_session
    if apply_filter not in {"first", "all"}:
        raise ValueError(f"apply_filter={apply_filter!r}; expected 'first' or 'all'")
    if views < 0 or events < 0:
        raise ValueError(f"children_per_session={views}, events_per_session={events}: >= 0")
    if events and not views:
        raise ValueError("events point at views of their session: events need views")
    params = {
        "tag": tag or uuid.uuid4().hex[:12],
        "n_eligible": n_eligible,
        "n_young": n_young,
        "n_sessions": n_eligible + n_young,
        "children": views,
        "views": max(views, 1),
        "events": events,
        "linked": min(views, events) if apply_filter == "all" else min(views, events, 1),
        "retention_days": retention_days,
        "young_age_days": young_age_days,
        "step_seconds": step_seconds,
        "n_property_objects": max(n_property_objects, 1),
    }
    conn.execute(_SESSIONS, params)
    if views > 0:
        conn.execute(_VIEWS, params)
    if events > 0:
        conn.execute(_EVENTS, params)
    if params["linked"] > 0:
        conn.execute(_BACK_REFERENCES, params)
    conn.execute(_STATS, params)
    n = n_eligible + n_young
    return SeededSessions(
        tag=params["tag"],
        eligible_sessions=n_eligible,
        young_sessions=n_young,
        property_object_views=n * views,
        action_events=n * events,
    )


def insert_session(
    conn: psycopg.Connection,
    *,
    ended_at: datetime | None,
    status: str = "Inactive",
    sid: uuid.UUID | None = None,
    views: int = 0,
    events: int = 0,
    linked: bool = False,
) -> uuid.UUID:
    """One session, started 900 days ago (database clock) and ended at ``ended_at`` (None: still
    open), with ``views`` property_object_views and ``events`` action_events of its own. With
    ``linked``, event k points at view k and view k back at event k, for k up to the smaller
    count: the schema's circular SET NULL references. Returns the session's id."""
    sid = sid or uuid.uuid4()
    conn.execute(
        "insert into user_activity.sessions"
        " (id, status, started_at, last_activity_at, ended_at, created_at)"
        " values (%(id)s, %(status)s, now() - interval '900 days', now() - interval '900 days',"
        " %(ended_at)s, now() - interval '900 days')",
        {"id": sid, "status": status, "ended_at": ended_at},
    )
    view_ids = [insert_view(conn, sid) for _ in range(views)]
    for k in range(events):
        view = view_ids[k] if linked and k < len(view_ids) else None
        event = insert_event(conn, sid, view=view)
        if view is not None:
            set_apply_filter_event(conn, view, event)
    return sid


def insert_view(conn: psycopg.Connection, session: uuid.UUID) -> uuid.UUID:
    """One property_object_view of ``session`` (a property object of its own), started now."""
    view = uuid.uuid4()
    conn.execute(
        "insert into user_activity.property_object_views"
        " (id, session_id, property_object_id, started_at) values (%s, %s, %s, now())",
        (view, session, uuid.uuid4()),
    )
    return view


def insert_event(
    conn: psycopg.Connection,
    session: uuid.UUID,
    *,
    view: uuid.UUID | None = None,
    occurred_at: datetime | None = None,
) -> uuid.UUID:
    """One ApplyFilter action_event of ``session`` (on ``view`` when given), at ``occurred_at``
    (default now)."""
    event = uuid.uuid4()
    conn.execute(
        "insert into user_activity.action_events"
        " (id, session_id, property_object_view_id, type, occurred_at)"
        " values (%s, %s, %s, 'ApplyFilter', coalesce(%s::timestamptz, now()))",
        (event, session, view, occurred_at),
    )
    return event


def set_apply_filter_event(conn: psycopg.Connection, view: uuid.UUID, event: uuid.UUID) -> None:
    """Point ``view`` at ``event`` (``apply_filter_event_id``, on delete set null)."""
    conn.execute(
        "update user_activity.property_object_views set apply_filter_event_id = %s where id = %s",
        (event, view),
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m devtools.retention_data --db-url URL --eligible N --young M --children K``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m devtools.retention_data")
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--eligible", type=int, default=1000)
    parser.add_argument("--young", type=int, default=200)
    parser.add_argument("--children", type=int, default=3)
    args = parser.parse_args(argv)
    with psycopg.connect(args.db_url) as conn:
        seeded = seed_sessions(conn, args.eligible, args.young, args.children)
    print(seeded)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
