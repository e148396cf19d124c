-- End-of-run gauges: Pending backlog and the age of its oldest row (0 when empty).
select count(*) as pending,
       coalesce(extract(epoch from (%(now)s - min(created_at))), 0)::float8 as oldest_age_seconds
from news.snapshot_detach_outbox
where status = 'Pending'
