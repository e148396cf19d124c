-- Requeue (dry run and report): the Quarantined rows a requeue would move, chosen by snapshot
-- id or all of them.
select id, snapshot_id
from news.snapshot_detach_outbox
where status = 'Quarantined'
  and (%(all_quarantined)s or snapshot_id = any(%(snapshot_ids)s::uuid[]))
order by snapshot_id
