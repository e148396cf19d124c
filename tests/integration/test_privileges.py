"""The job roles on a real Postgres: the grant script, the jobs as their roles, the refusals.

Every database of the suite carries the grants of ``include/sql/schema/job_roles.sql`` for
this session's roles (tests/conftest.py). Here:

- each job's connection is its role, not a superuser, and the role holds exactly what the job
  checks for; each job runs as it;
- with any one required grant revoked, each job fails before any write, naming the role, the
  object, the privilege and its use, with one ``database_privileges_missing`` alert, and
  nothing in the job tables changes;
- the grant script applied again (through psycopg and through psql, as docs/deploying.md shows
  it) changes nothing, takes back what it does not grant, and refuses a superuser or an owner.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from psycopg import sql as psql_sql

from devtools import pg
from devtools.pg import Database
from devtools.retention_data import seed_sessions
from devtools.selections_service import SelectionsService
from include.pin_maintenance import privileges as p
from include.pin_maintenance.jobs import (
    activity_retention,
    slot_expiration,
    snapshot_detach,
    snapshot_requeue,
)
from include.pin_maintenance.stopping import StopSignal
from include.pin_maintenance.telemetry import Telemetry
from tests.integration.runbook_sql import psql_binary
from tests.integration.slot_expiration_fixtures import insert_due
from tests.integration.snapshot_detach_fixtures import config as detach_config
from tests.integration.snapshot_detach_fixtures import insert_entries, insert_entry, make_client
from tests.job_db import conn_id_of, job_connect, job_telemetry

pytestmark = pytest.mark.integration

DETACH, REQUEUE = snapshot_detach.JOB, snapshot_requeue.JOB
SLOTS, RETENTION = slot_expiration.JOB, activity_retention.JOB
JOBS = (DETACH, REQUEUE, SLOTS, RETENTION)
JOB_TABLES = (
    "news.snapshot_detach_outbox",
    "calendar.availability_slots",
    "user_activity.sessions",
    "user_activity.property_object_views",
    "user_activity.action_events",
    "user_activity.property_object_view_stats",
)


def role_of(db: Database, job: str) -> str:
    return db.roles[conn_id_of(job)].name


def job_tables(db: Database) -> dict[str, list[tuple]]:
    """Every row of every job table, as the owner sees it."""
    with db.connect() as conn:
        return {t: conn.execute(f"select * from {t} order by 1").fetchall() for t in JOB_TABLES}


def seed(db: Database) -> None:
    """Work for every job: due and Quarantined outbox rows, due slots, old sessions."""
    insert_entries(db, 3)
    insert_entry(db, status="Quarantined", attempts=12)
    insert_due(db, 5)
    with db.connect() as conn:
        seed_sessions(conn, 4, 2, 2, tag="priv")


def run_as_role(db: Database, job: str, svc: SelectionsService, telemetry: Telemetry) -> Any:
    """The job's entry as its DAG task calls it, through its own role."""
    connect = job_connect(db, job)
    stop = StopSignal()
    if job == DETACH:
        with make_client(svc) as client:
            return snapshot_detach.run(connect, detach_config(), telemetry, stop, client)
    if job == REQUEUE:
        choice = snapshot_requeue.parse_choice(None, True)
        return snapshot_requeue.requeue(connect, telemetry, choice)
    if job == SLOTS:
        return slot_expiration.run(connect, {}, telemetry, stop)
    return activity_retention.run(
        connect, activity_retention.CONFIG.resolve(None, None), telemetry, stop
    )


@pytest.fixture
def selections() -> Any:
    with SelectionsService() as svc:
        yield svc


# ------------------------------------------------------------------ each job as its role


@pytest.mark.parametrize("job", JOBS)
def test_each_job_connects_as_its_role_which_holds_what_the_job_needs(db: Database, job: str):
    with job_connect(db, job)() as conn:
        user, superuser = conn.execute(
            "select current_user, rolsuper from pg_roles where rolname = current_user"
        ).fetchone()
    assert user == role_of(db, job)
    assert superuser is False
    telemetry = job_telemetry(job)
    p.require(job_connect(db, job), job, telemetry)
    assert telemetry.alerts.sent == []


def test_every_job_runs_as_its_role_and_does_its_work(db: Database, selections):
    seed(db)
    done = {job: run_as_role(db, job, selections, job_telemetry(job)) for job in JOBS}
    assert done[DETACH].succeeded == 3
    assert done[REQUEUE].count == 1
    assert done[SLOTS].expired_count == 5
    assert done[RETENTION].deleted_sessions == 4
    with db.connect() as conn:  # the stats table is the job role's to leave alone
        assert conn.execute(
            "select has_table_privilege(%s, 'user_activity.property_object_view_stats',"
            " 'SELECT,INSERT,UPDATE,DELETE,TRUNCATE,REFERENCES,TRIGGER')",
            (role_of(db, RETENTION),),
        ).fetchone() == (False,)


