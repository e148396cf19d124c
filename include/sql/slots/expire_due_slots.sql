-- One batch of the slot-expiration cycle (seed 002), in one statement.
-- Takes the oldest due Available slots (start_at <= as_of) under FOR UPDATE SKIP LOCKED, so a
-- slot held by another runner or by an in-flight booking is skipped without waiting, and moves
-- them to Expired (updated_at = as_of, version + 1). The row lock re-checks the predicate on
-- the latest committed version, so a slot booked after our snapshot is not taken.
-- The CTE is MATERIALIZED so that LIMIT and the locks apply once, before the update.
-- Plan: Index Scan on ix_availability_slots_status_start (status = 'Available', start_at <=
-- as_of), stopped by the LIMIT; the update joins back by primary key.
-- excluded_ids: poison slots already isolated in this cycle (left for the next cycle).
with due as materialized (
  select id
  from calendar.availability_slots
  where status = 'Available'
    and start_at <= %(as_of)s
    and id <> all(%(excluded_ids)s::uuid[])
  order by start_at
  limit %(batch_size)s
  for update skip locked
)
update calendar.availability_slots as s
set status = 'Expired',
    updated_at = %(as_of)s,
    version = s.version + 1
from due
where s.id = due.id
returning s.id
