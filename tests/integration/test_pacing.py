"""Pacing's signals on a real server, raised by real sessions (no replica here: see
test_pacing_replica.py)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from devtools.retention_data import seed_sessions
from include.pin_maintenance import pacing
from include.pin_maintenance.jobs import activity_retention
from include.pin_maintenance.pacing import (
    PROBE_INTERVAL_SECONDS,
    REASON_WAL_RATE,
    Pacer,
)
from include.pin_maintenance.pacing_config import PACING_OFF, PacingConfig
from include.pin_maintenance.pacing_rules import SHARED_BATCH_MIN, SHARED_BATCH_SECONDS
from include.pin_maintenance.parallel import BatchBudget, Deadline, run_batch_loops
from include.pin_maintenance.stopping import StopSignal
from include.pin_maintenance.telemetry import JobLog, RecordingMetrics, Telemetry
from tests.integration.slot_expiration_fixtures import insert_due_slots, run_job
from tests.job_db import job_connect, job_telemetry

pytestmark = pytest.mark.integration

APP = "pin-pacing-test"  # the loop's own sessions, which pacing does not count as others
CPU_HOG = "select count(*) from generate_series(1, 3000000)"
WAL_HOG = (
    "insert into calendar.availability_slots (id, tenant_id, consultant_id, start_at, end_at,"
    " status, version, created_at, updated_at) select gen_random_uuid(), gen_random_uuid(),"
    " gen_random_uuid(), now(), now(), 'Booked', 1, now(), now() from generate_series(1, 20000)"
)
WAL_BATCH = WAL_HOG.replace("20000", "1000")  # a batch's worth: a few hundred kB of WAL


def pacer(
    *,
    lag: float = 0,
    wal_mb: float = 0,
    metrics: RecordingMetrics | None = None,
    batch_size: int | None = None,
) -> Pacer:
    """A pacer of ``max_replica_lag_seconds`` ``lag`` and ``max_wal_mb_per_second`` ``wal_mb``."""
    telemetry = Telemetry.local(JobLog("pacing_test", "run-1"), metrics or RecordingMetrics())
    config = PacingConfig(max_replica_lag_seconds=lag, max_wal_mb_per_second=wal_mb)
    return Pacer(
        config,
        telemetry,
        paced_metric_prefix="pacing_test_paced",
        deadline_remaining=lambda: 60.0,
        batch_size=batch_size,
    )


@contextmanager
def busy(url: str, statements: list[str]) -> Iterator[None]:
    """Real sessions that keep the server busy (CPU and WAL) until the block ends."""
    stop = threading.Event()

    def work(statement: str) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute(statement)

    threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in statements]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # under way before the first probe
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def started(pacer: Pacer, *conns: psycopg.Connection) -> Pacer:
    pacer.connections = list(conns)
    pacer.start()
    return pacer


def probe_until(pacer: Pacer, conn: psycopg.Connection, condition, seconds: float) -> bool:
    """Call the loop's hook as a drain would (a 50 ms batch each time) until ``condition``."""
    pacer.connections[0] = conn
    stop = StopSignal()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pacer.pace(0, stop, 0.05, None)
        if condition():
            return True
        time.sleep(PROBE_INTERVAL_SECONDS)
    return False


def test_a_database_writing_wal_past_the_budget_paces_the_loop_until_it_writes_less(db, caplog):
    # one session inserting 20,000 rows a statement writes tens of MB/s, far over 2 MB/s
    caplog.set_level(logging.INFO)
    metrics = RecordingMetrics()
    with psycopg.connect(db.url, autocommit=True, application_name=APP) as conn:
        with busy(db.url, [WAL_HOG]):
            paced = started(pacer(wal_mb=2, metrics=metrics), conn)
            assert probe_until(paced, conn, lambda: paced.paced_seconds[REASON_WAL_RATE] > 0, 60), (
                "never paced"
            )
        assert probe_until(paced, conn, lambda: paced._wal_paced_at is None, 60), "never resumed"
    assert metrics.counters["pacing_test_paced_wal_rate_milliseconds_total"] > 0
    lines = [r.getMessage() for r in caplog.records]
    paced_lines = [
        line for line in lines if line.startswith("event=job_paced ") and "reason=wal_rate" in line
    ]
    assert paced_lines, lines
    fields = dict(field.split("=", 1) for field in paced_lines[0].split())
    assert float(fields["value"]) > float(fields["limit"]) == 2.0  # the rate it saw, in MB/s
    assert any(
        line.startswith("event=job_resumed ") and "reason=wal_rate" in line for line in lines
    )


