"""news_snapshot_detach_retry job on a real Postgres against a real HTTP selections service.

The seed's test table (success, empty run, unavailable -> retry with backoff, idempotency,
poison -> quarantine, dedupe, parallel instances, cancellation) plus the answers of
docs/design.md, "Selections API" (404, 429, 401/403, timeout, connection drop, other 4xx) and
the safety properties (claim guard, secrets never stored or logged, one bad row does not stop
the others).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from devtools.selections_service import SelectionsService
from include.pin_maintenance.db import lock_key
from include.pin_maintenance.jobs import snapshot_detach
from include.pin_maintenance.jobs.snapshot_detach import LOCK_NAME, Metric
from include.pin_maintenance.jobs.snapshot_detach_answers import CallOutcome
from include.pin_maintenance.stopping import JobCancelled, StopSignal
from tests.integration.snapshot_detach_fixtures import (
    config,
    insert_entries,
    insert_entry,
    later,
    make_client,
    rows,
    run_job,
    running_service,
)
from tests.job_db import job_connect, job_telemetry, job_url

pytestmark = pytest.mark.integration


@pytest.fixture
def service():
    yield from running_service()


def _seconds_after(moment: datetime, base: datetime) -> float:
    return (moment - base).total_seconds()


def _within(moment: datetime, started: datetime, low: float, high: float) -> bool:
    """``moment`` is between ``started + low`` and ``now + high`` (the run happened between)."""
    return started + timedelta(seconds=low) <= moment <= datetime.now(UTC) + timedelta(seconds=high)


# -- the seed's table ------------------------------------------------------------------------


def test_successful_detach_marks_done_and_reports(db, service, caplog):
    caplog.set_level(logging.INFO)
    entries = [*insert_entries(db, 3), insert_entry(db, reason="PostDeleted")]
    telemetry = job_telemetry(snapshot_detach.JOB, "run_success")

    result = run_job(db, service, telemetry=telemetry)

    state = rows(db)
    for e in entries:
        assert state[e.snapshot_id].status == "Done"
        assert state[e.snapshot_id].last_error is None
        assert state[e.snapshot_id].attempts == 1
        assert service.is_detached(e.snapshot_id)
        [call] = service.calls_for(e.snapshot_id)
        assert call.idempotency_key == e.id  # the outbox id
        assert call.reason == e.reason
    assert (result.succeeded, result.retried, result.quarantined, result.failed) == (4, 0, 0, 0)
    m = telemetry.metrics
    assert m.counters[Metric.SUCCEEDED] == 4
    assert len(m.timings[Metric.LAG]) == 4
    assert all(300 <= lag < 400 for lag in m.timings[Metric.LAG])  # created 5 min ago
    assert m.gauges[Metric.PENDING] == 0
    assert m.gauges[Metric.OLDEST_AGE] == 0
    assert Metric.LAST_SUCCESS in m.gauges
    lines = [
        r.getMessage() for r in caplog.records if "job=news_snapshot_detach_retry" in r.getMessage()
    ]
    for event in ("job_started", "batch_claimed", "entries_detached", "job_completed"):
        assert any(f"event={event}" in line for line in lines), event
    assert all("run_id=run_success" in line for line in lines)
    completed = next(line for line in lines if "event=job_completed" in line)
    assert "succeeded=4" in completed and "retried=0" in completed and "duration_ms=" in completed


def test_empty_run_calls_nothing_and_changes_nothing(db, service):
    future = insert_entry(db, due_in=timedelta(minutes=10))
    done = insert_entry(db, status="Done")
    quarantined = insert_entry(db, status="Quarantined", attempts=12)
    before = rows(db)
    telemetry = job_telemetry(snapshot_detach.JOB)

    result = run_job(db, service, telemetry=telemetry)

    assert service.calls == []
    assert rows(db) == before
    assert result.claimed == 0 and result.stop_reason == "drained"
    assert telemetry.metrics.gauges[Metric.PENDING] == 1  # the future row
    assert telemetry.metrics.gauges[Metric.OLDEST_AGE] >= 300
    assert Metric.LAST_SUCCESS in telemetry.metrics.gauges
    assert {future.snapshot_id, done.snapshot_id, quarantined.snapshot_id} == set(before)
    # every counter is sent at 0 (statsd_exporter then has the series before its first event)
    assert telemetry.metrics.counters == dict.fromkeys(Metric.COUNTERS, 0)


@pytest.mark.parametrize(
    ("behaviour", "error"),
    [
        ("error_503", "HttpServerError 503"),
        ("error_500", "HttpServerError 500"),
        ("slow", "Timeout"),
        ("drop", "ConnectionError"),
    ],
)
def test_unavailable_selections_keeps_pending_with_backoff(db, service, behaviour, error):
    entry = insert_entry(db)
    service.script(entry.snapshot_id, behaviour, "ok")
    cfg = config(detach_call_timeout_seconds=0.3)
    started = datetime.now(UTC)

    first = run_job(db, service, cfg=cfg)

    row = rows(db)[entry.snapshot_id]
    assert (row.status, row.attempts, row.last_error) == ("Pending", 1, error)
    assert _within(row.next_attempt_at, started, 60, 66)  # base 60 + jitter <= 10%
    assert first.retried == 1 and first.failed == 1

    # the next run (in real time) does not touch it: not due yet
    run_job(db, service, cfg=cfg)
    assert service.call_count(entry.snapshot_id) == 1

    # once due, it is retried and succeeds
    second = run_job(db, service, cfg=cfg, now=later(timedelta(minutes=2)))
    row = rows(db)[entry.snapshot_id]
    assert (row.status, row.attempts, row.last_error) == ("Done", 2, None)
    assert second.succeeded == 1
    assert service.call_count(entry.snapshot_id) == 2


def test_backoff_grows_with_each_failed_attempt(db, service):
    entry = insert_entry(db, attempts=3)  # this claim is attempt 4: 60 * 2^3 = 480 s
    service.script(entry.snapshot_id, "error_503")
    started = datetime.now(UTC)
    run_job(db, service)
    row = rows(db)[entry.snapshot_id]
    assert row.attempts == 4
    assert _within(row.next_attempt_at, started, 480, 528)


def test_already_detached_snapshot_is_done_without_second_effect(db, service):
    entry = insert_entry(db)
    service.script(entry.snapshot_id, "already_detached")
    result = run_job(db, service)
    assert rows(db)[entry.snapshot_id].status == "Done"
    assert result.succeeded == 1
    # Done rows are never selected again
    run_job(db, service, now=later(timedelta(days=1)))
    assert service.call_count(entry.snapshot_id) == 1


def test_poison_row_is_quarantined_with_alert_and_excluded(db, service, caplog):
    entry = insert_entry(db, attempts=11)  # this claim is attempt 12 = max_attempts
    service.script(entry.snapshot_id, "error_503")
    telemetry = job_telemetry(snapshot_detach.JOB)

    result = run_job(db, service, telemetry=telemetry)

    row = rows(db)[entry.snapshot_id]
    assert row.status == "Quarantined"
    assert row.attempts == 12
    assert row.last_error == "HttpServerError 503; max_attempts 12 reached"
    assert result.quarantined == 1
    assert telemetry.metrics.counters[Metric.QUARANTINED] == 1
    [alert] = telemetry.alerts.sent
    assert alert.name == "snapshot_detach_quarantined"
    assert dict(alert.details) == {
        "snapshot_id": entry.snapshot_id,
        "post_id": entry.post_id,
        "reason": "BlockReplaced",
        "attempts": 12,
    }
    assert any("event=entry_quarantined" in r.getMessage() for r in caplog.records)
    run_job(db, service, now=later(timedelta(days=1)))
    assert service.call_count(entry.snapshot_id) == 1  # excluded from selection


def test_dedupe_by_snapshot_id_via_unique_index(db):
    first = insert_entry(db)
    with pytest.raises(psycopg.errors.UniqueViolation):
        insert_entry(db, snapshot_id=first.snapshot_id)
    with db.connect() as conn:
        conn.execute(
            "update news.snapshot_detach_outbox set status = 'Done' where id = %s", (first.id,)
        )
    # once Done, a new intent for the same snapshot is allowed (index is partial)
    insert_entry(db, snapshot_id=first.snapshot_id)


def test_busy_lock_skips_the_run_as_success(db, service):
    entry = insert_entry(db)
    telemetry = job_telemetry(snapshot_detach.JOB)
    with psycopg.connect(job_url(db, snapshot_detach.JOB)) as holder:  # another run
        holder.execute("select pg_advisory_lock(%s)", (lock_key(LOCK_NAME),))
        result = run_job(db, service, telemetry=telemetry)
    assert not result.lock_acquired
    assert service.calls == []
    assert rows(db)[entry.snapshot_id].attempts == 0
    assert telemetry.metrics.counters[Metric.LOCK_CONTENTION] == 1
    assert Metric.LAST_SUCCESS in telemetry.metrics.gauges
    assert Metric.RUN_DURATION not in telemetry.metrics.timings  # a skip is no run


def test_lock_held_past_its_lease_raises_lock_held_too_long(db, service):
    # the threshold is the lease, not max_run_duration_seconds: a live run may hold
    # the lock up to max_run + call timeout + margin, and the lease is above that
    cfg = config(
        max_run_duration_seconds=0.1, detach_call_timeout_seconds=0.1, lock_ttl_seconds=5.5
    )
    with psycopg.connect(job_url(db, snapshot_detach.JOB)) as holder:  # another run, stuck
        holder.execute("select pg_advisory_lock(%s)", (lock_key(LOCK_NAME),))
        holder.commit()
        time.sleep(1.2)  # past max_run_duration_seconds, within the lease: a live holder
        early = job_telemetry(snapshot_detach.JOB)
        assert not run_job(db, service, telemetry=early, cfg=cfg).lock_acquired
        time.sleep(4.6)  # past the lease: the holder is stuck, not running
        telemetry = job_telemetry(snapshot_detach.JOB)
        result = run_job(db, service, telemetry=telemetry, cfg=cfg)
    assert [a.name for a in early.alerts.sent] == []
    assert not result.lock_acquired
    [alert] = [a for a in telemetry.alerts.sent if a.name == "lock_held_too_long"]
    assert alert.details["lock"] == LOCK_NAME
    assert alert.details["held_seconds"] >= 5.5
    assert alert.details["limit_seconds"] == 5.5


def test_busy_lock_within_a_run_bound_raises_no_alert(db, service):
    telemetry = job_telemetry(snapshot_detach.JOB)
    with psycopg.connect(job_url(db, snapshot_detach.JOB)) as holder:  # another run
        holder.execute("select pg_advisory_lock(%s)", (lock_key(LOCK_NAME),))
        run_job(db, service, telemetry=telemetry)  # default bound 240 s
    assert [a.name for a in telemetry.alerts.sent] == []


def _advisory_locks_held(db) -> int:
    with db.connect() as conn:
        return conn.execute(
            "select count(*) from pg_locks l join pg_database d on d.oid = l.database"
            " where l.locktype = 'advisory' and l.granted and d.datname = current_database()"
        ).fetchone()[0]


def test_a_second_run_while_the_first_holds_the_lock_skips(db, service):
    """One run skips on the lock: the second starts only once the first holds it (seen in
    pg_locks) and is still calling; it takes nothing, calls nothing and reports the skip."""
    service.latency_ms = 20  # 120 calls, 2 at a time: the first run holds the lock ~1-2 s
    entries = insert_entries(db, 120)
    cfg = config(batch_size=10, detach_concurrency=2)
    results: dict[str, snapshot_detach.DetachResult] = {}

    def worker(name: str) -> None:
        results[name] = run_job(db, service, cfg=cfg, lock_name=LOCK_NAME)

    first = threading.Thread(target=worker, args=("first",))
    first.start()
    deadline = time.monotonic() + 60
    while not (_advisory_locks_held(db) and service.call_counts()):
        assert first.is_alive() and time.monotonic() < deadline, "the first run never held it"
        time.sleep(0.01)
    second = threading.Thread(target=worker, args=("second",))
    second.start()
    second.join(timeout=120)
    still_calling = first.is_alive()
    first.join(timeout=120)

    assert still_calling, "the first run ended before the second tried: nothing was proven"
    assert results["second"].lock_acquired is False
    assert results["second"].succeeded == 0
    assert results["first"].lock_acquired is True
    assert results["first"].succeeded == 120
    counts = service.call_counts()
    assert {e.snapshot_id for e in entries} == set(counts)
    assert set(counts.values()) == {1}
    assert all(r.status == "Done" and r.attempts == 1 for r in rows(db).values())


def _two_concurrent_runs(db, service, lock_names: list[str]) -> list:
    """Two runs started together on 120 due rows, one per lock name; every snapshot must be
    called exactly once and every row end Done after one attempt. Returns both results."""
    service.latency_ms = 5
    entries = insert_entries(db, 120)
    cfg = config(batch_size=10, detach_concurrency=4)
    results = []

    def worker(lock_name: str) -> None:
        results.append(run_job(db, service, cfg=cfg, lock_name=lock_name))

    threads = [threading.Thread(target=worker, args=(name,)) for name in lock_names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    counts = service.call_counts()
    assert {e.snapshot_id for e in entries} == set(counts)
    assert set(counts.values()) == {1}
    assert all(r.status == "Done" and r.attempts == 1 for r in rows(db).values())
    assert len(results) == len(lock_names)
    return results


def test_two_concurrent_runs_with_the_lock_call_each_snapshot_once(db, service):
    """Started together under the same lock: one skips or runs after the other (then it finds
    nothing due), never both at once; each snapshot is called once."""
    results = _two_concurrent_runs(db, service, [LOCK_NAME, LOCK_NAME])
    # one run did every row; the other skipped on the lock or came after and found none due
    assert sorted(r.succeeded for r in results) == [0, 120]
    idle = next(r for r in results if r.succeeded == 0)
    assert idle.lock_acquired is False or idle.claimed == 0, idle


def test_two_concurrent_runs_without_the_lock_split_the_rows(db, service):
    """The lock bypassed (each run its own lock name): SKIP LOCKED alone splits the rows, and
    each snapshot is still called once."""
    results = _two_concurrent_runs(db, service, [f"{LOCK_NAME}:test-{i}" for i in range(2)])
    assert sum(r.succeeded for r in results) == 120
    assert all(r.lock_acquired for r in results)


def test_cancellation_stops_between_rows_and_gives_back_attempts(db, service):
    entries = insert_entries(db, 10)
    stop = StopSignal()
    real = make_client(service)
    calls = []

    class StopAfterThree:
        def call(self, snapshot_id, reason, idempotency_key, timeout):
            calls.append(snapshot_id)
            outcome = real.call(snapshot_id, reason, idempotency_key, timeout)
            if len(calls) == 3:
                stop.set("test cancel")
            return outcome

    before = rows(db)
    with pytest.raises(JobCancelled):
        run_job(db, service, stop=stop, client=StopAfterThree(), cfg=config(detach_concurrency=1))
    real.close()

    state = rows(db)
    called = set(calls)
    assert len(called) == 3
    for e in entries:
        row = state[e.snapshot_id]
        if e.snapshot_id in called:
            assert (row.status, row.attempts) == ("Done", 1)
        else:  # claimed, not called: the attempt and the due time are given back
            assert (row.status, row.attempts) == ("Pending", 0)
            assert row.next_attempt_at == before[e.snapshot_id].next_attempt_at
    with db.connect() as conn:
        open_tx = conn.execute(
            "select count(*) from pg_stat_activity where datname = current_database()"
            " and state like 'idle in transaction%%'"
        ).fetchone()[0]
    assert open_tx == 0
    # the next run finishes the rest
    run_job(db, service)
    assert all(r.status == "Done" for r in rows(db).values())
    assert set(service.call_counts().values()) == {1}


# -- docs/design.md, "Selections API" answers ------------------------------------------------


def test_404_quarantines_at_once_with_alert(db, service):
    entry = insert_entry(db)
    service.script(entry.snapshot_id, "not_found")
    telemetry = job_telemetry(snapshot_detach.JOB)
    run_job(db, service, telemetry=telemetry)
    row = rows(db)[entry.snapshot_id]
    assert (row.status, row.attempts, row.last_error) == ("Quarantined", 1, "HttpNotFound 404")
    assert [a.name for a in telemetry.alerts.sent] == ["snapshot_detach_quarantined"]


def test_other_4xx_quarantines_at_once(db, service):
    entry = insert_entry(db)
    service.script(entry.snapshot_id, "bad_request")
    run_job(db, service)
    row = rows(db)[entry.snapshot_id]
    assert (row.status, row.last_error) == ("Quarantined", "HttpBadRequest 400")


def test_429_honours_a_longer_retry_after(db, service):
    service.retry_after_seconds = 900  # longer than the 60 s backoff
    entry = insert_entry(db)
    service.script(entry.snapshot_id, "rate_limited")
    started = datetime.now(UTC)
    result = run_job(db, service)
    row = rows(db)[entry.snapshot_id]
    assert row.status == "Pending"
    assert row.last_error == "HttpTooManyRequests 429 retry_after=900s"
    assert _within(row.next_attempt_at, started, 900, 900)
    assert result.retried == 1


def test_429_with_a_shorter_retry_after_keeps_the_backoff(db, service):
    service.retry_after_seconds = 1
    entry = insert_entry(db)
    service.script(entry.snapshot_id, "rate_limited")
    started = datetime.now(UTC)
    run_job(db, service)
    assert _seconds_after(rows(db)[entry.snapshot_id].next_attempt_at, started) >= 60


def test_401_opens_the_breaker_alerts_and_costs_no_attempt(db, service):
    entries = insert_entries(db, 6, attempts=2, last_error="HttpServerError 503")
    before = rows(db)
    telemetry = job_telemetry(snapshot_detach.JOB)

    result = run_job(
        db, service, telemetry=telemetry, password="wrong", cfg=config(detach_concurrency=1)
    )

    assert len(service.calls) == 1  # the breaker stopped every later call
    state = rows(db)
    for e in entries:
        row = state[e.snapshot_id]
        assert row.status == "Pending"
        assert row.attempts == 2  # given back
        assert row.next_attempt_at == before[e.snapshot_id].next_attempt_at
    called = service.calls[0].snapshot_id
    assert state[called].last_error == "HttpUnauthorized 401"
    assert {state[e.snapshot_id].last_error for e in entries if e.snapshot_id != called} == {
        "HttpServerError 503"
    }
    assert result.auth_failed and result.stop_reason == "auth_failed"
    [alert] = telemetry.alerts.sent
    assert (alert.name, alert.severity) == ("selections_auth_failed", "critical")
    assert Metric.LAST_SUCCESS not in telemetry.metrics.gauges  # not a successful run


def test_403_also_opens_the_breaker(db, service):
    entries = insert_entries(db, 3)
    for e in entries:
        service.script(e.snapshot_id, "forbidden")
    result = run_job(db, service, cfg=config(detach_concurrency=1))
    assert result.auth_failed
    assert len(service.calls) == 1
    assert all(r.attempts == 0 for r in rows(db).values())


def test_secrets_never_reach_last_error_or_the_log(db, caplog):
    caplog.set_level(logging.DEBUG)
    from devtools.selections_service import SelectionsService

    secret = "Zq9-Distinctive-S3cret-Pw"
    wrong = "Wr0ng-Distinctive-Pw-7741"
    with SelectionsService(password=secret, slow_seconds=3) as svc:
        url = svc.url
        entries = insert_entries(db, 4)
        svc.script(entries[1].snapshot_id, "slow")
        svc.script(entries[2].snapshot_id, "drop")
        svc.script(entries[3].snapshot_id, "error_503")
        run_job(db, svc, password=secret, cfg=config(detach_call_timeout_seconds=0.3))
        insert_entries(db, 2)
        run_job(db, svc, password=wrong)  # 401 path
    with db.connect() as conn:
        errors = [r[0] for r in conn.execute("select last_error from news.snapshot_detach_outbox")]
    stored = " ".join(e for e in errors if e)
    assert "Timeout" in stored and "ConnectionError" in stored and "HttpUnauthorized" in stored
    job_lines = " ".join(
        r.getMessage() for r in caplog.records if r.name.startswith("pin_maintenance")
    )
    # every log record (urllib3's debug lines included) and every stored error
    for text in (stored, caplog.text):
        assert secret not in text
        assert wrong not in text
        assert "Authorization" not in text and "Basic " not in text
    assert url not in job_lines and url not in stored  # our own lines carry no URL at all


def test_unknown_reason_is_quarantined_without_a_call(db, service):
    entry = insert_entry(db, reason="Mystery")
    ok = insert_entry(db)
    telemetry = job_telemetry(snapshot_detach.JOB)
    run_job(db, service, telemetry=telemetry)
    state = rows(db)
    assert (state[entry.snapshot_id].status, state[entry.snapshot_id].last_error) == (
        "Quarantined",
        "UnknownReason",
    )
    assert service.call_count(entry.snapshot_id) == 0
    assert state[ok.snapshot_id].status == "Done"
    assert telemetry.alerts.sent[0].details["reason"] == "Mystery"


def test_unknown_status_is_never_selected(db, service):
    odd = insert_entry(db, status="Paused")
    run_job(db, service)
    assert rows(db)[odd.snapshot_id].status == "Paused"
    assert service.calls == []


def test_one_failing_row_does_not_stop_the_others(db, service):
    entries = insert_entries(db, 5)
    bad = entries[2].snapshot_id
    real = make_client(service)

    class Flaky:
        def call(self, snapshot_id, reason, idempotency_key, timeout):
            if snapshot_id == bad:
                raise RuntimeError("boom")
            return real.call(snapshot_id, reason, idempotency_key, timeout)

    result = run_job(db, service, client=Flaky())
    real.close()
    state = rows(db)
    assert (state[bad].status, state[bad].last_error) == ("Pending", "ClientError:RuntimeError")
    assert sum(r.status == "Done" for r in state.values()) == 4
    assert result.succeeded == 4 and result.retried == 1


def test_outcome_never_overwrites_a_newer_claim_or_requeue(db, service):
    entry = insert_entry(db)
    real = make_client(service)

    class RequeuedMeanwhile:
        def call(self, snapshot_id, reason, idempotency_key, timeout):
            with db.connect() as conn:  # someone re-wrote the row during our call
                conn.execute(
                    "update news.snapshot_detach_outbox set attempts = 0, updated_at = now(),"
                    " last_error = 'requeued: x' where id = %s",
                    (idempotency_key,),
                )
            return CallOutcome(status_code=503)

    result = run_job(db, service, client=RequeuedMeanwhile())
    real.close()
    row = rows(db)[entry.snapshot_id]
    assert (row.status, row.attempts, row.last_error) == ("Pending", 0, "requeued: x")
    assert result.superseded == 1 and result.retried == 0


def test_batches_loop_until_a_short_batch(db, service):
    insert_entries(db, 25)
    result = run_job(db, service, cfg=config(batch_size=10))
    assert result.batches == 3 and result.claimed == 25 and not result.has_more
    assert all(r.status == "Done" for r in rows(db).values())


def test_a_slow_call_holds_back_only_its_own_row(db):
    # the oldest row's call answers after 2 s; the five batches behind its own (more than the
    # pipeline's depth) are claimed, called and recorded meanwhile
    slow = insert_entry(db, due_in=timedelta(minutes=-5))
    same_batch = insert_entries(db, 9, due_in=timedelta(minutes=-4))
    later_batches = insert_entries(db, 50)
    # 20 ms a call: the pipeline stays full while the batches behind it are called
    with SelectionsService(slow_seconds=2, latency_ms=20) as svc:
        svc.script(slow.snapshot_id, "slow")
        cfg = config(
            batch_size=10,
            detach_call_timeout_seconds=5,
            detach_concurrency_min=4,  # the slow call holds a slot; three carry the rest
            detach_concurrency=4,
        )
        result = run_job(db, svc, cfg=cfg)
    state = rows(db)
    assert result.succeeded == 60 and result.calls == 60
    assert all(state[e.snapshot_id].status == "Done" for e in [slow, *same_batch, *later_batches])
    slow_recorded = state[slow.snapshot_id].updated_at
    assert max(state[e.snapshot_id].updated_at for e in later_batches) < slow_recorded
    # answered rows of its own batch too: the full pipeline recorded them without it
    assert min(state[e.snapshot_id].updated_at for e in same_batch) < slow_recorded


def test_max_run_duration_stops_between_batches(db, service):
    insert_entries(db, 25)
    service.latency_ms = 150  # one batch of 10 at 4 in flight takes >= 0.45 s
    result = run_job(
        db,
        service,
        cfg=config(
            batch_size=10,
            max_run_duration_seconds=0.3,
            detach_call_timeout_seconds=1,
            detach_concurrency=4,
            detach_concurrency_min=4,
            lock_ttl_seconds=60,
        ),
    )
    assert result.has_more and result.stop_reason == "max_duration"
    # calls stop once a whole call no longer fits before the deadline (0.3 s + 1 s)
    done = sum(r.status == "Done" for r in rows(db).values())
    assert 0 < done < 25
    assert result.succeeded == done and result.claimed - done == result.given_back


def test_dry_run_counts_due_rows_and_writes_nothing(db, service):
    insert_entries(db, 3)
    insert_entry(db, due_in=timedelta(hours=1))
    before = rows(db)
    result = snapshot_detach.run(
        job_connect(db, snapshot_detach.JOB),
        config(),
        job_telemetry(snapshot_detach.JOB),
        StopSignal(),
        None,
        dry_run=True,
    )
    assert result.due == 3 and result.claimed == 0
    assert rows(db) == before
    assert service.calls == []
