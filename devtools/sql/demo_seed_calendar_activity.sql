-- Demo data for calendar_slot_expiration and user_activity_retention (set-based, seconds).
-- Parameters are bound by devtools/demo.py: none needed; volumes are literal demo sizes.

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

-- user_activity: 3000 Inactive sessions ended 400..500 days ago (eligible at 365 days),
-- 500 Inactive ended 30 days ago (young), 200 Active sessions started long ago (never eligible).
create temporary table demo_sessions on commit drop as
select gen_random_uuid() as id, kind,
       case kind when 'old' then now() - interval '400 days' - (g % 100) * interval '1 day'
                 when 'young' then now() - interval '30 days'
                 else null end as ended_at
from (select g, 'old' as kind from generate_series(1, 3000) g
      union all select g, 'young' from generate_series(1, 500) g
      union all select g, 'active' from generate_series(1, 200) g) x;

insert into user_activity.sessions
  (id, user_id, anonymous_id, status, started_at, last_activity_at, ended_at, created_at)
select id, gen_random_uuid(), null,
       case kind when 'active' then 'Active' else 'Inactive' end,
       coalesce(ended_at, now() - interval '600 days') - interval '1 hour',
       coalesce(ended_at, now()),
       ended_at,
       coalesce(ended_at, now() - interval '600 days') - interval '1 hour'
from demo_sessions;

-- 6 property-object views and 7 action events per session; the first event of a session
-- points at its first view, and each view's apply_filter_event_id points at an event of the
-- same session (the circular SET NULL references of the schema).
insert into user_activity.property_object_views
  (id, session_id, property_object_id, apply_filter_event_id, started_at, ended_at, duration_ms)
select gen_random_uuid(), s.id, ('00000000-0000-0000-0000-' || lpad((v % 50)::text, 12, '0'))::uuid,
       null, now() - interval '1 day', now() - interval '1 day', 1000 * v
from demo_sessions s cross join generate_series(1, 6) v;

insert into user_activity.action_events (id, session_id, property_object_view_id, type, occurred_at, payload)
select gen_random_uuid(), s.id,
       case when e = 1 then (select id from user_activity.property_object_views p
                             where p.session_id = s.id limit 1) end,
       case when e = 1 then 'ViewPropertyObject' else 'ApplyFilter' end,
       now() - interval '1 day', jsonb_build_object('n', e)
from demo_sessions s cross join generate_series(1, 7) e;

update user_activity.property_object_views v
   set apply_filter_event_id = (select a.id from user_activity.action_events a
                                 where a.session_id = v.session_id and a.type = 'ApplyFilter'
                                 limit 1);

insert into user_activity.property_object_view_stats
  (property_object_id, views_count, total_duration_ms, updated_at)
select ('00000000-0000-0000-0000-' || lpad(g::text, 12, '0'))::uuid, 1000 + g, 60000 * g, now()
from generate_series(0, 49) g;
