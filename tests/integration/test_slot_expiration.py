"""SlotExpirationJob against a real Postgres: the seed's test table and the issue's extras."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import psycopg
import pytest

from devtools.pg import Database
from include.pin_maintenance.config import ConfigError
from include.pin_maintenance.db import SessionSettings
from include.pin_maintenance.jobs import slot_expiration as se
from include.pin_maintenance.jobs.slot_expiration_batch import M_ERRORS, POISON_ALERT
from include.pin_maintenance.stopping import JobCancelled
from tests.integration.slot_expiration_fixtures import (
    DRAIN,
    NOW,
    UNPACED,
    Background,
    backend_pids,
    backends_waiting,
    connect_for,
    gate,
    insert_due,
    insert_slot,
    install_test_triggers,
    lock_all_nowait,
    new_run,
    run_job,
    statuses,
    table_state,
    wait_at_gate,
    wait_for,
)
from tests.job_db import job_connect

pytestmark = pytest.mark.integration

LOGGER = f"pin_maintenance.{se.JOB}"


@pytest.fixture
def slots_db(db: Database) -> Database:
    install_test_triggers(db)
    return db


def test_empty_cycle_is_a_successful_no_op(slots_db: Database):
    with slots_db.connect() as conn:
        insert_slot(conn, start_at=NOW + timedelta(minutes=1))  # future Available
        insert_slot(conn, status="Booked", start_at=NOW - timedelta(hours=1), version=2)
        insert_slot(conn, status="Expired", start_at=NOW - timedelta(hours=2), version=2)
        insert_slot(conn, status="Archived", start_at=NOW - timedelta(hours=3), version=3)
    before = table_state(slots_db)
    run = new_run()

    result = run_job(slots_db, run=run)

    assert result.as_dict() | {"DurationMs": 0, "AsOf": None} == {
        "ExpiredCount": 0,
        "SkippedLockedCount": 0,
        "DurationMs": 0,
        "ErrorsCount": 0,
        "Backlog": 0,
        "Batches": 1,
        "Runners": 1,
        "StopReason": "drained",
        "AsOf": None,
        "PacedMs": 0,
    }
    assert table_state(slots_db) == before
    assert run.metrics.counters[se.M_ITEMS] == 0
    assert run.metrics.counters[M_ERRORS] == 0
    assert run.metrics.gauges[se.M_BACKLOG] == 0
    assert se.M_LAST_SUCCESS in run.metrics.gauges
    assert run.alerts.sent == []


def test_due_slots_expire_at_as_of_with_version_plus_one_and_a_second_pass_changes_nothing(
    slots_db: Database, caplog: pytest.LogCaptureFixture
):
    with slots_db.connect() as conn:
        due = [
            insert_slot(conn, start_at=NOW - timedelta(minutes=5), version=1),
            insert_slot(conn, start_at=NOW, version=7),  # start_at == AsOf is due
        ]
        future = insert_slot(conn, start_at=NOW + timedelta(seconds=1))
    before = table_state(slots_db)
    caplog.set_level(logging.INFO, logger=LOGGER)

    first = run_job(slots_db)

    after = table_state(slots_db)
    assert first.expired_count == 2
    for slot_id in due:
        status, version, updated_at, _ = after[slot_id]
        assert (status, version, updated_at) == ("Expired", before[slot_id][1] + 1, NOW)
    assert after[future] == before[future]
    events = [r.getMessage().split()[0] for r in caplog.records]
    assert events == ["event=job_started", "event=batch_selected", "event=job_completed"]
    assert all("run_id=test-run" in r.getMessage() for r in caplog.records)

    second = run_job(slots_db)

    assert second.expired_count == 0
    assert table_state(slots_db) == after


def test_booked_slot_in_the_past_is_never_selected(slots_db: Database):
    with slots_db.connect() as conn:
        booked = insert_slot(conn, status="Booked", start_at=NOW - timedelta(days=1), version=3)
        available = insert_slot(conn, start_at=NOW - timedelta(days=1))
    before = table_state(slots_db)

    result = run_job(slots_db)

    after = table_state(slots_db)
    assert result.expired_count == 1
    assert after[booked] == before[booked]
    assert after[available][0] == "Expired"


def test_backlog_bigger_than_a_batch_is_taken_oldest_first_and_the_rest_waits(
    slots_db: Database,
):
    ids = insert_due(slots_db, 25)  # oldest first
    ticks = iter([0.0, 0.0, 100.0, 100.0, 100.0])  # start, batch 1, then over the limit

    first = run_job(
        slots_db,
        # unpaced: a pause would read this test's clock, whose ticks are counted
        {**DRAIN, **UNPACED, "batch_size": 10, "runners": 1, "max_run_duration_seconds": 30},
        clock=lambda: next(ticks),
    )

    state = table_state(slots_db)
    assert (first.expired_count, first.batches, first.stop_reason) == (10, 1, "max_duration")
    assert first.backlog == 15
    assert [state[i][0] for i in ids] == ["Expired"] * 10 + ["Available"] * 15

    second = run_job(slots_db, {**DRAIN, "batch_size": 10, "runners": 1})

    assert (second.expired_count, second.batches, second.stop_reason) == (15, 2, "drained")
    assert second.backlog == 0
    assert {state[1] for state in table_state(slots_db).values()} == {2}


def test_slot_locked_by_an_in_flight_booking_is_skipped_and_the_booking_wins(
    slots_db: Database,
):
    slot, other = insert_due(slots_db, 2)
    booking = slots_db.connect()
    try:
        booking.execute(
            "select 1 from calendar.availability_slots where id = %s for update", (slot,)
        )
        run = new_run()

        result = run_job(slots_db, run=run)

        assert (result.expired_count, result.skipped_locked_count) == (1, 1)
        assert run.metrics.counters[se.M_SKIP_LOCKED] == 1
        booking.execute(
            "update calendar.availability_slots set status = 'Booked', version = version + 1"
            " where id = %s and status = 'Available'",
            (slot,),
        )
        booking.commit()
    finally:
        booking.close()

    state = table_state(slots_db)
    assert state[slot][:2] == ("Booked", 2)
    assert state[other][:2] == ("Expired", 2)
    assert run_job(slots_db).expired_count == 0
    assert table_state(slots_db)[slot][:2] == ("Booked", 2)


def test_slot_booked_before_the_cycle_is_out_of_the_selection(slots_db: Database):
    (slot,) = insert_due(slots_db, 1)
    with slots_db.connect() as booking:
        booking.execute(
            "update calendar.availability_slots set status = 'Booked', version = version + 1"
            " where id = %s and status = 'Available'",
            (slot,),
        )

    result = run_job(slots_db)

    assert (result.expired_count, result.skipped_locked_count) == (0, 0)
    assert table_state(slots_db)[slot][:2] == ("Booked", 2)


def book(db: Database, slot_id) -> str:
    """A book-slot stand-in: lock the slot, check it is still Available, book it."""
    with db.connect(application_name="booking") as conn:
        row = conn.execute(
            "select status from calendar.availability_slots where id = %s for update",
            (slot_id,),
        ).fetchone()
        if row is None or row[0] != "Available":
            return "CAL_SLOT_NOT_AVAILABLE"
        conn.execute(
            "update calendar.availability_slots set status = 'Booked', version = version + 1"
            " where id = %s",
            (slot_id,),
        )
    return "BOOKED"


def test_when_expiry_wins_the_concurrent_booking_gets_slot_not_available(slots_db: Database):
    (slot,) = insert_due(slots_db, 1)
    with gate(slots_db, slot) as release:
        job = Background(lambda: run_job(slots_db))
        job.start()
        wait_at_gate(slots_db)  # the job holds the slot's row lock, mid-statement
        booking = Background(lambda: book(slots_db, slot))
        booking.start()
        wait_for(
            lambda: backends_waiting(slots_db, "transactionid", "booking") > 0,
            "the booking waiting for the slot's row lock",
        )
        release()
        result = job.result()

    assert booking.result() == "CAL_SLOT_NOT_AVAILABLE"
    assert result.expired_count == 1
    assert table_state(slots_db)[slot][:2] == ("Expired", 2)


@pytest.mark.parametrize(
    "poison_kind",
    ["trigger", "constraint", "bad_value"],
)
def test_poison_row_is_isolated_logged_alerted_and_the_rest_of_the_batch_commits(
    slots_db: Database, caplog: pytest.LogCaptureFixture, poison_kind: str
):
    ids = insert_due(slots_db, 40)
    poison = ids[17]
    with slots_db.connect() as conn:
        if poison_kind == "trigger":
            conn.execute("insert into public.slot_poison (id) values (%s)", (poison,))
        elif poison_kind == "constraint":  # a bad end_at only an expired row is checked for
            conn.execute(
                "update calendar.availability_slots set end_at = start_at - interval '1 minute'"
                " where id = %s",
                (poison,),
            )
            conn.execute(
                "alter table calendar.availability_slots add constraint expired_ends_after_start"
                " check (status <> 'Expired' or end_at > start_at) not valid"
            )
        else:  # version at the integer limit: version + 1 overflows
            conn.execute(
                "update calendar.availability_slots set version = 2147483647 where id = %s",
                (poison,),
            )
    before = table_state(slots_db)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = new_run()

    result = run_job(slots_db, {**DRAIN, "batch_size": 25}, run=run)

    after = table_state(slots_db)
    assert after[poison] == before[poison]
    assert all(after[i][:2] == ("Expired", before[i][1] + 1) for i in ids if i != poison)
    assert (result.expired_count, result.errors_count) == (39, 1)
    assert result.poison[0].slot_id == str(poison)
    assert result.backlog == 1
    assert run.metrics.counters[M_ERRORS] == 1
    assert [(a.name, a.details["slot_id"]) for a in run.alerts.sent] == [
        (POISON_ALERT, str(poison))
    ]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("event=item_failed" in m and f"slot_id={poison}" in m for m in errors)

    again = run_job(slots_db, {**DRAIN, "batch_size": 25})  # left for the next cycle, still failing

    assert (again.expired_count, again.errors_count) == (0, 1)
    assert table_state(slots_db)[poison] == before[poison]


def test_runner_held_mid_batch_keeps_its_rows_and_a_parallel_runner_takes_the_rest(
    slots_db: Database,
):
    ids = insert_due(slots_db, 30)
    # The gate sits on the batch's last row: by the time it is updated, all ten are locked.
    with gate(slots_db, ids[9]) as release:
        held = Background(lambda: run_job(slots_db, {**DRAIN, "batch_size": 10}, app="runner-a"))
        held.start()
        wait_at_gate(slots_db, "runner-a")  # runner A has locked the 10 oldest

        other = run_job(slots_db, {**DRAIN, "batch_size": 10}, app="runner-b")

        assert (other.expired_count, other.skipped_locked_count) == (20, 10)
        release()
        first = held.result()

    assert first.expired_count + other.expired_count == 30
    assert first.expired_count == 10
    assert {s[:2] for s in table_state(slots_db).values()} == {("Expired", 2)}


def test_three_concurrent_runs_expire_each_slot_exactly_once(slots_db: Database):
    insert_due(slots_db, 3000)
    start = threading.Barrier(3)

    def runner(n: int):
        start.wait()
        return run_job(slots_db, {**DRAIN, "batch_size": 50}, app=f"runner-{n}")

    runs = [Background(lambda n=n: runner(n)) for n in range(3)]
    for r in runs:
        r.start()
    results = [r.result(timeout=120) for r in runs]

    assert sum(r.expired_count for r in results) == 3000
    assert statuses(slots_db) == {"Expired": 3000}
    assert {s[1] for s in table_state(slots_db).values()} == {2}  # version + 1, exactly once


def test_cancellation_mid_batch_commits_that_batch_whole_and_releases_the_locks(
    slots_db: Database,
):
    ids = insert_due(slots_db, 30)
    run = new_run()
    with gate(slots_db, ids[3]) as release:
        job = Background(lambda: run_job(slots_db, {**DRAIN, "batch_size": 10}, run=run))
        job.start()
        wait_at_gate(slots_db)
        run.stop.set("SIGTERM received")
        release()
        with pytest.raises(JobCancelled, match="SIGTERM received; 10 slots expired"):
            job.result()

    state = table_state(slots_db)
    assert [state[i][0] for i in ids] == ["Expired"] * 10 + ["Available"] * 20
    assert lock_all_nowait(slots_db) == 30
    assert se.M_LAST_SUCCESS not in run.metrics.gauges


@pytest.mark.parametrize("interrupt", ["pg_cancel_backend", "pg_terminate_backend"])
def test_interrupted_batch_rolls_back_whole_fails_the_run_and_the_next_run_finishes(
    slots_db: Database, interrupt: str
):
    ids = insert_due(slots_db, 30)
    run = new_run()
    with gate(slots_db, ids[14]) as release:  # second batch
        job = Background(
            lambda: run_job(
                slots_db, {**DRAIN, "batch_size": 10, "runners": 1}, run=run, app="victim"
            )
        )
        job.start()
        wait_at_gate(slots_db, "victim")
        (pid,) = backend_pids(slots_db, "victim")
        with slots_db.connect(autocommit=True) as admin:
            if interrupt == "pg_cancel_backend":
                admin.execute("select pg_cancel_backend(%s)", (pid,))
            else:
                admin.execute("select pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            job.result()
        release()

    state = table_state(slots_db)
    assert [state[i][:2] for i in ids] == [("Expired", 2)] * 10 + [("Available", 1)] * 20
    assert run.metrics.counters[M_ERRORS] == 1
    assert lock_all_nowait(slots_db) == 30

    assert run_job(slots_db, {**DRAIN, "batch_size": 10}).expired_count == 20
    assert {s[:2] for s in table_state(slots_db).values()} == {("Expired", 2)}


def test_dry_run_counts_what_would_expire_and_changes_nothing(slots_db: Database):
    insert_due(slots_db, 7)
    with slots_db.connect() as conn:
        insert_slot(conn, start_at=NOW + timedelta(hours=1))
    before = table_state(slots_db)

    result = run_job(slots_db, {**DRAIN, "batch_size": 2}, dry_run=True)

    assert result.as_dict()["WouldExpireCount"] == 7
    assert result.as_dict()["DryRun"] is True
    assert result.expired_count == 0
    assert table_state(slots_db) == before


def test_invalid_config_fails_before_any_connection_naming_the_key(slots_db: Database):
    insert_due(slots_db, 3)
    before = table_state(slots_db)
    opened = []

    def connect():
        opened.append(True)
        raise AssertionError("must not connect")

    run = new_run()
    with pytest.raises(ConfigError, match="batch_size = 0"):
        se.run(connect, {**DRAIN, "batch_size": 0}, run.telemetry, run.stop)
    with pytest.raises(ConfigError, match="max_run_duration_seconds"):
        se.run(connect, {"max_run_duration_seconds": -1}, run.telemetry, run.stop)
    assert opened == []
    assert table_state(slots_db) == before


def test_generated_mix_expires_exactly_the_past_available_slots(db: Database):
    from devtools.slot_data import SlotMix, generate

    mix = SlotMix(past_available=1200, future_available=300, booked_past=200, expired=100,
                  archived=50)  # fmt: skip
    with db.connect() as conn:
        assert generate(conn, mix, now=NOW) == {
            "past_available": 1200,
            "future_available": 300,
            "booked_past": 200,
            "expired": 100,
            "archived": 50,
        }

    result = run_job(db, {**DRAIN, "batch_size": 500})

    # two runners: the first batch (500) alone, then both loops until each comes back short;
    # under SKIP LOCKED the side loop may take rows between the first loop's locks, so the two
    # can end short together (500 + 215 + 485) or one after a full one (500 + 500 + 200 + 0)
    assert (result.expired_count, result.runners) == (1200, 2)
    assert result.batches in {3, 4}
    assert result.backlog == 0
    assert statuses(db) == {"Expired": 1300, "Available": 300, "Booked": 200, "Archived": 50}


# --- two runners in one cycle (config `runners`, default 2) ---------------------------------


def test_two_runners_share_a_backlog_and_expire_each_slot_once(
    slots_db: Database, caplog: pytest.LogCaptureFixture
):
    ids = insert_due(slots_db, 3000)
    caplog.set_level(logging.INFO, logger=LOGGER)

    result = run_job(slots_db, {**DRAIN, "batch_size": 50, "runners": 2})

    assert (result.expired_count, result.runners, result.stop_reason) == (3000, 2, "drained")
    state = table_state(slots_db)
    assert {state[i][:3] for i in ids} == {("Expired", 2, NOW)}  # version + 1, exactly once
    counts: dict[str, list[int]] = {}
    for record in caplog.records:
        if "event=batch_selected" in record.getMessage():
            fields = dict(f.split("=", 1) for f in record.getMessage().split() if "=" in f)
            counts.setdefault(fields["runner"], []).append(int(fields["count"]))
    assert set(counts) == {"1", "2"}
    # each runner took full batches and ended on one short batch (empty, or short because the
    # other runner held the rest of its rows), and together they took every slot once
    for taken in counts.values():
        assert all(count == 50 for count in taken[:-1]) and taken[-1] < 50, counts
    assert sum(map(sum, counts.values())) == 3000
    assert result.batches == sum(map(len, counts.values())) >= 3000 // 50 + 1


def test_a_single_batch_backlog_starts_no_second_runner(slots_db: Database):
    insert_due(slots_db, 7)
    opened = []

    def connect():
        opened.append(True)
        return connect_for(slots_db)()

    run = new_run()
    result = se.run(
        connect, {**DRAIN, "batch_size": 10, "runners": 4}, run.telemetry, run.stop, now=lambda: NOW
    )

    assert (result.expired_count, result.runners, result.batches) == (7, 1, 1)
    assert len(opened) == 2  # the privilege check's (closed at once), then one batch loop


def test_a_second_runner_that_cannot_connect_leaves_the_cycle_to_the_first(
    slots_db: Database, caplog: pytest.LogCaptureFixture
):
    insert_due(slots_db, 25)
    calls = []

    def connect():
        calls.append(True)
        if len(calls) > 2:  # the privilege check's and runner 1's connections open
            raise psycopg.OperationalError("connection refused (test)")
        return connect_for(slots_db)()

    run = new_run()
    result = se.run(
        connect, {**DRAIN, "batch_size": 10, "runners": 2}, run.telemetry, run.stop, now=lambda: NOW
    )

    assert (result.expired_count, result.runners, result.batches) == (25, 1, 3)
    assert statuses(slots_db) == {"Expired": 25}
    assert any("event=runner_not_started" in r.getMessage() for r in caplog.records)


def test_cancellation_with_two_runners_commits_both_batches_in_hand_then_stops(
    slots_db: Database,
):
    ids = insert_due(slots_db, 40)
    run = new_run()
    # Runner 1 commits ids[0:10], starts runner 2; the next two batches each stop at a gate.
    with gate(slots_db, ids[19], ids[29]) as release:
        job = Background(
            lambda: run_job(slots_db, {**DRAIN, "batch_size": 10, "runners": 2}, run=run)
        )
        job.start()
        wait_for(lambda: backends_waiting(slots_db, "advisory") == 2, "both runners at the gate")
        run.stop.set("SIGTERM received")
        release()
        with pytest.raises(JobCancelled, match="SIGTERM received; 30 slots expired"):
            job.result()

    state = table_state(slots_db)
    assert [state[i][:2] for i in ids] == [("Expired", 2)] * 30 + [("Available", 1)] * 10
    assert lock_all_nowait(slots_db) == 40


def test_a_failing_runner_fails_the_run_and_cancels_its_siblings_batch_in_hand(
    slots_db: Database, caplog: pytest.LogCaptureFixture
):
    ids = insert_due(slots_db, 40)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = new_run()
    with gate(slots_db, ids[19], ids[29]) as release:
        job = Background(
            lambda: run_job(
                slots_db, {**DRAIN, "batch_size": 10, "runners": 2}, run=run, app="pair"
            )
        )
        job.start()
        wait_for(lambda: backends_waiting(slots_db, "advisory", "pair") == 2, "both at the gate")
        victim = backend_pids(slots_db, "pair")[0]
        with slots_db.connect(autocommit=True) as admin:
            admin.execute("select pg_terminate_backend(%s)", (victim,))
        wait_for(
            lambda: any("event=job_failed" in r.getMessage() for r in caplog.records),
            "the cycle to fail on the failed runner",
        )
        # the sibling did not wait for the gate: its statement was cancelled (run_lanes' cancel
        # hook), its batch rolled back whole
        release()
        with pytest.raises(psycopg.OperationalError, match="terminat"):
            job.result()

    state = table_state(slots_db)
    assert [state[i][:2] for i in ids[:10]] == [("Expired", 2)] * 10
    middle = [state[i][:2] for i in ids[10:30]]  # both batches in hand rolled back
    assert middle == [("Available", 1)] * 20
    assert [state[i][:2] for i in ids[30:]] == [("Available", 1)] * 10  # nobody went on
    assert run.metrics.counters[M_ERRORS] == 1
    assert lock_all_nowait(slots_db) == 40

    assert run_job(slots_db, {**DRAIN, "batch_size": 10}).expired_count == 30
    assert {s[:2] for s in table_state(slots_db).values()} == {("Expired", 2)}


def test_poison_row_is_isolated_by_whichever_runner_meets_it(slots_db: Database):
    ids = insert_due(slots_db, 60)
    poison = ids[37]
    with slots_db.connect() as conn:
        conn.execute("insert into public.slot_poison (id) values (%s)", (poison,))
    run = new_run()

    result = run_job(slots_db, {**DRAIN, "batch_size": 10, "runners": 2}, run=run)

    assert (result.expired_count, result.errors_count, result.runners) == (59, 1, 2)
    assert [p.slot_id for p in result.poison] == [str(poison)]
    assert table_state(slots_db)[poison][:2] == ("Available", 1)
    assert statuses(slots_db) == {"Expired": 59, "Available": 1}
    assert run.metrics.counters[M_ERRORS] == 1
    assert [a.name for a in run.alerts.sent] == [POISON_ALERT]


# --- a slot updated (not booked) between the statement's snapshot and its row lock ----------

SCAN_GATE_KEY = 4343
SCAN_GATE = """
create table public.slot_scan_gate (id uuid primary key);
-- Called for every row the job's scan reads (a row-level security policy, which applies to the
-- job's role, not to the tables' owner): reading a gated slot waits on advisory lock 4343,
-- after the statement took its snapshot. It reads the gate as its owner (security definer).
create function public.slot_scan_wait(slot uuid) returns boolean
language plpgsql volatile security definer as $$
begin
  if exists (select 1 from public.slot_scan_gate g where g.id = slot) then
    perform pg_advisory_xact_lock_shared(4343);
  end if;
  return true;
