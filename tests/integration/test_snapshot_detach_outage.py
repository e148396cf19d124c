"""Issue 16: the detach job through a long selections outage and at the service's capacity.

Real Postgres, real HTTP (the local selections service with its outage switch and admission
limit). A many-hour outage is simulated by driving the job's clock (``now``), not real time:
each run is "5 minutes" after the previous one, so backoffs expire as they would.
"""

from __future__ import annotations

import logging
import socket
from datetime import UTC, datetime, timedelta

import pytest

from devtools.selections_service import SelectionsService
from include.pin_maintenance.jobs import snapshot_detach
from include.pin_maintenance.jobs.snapshot_detach import Metric
from include.pin_maintenance.jobs.snapshot_detach_http import (
    HttpDetachClient,
    basic_auth_session,
)
from tests.integration.snapshot_detach_fixtures import (
    config,
    insert_entries,
    insert_entry,
    rows,
    run_job,
    running_service,
)
from tests.job_db import job_telemetry

pytestmark = pytest.mark.integration

TICK = timedelta(minutes=5)  # the DAG's schedule


@pytest.fixture
def service():
    yield from running_service()


def _refused_client() -> HttpDetachClient:
    """A client aimed at a loopback port nobody listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return HttpDetachClient(f"http://127.0.0.1:{port}", lambda: basic_auth_session("u", "p"))


def test_outage_opens_the_breaker_bounds_calls_and_costs_no_attempt(db, service, caplog):
    caplog.set_level(logging.INFO)
    # the case: 60 due rows one attempt short of max_attempts, every call answers 503
    entries = insert_entries(db, 60, attempts=11, last_error="HttpServerError 500")
    before = rows(db)
    service.set_outage("error_503")
    telemetry = job_telemetry(snapshot_detach.JOB, "run_outage")

    result = run_job(db, service, telemetry=telemetry, cfg=config(detach_concurrency=8))

    threshold, start = 5, 1  # breaker_failure_threshold, detach_concurrency_min (defaults)
    assert 5 <= len(service.calls) <= threshold + start - 1
    state = rows(db)
    called = {c.snapshot_id for c in service.calls}
    for e in entries:
        row = state[e.snapshot_id]
        assert (row.status, row.attempts) == ("Pending", 11)  # nobody quarantined, no attempt
        if e.snapshot_id in called:  # the outage's evidence: error kept, backoff as claimed
            assert row.last_error == "HttpServerError 503"
            assert row.next_attempt_at > before[e.snapshot_id].next_attempt_at
        else:  # claimed, not called: given back exactly (401/403 breaker's mechanism)
            assert row.last_error == "HttpServerError 500"
            assert row.next_attempt_at == before[e.snapshot_id].next_attempt_at
    assert result.breaker_open and result.stop_reason == "selections_unavailable"
    assert result.breaker_failures == threshold
    assert result.outage_calls == result.calls == len(service.calls)
    assert result.given_back == 60 and result.quarantined == 0 and result.retried == 0
    assert result.as_dict()["BreakerOpen"] is True
    [alert] = telemetry.alerts.sent
    assert (alert.name, alert.severity) == ("selections_unavailable", "warning")
    assert alert.details["consecutive_failures"] == threshold
    m = telemetry.metrics
    assert m.counters[Metric.BREAKER_OPEN] == 1
    assert m.counters[Metric.FAILED] == len(service.calls)
    assert m.counters.get(Metric.QUARANTINED, 0) == 0  # sent at 0 at run start, never raised
    assert Metric.LAST_SUCCESS in m.gauges  # the job did its job: it is not a stalled worker
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("pin_maintenance")]
    assert sum("event=breaker_open" in line for line in lines) == 1
    [done] = [line for line in lines if "event=job_completed" in line]
    assert "breaker=open" in done and f"breaker_failures={threshold}" in done


def test_many_hour_outage_quarantines_nothing_and_the_backlog_drains_after(db, service):
    # 60 rows at every stage of their backoff, some one attempt short of quarantine
    entries = [insert_entry(db, attempts=i % 12) for i in range(60)]
    start = datetime.now(UTC)
    refused = _refused_client()
    cfg = config(batch_size=100, detach_call_timeout_seconds=0.1, detach_concurrency=8)
    bound = cfg.breaker_failure_threshold + cfg.detach_concurrency_min - 1
    runs = 8 * 12  # eight hours of 5-minute ticks
    phases = ["error_503"] * 40 + ["refused"] * 40 + ["slow"] * 16  # then timeouts
    per_run = []
    try:
        for k, phase in enumerate(phases):
            service.set_outage(None if phase == "refused" else phase)
            result = run_job(
                db,
                service,
                client=refused if phase == "refused" else None,
                cfg=cfg,
                now=lambda k=k: start + k * TICK,
            )
            per_run.append(result.calls)
            assert result.quarantined == 0 and result.succeeded == 0
            assert result.breaker_open, f"run {k} ({phase}) did not open the breaker"
    finally:
        refused.close()
    assert max(per_run) <= bound  # calls to the down service per run are bounded
    assert min(per_run) >= 1  # and every run probed again (half-open)
    state = rows(db)
    assert all(state[e.snapshot_id].status == "Pending" for e in entries)
    assert [state[e.snapshot_id].attempts for e in entries] == [i % 12 for i in range(60)]

    service.set_outage(None)  # selections is back
    service.reset_calls()
    healthy = config(batch_size=100, detach_concurrency=8)
    drained_after = None
    for k in range(runs, runs + 12):
        result = run_job(db, service, cfg=healthy, now=lambda k=k: start + k * TICK)
        assert not result.breaker_open and result.quarantined == 0
        if all(r.status == "Done" for r in rows(db).values()):
            drained_after = k - runs + 1
            break
    # the first run after recovery detaches every due row; rows probed in the last outage
    # runs rest the backoff they were given (at most backoff_cap_seconds = 6 ticks)
    assert drained_after is not None and drained_after <= 7, drained_after
    assert max(service.call_counts().values()) == 1  # each snapshot detached by one call


def test_scattered_503s_among_successes_do_not_open_the_breaker(db, service):
    # in claim order (oldest due first): two failures, one success, repeated; threshold 3
    entries = [insert_entry(db, due_in=timedelta(seconds=-600 + i)) for i in range(30)]
    for i, e in enumerate(entries):
        if i % 3 != 2:
            service.script(e.snapshot_id, "error_503", "ok")
    telemetry = job_telemetry(snapshot_detach.JOB)

    result = run_job(
        db,
        service,
        telemetry=telemetry,
        cfg=config(detach_concurrency=1, breaker_failure_threshold=3),
    )

    assert not result.breaker_open and result.calls == 30
    state = rows(db)
    for i, e in enumerate(entries):
        row = state[e.snapshot_id]
        if i % 3 != 2:  # the seed's semantics: attempt spent, backoff, stays Pending
            assert (row.status, row.attempts, row.last_error) == (
                "Pending",
                1,
                "HttpServerError 503",
            )
        else:
            assert row.status == "Done"
    assert result.retried == 20 and result.succeeded == 10
    assert [a.name for a in telemetry.alerts.sent] == []
    assert telemetry.metrics.counters.get(Metric.BREAKER_OPEN, 0) == 0  # only the run-start 0


def test_failures_before_the_streak_keep_the_seed_semantics(db, service):
    # claim order: fail, fail, ok, fail x3 (opens at threshold 3), then rows never called
    entries = [insert_entry(db, due_in=timedelta(seconds=-600 + i)) for i in range(10)]
    for i in (0, 1, 3, 4, 5):
        service.script(entries[i].snapshot_id, "error_500")

    result = run_job(db, service, cfg=config(detach_concurrency=1, breaker_failure_threshold=3))

    state = [rows(db)[e.snapshot_id] for e in entries]
    assert [(r.status, r.attempts) for r in state[:3]] == [
        ("Pending", 1),
        ("Pending", 1),
        ("Done", 1),
    ]
    assert [(r.status, r.attempts, r.last_error) for r in state[3:6]] == [
        ("Pending", 0, "HttpServerError 500")
    ] * 3
    assert [(r.status, r.attempts, r.last_error) for r in state[6:]] == [("Pending", 0, None)] * 4
    assert result.breaker_open and result.calls == 6 and result.outage_calls == 3
    assert result.retried == 2 and result.given_back == 7


def test_a_lone_poison_row_is_still_quarantined(db, service):
    entry = insert_entry(db, attempts=11)
    service.script(entry.snapshot_id, "error_500")
    result = run_job(db, service)
    assert rows(db)[entry.snapshot_id].status == "Quarantined"
    assert not result.breaker_open


def test_a_service_at_its_capacity_settles_near_it(db):
    # refuses (503, no Retry-After) any call beyond 4 in flight; 20 ms per call
    with SelectionsService(latency_ms=20, max_in_flight=4, overload_status=503) as svc:
        insert_entries(db, 300)
        result = run_job(
            db,
            svc,
            cfg=config(batch_size=100, detach_concurrency=32, detach_call_timeout_seconds=5),
        )
        admission = svc.admission()
    state = rows(db)
    done = sum(r.status == "Done" for r in state.values())
    assert not result.breaker_open
    assert admission["accepted"] == done == result.succeeded
    assert admission["refused"] == result.retried == result.throttled
    # every refused call costs its row one attempt and its backoff, as the seed says
    assert all(r.attempts == 1 for r in state.values())
    assert all(r.last_error == "HttpServerError 503" for r in state.values() if r.status != "Done")
    assert admission["refused"] <= 0.2 * admission["accepted"]  # calls within 1.2x of accepted
    assert result.concurrency_limit <= 5


def test_retry_after_pauses_new_calls(db):
    with SelectionsService(retry_after_seconds=1) as svc:
        entries = [insert_entry(db, due_in=timedelta(seconds=-600 + i)) for i in range(3)]
        svc.script(entries[0].snapshot_id, "rate_limited")
        result = run_job(db, svc, cfg=config(detach_concurrency=1))
        first, second, _third = sorted(svc.calls, key=lambda c: c.at)
    assert first.snapshot_id == entries[0].snapshot_id
    assert second.at - first.at >= 0.9  # nothing started during the pause
    assert result.throttled == 1 and result.retry_after_paused_seconds >= 0.9
    assert result.succeeded == 2 and result.retried == 1


@pytest.mark.parametrize(
    ("retry_after", "run_bound"),
    [(120, 240), (20, 10)],  # longer than the 30 s pause limit / past the run's bound
    ids=["long-retry-after", "past-the-run-bound"],
)
def test_a_long_retry_after_stops_calling_for_the_run(db, retry_after, run_bound):
    with SelectionsService(retry_after_seconds=retry_after) as svc:
        entries = [insert_entry(db, due_in=timedelta(seconds=-600 + i)) for i in range(4)]
        svc.script(entries[0].snapshot_id, "rate_limited")
        result = run_job(
            db,
            svc,
            cfg=config(
                detach_concurrency=1,
                max_run_duration_seconds=run_bound,
                lock_ttl_seconds=run_bound + 10,
            ),
        )
        calls = len(svc.calls)
    assert calls == 1 and result.stop_reason == "retry_after"
    assert result.duration_ms < 5000  # it did not sit out the pause
    state = rows(db)
    assert state[entries[0].snapshot_id].attempts == 1  # the 429 itself is a spent attempt
    assert all(state[e.snapshot_id].attempts == 0 for e in entries[1:])  # given back
