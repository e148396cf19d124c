"""Slot expiration branches the main suite does not reach, on a real Postgres.

* the real poison isolation (``_expire_isolating``), measured: UPDATE statements the server
  ran per poison row, counted by a statement-level trigger on a sequence (``nextval`` is not
  rolled back with the failed statements and savepoints), bounded by the bisection's
  ``1 + 2·k·ceil(log2 n)``; a fallback to one statement per row (n) fails it;
* more than 20 poison rows in a cycle: 20 alerts, every one logged and counted;
* the database failing during the isolation: nothing of the batch is written, the run fails;
* a read-only database (a failover): the run fails at once, nothing is isolated or written;
* no time left when the first batch comes back full: no side runner starts.
"""

from __future__ import annotations

import logging
import math
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql

from devtools.pg import Database
from include.pin_maintenance.jobs import slot_expiration as se
from include.pin_maintenance.jobs.slot_expiration_batch import M_ERRORS, POISON_ALERT
from include.pin_maintenance.lifecycle import MAX_ROW_ALERTS_PER_RUN
from tests.integration.slot_expiration_fixtures import (
    DRAIN,
    NOW,
    connect_for,
    insert_due,
    install_test_triggers,
    new_run,
    run_job,
    statuses,
    table_state,
)

pytestmark = pytest.mark.integration

LOGGER = f"pin_maintenance.{se.JOB}"

# The test triggers count with their owner's sequences (security definer): the job's role has
# no privilege on test objects.
COUNT_UPDATES = """
create sequence public.slot_update_statements;
create function public.count_slot_update() returns trigger language plpgsql security definer as $$
begin
  perform nextval('public.slot_update_statements');
  return null;
end $$;
create trigger count_slot_update before update on calendar.availability_slots
  for each statement execute function public.count_slot_update();
"""


@pytest.fixture
def slots_db(db: Database) -> Database:
    install_test_triggers(db)
    with db.connect() as conn:
        conn.execute(COUNT_UPDATES)
    return db


def update_statements(db: Database) -> int:
    with db.connect() as conn:
        value, called = conn.execute(
            "select last_value, is_called from public.slot_update_statements"
        ).fetchone()
    return int(value) if called else 0


def poison(db: Database, ids) -> None:
    with db.connect() as conn:
        for slot_id in ids:
            conn.execute("insert into public.slot_poison (id) values (%s)", (slot_id,))


@pytest.mark.parametrize(
    "positions",
    [[0], [250], [499], [3, 400], [10, 11, 300]],
    ids=["first", "middle", "last", "two", "three"],
)
def test_isolation_costs_a_logarithmic_number_of_statements_per_poison_row(
    slots_db: Database, positions: list[int]
) -> None:
    n = 500
    ids = insert_due(slots_db, n)
    poison(slots_db, [ids[i] for i in positions])
    k = len(positions)

    result = run_job(slots_db, {**DRAIN, "batch_size": n, "runners": 1})

    assert sorted(p.slot_id for p in result.poison) == sorted(str(ids[i]) for i in positions)
    assert result.expired_count == n - k
    assert statuses(slots_db) == {"Expired": n - k, "Available": k}
    # the cycle's statements: the failed batch, the isolation, the next (empty) batch
    statements = update_statements(slots_db)
    isolation = statements - 2
    bound = 1 + 2 * k * math.ceil(math.log2(n))
    assert isolation <= bound, (
        f"{isolation} isolation statements for {k} poison row(s) in {n} "
        f"({isolation / k:.1f} per poison row; bisection bound {bound}, per-row would be {n})"
    )
    assert isolation >= 1 + 2 * math.floor(math.log2(n))  # it did bisect (a sanity floor)


def test_a_batch_without_poison_is_one_statement(slots_db: Database) -> None:
    insert_due(slots_db, 500)
    result = run_job(slots_db, {**DRAIN, "batch_size": 500, "runners": 1})
    assert result.expired_count == 500
    assert update_statements(slots_db) == 2  # the full batch and the empty one after it


