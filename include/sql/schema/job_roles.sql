-- The job roles: what each job connection's Postgres role needs on its service's database, and
-- nothing more (docs/deploying.md, "Database roles"). Run it as the tables' owner or a superuser,
-- on each job database. Applying it again changes nothing.
--
-- Parameters: the role of each job connection, as a setting of the session that runs this file.
-- An unset or empty one skips that connection (e.g. on a database without its tables):
--   pin.news_db_role           connection news_db: news_snapshot_detach_retry, news_snapshot_detach_requeue
--   pin.calendar_db_role       connection calendar_db: calendar_slot_expiration
--   pin.user_activity_db_role  connection user_activity_db: user_activity_retention
--
--   psql "$OWNER_URL" -v ON_ERROR_STOP=1 -c "set pin.news_db_role = 'pin_news'" \
--     -f include/sql/schema/job_roles.sql
--
-- A role that does not exist is created with LOGIN and no password (set one: \password pin_news).
-- Each job table's privileges for the role are revoked and granted again in this one transaction:
-- the role ends with exactly these, whatever it had before, and a running job sees no gap.
-- Every job checks these privileges at the start of a run (include/pin_maintenance/privileges.py)
-- and fails before any write, naming the role, the table and the privilege, when one is missing.
--
-- Not granted here, because PUBLIC has them by default (the jobs check them too; a cluster that
-- revoked them from PUBLIC grants them to the role): EXECUTE on pg_try_advisory_xact_lock(bigint)
-- (the single-runner lock of detach and retention), SELECT on pg_locks and pg_stat_activity (who
-- holds that lock, and since when: for a holder of another role only with pg_read_all_stats).

do $grants$
declare
  news text := coalesce(current_setting('pin.news_db_role', true), '');
  calendar text := coalesce(current_setting('pin.calendar_db_role', true), '');
  activity text := coalesce(current_setting('pin.user_activity_db_role', true), '');
  job_role text;
  owned text;
begin
  foreach job_role in array array_remove(array[news, calendar, activity], '') loop
    if not exists (select from pg_roles where rolname = job_role) then
      execute format('create role %I login', job_role);
    end if;
    if exists (select from pg_roles where rolname = job_role and rolsuper) then
      raise exception 'role % is a superuser: a job role must not be (it would bypass every grant)',
        job_role;
    end if;
    select string_agg(c.oid::regclass::text, ', ') into owned
    from pg_class c
    where c.relowner = (select oid from pg_roles where rolname = job_role)
      and c.oid in (to_regclass('news.snapshot_detach_outbox'),
                    to_regclass('calendar.availability_slots'),
                    to_regclass('user_activity.sessions'),
                    to_regclass('user_activity.property_object_views'),
                    to_regclass('user_activity.action_events'));
    if owned is not null then
      raise exception 'role % owns %: a job role must not own the tables it works on', job_role, owned;
    end if;
    -- log in to this database (PUBLIC has it too unless it was revoked)
    execute format('grant connect on database %I to %I', current_database(), job_role);
  end loop;

  if news <> '' then
    execute format('revoke all on schema news from %I', news);
    execute format('revoke all on news.snapshot_detach_outbox from %I', news);
    -- name the outbox in every statement
    execute format('grant usage on schema news to %I', news);
    -- read rows: the claim, the dry-run count, the backlog gauges, the requeue's report
    execute format('grant select on news.snapshot_detach_outbox to %I', news);
    -- the claim (attempts, next_attempt_at, updated_at) and the row locks of its
    -- FOR UPDATE SKIP LOCKED; the recorded outcome (status, last_error too); the requeue
    execute format(
      'grant update (status, attempts, next_attempt_at, last_error, updated_at) '
      'on news.snapshot_detach_outbox to %I', news);
  end if;

  if calendar <> '' then
    execute format('revoke all on schema calendar from %I', calendar);
    execute format('revoke all on calendar.availability_slots from %I', calendar);
    -- name the slots in every statement
    execute format('grant usage on schema calendar to %I', calendar);
    -- read rows: the due batch, the skipped and backlog counts, the dry run
    execute format('grant select on calendar.availability_slots to %I', calendar);
    -- Available -> Expired (status, updated_at, version + 1), and the row locks of the batch's
    -- FOR UPDATE SKIP LOCKED
    execute format(
      'grant update (status, updated_at, version) on calendar.availability_slots to %I', calendar);
  end if;

  if activity <> '' then
    execute format('revoke all on schema user_activity from %I', activity);
    execute format(
      'revoke all on user_activity.sessions, user_activity.property_object_views, '
      'user_activity.action_events, user_activity.property_object_view_stats from %I', activity);
    -- name the tables in every statement
    execute format('grant usage on schema user_activity to %I', activity);
    -- read rows: the batch claim (status, ended_at, id), the delete filters (session_id), the
    -- childless check of delete_sessions, the backlog and dry-run counts
    execute format(
      'grant select on user_activity.sessions, user_activity.property_object_views, '
      'user_activity.action_events to %I', activity);
    -- the three delete steps (the foreign keys' SET NULL and RESTRICT checks run as the tables'
    -- owner: they need nothing more of this role)
    execute format(
      'grant delete on user_activity.sessions, user_activity.property_object_views, '
      'user_activity.action_events to %I', activity);
    -- the row locks of the batch claim (FOR UPDATE SKIP LOCKED on sessions): Postgres allows a
    -- row lock only with UPDATE on at least one column of the table. The job updates nothing;
    -- one column is the least that allows the lock, and created_at is the one whose change
    -- decides nothing (the job selects on status and ended_at, the service works by id, status
    -- and activity times), so the grant cannot move a session into or out of retention.
    execute format('grant update (created_at) on user_activity.sessions to %I', activity);
    -- property_object_view_stats: nothing (the job never reads or writes it; revoked above)
  end if;
end
$grants$;
