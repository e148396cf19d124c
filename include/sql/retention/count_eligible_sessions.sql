-- activity_retention_eligible_backlog: Inactive sessions past the cutoff at the start of a run.
-- Uses ix_sessions_status_ended_at (index-only scan once the visibility map is set).
select count(*)
from user_activity.sessions
where status = 'Inactive'
  and ended_at < %(cutoff)s
