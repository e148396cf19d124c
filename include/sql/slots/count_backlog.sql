-- The backlog gauge: Available slots whose start has passed and that are still not expired,
-- at most count_cap of them (index range read; see count_due_slots.sql for the ORDER BY).
select count(*)
from (
  select 1
  from calendar.availability_slots
  where status = 'Available'
    and start_at < %(now)s
  order by start_at
  limit %(count_cap)s
) as backlog
