-- Who holds a bigint advisory lock, and since when (the holder's transaction start: our locks
-- are transaction-level, so that is when it was taken; for a session-level lock held outside a
-- transaction, the session start is the best bound there is). A bigint key shows in pg_locks as
-- classid = high 32 bits, objid = low 32 bits, objsubid = 1. Advisory locks are per database:
-- a holder of the same key in another database of the server is not ours.
select l.pid,
       coalesce(a.application_name, '') as application_name,
       extract(epoch from (clock_timestamp() - coalesce(a.xact_start, a.backend_start)))::float8
         as held_seconds
from pg_locks l
join pg_stat_activity a on a.pid = l.pid
where l.locktype = 'advisory'
  and l.database = (select oid from pg_database where datname = current_database())
  and l.granted
  and l.objsubid = 1
  and l.classid = %(classid)s::oid
  and l.objid = %(objid)s::oid
limit 1
