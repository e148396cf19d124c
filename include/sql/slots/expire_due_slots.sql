-- One batch of the slot-expiration cycle (seed 002), in one statement.
-- Takes the oldest due Available slots (start_at <= as_of) under FOR UPDATE SKIP LOCKED, so a
-- slot held by another runner or by an in-flight booking is skipped without waiting, and moves
-- them to Expired (updated_at = as_of, version + 1). The row lock re-checks the predicate on
-- the latest committed version, so a slot booked after our snapshot is not taken.
-- The CTE is MATERIALIZED so that LIMIT and the locks apply once, before the update.
--
-- after: the runner's keyset, the largest start_at it locked in its previous batch (null at
--   the start). Every due slot before it was taken, skipped as locked or excluded already, so
--   the index range starts there instead of walking the index entries of the rows this cycle
--   already expired. Ties are kept (>=): the rows of that start_at not taken yet still match.
-- excluded_ids: poison slots already isolated in this cycle (left for the next cycle).
--
-- Plan: Index Scan on ix_availability_slots_status_start (status = 'Available', after <=
-- start_at <= as_of), stopped by the LIMIT; the update fetches the locked rows by ctid (a Tid
-- Scan, no primary-key descent per row; the rows are locked, so their ctid cannot change).
--
-- Result, one row: locked (rows this batch locked: a full batch means more may be due),
-- expired, last_start_at (the next keyset) and missed: locked rows the update did not reach.
-- That happens when a concurrent transaction updated a slot without booking it and committed
-- after this statement's snapshot but before the lock: the lock follows the update to the new
-- row version, which the ctid fetch under the statement's snapshot cannot see. The caller
-- expires them by id in the same transaction (expire_slots_by_id.sql, a fresh snapshot).
-- tenant_ids / tenant_count: the tenants the batch expired, for its trace span (seed 002:
-- tenantId per item), at most max_tenants named; only read when with_tenants (tracing is on), else
-- the one-time filter skips them (null, 0).
with due as materialized (
  select ctid, id, start_at
  from calendar.availability_slots
  where status = 'Available'
    and start_at <= %(as_of)s
    and start_at >= coalesce(%(after)s::timestamptz, '-infinity')
    and id <> all(%(excluded_ids)s::uuid[])
  order by start_at
  limit %(batch_size)s
  for update skip locked
),
expired as (
  update calendar.availability_slots as s
  set status = 'Expired',
      updated_at = %(as_of)s,
      version = s.version + 1
  where s.ctid = any(array(select ctid from due))
  returning s.id, s.tenant_id
),
tenants as (
  select distinct tenant_id from expired where %(with_tenants)s::boolean
)
select
  (select count(*) from due) as locked,
  (select count(*) from expired) as expired,
  (select max(start_at) from due) as last_start_at,
  array(select id from due except select id from expired) as missed,
  case when %(with_tenants)s::boolean
    then array(select tenant_id from tenants order by tenant_id limit %(max_tenants)s) end
    as tenant_ids,
  (select count(*) from tenants) as tenant_count