# -------------------------------------------------------- one grant missing: refused by name


@dataclass(frozen=True)
class Missing:
    job: str
    revoke: str  # {role}: the job's role
    says: str  # the shortfall, as the error words it


# One case per grant the script makes for each job (plus the PUBLIC defaults the jobs rely on).
CASES = [
    Missing(DETACH, "revoke usage on schema news from {role}", "lacks USAGE on schema news"),
    Missing(
        DETACH, "revoke select on news.snapshot_detach_outbox from {role}",
        "lacks SELECT on news.snapshot_detach_outbox (reading the due and Quarantined rows)",
    ),
    Missing(
        DETACH, "revoke update (attempts) on news.snapshot_detach_outbox from {role}",
        "lacks UPDATE on news.snapshot_detach_outbox column attempts (the claim, its row locks "
        "and the recorded outcomes)",
    ),
    Missing(
        DETACH, "revoke execute on function pg_try_advisory_xact_lock(bigint) from public",
        "lacks EXECUTE on function pg_catalog.pg_try_advisory_xact_lock(bigint) (the "
        "single-runner advisory lock)",
    ),
    Missing(
        DETACH, "revoke select on pg_catalog.pg_stat_activity from public",
        "lacks SELECT on pg_catalog.pg_stat_activity (since when the lock's holder holds it)",
    ),
    Missing(
        REQUEUE, "revoke update (status) on news.snapshot_detach_outbox from {role}",
        "lacks UPDATE on news.snapshot_detach_outbox column status (moving Quarantined rows "
        "back to Pending)",
    ),
    Missing(SLOTS, "revoke usage on schema calendar from {role}", "lacks USAGE on schema calendar"),
    Missing(
        SLOTS, "revoke update (version) on calendar.availability_slots from {role}",
        "lacks UPDATE on calendar.availability_slots column version (expiring the batch's slots "
        "and its row locks)",
    ),
    Missing(
        RETENTION, "revoke update (created_at) on user_activity.sessions from {role}",
        "lacks UPDATE on user_activity.sessions (row locks of the batch claim: a row lock needs "
        "UPDATE on at least one column)",
    ),
    Missing(
        RETENTION, "revoke delete on user_activity.sessions from {role}",
        "lacks DELETE on user_activity.sessions (the sessions delete step)",
    ),
    Missing(
        RETENTION, "revoke delete on user_activity.property_object_views from {role}",
        "lacks DELETE on user_activity.property_object_views (the property_object_views delete "
        "step)",
    ),
    Missing(
        RETENTION, "revoke select on user_activity.action_events from {role}",
        "lacks SELECT on user_activity.action_events (the action_events delete step's filter)",
    ),
    Missing(
        RETENTION, "revoke select on pg_catalog.pg_locks from public",
        "lacks SELECT on pg_catalog.pg_locks (who holds the advisory lock when it is busy)",
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.job}:{c.revoke.split(' from ')[0]}")
def test_a_missing_grant_fails_the_job_before_any_write_naming_it(
    db: Database, selections, case: Missing, caplog: pytest.LogCaptureFixture
):
    seed(db)
    role = role_of(db, case.job)
    with db.connect() as conn:
        try:
            conn.execute(case.revoke.format(role=psql_sql.Identifier(role).as_string(conn)))
        except psycopg.errors.InsufficientPrivilege:  # a catalog object, and no superuser
            pytest.skip(f"the test server's user may not {case.revoke.split(' from ')[0]}")
    before = job_tables(db)
    telemetry = job_telemetry(case.job)

    with caplog.at_level(logging.ERROR), pytest.raises(p.MissingPrivileges) as refused:
        run_as_role(db, case.job, selections, telemetry)

    text = str(refused.value)
    assert text.startswith(f"{case.job}: role {role} {case.says}"), text
    assert text.endswith(f"Nothing was changed: {p.FIX}")
    assert job_tables(db) == before  # nothing written, in any job table
    assert selections.calls == []  # and nothing called
    [alert] = telemetry.alerts.sent
    assert (alert.name, alert.severity) == ("database_privileges_missing", "critical")
    assert alert.details["problem"] == "configuration"
    assert alert.details["role"] == role
    assert [m.split(" (")[0] for m in alert.details["missing"]] == [
        f"role {role} {case.says}".split(" (")[0]
    ]
    [line] = [
        r.getMessage() for r in caplog.records if "event=privileges_missing" in r.getMessage()
    ]
    assert f"role={role}" in line and case.says.split(" (")[0] in line


def test_retention_refuses_in_prepare_before_the_first_delete_step(db: Database):
    """The DAG's first task checks for all three steps: without DELETE on sessions no event is
    deleted first (the steps would otherwise each commit batches of their own)."""
    seed(db)
    with db.connect() as conn:
        conn.execute(
            psql_sql.SQL("revoke delete on user_activity.sessions from {}").format(
                psql_sql.Identifier(role_of(db, RETENTION))
            )
        )
    before = job_tables(db)
    with pytest.raises(p.MissingPrivileges, match=r"lacks DELETE on user_activity\.sessions"):
        activity_retention.prepare(
            job_connect(db, RETENTION),
            activity_retention.CONFIG.resolve(None, None),
            job_telemetry(RETENTION),
        )
    assert job_tables(db) == before


def test_the_airflow_glue_turns_the_refusal_into_a_failure_without_retry(db: Database):
    from airflow.sdk.exceptions import AirflowFailException

    from include.pin_airflow.runtime import refuse_run

    with db.connect() as conn:
        conn.execute(
            psql_sql.SQL("revoke select on calendar.availability_slots from {}").format(
                psql_sql.Identifier(role_of(db, SLOTS))
            )
        )
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = job_telemetry(SLOTS, tracer=provider.get_tracer("test"))
    telemetry.refuse = refuse_run
    with pytest.raises(AirflowFailException, match="lacks SELECT on calendar") as refused:
        slot_expiration.run(job_connect(db, SLOTS), {}, telemetry, StopSignal())
    assert isinstance(refused.value, p.MissingPrivileges)
    assert refused.value.__cause__ is None
    spans = {s.name: s for s in exporter.get_finished_spans()}
    check, run = spans[f"{SLOTS} privileges"], spans[f"{SLOTS} run"]
    assert check.parent.span_id == run.context.span_id
    for span in (check, run):  # the class only, as every failed span
        assert span.attributes["error.type"] == "MissingPrivileges"
    provider.shutdown()


def test_an_object_the_database_lacks_is_named_as_missing(db: Database, monkeypatch):
    monkeypatch.setitem(
        p.REQUIREMENTS, DETACH, (p.table("SELECT", "news.no_such_table", "a test"),)
    )
    with pytest.raises(p.MissingPrivileges, match=r"table news\.no_such_table does not exist"):
        p.require(job_connect(db, DETACH), DETACH, job_telemetry(DETACH))


# -------------------------------------------------------------------- the grant script


def acl_state(db: Database) -> dict[str, Any]:
    """Every privilege of the job roles in this database: table, column, schema, database
    level, and the roles' attributes."""
    names = sorted({r.name for r in db.roles.values()})
    with db.connect() as conn:
        tables = conn.execute(
            "select c.oid::regclass::text, r.rolname, a.privilege_type"
            " from pg_class c, aclexplode(c.relacl) a join pg_roles r on r.oid = a.grantee"
            " where r.rolname = any(%s) order by 1, 2, 3",
            (names,),
        ).fetchall()
        columns = conn.execute(
            "select t.attrelid::regclass::text, t.attname, r.rolname, a.privilege_type"
            " from pg_attribute t, aclexplode(t.attacl) a join pg_roles r on r.oid = a.grantee"
            " where r.rolname = any(%s) order by 1, 2, 3, 4",
            (names,),
        ).fetchall()
        schemas = conn.execute(
            "select n.nspname, r.rolname, a.privilege_type"
            " from pg_namespace n, aclexplode(n.nspacl) a join pg_roles r on r.oid = a.grantee"
            " where r.rolname = any(%s) order by 1, 2, 3",
            (names,),
        ).fetchall()
        database = conn.execute(
            "select r.rolname, a.privilege_type"
            " from pg_database d, aclexplode(d.datacl) a join pg_roles r on r.oid = a.grantee"
            " where d.datname = current_database() and r.rolname = any(%s) order by 1, 2",
            (names,),
        ).fetchall()
        roles = conn.execute(
            "select rolname, rolsuper, rolcanlogin, rolinherit, rolcreaterole, rolcreatedb"
            " from pg_roles where rolname = any(%s) order by 1",
            (names,),
        ).fetchall()
    return {
        "tables": tables,
        "columns": columns,
        "schemas": schemas,
        "database": database,
        "roles": roles,
    }


def names_of(db: Database) -> dict[str, str]:
    return {conn_id: role.name for conn_id, role in db.roles.items()}


def psql_apply(db: Database, settings: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The script as docs/deploying.md runs it: psql, the roles as session settings."""
    psql = psql_binary()
    assert psql, "no psql client found"
    args = [psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", db.url]
    for setting, role in settings.items():
        args += ["-c", f"set {setting} = '{role}'"]
    args += ["-f", str(pg.JOB_ROLES_FILE)]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def test_the_grant_script_applied_again_changes_nothing(db: Database):
    pg.apply_job_roles(db.url, names_of(db))  # the clone has the template's; CONNECT is its own
    first = acl_state(db)
    assert first["tables"] and first["columns"] and first["schemas"] and first["database"]
    pg.apply_job_roles(db.url, names_of(db))
    assert acl_state(db) == first
    settings = {pg.ROLE_SETTINGS[c]: name for c, name in names_of(db).items()}
    for _ in range(2):
        done = psql_apply(db, settings)
        assert done.returncode == 0, done.stderr
        assert acl_state(db) == first
    for job in JOBS:
        p.require(job_connect(db, job), job, job_telemetry(job))


def test_the_grant_script_takes_back_what_it_does_not_grant(db: Database):
    pg.apply_job_roles(db.url, names_of(db))
    clean = acl_state(db)
    news, calendar, activity = (
        db.roles[c].name for c in ("news_db", "calendar_db", "user_activity_db")
    )
    with db.connect() as conn:
        for statement, role in (
            ("grant insert, delete, truncate on news.snapshot_detach_outbox to {}", news),
            ("grant update on calendar.availability_slots to {}", calendar),
            ("grant create on schema calendar to {}", calendar),
            ("grant update on user_activity.sessions to {}", activity),
            ("grant select on user_activity.property_object_view_stats to {}", activity),
            ("grant update (payload) on user_activity.action_events to {}", activity),
        ):
            conn.execute(psql_sql.SQL(statement).format(psql_sql.Identifier(role)))
    assert acl_state(db) != clean
    pg.apply_job_roles(db.url, names_of(db))
    assert acl_state(db) == clean


def test_one_role_can_be_set_up_alone(db: Database):
    """A database holding one service's tables gets only that connection's grants."""
    role = f"pin_alone_{db.name[-8:]}"
    pg.apply_job_roles(db.url, {"calendar_db": role})
    try:
        with db.connect() as conn:
            (rows,) = conn.execute(
                "select count(*) from pg_class c, aclexplode(c.relacl) a"
                " join pg_roles r on r.oid = a.grantee where r.rolname = %s",
                (role,),
            ).fetchone()
            has = conn.execute(
                "select has_table_privilege(%(r)s, 'calendar.availability_slots', 'SELECT'),"
                " has_schema_privilege(%(r)s, 'news', 'USAGE')",
                {"r": role},
            ).fetchone()
        assert rows == 1 and has == (True, False)  # SELECT on slots; its columns' UPDATE apart
    finally:
        with db.connect() as conn:
            conn.execute(psql_sql.SQL("drop owned by {}").format(psql_sql.Identifier(role)))
        pg.drop_roles(db.url, [role])


def test_the_grant_script_refuses_a_superuser(db: Database):
    with db.connect() as conn:
        user, superuser = conn.execute(
            "select current_user, rolsuper from pg_roles where rolname = current_user"
        ).fetchone()
    if not superuser:
        pytest.skip("the test server's user is not a superuser (PIN_PG_URL): none to try")
    before = acl_state(db)
    with pytest.raises(psycopg.errors.RaiseException, match=f"role {user} is a superuser"):
        pg.apply_job_roles(db.url, {"news_db": user})
    assert acl_state(db) == before


def test_the_grant_script_refuses_a_role_that_owns_a_job_table(db: Database):
    owner = f"pin_owner_{db.name[-8:]}"
    ident = psql_sql.Identifier(owner)
    with db.connect() as conn:
        conn.execute(psql_sql.SQL("create role {}").format(ident))
        conn.execute(
            psql_sql.SQL("alter table calendar.availability_slots owner to {}").format(ident)
        )
    try:
        before = acl_state(db)
        with pytest.raises(
            psycopg.errors.RaiseException,
            match=f"role {owner} owns calendar.availability_slots: a job role must not own",
        ):
            pg.apply_job_roles(db.url, {**names_of(db), "calendar_db": owner})
        assert acl_state(db) == before  # one transaction: the other roles' grants did not run
    finally:
        with db.connect() as conn:
            conn.execute("alter table calendar.availability_slots owner to current_user")
            conn.execute(psql_sql.SQL("drop owned by {}").format(ident))
        pg.drop_roles(db.url, [owner])
