-- Requeue report: the current status of each requested snapshot id (to explain skipped ids).
select snapshot_id, status
from news.snapshot_detach_outbox
where snapshot_id = any(%(snapshot_ids)s::uuid[])
