"""Each job DAG's successful run through the tests' fork server ends as the console script's.

Every other DAG test runs ``airflow dags test`` forked from a warm interpreter
(devtools/airflow_forkserver.py), which hands each run a prebuilt Execution API app. Here each
of the four job DAGs runs once that way and once through the venv's ``airflow`` console script
as a process of its own, exactly what a user runs, on two databases with the same seeded rows
(the second cloned from the first), and the two runs must agree on what a user and the next
run see: the run's and its tasks' states and tries, each task's XCom (durations and the
run's own clock normalised), the alerts sent, the calls made to selections, and every row of
the job tables afterwards (a time written by the run normalised). Under
``PIN_AIRFLOW_FORKSERVER=0`` the first run is a plain process too.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from devtools import pg
from devtools.pg import Database
from devtools.retention_data import seed_sessions
from devtools.selections_service import SelectionsService
from tests.integration.slot_expiration_fixtures import DAG_CONF, seed_slots_with_poison
from tests.integration.snapshot_detach_fixtures import insert_entries, insert_entry

pytestmark = [pytest.mark.dags, pytest.mark.slow]

JOB_SCHEMAS = ("news", "calendar", "user_activity")


@dataclass(frozen=True)
class Seeded:
    """What a case's seed hands its runs: the run's conf, selections' scripted answers, and the
    alerts the run must send (so that comparing them compares something)."""

    conf: dict[str, Any] | None = None
    scripts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    alerts: tuple[str, ...] = ()


def _detach(db: Database) -> Seeded:
    insert_entries(db, 3)
    flaky, gone = insert_entry(db), insert_entry(db)
    return Seeded(
        scripts={flaky.snapshot_id: ("error_503",), gone.snapshot_id: ("not_found",)},
        alerts=("snapshot_detach_quarantined",),
    )


def _requeue(db: Database) -> Seeded:
    chosen = insert_entry(db, status="Quarantined", attempts=12, last_error="HttpNotFound 404")
    insert_entry(db, status="Quarantined", attempts=12)
    return Seeded(conf={"snapshot_ids": [chosen.snapshot_id]})


def _slots(db: Database) -> Seeded:
    seed_slots_with_poison(db)
    # one loop: with two, how the batches split between them (the result's Batches) is timing
    return Seeded(conf=DAG_CONF | {"runners": 1}, alerts=("slot_expiration_poison_row",))


def _retention(db: Database) -> Seeded:
    with db.connect() as conn:
        seed_sessions(conn, 25, 8, 2, tag="parity")
        conn.commit()
    return Seeded(conf={"batch_size": 7})


CASES: dict[str, Callable[[Database], Seeded]] = {
    "news_snapshot_detach_retry": _detach,
    "news_snapshot_detach_requeue": _requeue,
    "calendar_slot_expiration": _slots,
    "user_activity_retention": _retention,
}


# XCom fields that hold the run's own clock or how long it took: compared as present
VOLATILE = frozenset(
    {"DurationMs", "OldestAgeSeconds", "AsOf", "cutoff", "deadline_at", "started_at_unix"}
    # how the detach calls happened to overlap (the adaptive limit follows their answers' order)
    | {"ConcurrencyPeak", "ConcurrencyLimit"}
    # how long the loops were paced (by the machine's load at the time)
    | {"PacedMs", "paced_ms"}
)
ALERT = re.compile(r"PIN_ALERT (\{.*)")


def _xcom(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: f"<{type(v).__name__}>" if k in VOLATILE else _xcom(v) for k, v in value.items()}
    return value


def _tables(db: Database) -> dict[str, dict[Any, tuple]]:
    """Every row of the job tables by primary key (the first column of each)."""
    with db.connect() as conn:
        names = conn.execute(
            "select table_schema || '.' || table_name from information_schema.tables"
            " where table_schema = any(%s) and table_type = 'BASE TABLE' order by 1",
            (list(JOB_SCHEMAS),),
        ).fetchall()
        return {
            name: {row[0]: tuple(row) for row in conn.execute(f"select * from {name}")}
            for (name,) in names
        }


def _written(before: dict[str, dict[Any, tuple]], after: dict[str, dict[Any, tuple]]) -> dict:
    """``after`` with each time the run wrote (a new or changed value) normalised: both runs
    write the same columns of the same rows, at their own clock."""

    def row(old: tuple | None, new: tuple) -> tuple:
        return tuple(
            "<written by the run>"
            if isinstance(v, datetime) and (old is None or old[i] != v)
            else v
            for i, v in enumerate(new)
        )

    return {
        table: {key: row(before[table].get(key), r) for key, r in rows.items()}
        for table, rows in after.items()
    }


@dataclass
class Outcome:
    """What one run left: its metadata, the alerts it sent, selections' calls, the rows."""

    run: dict[str, Any]
    alerts: list[tuple[str, str]]
    calls: list[tuple[str, int | None]]
    tables: dict[str, dict[Any, tuple]]


