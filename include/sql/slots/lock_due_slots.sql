-- The batch selection of expire_due_slots without the update: lock the oldest due Available
-- slots (SKIP LOCKED, same keyset and exclusions) so that a failed batch can be retried row
-- group by row group (poison row isolation) while the same rows stay locked by this transaction.
select id, start_at
from calendar.availability_slots
where status = 'Available'
  and start_at <= %(as_of)s
  and start_at >= coalesce(%(after)s::timestamptz, '-infinity')
  and id <> all(%(excluded_ids)s::uuid[])
order by start_at
limit %(batch_size)s
for update skip locked
