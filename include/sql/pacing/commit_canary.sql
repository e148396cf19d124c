-- The pacing canary: an empty transaction that takes a transaction id, so that its commit
-- waits for the WAL flush (synchronous_commit on, whatever the job's own setting) like the
-- services' commits do. Its time is what the database makes everyone wait for a commit now.
select set_config('synchronous_commit', 'on', true), pg_current_xact_id()