def _run(run_dag, dag_id: str, db: Database, seeded: Seeded, home: Path, **how) -> Outcome:
    before = _tables(db)
    with SelectionsService() as svc:
        for snapshot_id, behaviours in seeded.scripts.items():
            svc.script(snapshot_id, *behaviours)
        done = run_dag(dag_id, db, conf=seeded.conf, selections_url=svc.url, **how)
        calls = sorted((c.snapshot_id, c.status) for c in svc.calls)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    # closing(): sqlite3's own context manager commits and leaves the connection open
    with closing(sqlite3.connect(home / "airflow.db")) as meta:
        # dags test keeps the run and its XComs in the metadata DB, as a deployment does
        run_id, state = meta.execute(
            "select run_id, state from dag_run where dag_id = ? order by id desc limit 1",
            (dag_id,),
        ).fetchone()
        tasks = meta.execute(
            "select task_id, map_index, state, try_number from task_instance"
            " where dag_id = ? and run_id = ? order by task_id, map_index",
            (dag_id, run_id),
        ).fetchall()
        xcoms = meta.execute(
            "select task_id, key, value from xcom where dag_id = ? and run_id = ?"
            " order by task_id, key",
            (dag_id, run_id),
        ).fetchall()
    alerts = sorted(
        (a["alert"], a["severity"])
        for a in (json.JSONDecoder().raw_decode(m.group(1))[0] for m in ALERT.finditer(output))
    )
    return Outcome(
        run={
            "state": state,
            "tasks": tasks,
            "xcoms": {(task, key): _xcom(json.loads(value)) for task, key, value in xcoms},
        },
        alerts=alerts,
        calls=calls,
        tables=_written(before, _tables(db)),
    )


@pytest.mark.parametrize("dag_id", list(CASES))
def test_a_forked_run_ends_as_the_console_scripts(
    dag_id: str, db: Database, pg_admin_url: str, run_dag, airflow_home: Path
) -> None:
    seeded = CASES[dag_id](db)
    seeded_rows = _tables(db)
    twin = pg.create_database(pg_admin_url, f"{db.name}_plain", template=db.name)
    try:
        forked = _run(run_dag, dag_id, db, seeded, airflow_home)
        plain = _run(run_dag, dag_id, twin, seeded, airflow_home, console_script=True)
    finally:
        pg.drop_database(pg_admin_url, twin.name)
    assert forked.run["state"] == "success"
    assert {state for _, _, state, _ in forked.run["tasks"]} == {"success"}
    assert forked.run["xcoms"], "every job task returns its result"
    assert forked.tables != _written(seeded_rows, seeded_rows), "the run changed no row"
    assert sorted({name for name, _ in forked.alerts}) == sorted(seeded.alerts)
    assert bool(forked.calls) == bool(seeded.scripts)
    assert plain.run == forked.run
    assert plain.alerts == forked.alerts
    assert plain.calls == forked.calls
    assert plain.tables == forked.tables