def test_the_first_batch_beside_busy_sessions_pays_for_its_wal(db):
    # the bucket opens when the run starts: the WAL of the batch right after it is a debt at
    # once (a step's first batches ran back to back before, the services' worst moment)
    with (
        psycopg.connect(db.url, autocommit=True, application_name=APP) as conn,
        busy(db.url, [CPU_HOG] * 2),  # others active, writing no WAL of their own
    ):
        paced = started(pacer(wal_mb=1), conn)
        assert paced._shared
        conn.execute(WAL_HOG)  # the batch: 20,000 rows, megabytes of WAL
        paced.pace(0, StopSignal(), 0.05, None)
    assert paced.paced_seconds[REASON_WAL_RATE] > 0


def test_the_crews_own_loops_between_batches_are_not_neighbours(db):
    # between batches a loop's session is idle under no application_name (the job sets its name
    # per transaction), a statement just finished: by name alone it would read as a service
    from include.pin_maintenance import sql

    paced = pacer(wal_mb=8)
    stop = threading.Event()
    with (
        psycopg.connect(db.url, autocommit=True, application_name=APP) as conn,
        psycopg.connect(db.url, autocommit=True) as sibling,
    ):
        paced.connections = [conn, sibling]
        own = paced._own_pids()
        assert own == sorted({conn.info.backend_pid, sibling.info.backend_pid})

        def loop() -> None:
            while not stop.is_set():
                sibling.execute("select 1")

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        health = sql.load("pacing/read_database_health")
        seen = []
        try:
            for _ in range(20):
                named = conn.execute(health, {"own_pids": [conn.info.backend_pid]}).fetchone()
                excluded = conn.execute(health, {"own_pids": own}).fetchone()
                seen.append(named[3] - excluded[3])  # other workers' sessions come and go
                time.sleep(0.01)
        finally:
            stop.set()
            thread.join(10)
    assert sum(1 for difference in seen if difference >= 1) >= 10, seen


def test_a_monitor_that_polled_just_before_the_start_does_not_make_the_database_shared(
    db, monkeypatch
):
    # the probe as it is, but the others it counts are one monitor that polled just before
    # the first reading (seen while its statement is within the probe's 50 ms recency); timed
    # from that reading, not from the test's start, which a loaded host can put 50 ms before it
    polled_at: list[float] = []
    seen = []

    def monitor_only(conn, own_pids, clock):
        now = clock()
        if not polled_at:
            polled_at.append(now)
        reading = dataclasses.replace(
            real_read(conn, own_pids, clock), others_active=now - polled_at[0] < 0.05
        )
        seen.append(reading.others_active)
        return reading

    real_read = pacing.read
    monkeypatch.setattr(pacing, "read", monitor_only)
    with psycopg.connect(db.url, autocommit=True, application_name=APP) as conn:
        paced = started(pacer(wal_mb=8), conn)
    assert seen[0] and not all(seen)  # seen at the first reading, not at every one
    assert not paced._shared


def test_an_idle_database_is_never_paced(db):
    with psycopg.connect(db.url, autocommit=True, application_name=APP) as conn:
        paced = started(pacer(lag=2, wal_mb=4), conn)
        probe_until(paced, conn, lambda: False, 3)
    # on a server in PIN_PG_URL every xdist worker's sessions share it: the pacer then sees it
    # busy and may pace on its WAL rate, rightly; what must hold is that it paces only then
    saw_others = any(r.others_active for r in paced._history)
    assert paced.paced_total == 0 or saw_others
    assert paced.paced_seconds[pacing.REASON_REPLICA_LAG] == 0


