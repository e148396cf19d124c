-- dry_run: action_events a batch would delete.
select count(*) from user_activity.action_events where session_id = any(%(session_ids)s::uuid[])
