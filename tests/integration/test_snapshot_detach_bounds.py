"""Issue 27: the detach run's bounds in bad conditions, asserted as bounds.

Real Postgres, real loopback HTTP (the local selections service with a scripted latency).
Every bound is measured: the run's wall time, the calls the service saw, the rows changed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from devtools.selections_service import SelectionsService
from include.pin_maintenance.jobs import snapshot_detach
from include.pin_maintenance.jobs.snapshot_detach import MISROUTE_ALERT
from include.pin_maintenance.jobs.snapshot_detach_config import RUN_MARGIN_SECONDS
from include.pin_maintenance.lifecycle import MAX_ROW_ALERTS_PER_RUN
from include.pin_maintenance.telemetry import Alert, JobLog, RecordingMetrics, Telemetry
from tests.integration.snapshot_detach_fixtures import (
    config,
    insert_entries,
    rows,
    run_job,
)
from tests.job_db import job_telemetry

pytestmark = pytest.mark.integration


def _first_fast_then(seconds: float):
    """The issue's service: the first call answers in 1 ms, every later one in ``seconds``."""
    return lambda n: 0.001 if n == 0 else seconds


def _timed_run(db, svc, **kwargs):
    started = time.monotonic()
    result = run_job(db, svc, **kwargs)
    return result, time.monotonic() - started


def test_a_slow_service_cannot_stretch_the_run_past_its_bound(db):
    # a slow service, scaled down: 100 due rows, one batch of 100, every call but the first slow
    # (inside the call timeout). On main the run lasted until every claimed call was made.
    max_run, call_timeout, latency = 3.0, 2.0, 1.5
    entries = insert_entries(db, 100)
    before = rows(db)
    with SelectionsService(latency_fn=_first_fast_then(latency)) as svc:
        cfg = config(
            max_run_duration_seconds=max_run,
            detach_call_timeout_seconds=call_timeout,
            detach_concurrency=32,
            lock_ttl_seconds=30,
        )
        result, wall = _timed_run(db, svc, cfg=cfg)
        calls = len(svc.calls)
    assert wall <= max_run + call_timeout + RUN_MARGIN_SECONDS
    after = rows(db)
    done = [e for e in entries if after[e.snapshot_id].status == "Done"]
    given_back = [
        e
        for e in entries
        if after[e.snapshot_id].status == "Pending"
        and after[e.snapshot_id].attempts == before[e.snapshot_id].attempts
        and after[e.snapshot_id].next_attempt_at == before[e.snapshot_id].next_attempt_at
    ]
    # every call that started finished (no call past the bound), every other row is untouched
    assert len(done) == calls == result.calls
    assert len(done) + len(given_back) == 100
    assert result.given_back == len(given_back) > 0


def test_a_retry_after_pause_never_outlasts_the_bound(db):
    with SelectionsService(retry_after_seconds=3) as svc:
        entries = insert_entries(db, 20)
        for e in entries:
            svc.script(e.snapshot_id, "rate_limited", "ok")
        cfg = config(
            max_run_duration_seconds=2.0,
            detach_call_timeout_seconds=1.0,
            detach_concurrency=1,
            lock_ttl_seconds=30,
        )
        result, wall = _timed_run(db, svc, cfg=cfg)
    assert wall <= 2.0 + 1.0 + RUN_MARGIN_SECONDS
    assert result.stop_reason == "retry_after" and result.calls == 1


def test_404s_without_a_2xx_quarantine_a_few_rows_and_raise_one_critical_alert(db):
    # a misrouted service: every call answers 404 (a wrong base path, an ingress without the route)
    entries = insert_entries(db, 60)
    before = rows(db)
    telemetry = job_telemetry(snapshot_detach.JOB)
    with SelectionsService() as svc:
        svc.set_outage("not_found")
        result = run_job(db, svc, telemetry=telemetry, cfg=config(detach_concurrency=8))
        calls = len(svc.calls)
    limit = 5  # misroute_quarantine_limit's default
    after = rows(db)
    quarantined = [e for e in entries if after[e.snapshot_id].status == "Quarantined"]
    untouched = [
        e
        for e in entries
        if after[e.snapshot_id].status == "Pending"
        and after[e.snapshot_id].attempts == before[e.snapshot_id].attempts
    ]
    assert len(quarantined) == limit
    assert len(untouched) == 60 - limit
    assert calls <= limit + 8  # the limit's 404s, the one that opened it, those in flight
    assert result.misrouted and result.stop_reason == MISROUTE_ALERT
    misroute = [a for a in telemetry.alerts.sent if a.name == MISROUTE_ALERT]
    assert len(misroute) == 1 and misroute[0].severity == "critical"
    assert sum(a.name == "snapshot_detach_quarantined" for a in telemetry.alerts.sent) == limit


