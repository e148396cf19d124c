"""The Airflow side of the maintenance jobs: hooks, Variables, params, stats, alerts, deadlines.

DAG files import from here and from ``include.pin_maintenance``; nothing in
``include.pin_maintenance`` imports Airflow. Everything here is import-cheap: Airflow modules
that do I/O (hooks, Variables) are touched only inside a running task.
"""
