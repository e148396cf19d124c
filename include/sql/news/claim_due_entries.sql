-- Claim, step 2 of 2: pre-increment attempts and set the backoff computed by the job (pure
-- function, per row), then the transaction commits and releases the row locks. updated_at is
-- the claim token the outcome update checks.
update news.snapshot_detach_outbox as o
set attempts = c.attempts,
    next_attempt_at = c.next_attempt_at,
    updated_at = %(now)s
from unnest(%(ids)s::uuid[], %(attempts)s::integer[], %(next_attempt_at)s::timestamptz[])
  as c (id, attempts, next_attempt_at)
where o.id = c.id
  and o.status = 'Pending'