def run_crew(pacer: Pacer, conns: list[psycopg.Connection], batch, batches: int) -> None:
    """Run one loop of ``batch`` per connection under ``pacer``, ``batches`` batches in all."""
    pacer.connections = list(conns)
    run_batch_loops(
        [batch] * len(conns),
        stop=StopSignal(),
        deadline=Deadline(60),
        budget=BatchBudget(batches),
        grace_seconds=1,
        pacing=pacer,
    )


def run_timed_batches(
    pacer: Pacer, conns: list[psycopg.Connection], batches: int = 16, statement: str = ""
) -> list[tuple[float, float]]:
    """Run one loop per connection, ``batches`` batches in all (each ``statement`` on its
    loop's connection, or a 20 ms sleep), under ``pacer``; each batch's (start, end), in the
    order they started."""
    lock, spans = threading.Lock(), []

    def batch(lane, size) -> bool:
        begun = time.monotonic()
        if statement:
            conns[lane.index].execute(statement)
        else:
            time.sleep(0.02)
        with lock:
            spans.append((begun, time.monotonic()))
        return True

    run_crew(pacer, conns, batch, batches)
    return sorted(spans)


def most_batches_at_once(pacer: Pacer, conns: list[psycopg.Connection]) -> int:
    """Run two loops of 20 ms batches, 16 in all, under ``pacer``; the most that overlapped."""
    spans = run_timed_batches(pacer, conns)
    return max(sum(1 for s, e in spans if s <= begun < e) for begun, _ in spans)


def test_loops_take_turns_beside_busy_sessions_and_run_side_by_side_without_them(db, caplog):
    caplog.set_level(logging.INFO)
    limits = {"wal_mb": 1000}
    with (
        psycopg.connect(db.url, autocommit=True, application_name=APP) as first,
        psycopg.connect(db.url, autocommit=True, application_name=APP) as second,
    ):
        assert most_batches_at_once(pacer(**limits), [first, second]) == 2
        with busy(db.url, [CPU_HOG]):
            polite = pacer(**limits)
            assert most_batches_at_once(polite, [first, second]) == 1
    assert polite._shared
    lines = [r.getMessage() for r in caplog.records]
    started_lines = [line for line in lines if line.startswith("event=pacing_started ")]
    assert "database_shared=False" in started_lines[0]
    assert "database_shared=True" in started_lines[1]


def test_a_pause_holds_the_whole_crew_not_only_the_loop_that_paced(db):
    # three loops writing WAL past the budget: were the pause one loop's sleep, the other two
    # would run their batches meanwhile and the database would see no gap at all
    with (
        psycopg.connect(db.url, autocommit=True, application_name=APP) as first,
        psycopg.connect(db.url, autocommit=True, application_name=APP) as second,
        psycopg.connect(db.url, autocommit=True, application_name=APP) as third,
        busy(db.url, [CPU_HOG]),
    ):
        polite = pacer(wal_mb=1)
        spans = run_timed_batches(polite, [first, second, third], statement=WAL_BATCH)
    idle = sum(max(0.0, later[0] - earlier[1]) for earlier, later in itertools.pairwise(spans))
    paced = polite.paced_seconds[REASON_WAL_RATE]
    assert paced > 0.05
    assert idle >= 0.9 * paced, (idle, paced)


def test_batches_beside_busy_sessions_are_sized_to_the_target_time_and_whole_without_them(db):
    # the target time's worth is 250 rows, 1000 rows take four times the target
    limits = {"wal_mb": 1000}
    target_rows = 250
    row_seconds = SHARED_BATCH_SECONDS / target_rows

    def sized(paced: Pacer, conns: list[psycopg.Connection]) -> list:
        sizes = []

        def batch(lane, size) -> bool:
            time.sleep(size * row_seconds)
            sizes.append(size)
            return True

        run_crew(paced, conns, batch, batches=12)
        return sizes

    with (
        psycopg.connect(db.url, autocommit=True, application_name=APP) as first,
        psycopg.connect(db.url, autocommit=True, application_name=APP) as second,
    ):
        assert set(sized(pacer(**limits, batch_size=1000), [first, second])) == {1000}
        with busy(db.url, [CPU_HOG]):
            polite = pacer(**limits, batch_size=1000)
            sizes = sized(polite, [first, second])
    assert polite._shared
    assert sizes[0] == SHARED_BATCH_MIN  # nothing timed yet: the first batch is the smallest
    # then what takes the target time at the batches' own pace (sleeps overshoot: not more)
    assert all(SHARED_BATCH_MIN <= size <= target_rows for size in sizes[1:]), sizes
    assert max(sizes[1:]) >= target_rows // 4, sizes  # a loaded machine's sleeps overshoot


