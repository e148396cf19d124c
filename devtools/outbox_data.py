"""Set-based generator of ``news.snapshot_detach_outbox`` rows for the demo, tests and bench.

One ``insert ... select from generate_series`` per call, so 10k or 1M rows take one statement.
"""

from __future__ import annotations

from datetime import timedelta

import psycopg

_INSERT = """
insert into news.snapshot_detach_outbox
  (id, snapshot_id, post_id, reason, attempts, next_attempt_at, status, last_error,
   created_at, updated_at)
select gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
       case when %(reason)s::text is not null then %(reason)s::text
            when g %% 3 = 0 then 'PostDeleted' else 'BlockReplaced' end,
       %(attempts)s, now() + %(due_in)s::interval - (g * interval '1 millisecond'),
       %(status)s, %(last_error)s,
       now() - %(age)s::interval, now() - %(age)s::interval
from generate_series(1, %(count)s) as g
returning snapshot_id
"""


def generate_outbox(
    conn: psycopg.Connection,
    count: int,
    *,
    status: str = "Pending",
    attempts: int = 0,
    due_in: timedelta = timedelta(seconds=-60),
    age: timedelta = timedelta(minutes=10),
    reason: str | None = None,
    last_error: str | None = None,
) -> list[str]:
    """Insert ``count`` rows (committed); return their snapshot ids.

    ``due_in`` negative = already due; ``reason`` None alternates BlockReplaced / PostDeleted.
    """
    rows = conn.execute(
        _INSERT,
        {
            "count": count,
            "status": status,
            "attempts": attempts,
            "due_in": due_in,
            "age": age,
            "reason": reason,
            "last_error": last_error,
        },
    ).fetchall()
    conn.commit()
    return [str(r[0]) for r in rows]
