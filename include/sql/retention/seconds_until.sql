-- Remaining run budget of a task, on the same (server) clock as the run's deadline.
select extract(epoch from (%(deadline_at)s::timestamptz - now()))::float8
