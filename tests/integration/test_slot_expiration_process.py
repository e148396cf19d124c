"""The job as a separate process (its CLI): killed, terminated, misconfigured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.pg import Database
from include.pin_maintenance.jobs import slot_expiration as se
from tests.integration.slot_expiration_fixtures import (
    backend_pids,
    gate,
    insert_due,
    install_test_triggers,
    lock_all_nowait,
    statuses,
    table_state,
    wait_at_gate,
    wait_for,
)
from tests.job_db import job_cli

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
APP = se.SESSION.application_name


@pytest.fixture
def slots_db(db: Database) -> Database:
    install_test_triggers(db)
    return db


def start_cli(db: Database, *args: str) -> subprocess.Popen[str]:
    url, db_env = job_cli(db, se.JOB)
    return subprocess.Popen(
        [sys.executable, "-m", se.__name__, "--db-url", url, "--run-id", "proc-test", *args],
        cwd=REPO,
        env={**os.environ, **db_env, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkill_mid_batch_leaves_no_slot_half_updated_and_the_next_run_finishes(
    slots_db: Database,
):
    ids = insert_due(slots_db, 30)
    with gate(slots_db, ids[19]) as release:  # last row of the second batch
        proc = start_cli(
            slots_db, "--config", '{"batch_size": 10, "runners": 1, "max_batches_per_cycle": 1000}'
        )
        wait_at_gate(slots_db, APP)
        (backend,) = backend_pids(slots_db, APP)
        proc.kill()
        proc.communicate(timeout=30)
        release()  # the orphaned backend finishes its statement, finds no client, aborts
        wait_for(lambda: backend not in backend_pids(slots_db, APP), "the orphan backend to end")

    state = table_state(slots_db)
    assert [state[i][:2] for i in ids] == [("Expired", 2)] * 10 + [("Available", 1)] * 20
    assert lock_all_nowait(slots_db) == 30

    done = start_cli(slots_db, "--config", '{"batch_size": 10, "max_batches_per_cycle": 1000}')
    out, err = done.communicate(timeout=60)

    assert done.returncode == 0, err
    assert json.loads(out)["ExpiredCount"] == 20
    assert {s[:2] for s in table_state(slots_db).values()} == {("Expired", 2)}


def test_sigterm_mid_batch_commits_the_batch_in_hand_then_stops(slots_db: Database):
    ids = insert_due(slots_db, 30)
    with gate(slots_db, ids[4]) as release:
        proc = start_cli(slots_db, "--config", '{"batch_size": 10}')
        wait_at_gate(slots_db, APP)
        proc.send_signal(signal.SIGTERM)
        release()
        _, err = proc.communicate(timeout=30)

    assert proc.returncode == 3, err
    assert "event=job_cancelled" in err
    state = table_state(slots_db)
    assert [state[i][:2] for i in ids] == [("Expired", 2)] * 10 + [("Available", 1)] * 20
    assert lock_all_nowait(slots_db) == 30


def test_invalid_config_fails_before_any_write_naming_the_key(slots_db: Database):
    insert_due(slots_db, 5)

    proc = start_cli(slots_db, "--config", '{"batch_size": 10001}')
    _, err = proc.communicate(timeout=60)

    assert proc.returncode == 2
    assert "batch_size = 10001" in err and "1..10000" in err
    assert statuses(slots_db) == {"Available": 5}


def test_sigkill_with_two_runners_keeps_committed_batches_and_rolls_back_the_one_in_hand(
    slots_db: Database,
):
    ids = insert_due(slots_db, 30)
    with gate(slots_db, ids[19]) as release:
        # Runner 1 commits ids[0:10] and starts runner 2; one of them locks ids[10:20] and stops
        # at the gate, the other commits ids[20:30] and finds nothing more.
        proc = start_cli(
            slots_db, "--config", '{"batch_size": 10, "runners": 2, "max_batches_per_cycle": 1000}'
        )
        wait_at_gate(slots_db, APP)
        wait_for(lambda: statuses(slots_db).get("Expired") == 20, "the free runner to finish")
        (backend,) = [
            pid for pid in backend_pids(slots_db, APP) if pid in gated_pids(slots_db, APP)
        ]
        proc.kill()
        proc.communicate(timeout=30)
        release()
        wait_for(lambda: backend not in backend_pids(slots_db, APP), "the orphan backend to end")

    state = table_state(slots_db)
    assert [state[i][:2] for i in ids] == (
        [("Expired", 2)] * 10 + [("Available", 1)] * 10 + [("Expired", 2)] * 10
    )
    assert lock_all_nowait(slots_db) == 30

    done = start_cli(
        slots_db, "--config", '{"batch_size": 10, "runners": 2, "max_batches_per_cycle": 1000}'
    )
    out, err = done.communicate(timeout=60)

    assert done.returncode == 0, err
    assert json.loads(out)["ExpiredCount"] == 10
    assert {s[:2] for s in table_state(slots_db).values()} == {("Expired", 2)}


def gated_pids(db: Database, app: str) -> list[int]:
    with db.connect(autocommit=True) as conn:
        rows = conn.execute(
            "select pid from pg_stat_activity where datname = current_database()"
            " and application_name = %s and wait_event = 'advisory'",
            (app,),
        ).fetchall()
    return [r[0] for r in rows]
