-- Whether this role sees other roles' sessions and the replicas' positions (pacing's signals).
select pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')
