"""What each job needs of its database role, checked at the start of a run, before any write.

The grants themselves are ``include/sql/schema/job_roles.sql`` (docs/deploying.md, "Database
roles"); this module holds the same list as data (:data:`REQUIREMENTS`, one tuple per job), asks
the server what the connection's role may do (one query,
``include/sql/privileges/check_role_privileges.sql``) and, when a required privilege is missing,
fails the run before it writes anything, with one error line and one alert that name the role,
the object, the privilege and what the job needs it for::

    role pin_activity lacks UPDATE on user_activity.sessions (row locks of the batch claim: ...)

A missing privilege is a configuration problem, not a data problem: nothing a retry or the next
run can fix, so the alert :data:`ALERT` says so, and the Airflow glue fails the task without a
retry (``Telemetry.refuse``).

The pure part (:func:`shortfalls`, :func:`describe`, :class:`MissingPrivileges`) turns the server's
answers into those words; :func:`require` is the one function that queries and raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

from include.pin_maintenance import server_version, sql
from include.pin_maintenance.db import Connect
from include.pin_maintenance.telemetry import Alert, Telemetry

Kind = Literal["schema", "table", "any_column", "columns", "function"]

ALERT = "database_privileges_missing"
GRANT_SCRIPT = "include/sql/schema/job_roles.sql"
FIX = (
    f"apply {GRANT_SCRIPT} to this database as the tables' owner "
    '(docs/deploying.md, "Database roles")'
)


@dataclass(frozen=True)
class Requirement:
    """One privilege a job needs: ``privilege`` on ``name`` (``schema.object``), and what for,
    in a few words an operator reads in the error."""

    kind: Kind
    privilege: str
    name: str
    purpose: str
    columns: tuple[str, ...] = ()

    @property
    def schema(self) -> str:
        return self.name.split(".", 1)[0] if "." in self.name else self.name

    @property
    def object(self) -> str:
        return self.name.split(".", 1)[1] if "." in self.name else ""


def usage(schema: str, purpose: str) -> Requirement:
    return Requirement("schema", "USAGE", schema, purpose)


def table(privilege: str, name: str, purpose: str) -> Requirement:
    return Requirement("table", privilege, name, purpose)


def columns(privilege: str, name: str, cols: Sequence[str], purpose: str) -> Requirement:
    return Requirement("columns", privilege, name, purpose, tuple(cols))


def row_locks(name: str, purpose: str) -> Requirement:
    """A row lock (``FOR UPDATE``, ``FOR KEY SHARE``...) on ``name``: Postgres allows it only
    with UPDATE on at least one column of the table, even to a role that never updates it."""
    return Requirement("any_column", "UPDATE", name, purpose)


def function(signature: str, purpose: str) -> Requirement:
    return Requirement("function", "EXECUTE", signature, purpose)


ADVISORY_LOCK = function(
    "pg_catalog.pg_try_advisory_xact_lock(bigint)", "the single-runner advisory lock"
)
LOCK_HOLDER = (
    table("SELECT", "pg_catalog.pg_locks", "who holds the advisory lock when it is busy"),
    table("SELECT", "pg_catalog.pg_stat_activity", "since when the lock's holder holds it"),
)

OUTBOX = "news.snapshot_detach_outbox"
SLOTS = "calendar.availability_slots"
SESSIONS = "user_activity.sessions"
VIEWS = "user_activity.property_object_views"
EVENTS = "user_activity.action_events"

_NEWS_ROWS = (
    usage("news", "every statement on the outbox"),
    table("SELECT", OUTBOX, "reading the due and Quarantined rows"),
)
DETACH = (
    *_NEWS_ROWS,
    columns(
        "UPDATE",
        OUTBOX,
        ("attempts", "next_attempt_at", "updated_at", "status", "last_error"),
        "the claim, its row locks and the recorded outcomes",
    ),
    ADVISORY_LOCK,
    *LOCK_HOLDER,
)
REQUEUE = (
    *_NEWS_ROWS,
    columns(
        "UPDATE",
        OUTBOX,
        ("status", "attempts", "next_attempt_at", "last_error", "updated_at"),
        "moving Quarantined rows back to Pending",
    ),
)
SLOT_EXPIRATION = (
    usage("calendar", "every statement on the slots"),
    table("SELECT", SLOTS, "reading the due slots and the backlog"),
    columns(
        "UPDATE",
        SLOTS,
        ("status", "updated_at", "version"),
        "expiring the batch's slots and its row locks",
    ),
)
RETENTION = (
    usage("user_activity", "every statement on the activity tables"),
    table("SELECT", SESSIONS, "the batch claim and the backlog count"),
    row_locks(SESSIONS, "row locks of the batch claim"),
    table("SELECT", EVENTS, "the action_events delete step's filter"),
    table("DELETE", EVENTS, "the action_events delete step"),
    table("SELECT", VIEWS, "the property_object_views delete step's filter"),
    table("DELETE", VIEWS, "the property_object_views delete step"),
    table("DELETE", SESSIONS, "the sessions delete step"),
    ADVISORY_LOCK,
    *LOCK_HOLDER,
)

# Per job (its DAG id): everything a run needs, write steps included, checked before the first
# write. Retention checks in its first task for all three delete steps, so that a run without
# DELETE on sessions does not first delete every event of the batch.
REQUIREMENTS: dict[str, tuple[Requirement, ...]] = {
    "news_snapshot_detach_retry": DETACH,
    "news_snapshot_detach_requeue": REQUEUE,
    "calendar_slot_expiration": SLOT_EXPIRATION,
    "user_activity_retention": RETENTION,
}


# -- the pure part ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One row of the check query: a requirement, or one column of a ``columns`` one."""

    requirement: int  # index into the requirements
    kind: str
    schema: str
    name: str
    column: str
    privilege: str


