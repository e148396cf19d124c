-- Claim, step 1 of 2 (same short transaction as claim_due_entries): lock a page of due Pending
-- rows, oldest due first (ix_sdo_due), skipping rows another runner holds. Unknown statuses are
-- never selected. in_flight: rows of the previous batch whose calls are still running (a tiny
-- backoff could make them due again before their outcome is recorded).
select id, snapshot_id, post_id, reason, attempts, next_attempt_at, created_at
from news.snapshot_detach_outbox
where status = 'Pending'
  and next_attempt_at <= %(now)s
  and not (id = any(%(in_flight)s::uuid[]))
order by next_attempt_at
limit %(batch_size)s
for update skip locked
