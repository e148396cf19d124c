"""PIN platform Postgres maintenance jobs.

The job logic lives here and imports nothing from Airflow: each job takes a connection factory,
a validated config, a clock and a telemetry object, so it runs the same under a scheduler, in a
test or from a shell. The Airflow side (hooks, Variables, params, stats, deadlines) is in
``include.pin_airflow``.
"""
