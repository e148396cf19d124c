"""PIN platform Postgres maintenance jobs, free of Airflow (docs/design.md, "Architecture")."""
