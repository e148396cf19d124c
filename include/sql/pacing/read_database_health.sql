-- The pacing probe (include/pin_maintenance/pacing.py): this server's WAL position, the slowest
-- streaming replica's replay position and lag, and how many other client sessions run a
-- statement now or finished one in the last 50 ms (a service between two short transactions is
-- still there), not counting this job's own loops: their server processes (own_pids) and, in
-- a transaction, their application_name (set in each of their transactions). Replicas'
-- positions and other roles' sessions read as null / 0 to a role without pg_read_all_stats.
select pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0') as wal_bytes,
       (select min(pg_wal_lsn_diff(replay_lsn, '0/0'))
          from pg_stat_replication
         where state in ('streaming', 'catchup')) as replay_bytes,
       (select extract(epoch from max(replay_lag))
          from pg_stat_replication
         where state in ('streaming', 'catchup')) as replay_lag_seconds,
       (select count(*)
          from pg_stat_activity
         where backend_type = 'client backend'
           and (state = 'active'
                or state_change > clock_timestamp() - interval '50 milliseconds')
           and pid <> pg_backend_pid()
           and pid <> all(%(own_pids)s::int[])
           and application_name is distinct from current_setting('application_name')
       ) as others_active
