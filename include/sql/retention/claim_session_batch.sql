-- The next batch of eligible sessions after the keyset position (ended_at, id), oldest first,
-- row-locked so that a parallel run (or a parallel task of another run) skips them.
-- ended_at >= after_ended_at is the index condition on ix_sessions_status_ended_at; the row
-- comparison breaks ties on id (incremental sort within equal ended_at), so a task walks the
-- eligible set once per run and never re-reads sessions it has already handled.
-- The first batch passes after_ended_at = '-infinity' (no OR, so a generic plan stays good).
-- One row back, not one per session: the batch's ids as one uuid[] literal (the delete takes it
-- back as is, so the client never parses or re-encodes 5000 uuids), their count, the first id
-- (for the failure log) and the last key (ended_at, id) the next claim starts after. A batch
-- of no session returns count 0 and nulls.
-- The later steps of a run pass the last key the step before them reached as until_*: they
-- cover no session past it (the first step passes a key after every session).
-- First column: the batch transaction commits asynchronously (set_config(..., true) lasts
-- for this transaction only, so nothing outlives it in a pooled server connection). A commit
-- lost in a server crash only leaves its rows in place, still eligible: the next run deletes
-- them (no events are published, nothing downstream saw the delete). Saves a WAL flush per
-- batch.
with batch as (
  select id, ended_at
  from user_activity.sessions
  where status = 'Inactive'
    and ended_at < %(cutoff)s
    and ended_at >= %(after_ended_at)s
    and ended_at <= %(until_ended_at)s
    and (ended_at, id) > (%(after_ended_at)s::timestamptz, %(after_id)s::uuid)
    and (ended_at, id) <= (%(until_ended_at)s::timestamptz, %(until_id)s::uuid)
  order by ended_at, id
  limit %(batch_size)s
  for update skip locked
)
select (select set_config('synchronous_commit', 'off', true)),
       count(*),
       array_agg(id order by ended_at, id)::text,
       (array_agg(id order by ended_at, id))[1],
       max(ended_at),
       (array_agg(id order by ended_at desc, id desc))[1]
from batch