def items(requirements: Sequence[Requirement]) -> list[Item]:
    """What the check query asks, in order (a ``columns`` requirement asks once per column)."""
    out: list[Item] = []
    for index, req in enumerate(requirements):
        if req.kind == "columns":
            out += [
                Item(index, "column", req.schema, req.object, c, req.privilege) for c in req.columns
            ]
        elif req.kind == "schema":
            out.append(Item(index, req.kind, req.name, req.name, "", req.privilege))
        else:
            out.append(Item(index, req.kind, req.schema, req.object, "", req.privilege))
    return out


@dataclass(frozen=True)
class Shortfall:
    """A requirement the role does not meet: ``absent`` when its object does not exist (a
    wrong database, or a schema the services have not migrated), else the privilege is not
    granted; ``columns`` are the columns without it (a ``columns`` requirement)."""

    requirement: Requirement
    absent: bool = False
    columns: tuple[str, ...] = ()


def shortfalls(
    requirements: Sequence[Requirement], answers: Sequence[bool | None]
) -> list[Shortfall]:
    """The requirements the answers (one per :func:`items` row: granted, not, or None for an
    object that does not exist) leave unmet, in the requirements' order."""
    asked = items(requirements)
    if len(answers) != len(asked):
        raise ValueError(f"{len(answers)} answers for {len(asked)} questions")
    by_requirement: dict[int, list[tuple[Item, bool | None]]] = {}
    for item, answer in zip(asked, answers, strict=True):
        by_requirement.setdefault(item.requirement, []).append((item, answer))
    out: list[Shortfall] = []
    for index, req in enumerate(requirements):
        got = by_requirement[index]
        if any(answer is None for _, answer in got):
            out.append(Shortfall(req, absent=True))
        elif not all(answer for _, answer in got):
            cols = tuple(item.column for item, answer in got if not answer and item.column)
            out.append(Shortfall(req, columns=cols))
    return out


