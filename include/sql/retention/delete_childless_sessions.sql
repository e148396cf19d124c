-- Last in FK order: only sessions of the batch that have no child rows left, so this never
-- hits RESTRICT and never removes a session whose children an earlier, bounded or failed task
-- left behind (the next run deletes them). The eligibility predicate is re-checked here too.
delete from user_activity.sessions s
where s.id = any(%(session_ids)s::uuid[])
  and s.status = 'Inactive'
  and s.ended_at < %(cutoff)s
  and not exists (select 1 from user_activity.action_events e where e.session_id = s.id)
  and not exists (select 1 from user_activity.property_object_views v where v.session_id = s.id)
