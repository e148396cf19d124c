"""Fixture: emits the metrics named in the run conf through the project's StatsMetrics.

conf: {"emit": [[name, "counter"|"gauge"|"timing", value], ...]} (timing value in seconds).
Used by tests/dags/test_metrics_statsd.py to see what reaches a StatsD listener.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import dag, get_current_context, task

from include.pin_airflow.dag_support import START_DATE


@dag(
    dag_id="pin_fixture_metrics",
    schedule=None,
    start_date=START_DATE,
    catchup=False,
    tags=["pin", "fixture"],
)
def pin_fixture_metrics():
    @task
    def emit() -> int:
        """Emit each metric of the conf once."""
        from include.pin_airflow.runtime import StatsMetrics

        metrics = StatsMetrics()
        conf = get_current_context()["dag_run"].conf or {}
        for name, kind, value in conf.get("emit", []):
            if kind == "counter":
                metrics.incr(name, int(value))
            elif kind == "gauge":
                metrics.gauge(name, float(value))
            else:
                metrics.timing(name, timedelta(seconds=float(value)))
        return len(conf.get("emit", []))

    emit()


pin_fixture_metrics()
