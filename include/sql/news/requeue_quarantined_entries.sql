-- Requeue (runbook): chosen Quarantined rows back to Pending, attempts = 0, due now. last_error
-- keeps the cause with a "requeued:" prefix (bounded to the column's 512 characters). Only
-- Quarantined rows move; the unique index ux_sdo_snapshot already counts them as active, so
-- the move cannot conflict.
update news.snapshot_detach_outbox
set status = 'Pending',
    attempts = 0,
    next_attempt_at = %(now)s,
    last_error = left('requeued: ' || coalesce(last_error, 'no error recorded'), 512),
    updated_at = %(now)s
where status = 'Quarantined'
  and (%(all_quarantined)s or snapshot_id = any(%(snapshot_ids)s::uuid[]))
returning id, snapshot_id
