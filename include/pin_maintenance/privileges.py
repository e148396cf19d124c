"""What each job's database role must hold (docs/design.md, "Database schema"), checked before a
run's first write; a shortfall fails the run naming role, object, privilege and its use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal, NoReturn

from include.pin_maintenance import server_version, sql
from include.pin_maintenance.db import Connect
from include.pin_maintenance.telemetry import Alert, Telemetry

ALERT = "database_privileges_missing"
GRANT_SCRIPT = "include/sql/schema/job_roles.sql"
FIX = (
    f"apply {GRANT_SCRIPT} to this database as the tables' owner "
    '(docs/deploying.md, "Database roles")'
)


@dataclass(frozen=True)
class Requirement:
    """``privilege`` on ``name`` (``schema.object``), and what the job needs it for."""

    kind: Literal["schema", "table", "any_column", "columns", "function"]
    privilege: str
    name: str
    purpose: str
    columns: tuple[str, ...] = ()


usage = partial(Requirement, "schema", "USAGE")  # usage(schema, purpose)
table = partial(Requirement, "table")  # table(privilege, name, purpose)
# a row lock (FOR UPDATE...) needs UPDATE on at least one column, even if the job never updates
row_locks = partial(Requirement, "any_column", "UPDATE")  # row_locks(name, purpose)
function = partial(Requirement, "function", "EXECUTE")  # function(signature, purpose)


def columns(privilege: str, name: str, cols: Sequence[str], purpose: str) -> Requirement:
    return Requirement("columns", privilege, name, purpose, tuple(cols))


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

# Per DAG id, write steps included: retention checks all three delete steps in its first task.
REQUIREMENTS: dict[str, tuple[Requirement, ...]] = {
    "news_snapshot_detach_retry": DETACH,
    "news_snapshot_detach_requeue": REQUEUE,
    "calendar_slot_expiration": SLOT_EXPIRATION,
    "user_activity_retention": RETENTION,
}


@dataclass(frozen=True)
class Item:
    """One row of the check query: a requirement, or one column of a ``columns`` one."""

    requirement: int  # index into the requirements
    kind: str
    schema: str
    name: str
    column: str
    privilege: str


# the check query's parameters: one array per field (kinds, schemas, names, columns, privileges)
_QUERY_FIELDS = ("kind", "schema", "name", "column", "privilege")


def items(requirements: Sequence[Requirement]) -> list[Item]:
    """What the check query asks, in order (a ``columns`` requirement asks once per column)."""
    out: list[Item] = []
    for index, req in enumerate(requirements):
        schema, _, name = req.name.partition(".")
        kind = "column" if req.kind == "columns" else req.kind
        for column in req.columns or ("",):
            out.append(Item(index, kind, schema, name or schema, column, req.privilege))
    return out


@dataclass(frozen=True)
class Shortfall:
    """An unmet requirement: its object is ``absent``, or the privilege is not granted (on
    ``columns``, for a ``columns`` requirement)."""

    requirement: Requirement
    absent: bool = False
    columns: tuple[str, ...] = ()


def shortfalls(
    requirements: Sequence[Requirement], answers: Sequence[bool | None]
) -> list[Shortfall]:
    """The unmet requirements, in order; ``answers`` has one per :func:`items` row (None: the
    object does not exist)."""
    asked = items(requirements)
    if len(answers) != len(asked):
        raise ValueError(f"{len(answers)} answers for {len(asked)} questions")
    out: list[Shortfall] = []
    for index, req in enumerate(requirements):
        got = [(i.column, a) for i, a in zip(asked, answers, strict=True) if i.requirement == index]
        if any(a is None for _, a in got):
            out.append(Shortfall(req, absent=True))
        elif not all(a for _, a in got):
            out.append(Shortfall(req, columns=tuple(c for c, a in got if not a and c)))
    return out


def describe(role: str, shortfall: Shortfall) -> str:
    """One shortfall in the words of the error."""
    req = shortfall.requirement
    named = req.kind in ("schema", "function")  # said with their kind: "schema news"
    if shortfall.absent:
        return f"{req.kind if named else 'table'} {req.name} does not exist ({req.purpose})"
    target = f"{req.kind} {req.name}" if named else req.name
    purpose = req.purpose
    if req.kind == "any_column":
        purpose += ": a row lock needs UPDATE on at least one column"
    elif req.kind == "columns":
        plural = "s" if len(shortfall.columns) != 1 else ""
        target += f" column{plural} {', '.join(shortfall.columns)}"
    return f"role {role} lacks {req.privilege} on {target} ({purpose})"


class MissingPrivileges(RuntimeError):
    """The job's role lacks privileges the run needs; raised before any write."""

    alert_event = ALERT  # the task_failed alert that follows names it (one page per event)

    def __init__(self, job: str, role: str, missing: Sequence[Shortfall]) -> None:
        self.job, self.role, self.missing = job, role, tuple(missing)
        self.described = [describe(role, s) for s in self.missing]
        super().__init__(f"{job}: {'; '.join(self.described)}. Nothing was changed: {FIX}")

    def alert(self) -> Alert:
        n = len(self.missing)
        return Alert(
            ALERT,
            "critical",
            f"{self.job}: role {self.role} lacks {n} database privilege{'s' if n != 1 else ''} "
            "the job needs; a configuration problem, nothing was changed",
            {
                "problem": "configuration",
                "role": self.role,
                "missing": list(self.described),
                "fix": GRANT_SCRIPT,
            },
        )


def require(connect: Connect, job: str, telemetry: Telemetry) -> None:
    """Check the server's version, then the job's :data:`REQUIREMENTS`, on one connection before
    the run's first statement on a job table; refuse (alert, then raise) when one fails."""
    reqs = REQUIREMENTS[job]
    asked = items(reqs)
    with telemetry.span(f"{job} privileges"):
        conn = connect()
        try:
            _check_server(job, telemetry, conn.info.server_version)
            arrays = {f"{f}s": [getattr(i, f) for i in asked] for f in _QUERY_FIELDS}
            rows = conn.execute(sql.load("privileges/check_role_privileges"), arrays).fetchall()
            conn.rollback()
        finally:
            conn.close()
        role = str(rows[0][2])
        missing = shortfalls(reqs, [row[1] for row in rows])
        if missing:
            error = MissingPrivileges(job, role, missing)
            telemetry.log.error("privileges_missing", role=role, missing="; ".join(error.described))
            _refuse(telemetry, error)


def _check_server(job: str, telemetry: Telemetry, version: int) -> None:
    described, supported = server_version.describe(version), server_version.supported_range()
    if not server_version.is_supported(version):
        telemetry.log.error("server_unsupported", server_version=described, supported=supported)
        _refuse(telemetry, server_version.UnsupportedServer(job, version))
    if server_version.major_of(version) > server_version.SUPPORTED_MAJORS[-1]:
        telemetry.log.warning("server_untested", server_version=described, supported=supported)


def _refuse(
    telemetry: Telemetry, error: MissingPrivileges | server_version.UnsupportedServer
) -> NoReturn:
    telemetry.alerts.send(error.alert())
    raise (telemetry.refuse(error) if telemetry.refuse else error) from None
