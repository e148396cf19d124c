-- The WAL-rate signal (include/pin_maintenance/pacing.py): where this server inserts WAL now, as
-- a byte position; its growth between two reads is everyone's WAL in between.
select pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0') as wal_bytes