end $$;
alter table calendar.availability_slots enable row level security;
create policy slot_scan_wait on calendar.availability_slots using (public.slot_scan_wait(id));
"""


def test_a_slot_updated_after_the_snapshot_but_before_the_lock_still_expires(
    slots_db: Database,
):
    """The ctid join back cannot see a row version newer than the statement's snapshot; the
    lock follows such an update, so the row is expired by id in the same transaction."""
    first, moved, *rest = insert_due(slots_db, 4)
    with slots_db.connect() as conn:
        conn.execute(SCAN_GATE)
        conn.execute("insert into public.slot_scan_gate (id) values (%s)", (first,))
    before = table_state(slots_db)
    end_before = end_at(slots_db, moved)
    settings = SessionSettings(
        statement_timeout_ms=60_000, lock_timeout_ms=60_000, application_name="scan-gated"
    )
    connect = job_connect(slots_db, se.JOB, settings)
    run = new_run()
    holder = slots_db.connect(autocommit=True)
    try:
        holder.execute("select pg_advisory_lock(%s)", (SCAN_GATE_KEY,))
        job = Background(
            lambda: se.run(
                connect,
                {**DRAIN, "batch_size": 10, "runners": 1},
                run.telemetry,
                run.stop,
                now=lambda: NOW,
            )
        )
        job.start()
        # the batch statement has its snapshot and waits while reading the oldest slot
        wait_for(lambda: backends_waiting(slots_db, "advisory", "scan-gated") == 1, "the scan")
        with slots_db.connect() as other:  # an edit that keeps the slot Available, committed
            other.execute(
                "update calendar.availability_slots set end_at = end_at + interval '5 minutes'"
                " where id = %s",
                (moved,),
            )
        holder.execute("select pg_advisory_unlock(%s)", (SCAN_GATE_KEY,))
        result = job.result()
    finally:
        holder.close()

    after = table_state(slots_db)
    assert result.expired_count == 4
    for slot_id in (first, moved, *rest):
        assert after[slot_id][:3] == ("Expired", before[slot_id][1] + 1, NOW)
    assert end_at(slots_db, moved) == end_before + timedelta(minutes=5)  # the edit is kept


def end_at(db: Database, slot_id):
    with db.connect() as conn:
        row = conn.execute(
            "select end_at from calendar.availability_slots where id = %s", (slot_id,)
        ).fetchone()
    return row[0]
