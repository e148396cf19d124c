-- dry_run: sessions a batch would delete, assuming the child tasks before it did their part
-- (in a dry run they deleted nothing, so "no children left" cannot be checked literally).
select count(*)
from user_activity.sessions s
where s.id = any(%(session_ids)s::uuid[])
  and s.status = 'Inactive'
  and s.ended_at < %(cutoff)s