def describe(role: str, shortfall: Shortfall) -> str:
    """One shortfall in the words of the error, e.g. ``role pin_activity lacks UPDATE on
    user_activity.sessions (row locks of the batch claim: ...)``."""
    req = shortfall.requirement
    if shortfall.absent:
        kind = req.kind if req.kind in ("schema", "function") else "table"
        return f"{kind} {req.name} does not exist ({req.purpose})"
    target = f"{req.kind} {req.name}" if req.kind in ("schema", "function") else req.name
    purpose = req.purpose
    if req.kind == "any_column":
        purpose += ": a row lock needs UPDATE on at least one column"
    elif req.kind == "columns":
        plural = "s" if len(shortfall.columns) != 1 else ""
        target += f" column{plural} {', '.join(shortfall.columns)}"
    return f"role {role} lacks {req.privilege} on {target} ({purpose})"


class MissingPrivileges(RuntimeError):
    """The job's role lacks a privilege the run needs; raised before any write. Its text lists
    every required privilege missing, and the fix."""

    alert_event = ALERT  # the task_failed alert that follows names it (one page per event)

    def __init__(self, job: str, role: str, missing: Sequence[Shortfall]) -> None:
        self.job, self.role, self.missing = job, role, tuple(missing)
        described = "; ".join(describe(role, s) for s in missing)
        super().__init__(f"{job}: {described}. Nothing was changed: {FIX}")

    def alert(self) -> Alert:
        """The run's one alert: a configuration problem (no data was touched)."""
        n = len(self.missing)
        return Alert(
            ALERT,
            "critical",
            f"{self.job}: role {self.role} lacks {n} database privilege{'s' if n != 1 else ''} "
            "the job needs; a configuration problem, nothing was changed",
            {
                "problem": "configuration",
                "role": self.role,
                "missing": [describe(self.role, s) for s in self.missing],
                "fix": GRANT_SCRIPT,
            },
        )


# -- the check --------------------------------------------------------------------------------


def require(connect: Connect, job: str, telemetry: Telemetry) -> None:
    """Check the server's version (:mod:`server_version`), then the job's privileges
    (:data:`REQUIREMENTS`), on one connection of ``connect``, before the run's first statement
    on a job table. Raise :class:`UnsupportedServer` or :class:`MissingPrivileges` (through
    ``telemetry.refuse`` when the host has one) after one error line and one alert."""
    reqs = REQUIREMENTS[job]
    asked = items(reqs)
    with telemetry.span(f"{job} privileges"):
        conn = connect()
        try:
            _check_server(job, telemetry, conn.info.server_version)
            rows = conn.execute(
                sql.load("privileges/check_role_privileges"),
                {
                    "kinds": [i.kind for i in asked],
                    "schemas": [i.schema for i in asked],
                    "names": [i.name for i in asked],
                    "columns": [i.column for i in asked],
                    "privileges": [i.privilege for i in asked],
                },
            ).fetchall()
            conn.rollback()
        finally:
            conn.close()
        role = str(rows[0][2])
        missing = shortfalls(reqs, [row[1] for row in rows])
        if missing:
            described = "; ".join(describe(role, s) for s in missing)
            telemetry.log.error("privileges_missing", role=role, missing=described)
            _refuse(telemetry, MissingPrivileges(job, role, missing))


def _check_server(job: str, telemetry: Telemetry, version: int) -> None:
    if not server_version.is_supported(version):
        telemetry.log.error(
            "server_unsupported",
            server_version=server_version.describe(version),
            supported=server_version.supported_range(),
        )
        _refuse(telemetry, server_version.UnsupportedServer(job, version))
    if server_version.major_of(version) > server_version.SUPPORTED_MAJORS[-1]:
        telemetry.log.warning(
            "server_untested",
            server_version=server_version.describe(version),
            supported=server_version.supported_range(),
        )


def _refuse(
    telemetry: Telemetry, error: MissingPrivileges | server_version.UnsupportedServer
) -> NoReturn:
    """The refusal's one alert, then its error (as the host fails a refused run)."""
    telemetry.alerts.send(error.alert())
    raise (telemetry.refuse(error) if telemetry.refuse else error) from None
