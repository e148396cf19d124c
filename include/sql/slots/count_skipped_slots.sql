-- SkippedLockedCount of a cycle: due Available slots (start_at <= as_of, not excluded as
-- poison) that SKIP LOCKED passed over, at most count_cap of them. Run after the cycle's loops
-- stopped, outside their transactions.
-- bounded = false (every loop ended on a short batch): every due slot still Available was
--   locked by someone else (a booking in flight, another instance) when a loop passed.
-- bounded = true (the cycle stopped on max_batches_per_cycle, max_run_duration_seconds or a
--   stop): only the slots before `before`, the furthest start_at a loop's keyset reached, were
--   passed over; the due slots after it are backlog no loop reached, not skipped. Strictly
--   before: slots of that very start_at may be next in line rather than skipped.
-- ORDER BY start_at + LIMIT keep the plan on ix_availability_slots_status_start (see
-- count_due_slots.sql).
select count(*)
from (
  select 1
  from calendar.availability_slots
  where status = 'Available'
    and start_at <= %(as_of)s
    and (not %(bounded)s::boolean or start_at < %(before)s::timestamptz)
    and id <> all(%(excluded_ids)s::uuid[])
  order by start_at
  limit %(count_cap)s
) as skipped
