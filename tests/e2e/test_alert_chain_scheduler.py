"""The alert chain under the real scheduler: Airflow's own dagrun metrics page.

The session's manual-runs stack (``chain_airflow``, tests/e2e/chain_fixtures.py) sends its
StatsD to a fresh chain of this test's own (statsd_exporter -> Prometheus -> Alertmanager -> a
recording webhook, as in tests/e2e/test_alert_chain.py): two failed retention runs and a good
one page ActivityRetentionRunErrorRate, and the dashboard panels those runs feed have data.

Apart from tests/e2e/test_alert_chain.py because it needs an Airflow stack: the stack tiers run
on one pytest-xdist worker, one stack at a time (tests/conftest.py), while that module's
``airflow dags test`` runs go to the other workers.
"""

from __future__ import annotations

import pytest

from tests.e2e.chain_fixtures import SCHEDULER_METRICS, Chain, alert_chain, assert_panels_have_data
from tests.e2e.stack_fixtures import E2EAirflow

__all__ = ["alert_chain"]

pytestmark = [pytest.mark.slow]

RETENTION = "user_activity_retention"


def test_scheduler_dagrun_metrics_page_the_retention_error_rate(
    alert_chain: Chain, chain_airflow: E2EAirflow
) -> None:
    chain, e2e = alert_chain, chain_airflow
    e2e.wait_dag(RETENTION)
    e2e.set_paused(RETENTION, False)
    runs = []
    # two runs with a misspelt key (the API accepts it; the run fails at once, without a
    # retry, naming the key), then a good one
    for conf in ({"batch_sise": 100}, {"batch_sise": 100}, {}):
        run_id = e2e.new_run_id("chain")
        answer = e2e.trigger_api(RETENTION, conf, run_id)
        assert answer.status_code in (200, 201), answer.text
        runs.append(run_id)
    states = [e2e.wait_run(RETENTION, run_id)["state"] for run_id in runs]
    assert states == ["failed", "failed", "success"]

    failed = (
        'airflow_dagrun_duration_seconds_count{dag_id="user_activity_retention",outcome="failed"}'
    )
    ok = 'airflow_dagrun_duration_seconds_count{dag_id="user_activity_retention",outcome="success"}'
    chain.wait_series(f"{failed} == 2", timeout=60)
    chain.wait_series(f"{ok} == 1", timeout=60)
    # task_failed joins a group that may exist already: it pages at the next group_interval
    got = chain.wait_received("ActivityRetentionRunErrorRate", "task_failed", timeout=240)
    assert got["ActivityRetentionRunErrorRate"][0]["labels"]["dag_id"] == RETENTION
    # the dashboard's failed-runs panel, on the scheduler's metrics of these runs
    assert_panels_have_data(chain, SCHEDULER_METRICS)