def test_more_poison_rows_than_the_alert_cap_are_all_logged_and_counted_but_20_alerted(
    slots_db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    ids = insert_due(slots_db, 100)
    bad = ids[::4]  # 25 poison rows
    poison(slots_db, bad)
    run = new_run()

    with caplog.at_level(logging.ERROR, logger=LOGGER):
        result = run_job(slots_db, {**DRAIN, "batch_size": 100, "runners": 1}, run=run)

    assert len(bad) == 25 > MAX_ROW_ALERTS_PER_RUN == 20
    assert len(result.poison) == 25
    assert run.metrics.counters[M_ERRORS] == 25
    failed = [r.getMessage() for r in caplog.records if "event=item_failed" in r.getMessage()]
    assert len(failed) == 25
    assert len(run.alerts.sent) == 20
    assert {a.name for a in run.alerts.sent} == {POISON_ALERT}
    assert statuses(slots_db) == {"Expired": 75, "Available": 25}


FAIL_DURING_ISOLATION = """
create sequence public.slot_statement_phase;
create function public.fail_after_first_update() returns trigger language plpgsql
security definer as $$
begin
  if nextval('public.slot_statement_phase') >= 2 then
    raise exception 'terminating connection due to administrator command'
      using errcode = '57P01';
  end if;
  return null;
end $$;
create trigger fail_after_first_update before update on calendar.availability_slots
  for each statement execute function public.fail_after_first_update();
"""


def test_a_database_failure_during_isolation_writes_nothing_and_fails_the_run(
    slots_db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """The batch statement meets a poison row; the first isolation statement then meets an
    infrastructure error (SQLSTATE class 57): no row of the batch is written, the run fails."""
    ids = insert_due(slots_db, 50)
    poison(slots_db, [ids[20]])
    with slots_db.connect() as conn:
        conn.execute(FAIL_DURING_ISOLATION)
    run = new_run()

    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(psycopg.Error) as err:
        run_job(slots_db, {**DRAIN, "batch_size": 50, "runners": 1}, run=run)

    assert err.value.sqlstate == "57P01"
    assert statuses(slots_db) == {"Available": 50}  # the batch rolled back whole
    messages = [r.getMessage() for r in caplog.records]
    assert any("event=batch_isolating" in m for m in messages)
    assert any("event=job_failed" in m and "57P01" in m for m in messages)
    assert run.metrics.counters[M_ERRORS] == 1
    assert run.alerts.sent == []  # no row was found poison: the isolation never finished
    assert se.M_LAST_SUCCESS not in run.metrics.gauges


def test_a_read_only_database_fails_the_cycle_at_once_without_isolating(
    slots_db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """A failover in progress (``default_transaction_read_only = on``): SQLSTATE 25006 is the
    database, not a row, so the cycle fails on its first statement, bisects nothing and alerts
    no poison slot."""
    insert_due(slots_db, 30)
    with slots_db.connect(autocommit=True) as admin:
        admin.execute(
            sql.SQL("alter database {} set default_transaction_read_only = on").format(
                sql.Identifier(slots_db.name)
            )
        )
    before = table_state(slots_db)
    run = new_run()

    with caplog.at_level(logging.INFO, logger=LOGGER), pytest.raises(psycopg.Error) as err:
        run_job(slots_db, {**DRAIN, "batch_size": 10, "runners": 2}, run=run)

    assert err.value.sqlstate == "25006"
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "event=batch_isolating" in m]
    assert not [m for m in messages if "event=batch_selected" in m]
    [failed] = [m for m in messages if "event=job_failed" in m]
    assert "25006" in failed and "expired_count=0" in failed, failed
    assert run.alerts.sent == []
    assert run.metrics.counters[M_ERRORS] == 1
    assert se.M_LAST_SUCCESS not in run.metrics.gauges
    assert update_statements(slots_db) == 0  # the server ran no UPDATE: nothing bisected
    assert table_state(slots_db) == before


def test_no_side_runner_starts_when_the_first_batch_used_up_the_time(slots_db: Database) -> None:
    insert_due(slots_db, 30)
    opened: list[int] = []
    connect = connect_for(slots_db, "slots-no-time")

    def counting_connect() -> psycopg.Connection:
        conn = connect()
        opened.append(conn.info.backend_pid)
        return conn

    ticks = iter(range(0, 10_000, 40))  # every reading of the clock is 40 s later
    run = new_run()

    result = se.run(
        counting_connect,
        {**DRAIN, "batch_size": 10, "runners": 4, "max_run_duration_seconds": 30},
        run.telemetry,
        run.stop,
        now=lambda: NOW,
        clock=lambda: float(next(ticks)),
    )

    assert result.runners == 1
    assert len(opened) == 2  # the privilege check's and the first loop's; none for a side runner
    assert result.expired_count == 10  # the first batch, then the bound
    assert result.stop_reason == "max_duration"
    assert statuses(slots_db) == {"Expired": 10, "Available": 20}


def test_side_runners_start_when_time_is_left(slots_db: Database) -> None:
    """The counterpart: the same backlog with time left starts the side runners."""
    insert_due(slots_db, 30)
    result = run_job(
        slots_db, {**DRAIN, "batch_size": 10, "runners": 3, "max_run_duration_seconds": 30}
    )
    assert result.runners == 3
    assert result.expired_count == 30
    assert timedelta(0) <= timedelta(milliseconds=result.duration_ms)
