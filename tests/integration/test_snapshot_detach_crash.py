"""A detach run killed with SIGKILL mid-batch loses nothing and double-calls nothing twice.

The job runs in a subprocess (the CLI, as a worker would), the selections service in this
process; the worker is killed while calls are in flight. Claims already committed keep their
pre-incremented attempts and backoff; the next run (once they are due) finishes every row.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from devtools.pg import Database
from devtools.selections_service import DEFAULT_LOGIN, DEFAULT_PASSWORD, SelectionsService
from include.pin_maintenance.jobs import snapshot_detach
from tests.integration.snapshot_detach_fixtures import (
    config,
    insert_entries,
    later,
    rows,
    run_job,
)
from tests.job_db import job_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _start_worker(db: Database, svc_url: str, cfg: dict) -> subprocess.Popen:
    url, db_env = job_cli(db, snapshot_detach.JOB)
    env = {
        **os.environ,
        **db_env,
        "PYTHONPATH": str(REPO),
        "SELECTIONS_PASSWORD": DEFAULT_PASSWORD,
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "include.pin_maintenance.jobs.snapshot_detach",
            "--db-url",
            url,
            "--selections-url",
            svc_url,
            "--login",
            DEFAULT_LOGIN,
            "--config",
            json.dumps(cfg),
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_sigkill_mid_batch_then_normal_run_finishes_every_row(db):
    entries = insert_entries(db, 60)
    with SelectionsService(latency_ms=100) as svc:
        worker = _start_worker(db, svc.url, {"batch_size": 20, "detach_concurrency": 2})
        try:
            _wait_for(lambda: len(svc.calls) >= 5 or worker.poll() is not None)
            assert worker.poll() is None, worker.stderr.read()
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
            worker.stdout.close()
            worker.stderr.close()
        assert worker.returncode == -signal.SIGKILL

        after_kill = rows(db)
        claimed = [r for r in after_kill.values() if r.attempts == 1]
        assert claimed, "the kill happened after a claim"
        assert any(r.status == "Pending" for r in after_kill.values())
        # a claimed row whose outcome was lost stays Pending with its backoff: not due now
        lost = [r for r in claimed if r.status == "Pending"]
        assert lost, "some claimed rows were in flight when the worker died"

        # the next tick (once the backoff has passed) finishes everything
        result = run_job(db, svc, cfg=config(), now=later(timedelta(hours=2)))
        assert result.claimed >= len(lost)

        state = rows(db)
        assert all(state[e.snapshot_id].status == "Done" for e in entries)
        counts = svc.call_counts()
        assert {e.snapshot_id for e in entries} <= set(counts)
        assert max(counts.values()) <= 2
        with db.connect() as conn:
            idle_in_tx = conn.execute(
                "select count(*) from pg_stat_activity where datname = current_database()"
                " and state like 'idle in transaction%%'"
            ).fetchone()[0]
        assert idle_in_tx == 0


def test_sigterm_stops_between_rows_and_costs_no_attempt(db):
    """SIGTERM (what Airflow sends on kill/timeout) = graceful stop: the call in flight is
    recorded, claimed rows not yet called get their attempt back, the worker exits cancelled."""
    entries = insert_entries(db, 30)
    with SelectionsService(latency_ms=150) as svc:
        worker = _start_worker(db, svc.url, {"batch_size": 10, "detach_concurrency": 1})
        try:
            _wait_for(lambda: len(svc.calls) >= 3 or worker.poll() is not None)
            assert worker.poll() is None
            worker.send_signal(signal.SIGTERM)
            out, err = worker.communicate(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert worker.returncode == 3, err
        assert '"cancelled": true' in out
        state = rows(db)
        called = svc.call_counts()
        assert 3 <= len(called) < 30
        for e in entries:
            row = state[e.snapshot_id]
            if e.snapshot_id in called:
                assert (row.status, row.attempts) == ("Done", 1)
            else:
                assert (row.status, row.attempts) == ("Pending", 0)
