"""Alerts that page when they should, and only then: real DAG runs -> statsd_exporter (the
shipped mapping) -> Prometheus (the shipped rules, 1 s scrape and evaluation) -> Alertmanager ->
a webhook receiver on loopback. Task alerts reach the same Alertmanager through the notifier's
``alertmanager`` connection.

Each test has a fresh chain of its own (new daemons, empty storage, a new receiver: a first
deployment) and a fresh job database, so they run in any order:

1. each provokable condition once: quarantine, auth failure, poison slot, retention batch
   failure, lock held too long, one busy night (no page) and a second one (page), an old
   Pending row (the lag rule), ten 503s (the failure spike rule); the ``for:`` of those two
   (15 min, 10 min) and of the poison-slot errors rule (30 min) are too long here, so their
   expressions are evaluated through the query API; nothing else pages; every Grafana panel
   that the jobs' own metrics feed has data. Alertmanager runs the shipped
   ops/alertmanager/alertmanager.yml: the quarantine and lock rules, whose events also raised
   a task alert with the details, are inhibited (one page per event), and the failed batch's
   trigger text (a secret, a row id) reaches no alert; then one quarantine is one
   notification, and a second quarantine later pages again;
2. one healthy run of each job, then an exporter restart, a Prometheus restart and a healthy
   run: no rule becomes pending, nothing new reaches the receiver; the liveness rules'
   expressions, evaluated at later times through the query API, show that a job that really
   stops still pages in the seed's window (thresholds 15 min / 30 min / 26 h);
   the retention run of these feeds the run-duration panels that test 1's runs do not.

Under the real scheduler (Airflow's own dagrun metrics): tests/e2e/test_alert_chain_scheduler.py.
These tests start no Airflow stack (``airflow dags test`` only), so under pytest-xdist they run
beside the stack tiers, on another worker (tests/conftest.py, ``STACK_FREE``).

Alertmanager runs the shipped route, grouping and inhibit rules with its timings scaled down
(``group_wait`` 30 s -> 5 s, ``group_interval`` 2 min -> 15 s: chain_fixtures.TEST_TIMINGS), so
that "a later event pages at the next group_interval" takes seconds, not minutes.

Skipped with a message when statsd_exporter (PATH or ``STATSD_EXPORTER``), Prometheus or
Alertmanager is missing (tests/e2e/chain_fixtures.py).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import psycopg
import pytest

from devtools import airflow_env as ae
from devtools.local_airflow import wait_for
from devtools.pg import Database
from devtools.retention_data import seed_sessions
from devtools.selections_service import SelectionsService
from include.pin_maintenance.db import advisory_lock
from include.pin_maintenance.jobs import activity_retention, snapshot_detach
from tests.e2e.chain_fixtures import JOB_METRICS, Chain, alert_chain, assert_panels_have_data
from tests.environment import migrated_airflow_home
from tests.integration.slot_expiration_fixtures import insert_slot
from tests.integration.snapshot_detach_fixtures import insert_entries, insert_entry
from tests.job_db import job_url

__all__ = ["alert_chain"]

# e2e by directory; each test runs several `airflow dags test` subprocesses (about 15 s each on a
# quiet machine, a minute each on a loaded one): more than the suite's default 600 s limit there
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
DETACH = "news_snapshot_detach_retry"
SLOTS = "calendar_slot_expiration"
RETENTION = "user_activity_retention"
LIVENESS_GAUGES = [
    "news_snapshot_detach_last_success_timestamp_seconds",
    "calendar_slot_expiration_last_success_timestamp_seconds",
    "activity_retention_last_success_timestamp_seconds",
]
LIVENESS = {
    # rule: its threshold in seconds (same order as LIVENESS_GAUGES)
    "NewsSnapshotDetachNoSuccessfulRun": 900,
    "CalendarSlotExpirationNoSuccessfulCycle": 1800,
    "ActivityRetentionNotRun": 26 * 3600,
}
# what the provoking test expects at the receiver (task alerts are lower case)
PROVOKED = {
    "snapshot_detach_quarantined",
    "selections_auth_failed",
    "slot_expiration_poison_row",
    "retention_batch_failed",
    "lock_held_too_long",
    "ActivityRetentionLockHeldTooLong",
}
# rules that fire too, but are inhibited by the task alert of the same event (pin_event) under
# the shipped ops/alertmanager/alertmanager.yml: one page per event, the one with the details
INHIBITED = {
    "NewsSnapshotDetachQuarantined": "snapshot_detach_quarantined",
    "NewsSnapshotDetachLockHeldTooLong": "lock_held_too_long",
}
# the retention trigger's RAISE text: a recognisable secret and a row value (action event ids)
RAISE_SECRET = "chain-raise-secret-51d0"


@pytest.fixture(scope="module")
def dags_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # with the tests' policy: the failed retention batch is retried after 2 s, not 30
    return migrated_airflow_home(tmp_path_factory.mktemp("chain-airflow-home"))


@pytest.fixture(scope="module")
def selections() -> Iterator[SelectionsService]:
    with SelectionsService() as service:
        yield service


@pytest.fixture
def job_db(db: Database) -> Database:
    """A fresh job database per test (tests/conftest.py's ``db``)."""
    return db


def am_alerts(chain: Chain, alertname: str | None = None) -> list[dict]:
    """Every alert Alertmanager holds (active, silenced or inhibited), optionally one name."""
    params: dict = {"inhibited": "true", "silenced": "true", "active": "true"}
    if alertname:
        params["filter"] = f'alertname="{alertname}"'
    answer = httpx.get(f"{chain.alertmanager_url}/api/v2/alerts", params=params, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def notifications_of(chain: Chain, event: str) -> list[dict]:
    """The receiver's notifications (one POST each) that carry a firing alert of ``event``
    (its task alert or its rule: label pin_event)."""
    return [
        n
        for n in chain.receiver.alerts()
        if any(
            a.get("status") == "firing" and a["labels"].get("pin_event") == event
            for a in n.get("alerts", [])
        )
    ]


def dags_test(
    chain: Chain,
    home: Path,
    db: Database,
    dag_id: str,
    *,
    conf: dict | None = None,
    selections: SelectionsService | None = None,
    password: str = "local-dev-secret",
) -> subprocess.CompletedProcess[str]:
    """``airflow dags test`` the standard way, StatsD to the chain's exporter; the job
    connections log in as the job roles."""
    env = ae.airflow_env(
        home,
        job_db_url=db.job_urls(),
        selections_url=selections.url if selections else None,
        selections_password=password,
        extra=chain.airflow_env(),
    )
    args = ["dags", "test", dag_id]
    if conf is not None:
        args += ["--conf", json.dumps(conf)]
    return ae.airflow(args, env, timeout=300)


# ------------------------------------------------------------------------------------------ 1


# eight real `airflow dags test` runs, about a minute each on 2 loaded cores, and the shipped
# group_wait: more than the suite's default 600 s per test (hit here once, on a loaded machine)
@pytest.mark.timeout(1200)
def test_each_condition_pages_the_first_time_after_a_fresh_exporter(
    alert_chain: Chain, dags_home, job_db, selections
) -> None:
    """A fresh exporter and Prometheus (a first deployment): every provoked condition pages."""
    chain = alert_chain
    since = time.time()

    # quarantine (404 from selections) + an old Pending row not yet due (the lag/backlog rule)
    # + 10 calls answered 503 among 2 good ones (the failure spike rule)
    insert_entries(job_db, 2)
    gone = insert_entry(job_db)
    selections.script(gone.snapshot_id, "not_found")
    for flaky in insert_entries(job_db, 10):  # one 503 each, then detached: later runs are
        selections.script(flaky.snapshot_id, "error_503", "ok")  # healthy (no outage breaker)
    insert_entry(job_db, due_in=timedelta(hours=1), created_ago=timedelta(hours=1))
    # the outage breaker would stop calling after 5 failures in a row: this run is about the
    # failure-spike rule, so every row is called (the breaker's own rule: promtool cases)
    calls_all = {"breaker_failure_threshold": 1000}
    done = dags_test(chain, dags_home, job_db, DETACH, selections=selections, conf=calls_all)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    # selections rejects our credentials
    insert_entry(job_db)
    dags_test(chain, dags_home, job_db, DETACH, selections=selections, password="wrong")
    # a poison slot (version + 1 overflows) among due ones
    with job_db.connect() as conn:
        insert_slot(conn, start_at=datetime.now(UTC) - timedelta(hours=2))
        insert_slot(conn, start_at=datetime.now(UTC) - timedelta(hours=3), version=2**31 - 1)
    done = dags_test(chain, dags_home, job_db, SLOTS)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]

    # a detach lock held past its lease by another worker of the job (its role: another role's
    # holder shows no age without pg_read_all_stats): each run skips and raises
    # lock_held_too_long (the threshold is the lease, lock_ttl_seconds, which validation keeps
    # above the worst-case run); three busy runs also fire its rule, which the task alert of
    # the same event holds back (one page per event)
    stuck = {"max_run_duration_seconds": 1, "detach_call_timeout_seconds": 1, "lock_ttl_seconds": 8}
    detach_worker = job_url(job_db, snapshot_detach.JOB)
    with advisory_lock(
        lambda: psycopg.connect(detach_worker), snapshot_detach.LOCK_NAME, 600
    ) as held:
        assert held
        time.sleep(9)  # older than the lease the runs below are given
        for _ in range(3):
            done = dags_test(chain, dags_home, job_db, DETACH, selections=selections, conf=stuck)
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        chain.wait_series("news_snapshot_detach_lock_contention_total >= 3")

    # retention busy on one night (no page), then on the next (its rule pages): the holder is
    # inside the lease a live run holds the lock for, so no lock_held_too_long is raised and
    # the rule is the page
    with job_db.connect() as conn:
        seed_sessions(conn, 3, 0, 1, tag="busy")
        conn.commit()
    lock = activity_retention.LOCK_NAME
    retention_worker = job_url(job_db, activity_retention.JOB)
    with advisory_lock(lambda: psycopg.connect(retention_worker), lock, 600) as held:
        assert held
        busy = {"max_run_duration_seconds": 1}
        assert dags_test(chain, dags_home, job_db, RETENTION, conf=busy).returncode == 0
        chain.wait_series("activity_retention_lock_contention_total > 0")
        chain.scraped_since(time.time(), scrapes=3)
        assert chain.query(chain.rule_expr("ActivityRetentionLockHeldTooLong")) == []
        assert "ActivityRetentionLockHeldTooLong" not in chain.alert_states(since)
        assert dags_test(chain, dags_home, job_db, RETENTION, conf=busy).returncode == 0

    # a retention batch that fails (a trigger refuses the delete, its text naming a secret and
    # the row's id): neither reaches an alert (payloads carry class + SQLSTATE)
    with psycopg.connect(job_db.url, autocommit=True) as conn:
        conn.execute(
            f"""
            create function public.refuse_delete() returns trigger language plpgsql as $$
            begin raise exception 'injected failure for event % password={RAISE_SECRET}',
              old.id; end $$;
            create trigger refuse_delete before delete on user_activity.action_events
              for each row execute function public.refuse_delete();
            """
        )
        event_ids = [str(r[0]) for r in conn.execute("select id from user_activity.action_events")]
    assert event_ids
    try:
        failed = dags_test(chain, dags_home, job_db, RETENTION)
    finally:
        with psycopg.connect(job_db.url, autocommit=True) as conn:
            conn.execute("drop trigger refuse_delete on user_activity.action_events")
    output = failed.stdout + failed.stderr
    assert RAISE_SECRET in output  # the task log has the server's text ...
    alert_lines = [line for line in output.splitlines() if "PIN_ALERT {" in line]
    assert any("retention_batch_failed" in line for line in alert_lines), output[-3000:]

    got = chain.wait_received(*PROVOKED, timeout=180)  # minutes on a loaded machine
    # ... no alert has it: not the task's alert lines, the receiver, or Alertmanager
    leaks = [RAISE_SECRET, *event_ids]
    assert not [x for x in leaks if x in "\n".join(alert_lines)], alert_lines
    assert not [x for x in leaks if x in json.dumps(chain.receiver.alerts())]
    assert not [x for x in leaks if x in json.dumps(am_alerts(chain))]
    for batch in got["retention_batch_failed"]:
        assert json.loads(batch["annotations"]["details"])["error"] == "RaiseException P0001"
    [task_alert] = got["snapshot_detach_quarantined"]
    assert task_alert["labels"] == {
        "alertname": "snapshot_detach_quarantined",
        "severity": "warning",  # a 404: quarantined at once (critical after all attempts)
        "dag_id": DETACH,
        "pin_event": "snapshot_detach_quarantined",
        "pin_detail": "true",
        "pin_alert_id": task_alert["labels"]["pin_alert_id"],
    }
    assert gone.snapshot_id in task_alert["annotations"]["details"]
    # the rules of the same events fire, and Alertmanager holds them back (inhibited)
    for rule, event in INHIBITED.items():
        [held] = wait_for(
            lambda rule=rule: [a for a in am_alerts(chain, rule) if a["status"]["inhibitedBy"]],
            timeout=60,
            what=f"{rule} inhibited",
        )
        assert held["labels"]["pin_event"] == event
        assert held["status"]["state"] == "suppressed"
        assert rule not in chain.received()
    # rules whose `for:` is too long here (15, 10 and 30 min): their expressions hold
    assert chain.query(chain.rule_expr("NewsSnapshotDetachLagSLOAtRisk")) != []
    assert chain.query(chain.rule_expr("NewsSnapshotDetachFailureSpike")) != []
    assert chain.query(chain.rule_expr("CalendarSlotExpirationErrors")) != []
    # and nothing else paged: no liveness rule (a first deployment), no failure spike
    unexpected = set(chain.received()) - PROVOKED - {"task_failed"}
    assert unexpected == set(), unexpected
    states = chain.alert_states(since)
    assert not set(states) & set(LIVENESS), states
    # the dashboard, on the metrics these runs produced
    assert_panels_have_data(chain, JOB_METRICS, not_fed=NOT_FED_BY_THE_JOB_RUNS)


def test_one_quarantine_pages_once_and_a_later_one_pages_again(
    alert_chain: Chain, dags_home, job_db, selections
) -> None:
    """Both paths on, the shipped Alertmanager config: a quarantine reaches the pager once (its
    task alert, with the snapshot id), although its rule fires too; a second
    quarantine, minutes later while the rule still fires, is a new event and pages again."""
    chain = alert_chain
    event = "snapshot_detach_quarantined"
    gone = insert_entry(job_db)
    selections.script(gone.snapshot_id, "not_found")
    done = dags_test(chain, dags_home, job_db, DETACH, selections=selections)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    chain.wait_received(event, timeout=180)
    # its rule fires too (a first appearance of the counter), and stays held back
    wait_for(
        lambda: chain.query(
            'ALERTS{alertname="NewsSnapshotDetachQuarantined",alertstate="firing"}'
        ),
        timeout=120,
        what="NewsSnapshotDetachQuarantined firing",
    )
    [first] = notifications_of(chain, event)
    assert [a["labels"]["alertname"] for a in first["alerts"]] == [event]
    assert "NewsSnapshotDetachQuarantined" not in chain.received()
    assert chain.query('ALERTS{alertname="NewsSnapshotDetachQuarantined",alertstate="firing"}')

    again = insert_entry(job_db)
    selections.script(again.snapshot_id, "not_found")
    done = dags_test(chain, dags_home, job_db, DETACH, selections=selections)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    # a new alert of an existing group pages at the group's next group_interval
    second = wait_for(
        lambda: [n for n in notifications_of(chain, event) if again.snapshot_id in json.dumps(n)],
        timeout=240,
        what="the second quarantine's page",
    )
    assert len(second) == 1
    assert len(notifications_of(chain, event)) == 2
    # the rule still fires, still held back
    chain.scraped_since(time.time(), scrapes=3)
    assert chain.query('ALERTS{alertname="NewsSnapshotDetachQuarantined",alertstate="firing"}')
    assert all(
        a["labels"]["alertname"] == event
        for n in notifications_of(chain, event)
        for a in n["alerts"]
    )


# ------------------------------------------------------------------------------------------ 2


def test_restarts_and_a_healthy_run_page_nothing_but_a_stopped_job_would(
    alert_chain: Chain, dags_home, job_db, selections
) -> None:
    chain = alert_chain
    # every job succeeds once (a deployment that has been running)
    insert_entries(job_db, 1)
    for dag_id in (DETACH, SLOTS, RETENTION):
        done = dags_test(chain, dags_home, job_db, dag_id, selections=selections)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for name in LIVENESS_GAUGES:
        chain.wait_series(name)
    # the run-duration panels, fed by the completed retention run (test 1 has none)
    assert_panels_have_data(chain, ("activity_retention_run_duration_seconds",))
    before = {name: len(alerts) for name, alerts in chain.received().items()}
    firing_before = set(chain.alert_states(time.time() - 2))

    # statsd_exporter restart: every series is gone until the next run
    chain.exporter.restart()
    since = time.time()
    chain.scraped_since(since, scrapes=5)
    assert chain.query(LIVENESS_GAUGES[0]) == []
    # Prometheus restart (same data directory)
    chain.prometheus.restart()
    chain.scraped_since(time.time(), scrapes=5)
    # a healthy run brings the detach series back, its counters at 0
    insert_entries(job_db, 2)
    done = dags_test(chain, dags_home, job_db, DETACH, selections=selections)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    chain.wait_series("news_snapshot_detach_quarantined_total == 0")
    chain.scraped_since(time.time(), scrapes=3)

    newly = set(chain.alert_states(since)) - firing_before
    assert newly == set(), f"rules pending or firing only since the restarts: {newly}"
    after = {name: len(alerts) for name, alerts in chain.received().items()}
    assert after == before, "nothing new reached the receiver"
    for rule, threshold in LIVENESS.items():
        expr = chain.rule_expr(rule)
        assert chain.query(expr) == [], rule
        # The job stops now. `for:` is 1 min / 1 min / 10 min, the thresholds 15 min / 30 min /
        # 26 h: the expression, evaluated at later times through the query API, holds once the
        # last success is older than the threshold, not before.
        gauge = LIVENESS_GAUGES[list(LIVENESS).index(rule)]
        last = chain.value(f"max(max_over_time({gauge}[1h]))")
        assert last is not None, gauge
        assert chain.query(expr, at=last + threshold - 60) == [], rule
        assert chain.query(expr, at=last + threshold + 60) != [], rule


# Panel targets that test 1's runs do not feed, and why (every other job-metric target must
# have data after them); test 2 checks these on its completed retention run.
NOT_FED_BY_THE_JOB_RUNS: dict[str, str] = {
    # test 1's retention runs are two lock skips and a failed batch: none completes, so none
    # observes a run duration (measured: the series is never scraped there)
    "histogram_quantile(0.95, sum by (le) "
    "(rate(activity_retention_run_duration_seconds_bucket[1d])))": "no completed retention run",
    "sum(rate(activity_retention_run_duration_seconds_sum[1d]))"
    " / sum(rate(activity_retention_run_duration_seconds_count[1d]))": "no completed retention run",
}
