-- The run's window on the database server's clock (the seed: "the server computes the
-- threshold, no client timestamps"). Computed once per run and handed to every task.
select now() - make_interval(days => %(retention_period_days)s) as cutoff,
       now() + make_interval(secs => %(max_run_duration_seconds)s) as deadline_at
