-- Whether any job table holds a row (make up seeds demo data only into empty job tables).
select exists (select 1 from news.snapshot_detach_outbox)
    or exists (select 1 from calendar.availability_slots)
    or exists (select 1 from user_activity.sessions)
    or exists (select 1 from user_activity.property_object_views)
    or exists (select 1 from user_activity.action_events);
