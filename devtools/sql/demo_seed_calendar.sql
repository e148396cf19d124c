-- Demo data for calendar_slot_expiration (set-based); devtools/demo.py runs it, and seeds
-- user_activity with devtools/retention_data.py. No parameters: volumes are literal demo sizes.

-- calendar: 1250 past Available slots (three batches of 500), 300 future Available,
-- 100 past Booked, 50 Expired, 20 Archived.
insert into calendar.availability_slots
  (id, tenant_id, consultant_id, start_at, end_at, status, version, created_at, updated_at)
select gen_random_uuid(), t.tenant, gen_random_uuid(), s.start_at, s.start_at + interval '1 hour',
       s.status, 1, now() - interval '30 days', now() - interval '30 days'
from (
  select now() - (g * interval '7 minutes') as start_at, 'Available' as status
    from generate_series(1, 1250) g
  union all select now() + (g * interval '1 hour'), 'Available' from generate_series(1, 300) g
  union all select now() - (g * interval '1 hour'), 'Booked' from generate_series(1, 100) g
  union all select now() - (g * interval '1 day'), 'Expired' from generate_series(1, 50) g
  union all select now() - (g * interval '2 days'), 'Archived' from generate_series(1, 20) g
) s
cross join lateral (select gen_random_uuid() as tenant) t;
