-- Due Available slots (start_at <= as_of) other than the excluded (poison) ones, at most
-- count_cap of them.
-- Run inside the transaction of a short batch, it counts the slots that SKIP LOCKED passed
-- over (locked by another runner or an in-flight booking): every other due slot was taken.
-- Without a lock it is the dry-run count ("would expire").
-- ORDER BY start_at + LIMIT keep the plan on ix_availability_slots_status_start (a range read
-- that stops at the cap) even when the statistics still count a drained backlog as due, where
-- a plain count(*) flips to a sequential scan of the whole table.
select count(*)
from (
  select 1
  from calendar.availability_slots
  where status = 'Available'
    and start_at <= %(as_of)s
    and id <> all(%(excluded_ids)s::uuid[])
  order by start_at
  limit %(count_cap)s
) as due
