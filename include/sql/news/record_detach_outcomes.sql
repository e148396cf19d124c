-- Outcomes of one batch in one short transaction. Each row applies only to the claim it belongs
-- to (status still Pending, attempts and updated_at as the claim left them), so an outcome
-- never overwrites a later claim, a requeue or another runner's outcome.
-- keep_last_error: the attempt is given back (call not made), last_error stays as it was.
update news.snapshot_detach_outbox as t
set status = o.status,
    attempts = o.attempts,
    next_attempt_at = o.next_attempt_at,
    last_error = case when o.keep_last_error then t.last_error else o.last_error end,
    updated_at = %(now)s
from unnest(
    %(ids)s::uuid[],
    %(claimed_attempts)s::integer[],
    %(claimed_at)s::timestamptz[],
    %(statuses)s::varchar[],
    %(attempts)s::integer[],
    %(next_attempt_at)s::timestamptz[],
    %(last_errors)s::varchar[],
    %(keep_last_error)s::boolean[]
  ) as o (id, claimed_attempts, claimed_at, status, attempts, next_attempt_at, last_error,
          keep_last_error)
where t.id = o.id
  and t.status = 'Pending'
  and t.attempts = o.claimed_attempts
  and t.updated_at = o.claimed_at
returning t.id
