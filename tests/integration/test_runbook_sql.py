"""Every SQL block of docs/runbooks/ runs in real psql and returns what its runbook says.

A block is matched to its check by the runbook file and a fragment of its text; a block with no
check (a new query) or a check with no block (a query removed or rewritten) fails
:func:`test_every_runbook_query_has_a_check`. Data is seeded on the reference schema, or made
by the job itself where the runbook talks about what the job wrote (``last_error`` values, a
failed retention batch, a held advisory lock).
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from devtools.pg import Database
from devtools.retention_data import insert_session
from devtools.selections_service import SelectionsService
from include.pin_maintenance import sql
from include.pin_maintenance.db import advisory_lock, lock_key
from include.pin_maintenance.jobs import activity_retention, slot_expiration, snapshot_detach
from include.pin_maintenance.jobs.activity_retention_walk import BatchFailed
from include.pin_maintenance.jobs.slot_expiration_batch import COUNT_CAP
from include.pin_maintenance.server_version import SUPPORTED_MAJORS
from include.pin_maintenance.stopping import StopSignal
from tests.environment import external_postgres_url, requested_major
from tests.integration.runbook_sql import RUNBOOKS, Block, psql_binary, run_psql, sql_blocks
from tests.integration.snapshot_detach_fixtures import config as detach_config
from tests.integration.snapshot_detach_fixtures import insert_entry, run_job
from tests.job_db import job_connect, job_telemetry, job_url

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(psql_binary() is None, reason="no psql client (embedded or on PATH)"),
]

Check = Callable[[Database, Block], None]
CHECKS: dict[tuple[str, str], Check] = {}


def check(runbook: str, fragment: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS[(runbook, fragment)] = fn
        return fn

    return register


def _matching(block: Block) -> list[tuple[str, str]]:
    return [key for key in CHECKS if key[0] == block.runbook and key[1] in block.sql]


BLOCKS = sql_blocks()


def test_every_runbook_query_has_a_check() -> None:
    assert BLOCKS, "no sql blocks found in docs/runbooks"
    for block in BLOCKS:
        assert len(_matching(block)) == 1, f"{block.name} needs exactly one check:\n{block.sql}"
    used = {key for block in BLOCKS for key in _matching(block)}
    assert used == set(CHECKS), f"checks without a block: {set(CHECKS) - used}"


def test_no_block_uses_python_placeholders() -> None:
    for block in BLOCKS:
        assert "%(" not in block.sql, f"{block.name}: psql does not know %(name)s"
        code = "\n".join(line.split("--", 1)[0] for line in block.sql.splitlines())
        assert not re.search(r"<[a-z][^>]*>", code), f"{block.name}: use a psql variable"


def test_the_blocks_run_in_the_psql_of_the_server_s_major(db: Database) -> None:
    """An operator pastes these into the psql their server's packages bring (Debian 12's is 15),
    so the client is the server's major; on a server of ``PIN_PG_URL`` it is whatever psql this
    machine has, at least the oldest major the jobs support."""
    version = subprocess.run(
        [psql_binary(), "--version"], capture_output=True, text=True, check=True
    )
    client = int(re.search(r"\(PostgreSQL\) (\d+)", version.stdout).group(1))
    with db.connect() as conn:
        server = int(conn.execute("show server_version_num").fetchone()[0]) // 10000
    if external_postgres_url() and requested_major() is None:
        assert client >= min(SUPPORTED_MAJORS), version.stdout
    else:
        assert client == server, version.stdout


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_runbook_query(db, block: Block) -> None:
    [key] = _matching(block)
    CHECKS[key](db, block)


# ------------------------------------------------------------------------------- helpers


def psql(db: Database, block: Block, **variables: object):
    return run_psql(db.url, block.sql, {k: str(v) for k, v in variables.items()})


def days_ago(days: float) -> datetime:
    return datetime.now(UTC) - timedelta(days=days)


def add_slot(conn: psycopg.Connection, *, start_in: timedelta, status: str = "Available"):
    slot_id = uuid.uuid4()
    start = datetime.now(UTC) + start_in
    conn.execute(
        "insert into calendar.availability_slots (id, tenant_id, consultant_id, start_at, end_at,"
        " status, version, created_at, updated_at)"
        " values (%s, %s, %s, %s, %s, %s, 1, %s, %s)",
        (slot_id, uuid.uuid4(), uuid.uuid4(), start, start + timedelta(minutes=30), status)
        + (start - timedelta(days=7),) * 2,
    )
    return slot_id, start


@contextmanager
def open_transaction(db: Database, app: str) -> Iterator[psycopg.Connection]:
    """A session with a transaction left open (as a hung worker or a person's psql would)."""
    conn = psycopg.connect(db.url)
    try:
        conn.execute("select set_config('application_name', %s, false)", (app,))
        conn.commit()
        conn.execute("select 1")  # the transaction is open now (xact_start set)
        yield conn
    finally:
        conn.close()


LOCK_JOBS = {
    activity_retention.LOCK_NAME: activity_retention.JOB,
    snapshot_detach.LOCK_NAME: snapshot_detach.JOB,
}


@contextmanager
def job_lock_held(db: Database, lock_name: str) -> Iterator[int]:
    """The job's own advisory lock, taken by the job's own code as its own role; yields the
    holder's pid."""
    pids: list[int] = []
    url = job_url(db, LOCK_JOBS[lock_name])

    def connect() -> psycopg.Connection:
        conn = psycopg.connect(url)
        pids.append(conn.info.backend_pid)
        return conn

    with advisory_lock(connect, lock_name, ttl_seconds=600) as held:
        assert held
        yield pids[0]


def lock_is_free(db: Database, lock_name: str) -> bool:
    with db.connect() as conn:
        free = conn.execute("select pg_try_advisory_xact_lock(%s)", (lock_key(lock_name),))
        return bool(free.fetchone()[0])


def wait_until(predicate: Callable[[], bool], what: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.05)


def backend_alive(db: Database, pid: int) -> bool:
    with db.connect() as conn:
        row = conn.execute("select count(*) from pg_stat_activity where pid = %s", (pid,))
        return row.fetchone()[0] > 0


def one(rows: list[dict[str, str]]) -> dict[str, str]:
    assert len(rows) == 1, rows
    return rows[0]


# ----------------------------------------------------------- activity-retention-backlog.md


@check("activity-retention-backlog.md", "as eligible, min(ended_at) as oldest_ended")
def _eligible_backlog(db: Database, block: Block) -> None:
    with db.connect() as conn:
        oldest = insert_session(conn, ended_at=days_ago(800))
        insert_session(conn, ended_at=days_ago(400))
        insert_session(conn, ended_at=days_ago(366))
        insert_session(conn, ended_at=days_ago(364))  # young
        insert_session(conn, ended_at=None, status="Active")
        # not Inactive: never eligible
        insert_session(conn, ended_at=days_ago(500), status="Active")
        ended = conn.execute(
            "select ended_at from user_activity.sessions where id = %s", (oldest,)
        ).fetchone()[0]
        cutoff = conn.execute("select now() - interval '365 days'").fetchone()[0]
        gauge = conn.execute(
            sql.load("retention/count_eligible_sessions"), {"cutoff": cutoff}
        ).fetchone()[0]
    row = one(psql(db, block).rows())
    assert int(row["eligible"]) == 3 == gauge  # what the job's gauge counts
    assert datetime.fromisoformat(row["oldest_ended"]) == ended


@check("activity-retention-backlog.md", "each child table counted on its own")
def _children_of_oldest(db: Database, block: Block) -> None:
    with db.connect() as conn:
        insert_session(conn, ended_at=days_ago(700), events=12, views=2)
        insert_session(conn, ended_at=days_ago(600), events=3, views=0)
        insert_session(conn, ended_at=days_ago(500))
        insert_session(conn, ended_at=days_ago(30), events=50, views=50)  # young: not counted
    row = one(psql(db, block).rows())
    assert row == {"sessions": "3", "action_events": "15", "property_object_views": "2"}


@check("activity-retention-backlog.md", "from pg_stat_user_tables")
def _table_sizes(db: Database, block: Block) -> None:
    rows = psql(db, block).rows()
    assert [r["relname"] for r in rows] == [
        "action_events",
        "property_object_view_stats",
        "property_object_views",
        "sessions",
    ]
    assert all(r["pg_size_pretty"] for r in rows)


# ---------------------------------------------------------- database-server-unsupported.md


@check("database-server-unsupported.md", "current_setting('server_version_num')::int / 10000")
def _server_major(db: Database, block: Block) -> None:
    row = one(psql(db, block).rows())
    with db.connect() as conn:
        version = conn.info.server_version
    assert row["major"] == str(version // 10000)
    assert row["server_version"].startswith(f"{version // 10000}.")
    assert row["database"] == db.name


# ----------------------------------------------------------- activity-retention-failure.md

EXTRA_FK = """
create table user_activity.session_notes (
  id uuid primary key,
  session_id uuid not null references user_activity.sessions (id) on delete restrict
)"""


@check("activity-retention-failure.md", "(s.ended_at, s.id) >= (f.ended_at, f.id)")
def _failed_batch(db: Database, block: Block) -> None:
    """A real failed batch: a service's new RESTRICT FK blocks one session of the 3rd batch."""
    base = datetime.now(UTC) - timedelta(days=500)
    with db.connect() as conn:
        conn.execute(EXTRA_FK)
        # ties on ended_at (three sessions a minute) so the batch order needs the id as well
        eligible = [
            insert_session(conn, ended_at=base + timedelta(minutes=i // 3)) for i in range(23)
        ]
        insert_session(conn, ended_at=days_ago(10))
        ordered = [
            r[0]
            for r in conn.execute(
                "select id from user_activity.sessions where id = any(%s) order by ended_at, id",
                (eligible,),
            ).fetchall()
        ]
        blocked = ordered[12]  # batch 3 of 5-session batches: ordered[10:15]
        conn.execute(
            "insert into user_activity.session_notes values (%s, %s)", (uuid.uuid4(), blocked)
        )
    connect = job_connect(db, activity_retention.JOB)
    telemetry = job_telemetry(activity_retention.JOB, "runbook")
    cfg = activity_retention.CONFIG.resolve(None, {"batch_size": 5})
    plan = activity_retention.prepare(connect, cfg, telemetry)
    with pytest.raises(BatchFailed):
        activity_retention.delete_step(connect, plan, "sessions", telemetry, StopSignal())
    [alert] = telemetry.alerts.sent
    assert alert.name == "retention_batch_failed"
    ids = alert.details["batch_ids"]

    rows = psql(db, block, first_id=ids["first"], last_id=ids["last"]).rows()

    assert [uuid.UUID(r["id"]) for r in rows] == ordered[10:15]  # exactly the failed batch
    assert len(rows) == ids["count"]
    assert {r["status"] for r in rows} == {"Inactive"}


@check("activity-retention-failure.md", "from pg_constraint")
def _foreign_keys_to_sessions(db: Database, block: Block) -> None:
    rows = psql(db, block).rows()
    assert sorted((r["child"], r["confdeltype"]) for r in rows) == [
        ("user_activity.action_events", "r"),
        ("user_activity.property_object_views", "r"),
    ]  # "only these are expected" on the reference schema
    with db.connect() as conn:
        conn.execute(EXTRA_FK)
    children = {r["child"] for r in psql(db, block).rows()}
    assert "user_activity.session_notes" in children  # the unknown FK the runbook looks for


# ---------------------------------------------------------- database-privileges-missing.md


@check("database-privileges-missing.md", "has_any_column_privilege")
def _job_role_privileges(db: Database, block: Block) -> None:
    role = db.roles["user_activity_db"].name
    rows = {r["job_table"]: r for r in psql(db, block, role=role).rows()}
    assert set(rows) == {
        "news.snapshot_detach_outbox",
        "calendar.availability_slots",
        "user_activity.sessions",
        "user_activity.property_object_views",
        "user_activity.action_events",
        "user_activity.property_object_view_stats",
    }
    granted = ("schema_usage", "can_select", "can_lock_rows", "can_delete")
    assert [rows["user_activity.sessions"][k] for k in granted] == ["t", "t", "t", "t"]
    assert [rows["user_activity.action_events"][k] for k in granted] == ["t", "t", "f", "t"]
    stats = rows["user_activity.property_object_view_stats"]
    assert [stats[k] for k in granted[1:]] == ["f", "f", "f"]  # nothing there
    assert rows["news.snapshot_detach_outbox"]["schema_usage"] == "f"  # another role's
    with db.connect() as conn:  # what the alert would name shows up here
        conn.execute(f'revoke update (created_at) on user_activity.sessions from "{role}"')
    after = {r["job_table"]: r for r in psql(db, block, role=role).rows()}
    assert after["user_activity.sessions"]["can_lock_rows"] == "f"


# -------------------------------------------------------------- activity-retention-lock.md


@check("activity-retention-lock.md", "from pg_locks l")
def _retention_lock_holder(db: Database, block: Block) -> None:
    key = lock_key(activity_retention.LOCK_NAME)
    assert str(key) in block.sql  # the key the runbook quotes is the job's key
    assert psql(db, block).rows() == []
    with job_lock_held(db, activity_retention.LOCK_NAME) as pid:
        row = one(psql(db, block).rows())
    assert int(row["pid"]) == pid
    assert row["held_for"]


@check("activity-retention-lock.md", "pg_terminate_backend(:pid)")
def _retention_terminate(db: Database, block: Block) -> None:
    _terminate_frees_the_lock(db, block, activity_retention.LOCK_NAME)


def _terminate_frees_the_lock(db: Database, block: Block, lock_name: str) -> None:
    holder = psycopg.connect(db.url)
    try:
        pid = holder.info.backend_pid
        holder.execute("select pg_try_advisory_xact_lock(%s)", (lock_key(lock_name),))
        assert not lock_is_free(db, lock_name)
        row = one(psql(db, block, pid=pid).rows())
        assert row["pg_terminate_backend"] == "t"
        wait_until(lambda: not backend_alive(db, pid), f"backend {pid} gone")
        assert lock_is_free(db, lock_name)
    finally:
        holder.close()


# ------------------------------------------------------------------- deadline-missed.md


@check("deadline-missed.md", "now() - xact_start as xact_age")
def _long_transactions(db: Database, block: Block) -> None:
    with open_transaction(db, "runbook-hung-task") as conn:
        pid = conn.info.backend_pid
        rows = psql(db, block).rows()
    [held] = [r for r in rows if int(r["pid"]) == pid]
    assert held["application_name"] == "runbook-hung-task"
    assert held["state"] == "idle in transaction"
    assert rows[0]["pid"] == held["pid"]  # oldest first: it opened before psql's own


# ------------------------------------------------------------ slot-expiration-backlog.md


@check("slot-expiration-backlog.md", "count(*) as backlog, min(start_at) as oldest_start")
def _slot_backlog(db: Database, block: Block) -> None:
    with db.connect() as conn:
        _, oldest = add_slot(conn, start_in=timedelta(hours=-5))
        add_slot(conn, start_in=timedelta(hours=-1))
        add_slot(conn, start_in=timedelta(minutes=-1))
        add_slot(conn, start_in=timedelta(hours=1))  # future
        add_slot(conn, start_in=timedelta(hours=-9), status="Booked")
        add_slot(conn, start_in=timedelta(hours=-9), status="Expired")
        gauge = conn.execute(
            sql.load("slots/count_backlog"),
            {"now": datetime.now(UTC), "count_cap": COUNT_CAP},
        ).fetchone()[0]
    row = one(psql(db, block).rows())
    assert int(row["backlog"]) == 3 == gauge  # what the backlog gauge reports
    assert datetime.fromisoformat(row["oldest_start"]) == oldest


@check("slot-expiration-backlog.md", "l.relation = 'calendar.availability_slots'::regclass")
def _slot_row_lock_holders(db: Database, block: Block) -> None:
    with db.connect() as conn:
        slot_id, _ = add_slot(conn, start_in=timedelta(hours=-1))
    assert psql(db, block).rows() == []
    with open_transaction(db, "booking-service") as holder:
        holder.execute(
            "select id from calendar.availability_slots where id = %s for update", (slot_id,)
        )
        pid = holder.info.backend_pid
        row = one(psql(db, block).rows())
    assert int(row["pid"]) == pid
    assert row["application_name"] == "booking-service"


@check("slot-expiration-backlog.md", "from pg_indexes")
def _slot_indexes(db: Database, block: Block) -> None:
    names = {r["indexname"] for r in psql(db, block).rows()}
    assert "ix_availability_slots_status_start" in names


@check("slot-expiration-backlog.md", "from pg_stat_replication")
def _slot_replicas(db: Database, block: Block) -> None:
    # the test server streams to no replica: the query runs and finds none
    assert psql(db, block).rows() == []


@check("slot-expiration-backlog.md", "as wal_mb_per_s")
def _slot_wal_rate(db: Database, block: Block) -> None:
    # a session writing WAL throughout: 2,000 slots a statement, a few MB/s at least
    stop = threading.Event()

    def write() -> None:
        with psycopg.connect(db.url, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute(
                    "insert into calendar.availability_slots (id, tenant_id, consultant_id,"
                    " start_at, end_at, status, version, created_at, updated_at)"
                    " select gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), now(),"
                    " now(), 'Booked', 1, now(), now() from generate_series(1, 2000)"
                )

    writer = threading.Thread(target=write)
    writer.start()
    try:
        run = psql(db, block)
    finally:
        stop.set()
        writer.join(30)
    (row,) = run.rows(1)  # after the pg_sleep
    assert float(row["wal_mb_per_s"]) > 0.1, row


@check("slot-expiration-backlog.md", "group by application_name order by count(*) desc")
def _slot_busy_sessions(db: Database, block: Block) -> None:
    started = threading.Event()

    def busy() -> None:
        with psycopg.connect(db.url, application_name="booking-service") as conn:
            started.set()
            conn.execute("select pg_sleep(3)")

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        started.wait(10)
        rows = []
        for _ in range(20):  # until the sleep is under way
            rows = psql(db, block).rows()
            if any(r["application_name"] == "booking-service" for r in rows):
                break
            time.sleep(0.1)
        counts = {r["application_name"]: int(r["count"]) for r in rows}
        assert counts.get("booking-service") == 1, rows
    finally:
        worker.join(10)


# ------------------------------------------------------- slot-expiration-poison-slot.md

POISON_TRIGGER = """
create function public.reject_slot() returns trigger language plpgsql as $$
begin
  if old.id = '{slot_id}' then
    raise exception 'slot % is frozen by the billing migration', old.id;
  end if;
  return new;
end $$;
create trigger reject_slot before update on calendar.availability_slots
  for each row execute function public.reject_slot();
"""


@check("slot-expiration-poison-slot.md", "the slot from details.slot_id")
def _poison_slot_row(db: Database, block: Block) -> None:
    with db.connect() as conn:
        slot_id, _ = add_slot(conn, start_in=timedelta(hours=-1))
        add_slot(conn, start_in=timedelta(hours=-2))
    row = one(psql(db, block, slot_id=slot_id).rows())
    assert row["id"] == str(slot_id) and row["status"] == "Available"


@check("slot-expiration-poison-slot.md", "group by status")
def _slot_statuses(db: Database, block: Block) -> None:
    with db.connect() as conn:
        for status in ("Available", "Available", "Booked", "Blocked"):
            add_slot(conn, start_in=timedelta(hours=-1), status=status)
    rows = psql(db, block).rows()
    assert {r["status"]: int(r["count"]) for r in rows} == {
        "Available": 2,
        "Booked": 1,
        "Blocked": 1,  # the unexpected value the runbook looks for
    }


@check("slot-expiration-poison-slot.md", "reproduce the failing update")
def _reproduce_poison(db: Database, block: Block) -> None:
    with db.connect() as conn:
        poison, _ = add_slot(conn, start_in=timedelta(hours=-1))
        good, _ = add_slot(conn, start_in=timedelta(hours=-2))
        conn.execute(POISON_TRIGGER.replace("{slot_id}", str(poison)))

    # the job meets the poison row: what it alerts is what the runbook's update reproduces
    telemetry = job_telemetry(slot_expiration.JOB, "runbook")
    connect = job_connect(db, slot_expiration.JOB)
    slot_expiration.run(connect, {}, telemetry, StopSignal())
    [alert] = telemetry.alerts.sent
    assert alert.details["slot_id"] == str(poison)

    failing = psql(db, block, slot_id=poison)
    assert failing.returncode != 0
    assert f"slot {poison} is frozen by the billing migration" in failing.stderr
    # the alert names the error's class and SQLSTATE only; the update shows its text
    assert alert.details["error"] == "RaiseException P0001"
    assert "frozen" not in json.dumps(dict(alert.details))

    with db.connect() as conn:  # nothing changed: the good row was expired by the job only
        conn.execute("drop trigger reject_slot on calendar.availability_slots")
        conn.execute(
            "update calendar.availability_slots set status = 'Available' where id = %s", (good,)
        )
    ok = psql(db, block, slot_id=good)
    assert ok.returncode == 0, ok.stderr
    with db.connect() as conn:
        rows = conn.execute(
            "select id, status, version from calendar.availability_slots order by id"
        ).fetchall()
    assert {(r[0], r[1]) for r in rows} == {(poison, "Available"), (good, "Available")}


# ------------------------------------------------------------- snapshot-detach-pending.md


@check("snapshot-detach-pending.md", "backlog by status and the oldest Pending row")
def _detach_backlog(db: Database, block: Block) -> None:
    insert_entry(db, created_ago=timedelta(hours=3), attempts=4)
    insert_entry(db, created_ago=timedelta(minutes=5))
    insert_entry(db, status="Quarantined", attempts=12)
    for _ in range(3):
        insert_entry(db, status="Done", attempts=1)
    rows = {r["status"]: r for r in psql(db, block).rows()}
    assert set(rows) == {"Pending", "Quarantined"}
    assert rows["Pending"]["count"] == "2" and rows["Pending"]["max_attempts"] == "4"
    assert rows["Quarantined"]["count"] == "1"


@check("snapshot-detach-pending.md", "what the failures are")
def _detach_failures(db: Database, block: Block) -> None:
    with SelectionsService(slow_seconds=5) as svc:
        for behaviour in ("error_503", "error_500", "slow", "drop"):
            svc.script(insert_entry(db, attempts=1).snapshot_id, behaviour)
        run_job(db, svc)  # detach_call_timeout 1 s: "slow" times out
        # a Retry-After of 120 s ends a run's calls (the rows not yet called keep their
        # attempt), so the 429 gets a run of its own: the rows above are not due again yet
        svc.script(insert_entry(db, attempts=1).snapshot_id, "rate_limited")
        run_job(db, svc)
        auth = insert_entry(db)  # a fresh row: its attempt is given back on 401 (attempts 0)
        svc.script(auth.snapshot_id, "unauthorized")
        run_job(db, svc, password="wrong")
    errors = {r["last_error"] for r in psql(db, block).rows()}
    assert errors == {
        "HttpServerError 503",
        "HttpServerError 500",
        "Timeout",
        "ConnectionError",
        f"HttpTooManyRequests 429 retry_after={svc.retry_after_seconds:g}s",
        "HttpUnauthorized 401",
    }
    text = _runbook("snapshot-detach-pending.md")
    for value in ("HttpServerError 503", "Timeout", "ConnectionError", "HttpUnauthorized 401"):
        assert f"`{value}`" in text, value  # the runbook names what the job wrote
    assert "`HttpTooManyRequests 429 retry_after=<n>s`" in text


@check("snapshot-detach-pending.md", "rows due now that the job has not picked up")
def _detach_due_now(db: Database, block: Block) -> None:
    insert_entry(db, due_in=timedelta(minutes=-10))
    insert_entry(db, due_in=timedelta(seconds=-1))
    insert_entry(db, due_in=timedelta(minutes=10))
    insert_entry(db, status="Quarantined", due_in=timedelta(minutes=-10))
    with db.connect() as conn:
        job_count = conn.execute(
            sql.load("news/count_due_entries"), {"now": datetime.now(UTC)}
        ).fetchone()[0]
    assert one(psql(db, block).rows())["count"] == "2" == str(job_count)


# ----------------------------------------------------------- snapshot-detach-misrouted.md


@check("snapshot-detach-misrouted.md", "the rows this run quarantined")
def _detach_misrouted(db: Database, block: Block) -> None:
    for _ in range(12):
        insert_entry(db)
    insert_entry(db, status="Quarantined", attempts=12)  # an older quarantine, another cause
    with SelectionsService() as svc:
        svc.set_outage("not_found")  # every call answers 404: a wrong route
        result = run_job(db, svc)
    assert result.misrouted
    counts = {(r["status"], r["last_error"]): int(r["count"]) for r in psql(db, block).rows()}
    # misroute_quarantine_limit's default quarantined; the 404 that stopped the calls (and any
    # in flight) given back as Pending, marked; the older quarantine is not listed
    assert counts.pop(("Quarantined", "HttpNotFound 404")) == 5
    assert set(counts) <= {("Pending", "HttpNotFound 404; route suspect")}
    assert 1 <= sum(counts.values()) <= 12 - 5


# --------------------------------------------------------- snapshot-detach-quarantined.md

QUARANTINE_CAUSES = {
    "not_found": "HttpNotFound 404",
    "bad_request": "HttpBadRequest 400",
    "error_503": "HttpServerError 503; max_attempts 12 reached",
    "slow": "Timeout; max_attempts 12 reached",
    "drop": "ConnectionError; max_attempts 12 reached",
}


def _quarantine_by_the_job(db: Database) -> dict[str, str]:
    """Rows quarantined by a real run, one per cause the runbook lists; snapshot -> cause."""
    made = {}
    with SelectionsService(slow_seconds=5) as svc:
        for behaviour, cause in QUARANTINE_CAUSES.items():
            entry = insert_entry(db, attempts=11)  # the next failure is the 12th attempt
            svc.script(entry.snapshot_id, behaviour)
            made[entry.snapshot_id] = cause
        unknown = insert_entry(db, reason="Migrated")
        made[unknown.snapshot_id] = "UnknownReason"
        run_job(db, svc, cfg=detach_config(max_attempts=12))
    return made


@check("snapshot-detach-quarantined.md", "order by updated_at desc")
def _quarantined_rows(db: Database, block: Block) -> None:
    made = _quarantine_by_the_job(db)
    insert_entry(db)  # Pending, not listed
    rows = psql(db, block).rows()
    assert {r["snapshot_id"]: r["last_error"] for r in rows} == made


@check("snapshot-detach-quarantined.md", "group by last_error, reason")
def _quarantined_by_cause(db: Database, block: Block) -> None:
    made = _quarantine_by_the_job(db)
    rows = psql(db, block).rows()
    assert {r["last_error"] for r in rows} == set(made.values())
    text = _runbook("snapshot-detach-quarantined.md")
    for cause in ("HttpNotFound 404", "UnknownReason", "HttpServerError 503; max_attempts"):
        assert f"`{cause}" in text, cause  # the runbook names what the job wrote


@check("snapshot-detach-quarantined.md", "any(:'snapshot_ids'::uuid[])")
def _requeued_reach_done(db: Database, block: Block) -> None:
    done = insert_entry(db, status="Done")
    pending = insert_entry(db)
    other = insert_entry(db, status="Quarantined")
    rows = psql(db, block, snapshot_ids=f"{{{done.snapshot_id},{pending.snapshot_id}}}").rows()
    assert {r["status"]: r["count"] for r in rows} == {"Done": "1", "Pending": "1"}
    assert other.snapshot_id not in str(rows)


# ------------------------------------------------------ snapshot-detach-worker-stopped.md


@check("snapshot-detach-worker-stopped.md", "holders of advisory locks, oldest first")
def _detach_lock_holders(db: Database, block: Block) -> None:
    key = lock_key(snapshot_detach.LOCK_NAME)
    assert str(key) in block.sql  # the key the runbook quotes is the job's key
    with job_lock_held(db, snapshot_detach.LOCK_NAME) as pid:
        rows = psql(db, block).rows()
    [row] = [r for r in rows if int(r["pid"]) == pid]
    assert int(row["lock_key"]) == key


@check("snapshot-detach-worker-stopped.md", "pg_terminate_backend(:pid)")
def _detach_terminate(db: Database, block: Block) -> None:
    _terminate_frees_the_lock(db, block, snapshot_detach.LOCK_NAME)


def _runbook(name: str) -> str:
    return (RUNBOOKS / name).read_text()