def test_a_role_without_pg_monitor_runs_unpaced_with_one_warning(db, caplog):
    # the slot job's own role, as the grant script makes it: no pg_read_all_stats, so it cannot
    # tell its own load from its neighbours' and is not paced, even on a busy server
    caplog.set_level(logging.INFO)
    with (
        psycopg.connect(db.job_url("calendar_db"), autocommit=True) as conn,
        busy(db.url, [CPU_HOG, WAL_HOG]),
    ):
        paced = started(pacer(lag=2, wal_mb=1), conn)
        probe_until(paced, conn, lambda: False, 1)
        with paced.turn(StopSignal()) as size:
            assert size is None
    assert not paced._history and paced.paced_total == 0  # nothing read, nothing paced
    warnings = [
        r.getMessage() for r in caplog.records if "pacing_signal_unavailable" in r.getMessage()
    ]
    assert len(warnings) == 1 and "pg_read_all_stats" in warnings[0]
    assert not any("pacing_started" in r.getMessage() for r in caplog.records)


def test_pacing_off_reads_nothing(db):
    with psycopg.connect(db.url, autocommit=True) as conn:
        paced = started(pacer(), conn)
        paced.pace(0, StopSignal(), 0.05, None)
    assert not paced._history and paced.paced_total == 0


def test_a_slot_drain_beside_a_wal_heavy_session_holds_its_wal_budget(db, caplog):
    # 10 batches: each pauses up to 20 times its own time, and the hog burns a core meanwhile
    caplog.set_level(logging.INFO)
    due = 2_500
    with psycopg.connect(db.url) as conn:
        insert_due_slots(conn, due)
    with busy(db.url, [WAL_HOG]):
        result = run_job(
            db,
            {
                "max_batches_per_cycle": 1000,
                "batch_size": 250,
                "max_run_duration_seconds": 120,
                "max_wal_mb_per_second": 2,
            },
            app="pin-slot-expiration",
            url=db.url,  # the owner, who sees the other sessions as a role in pg_monitor would
        )
    assert result.stop_reason == "drained" and result.expired_count == due
    assert result.paced_ms > 0 and result.as_dict()["PacedMs"] == result.paced_ms
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("event=job_paced ") and "reason=wal_rate" in line for line in lines)
    completed = [line for line in lines if line.startswith("event=job_completed ")]
    assert f"paced_ms={result.paced_ms}" in completed[-1].split()


def test_a_slot_drain_with_pacing_off_never_probes(db, caplog):
    caplog.set_level(logging.INFO)
    with psycopg.connect(db.url) as conn:
        insert_due_slots(conn, 2000)
    result = run_job(db, {"max_batches_per_cycle": 1000, **PACING_OFF})
    assert result.expired_count == 2000 and result.paced_ms == 0
    assert not any("pacing_started" in r.getMessage() for r in caplog.records)


def test_a_retention_run_beside_busy_sessions_sizes_its_child_batches_and_keeps_session_batches(
    db,
):
    # the child steps' batches are sized while others use the database (the first at the
    # minimum, before any batch was timed); a session batch stays the seed's unit: batch_size
    with db.connect() as conn:
        seed_sessions(conn, 1000, 0, 1, tag="shared")
        conn.commit()
    with busy(db.url, [CPU_HOG]):
        result = activity_retention.run(
            job_connect(db, activity_retention.JOB, url=db.url),  # sees others, as pg_monitor
            activity_retention.CONFIG.resolve(None, {"batch_size": 500, "runners": 2}),
            job_telemetry(activity_retention.JOB),
            StopSignal(),
        )
    events, views, sessions = result.steps
    assert result.deleted_sessions == 1000 and not result.has_more
    assert result.deleted_action_events == result.deleted_property_object_views == 1000
    assert sessions.batches == result.batches_processed == 2
    assert events.batches >= 3 and views.batches >= 3, (events.batches, views.batches)
