"""Pacing by replica lag on a real streaming replica whose replay is held back.

The cluster (a primary and a ``pg_basebackup -R`` replica, devtools/pg_cluster.py) is this
module's own: a paused replica on the shared test server would hold every other test's drain.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql as psql

from devtools import pg
from devtools.pg_cluster import Cluster
from include.pin_maintenance.pacing import (
    PROBE_INTERVAL_SECONDS,
    REASON_REPLICA_LAG,
    Pacer,
)
from include.pin_maintenance.pacing_config import PacingConfig
from include.pin_maintenance.stopping import StopSignal
from include.pin_maintenance.telemetry import JobLog, RecordingMetrics, Telemetry
from tests.integration.slot_expiration_fixtures import insert_due_slots, run_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WRITE_WAL = (
    "insert into calendar.availability_slots (id, tenant_id, consultant_id, start_at, end_at,"
    " status, version, created_at, updated_at) select gen_random_uuid(), gen_random_uuid(),"
    " gen_random_uuid(), now(), now(), 'Booked', 1, now(), now() from generate_series(1, 2000)"
)


@pytest.fixture(scope="module")
def cluster(pg_admin_url) -> Iterator[Cluster]:  # pg_admin_url: skips without a Postgres
    made = Cluster.start()
    try:
        pg.apply_schema(made.primary_url("postgres"))
        made.wait_replica_caught_up(60)
        yield made
    finally:
        made.stop()


@pytest.fixture(scope="module")
def primary(cluster) -> pg.Database:
    """The primary's job database, its roles made by the grant script; the slot job's role is
    in pg_monitor, as docs/deploying.md says to let it see the replicas."""
    database = pg.job_database(cluster.primary_url("postgres"), "pin_pacing")
    with psycopg.connect(database.url, autocommit=True) as conn:
        role = database.roles["calendar_db"].name
        conn.execute(psql.SQL("grant pg_monitor to {}").format(psql.Identifier(role)))
    return database


def pacer(deadline_at: float) -> Pacer:
    return Pacer(
        PacingConfig(max_replica_lag_seconds=1.0, max_wal_mb_per_second=0),
        Telemetry.local(JobLog("pacing_test", "run-1"), RecordingMetrics()),
        paced_metric_prefix="pacing_test_paced",
        deadline_remaining=lambda: max(0.0, deadline_at - time.monotonic()),
    )


def replay(cluster: Cluster, action: str) -> None:
    with psycopg.connect(cluster.replica_url("postgres"), autocommit=True) as conn:
        conn.execute(f"select pg_wal_replay_{action}()")


def test_a_held_back_replica_holds_the_loop_until_its_replay_resumes(cluster, caplog):
    caplog.set_level(logging.INFO)
    paced = pacer(time.monotonic() + 120)
    with psycopg.connect(cluster.primary_url("postgres"), autocommit=True) as conn:
        paced.connections = [conn]
        paced.start()
        paced.pace(0, StopSignal(), 0.05, None)  # caught up: no hold
        assert paced.paced_total == 0
        replay(cluster, "pause")
        try:
            conn.execute(WRITE_WAL)  # a batch's WAL the replica does not replay
            time.sleep(PROBE_INTERVAL_SECONDS)  # so that the next batch's end probes
            paced.pace(0, StopSignal(), 0.05, None)  # seen written, not yet 1 s old
            assert paced.paced_total == 0
            probed = paced._history[-1]
            assert probed is not None and probed.replay_bytes < probed.wal_bytes
            time.sleep(1.5)
            conn.execute(WRITE_WAL)  # the next batch: its loop is held now
            threading.Timer(4.0, replay, args=(cluster, "resume")).start()
            started = time.monotonic()
            paced.pace(0, StopSignal(), 0.05, None)
            held = time.monotonic() - started
        finally:
            replay(cluster, "resume")
    assert 3.0 <= held < 30.0  # held while replay was paused, let go once it resumed
    assert paced.paced_seconds[REASON_REPLICA_LAG] >= 3.0
    lines = [r.getMessage() for r in caplog.records]
    for event in ("event=job_paced ", "event=job_resumed "):
        assert any(line.startswith(event) and "reason=replica_lag" in line for line in lines)


def test_the_hold_ends_at_the_runs_deadline_and_on_a_stop(cluster):
    with psycopg.connect(cluster.primary_url("postgres"), autocommit=True) as conn:
        replay(cluster, "pause")
        try:
            conn.execute(WRITE_WAL)
            paced = pacer(time.monotonic() + 3.0)
            paced.connections = [conn]
            paced.start()  # sees the WAL written, not replayed
            time.sleep(1.5)  # the replica is now behind the limit
            started = time.monotonic()
            paced.pace(0, StopSignal(), 0.05, None)
            assert time.monotonic() - started < 3.0  # within the deadline, not until resume

            stop = StopSignal()
            endless = pacer(time.monotonic() + 120)
            endless.connections = [conn]
            endless.start()
            conn.execute(WRITE_WAL)
            threading.Timer(1.0, stop.set, args=("SIGTERM received",)).start()
            started = time.monotonic()
            endless.pace(0, stop, 0.05, None)
            assert time.monotonic() - started < 10.0  # the stop ends the hold
        finally:
            replay(cluster, "resume")


def test_a_slot_drain_holds_while_the_replica_is_held_back_and_drains_once_it_resumes(
    cluster, primary, caplog
):
    caplog.set_level(logging.INFO)
    with primary.connect() as conn:
        conn.execute("truncate calendar.availability_slots")
        insert_due_slots(conn, 40_000)
    cluster.wait_replica_caught_up(60)
    replay(cluster, "pause")
    resume = threading.Timer(5.0, replay, args=(cluster, "resume"))
    resume.start()
    try:
        result = run_job(
            primary,
            {
                "max_batches_per_cycle": 1000,
                # 400 batches: the drain outlasts the probe after its first (0.25 s) even on an
                # idle machine, which then sees the replica 0.25 s behind, over the limit
                "batch_size": 100,
                "max_run_duration_seconds": 60,
                "max_replica_lag_seconds": 0.05,
            },
        )
    finally:
        resume.cancel()
        replay(cluster, "resume")
    assert result.stop_reason == "drained" and result.expired_count == 40_000
    assert result.paced_ms >= 2000  # held while replay was paused (both loops, summed)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("event=job_paced ") and "replica_lag" in line for line in lines)


def test_a_retention_step_holds_while_the_replica_is_held_back(cluster, primary, caplog):
    from devtools.retention_data import seed_sessions
    from include.pin_maintenance.jobs import activity_retention as retention
    from tests.job_db import job_connect, job_telemetry

    caplog.set_level(logging.INFO)
    with psycopg.connect(primary.url, autocommit=True) as conn:
        role = primary.roles["user_activity_db"].name
        conn.execute(psql.SQL("grant pg_monitor to {}").format(psql.Identifier(role)))
    with primary.connect() as conn:
        seed_sessions(conn, 3000, 0, 2, tag="replica")
    cluster.wait_replica_caught_up(60)
    replay(cluster, "pause")
    resume = threading.Timer(5.0, replay, args=(cluster, "resume"))
    resume.start()
    try:
        config = retention.CONFIG.resolve(
            None,
            {
                "batch_size": 10,  # 300 batches a step: each step outlasts a probe or two
                "max_batches_per_run": 1000,
                "max_replica_lag_seconds": 0.2,
            },
        )
        result = retention.run(
            job_connect(primary, retention.JOB),
            config,
            job_telemetry(retention.JOB),
            StopSignal(),
        )
    finally:
        resume.cancel()
        replay(cluster, "resume")
    assert result.deleted_sessions == 3000 and not result.has_more
    assert result.as_dict()["PacedMs"] >= 2000
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("event=job_paced ") and "replica_lag" in line for line in lines)