def test_a_flood_of_unknown_snapshots_drains_a_bounded_number_per_run(db):
    entries = insert_entries(db, 12)
    with SelectionsService(known_snapshots=set()) as svc:  # no snapshot is known: 404 each
        per_run = []
        for _ in range(3):
            before = sum(r.status == "Quarantined" for r in rows(db).values())
            run_job(db, svc, cfg=config(misroute_quarantine_limit=5))
            per_run.append(sum(r.status == "Quarantined" for r in rows(db).values()) - before)
    assert per_run == [5, 5, 2]
    assert all(rows(db)[e.snapshot_id].status == "Quarantined" for e in entries)


def test_404s_among_successes_quarantine_each_row(db):
    known = insert_entries(db, 20)
    unknown = insert_entries(db, 15)
    with SelectionsService(known_snapshots={e.snapshot_id for e in known}) as svc:
        # the first answers are 2xx: the route works, every 404 is an unknown snapshot
        for e in known[:3]:
            svc.script(e.snapshot_id, "ok")
        cfg = config(detach_concurrency=1, detach_concurrency_min=1)
        # claim order is next_attempt_at: make the known rows due first
        with db.connect() as conn:
            conn.execute(
                "update news.snapshot_detach_outbox set next_attempt_at = next_attempt_at"
                " - interval '1 hour' where snapshot_id = any(%s::uuid[])",
                ([e.snapshot_id for e in known[:3]],),
            )
        result = run_job(db, svc, cfg=cfg)
    after = rows(db)
    assert not result.misrouted
    assert all(after[e.snapshot_id].status == "Quarantined" for e in unknown)
    assert all(after[e.snapshot_id].status == "Done" for e in known)


def test_quarantine_alerts_are_capped_per_run_with_one_summary(db):
    entries = insert_entries(db, 30)
    telemetry = job_telemetry(snapshot_detach.JOB)
    with SelectionsService() as svc:
        for e in entries:
            svc.script(e.snapshot_id, "bad_request")
        result = run_job(db, svc, telemetry=telemetry)
    assert result.quarantined == 30
    alerts = [a for a in telemetry.alerts.sent if a.name == "snapshot_detach_quarantined"]
    assert len(alerts) == MAX_ROW_ALERTS_PER_RUN + 1
    [summary] = [a for a in alerts if "suppressed" in a.details]
    assert summary.details == {"quarantined": 30, "alerted": 20, "suppressed": 10}


@dataclass
class _SlowAlerts:
    """An alert sink as slow as a webhook that times out (3 s per alert)."""

    seconds: float
    sent: list

    def send(self, alert: Alert) -> None:
        time.sleep(self.seconds)
        self.sent.append(alert)


def test_slow_alert_delivery_does_not_stretch_the_run(db):
    entries = insert_entries(db, 25)
    sink = _SlowAlerts(3.0, [])
    log = JobLog("news_snapshot_detach_retry", "slow_alerts")
    telemetry = Telemetry(log, RecordingMetrics(), sink)
    cfg = config(max_run_duration_seconds=2.0, detach_call_timeout_seconds=1.0)
    with SelectionsService() as svc:
        for e in entries:
            svc.script(e.snapshot_id, "bad_request")
        result, wall = _timed_run(db, svc, telemetry=telemetry, cfg=cfg)
    # 21 alerts at 3 s each would take 63 s; delivery is counted inside the margin
    assert wall <= 2.0 + 1.0 + RUN_MARGIN_SECONDS
    assert result.quarantined == 25
    assert len(sink.sent) < MAX_ROW_ALERTS_PER_RUN + 1  # still being delivered
