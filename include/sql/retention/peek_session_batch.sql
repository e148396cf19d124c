-- dry_run: the same walk as claim_session_batch, without row locks (reads only).
select id, ended_at
from user_activity.sessions
where status = 'Inactive'
  and ended_at < %(cutoff)s
  and ended_at >= %(after_ended_at)s
  and (ended_at, id) > (%(after_ended_at)s::timestamptz, %(after_id)s::uuid)
order by ended_at, id
limit %(batch_size)s
