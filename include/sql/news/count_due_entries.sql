-- Dry run: how many Pending rows are due now (nothing is locked or written).
select count(*) as due
from news.snapshot_detach_outbox
where status = 'Pending'
  and next_attempt_at <= %(now)s
