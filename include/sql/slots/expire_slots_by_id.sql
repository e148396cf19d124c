-- Expire the given (already locked) slots; used under a savepoint to isolate a poison row.
-- The status guard keeps the transition idempotent: only Available slots expire.
update calendar.availability_slots
set status = 'Expired',
    updated_at = %(as_of)s,
    version = version + 1
where id = any(%(ids)s::uuid[])
  and status = 'Available'
