"""A real PgBouncer in front of the suite's Postgres, and the canary that checks what it left.

Debian's ``pgbouncer`` is installed by ``devtools/ensure_system_packages.sh`` where that is
possible (root with apt-get, as in CI); elsewhere the tests that need it skip with one line
saying why. Each :class:`PgBouncer` is its own process on a free loopback port, in front of one
test database, with the pool mode and size the test asks for, stopped by its pid.

PgBouncer refuses to run as root: when the suite runs as root, it runs as the OS user that owns
the embedded server's socket directory (``pgbouncer -u <user>``); that user also owns the
working directory with its config, log and pid file.

Each client logs in to the pooler as the role it asks for: the database's owner (set-up,
the admin console) or one of the job roles (``Database.roles``), and PgBouncer logs in to the
server as that role, with one pool per role (``default_pool_size`` is per database and user, as
in production). :meth:`PgBouncer.db` gives the jobs their roles through the pooler; the canary
visits one role's pool.

Used by ``tests/integration/test_pooler.py`` and ``tests/dags/test_pooler_dags.py``; the
fixture :func:`pgbouncer` is registered for the whole suite by ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from devtools.local_airflow import free_port
from devtools.pg import Database, JobRole

REPO = Path(__file__).resolve().parent.parent
ENSURE = REPO / "devtools" / "ensure_system_packages.sh"
START_TIMEOUT_SECONDS = 15.0
# What the canary reads on every server connection: a client of the pool must see the server's
# defaults there, whatever a job set in its own transactions.
CANARY_SETTINGS = (
    "statement_timeout",
    "lock_timeout",
    "synchronous_commit",
    "idle_in_transaction_session_timeout",
    "application_name",
)


def pgbouncer_or_skip() -> str:
    """The pgbouncer binary; installed through ensure_system_packages.sh when missing."""
    found = shutil.which("pgbouncer") or _sbin("pgbouncer")
    if found:
        return found
    done = subprocess.run(
        ["bash", str(ENSURE), "pgbouncer"], capture_output=True, text=True, check=False
    )
    found = shutil.which("pgbouncer") or _sbin("pgbouncer")
    if not found:
        pytest.skip(
            "PgBouncer tests skipped: pgbouncer is not installed and could not be installed "
            f"(needs root and apt-get): {done.stderr.strip()}"
        )
    return found


def _sbin(name: str) -> str | None:
    path = Path("/usr/sbin") / name
    return str(path) if path.exists() else None


@dataclass
class PgBouncer:
    """One running pgbouncer in front of one database."""

    proc: subprocess.Popen[bytes]
    port: int
    workdir: Path
    database: Database
    pool_mode: str
    pool_size: int
    user: str
    _log: Any = field(repr=False, default=None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def url(self, **params: Any) -> str:
        """A libpq URL to the test database through the pooler (as the owner, or ``user=``)."""
        params.setdefault("user", self.user)
        return make_conninfo(
            host="127.0.0.1", port=str(self.port), dbname=self.database.name, **params
        )

    def db(self) -> Database:
        """The test database as seen through the pooler (for ``run_dag``, the CLIs and
        ``tests/job_db.py``): the owner's URL, and every job connection's role through it (the
        pooler asks for no password; it logs in to the server with the role's)."""
        return Database(
            f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database.name}",
            self.database.name,
            {conn_id: JobRole(role.name, "") for conn_id, role in self.database.roles.items()},
        )

    def connect(self, user: str | None = None, **kwargs: Any) -> psycopg.Connection:
        return psycopg.connect(self.url(user=user or self.user), **kwargs)

    def admin(self, command: str) -> list[dict[str, Any]]:
        """A command on the admin console (``SHOW SERVERS``...), rows as dicts."""
        with psycopg.connect(
            make_conninfo(
                host="127.0.0.1", port=str(self.port), dbname="pgbouncer", user=self.user
            ),
            autocommit=True,
        ) as conn:
            cur = conn.execute(command)
            if cur.description is None:
                return []
            names = [c.name for c in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def servers(self, user: str | None = None) -> list[dict[str, Any]]:
        """The server connections of this database's pool of ``user`` (the owner by default;
        ``SHOW SERVERS``)."""
        return [
            s
            for s in self.admin("SHOW SERVERS")
            if s["database"] == self.database.name and s["user"] == (user or self.user)
        ]

    def log_text(self) -> str:
        path = self.workdir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Stop it by its pid (SIGINT: pgbouncer's safe shutdown; SIGKILL after 10 s)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_pgbouncer(
    binary: str,
    database: Database,
    *,
    pool_mode: str = "transaction",
    pool_size: int = 4,
    query_wait_timeout: int = 120,
    server_reset_query: str | None = None,
) -> PgBouncer:
    """Start pgbouncer on a free loopback port in front of ``database`` (its own process).

    ``server_reset_query`` defaults to PgBouncer's own rule: ``DISCARD ALL`` in session mode,
    none in transaction mode (there it is not run anyway).
    """
    params = conninfo_to_dict(database.url)
    host = params.get("host") or "localhost"
    user = params.get("user") or "postgres"
    run_as = _os_user_for(host)
    workdir = Path(tempfile.mkdtemp(prefix="pin-pgbouncer-"))
    reset = server_reset_query
    if reset is None:
        reset = "DISCARD ALL" if pool_mode == "session" else ""
    # no user here: each client's own, logging in to the server with its auth_file password
    target = f"host={host} port={params.get('port') or 5432} dbname={database.name}"
    logins = {user: params.get("password") or ""}
    logins.update({role.name: role.password for role in database.roles.values()})
    userlist = "".join(f'"{name}" "{password}"\n' for name, password in logins.items())
    last_error = ""
    for _ in range(3):  # a free port can be taken between the probe and the listen
        port = free_port()
        (workdir / "userlist.txt").write_text(userlist)
        (workdir / "pgbouncer.ini").write_text(
            "\n".join(
                [
                    "[databases]",
                    f"{database.name} = {target}",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {port}",
                    "unix_socket_dir =",
                    "auth_type = trust",
                    f"auth_file = {workdir / 'userlist.txt'}",
                    f"admin_users = {user}",
                    f"pool_mode = {pool_mode}",
                    f"default_pool_size = {pool_size}",
                    "min_pool_size = 0",
                    "reserve_pool_size = 0",
                    "max_client_conn = 200",
                    f"server_reset_query = {reset}",
                    f"query_wait_timeout = {query_wait_timeout}",
                    f"logfile = {workdir / 'pgbouncer.log'}",
                    f"pidfile = {workdir / 'pgbouncer.pid'}",
                    "",
                ]
            )
        )
        if run_as is not None:
            pw = pwd.getpwnam(run_as)
            for path in (workdir, *workdir.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        cmd = [binary, *(["-u", run_as] if run_as else []), str(workdir / "pgbouncer.ini")]
        out = (workdir / "stdout.log").open("ab")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
        bouncer = PgBouncer(proc, port, workdir, database, pool_mode, pool_size, user, _log=out)
        error = _wait_ready(bouncer)
        if error is None:
            return bouncer
        last_error = error
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        out.close()
    shutil.rmtree(workdir, ignore_errors=True)
    raise RuntimeError(f"pgbouncer did not start: {last_error}")


def _os_user_for(host: str) -> str | None:
    """pgbouncer refuses root: run it as the owner of the server's socket directory."""
    if os.geteuid() != 0:
        return None
    if host.startswith("/"):
        owner = pwd.getpwuid(os.stat(host).st_uid).pw_name
        if owner != "root":
            return owner
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("running as root and found no other OS user to run pgbouncer as")


def _wait_ready(bouncer: PgBouncer) -> str | None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    error = "not ready"
    while time.monotonic() < deadline:
        if bouncer.proc.poll() is not None:
            return f"exited {bouncer.proc.returncode}: {bouncer.log_text()[-2000:]}"
        try:
            bouncer.admin("SHOW VERSION")
            return None
        except psycopg.Error as exc:
            error = str(exc)
            time.sleep(0.05)
    return f"{error}; log: {bouncer.log_text()[-2000:]}"


@dataclass(frozen=True)
class ServerView:
    """What one client transaction saw on one server connection."""

    pid: int
    settings: dict[str, str]
    prepared_statements: int


def canary(bouncer: PgBouncer, user: str | None = None) -> list[ServerView]:
    """Visit every server connection of ``user``'s pool (the owner's by default) as an ordinary
    client of it and read its state.

    The canary sends no ``application_name`` of its own (like a service that never sets one,
    the strictest case: PgBouncer then applies nothing for it). It opens ``pool_size`` client
    connections and holds a transaction on each at once, so each sits on a different server
    connection and together they cover every server connection the pool has; the caller
    compares the pids with ``SHOW SERVERS``.
    """
    conns = [bouncer.connect(user) for _ in range(bouncer.pool_size)]
    try:
        views = []
        for conn in conns:
            row = conn.execute(
                "select pg_backend_pid(), "
                + ", ".join(f"current_setting('{name}')" for name in CANARY_SETTINGS)
                + ", (select count(*) from pg_prepared_statements)"
            ).fetchone()
            views.append(
                ServerView(
                    int(row[0]), dict(zip(CANARY_SETTINGS, row[1:-1], strict=True)), int(row[-1])
                )
            )
        for conn in conns:
            conn.rollback()
        return views
    finally:
        for conn in conns:
            conn.close()


def server_defaults(database: Database, user: str | None = None) -> dict[str, str]:
    """The settings a fresh direct session of the same role (the owner, or ``user``) gets (no
    application_name)."""
    url = database.url
    for role in database.roles.values():
        if role.name == user:
            url = make_conninfo(url, user=role.name, password=role.password)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "select " + ", ".join(f"current_setting('{name}')" for name in CANARY_SETTINGS)
        ).fetchone()
    return dict(zip(CANARY_SETTINGS, row, strict=True))


def assert_pool_is_clean(bouncer: PgBouncer, user: str | None = None) -> list[ServerView]:
    """Every server connection ``user``'s pool (the owner's by default; a job's role) had shows
    the server defaults, and no prepared statement. Returns what the canary saw."""
    before = {int(s["remote_pid"]) for s in bouncer.servers(user)}
    assert before, "the pool has no server connection: the job did not run through it"
    views = canary(bouncer, user)
    seen = {v.pid for v in views}
    assert before <= seen, f"canary missed server connections {sorted(before - seen)}"
    expected = server_defaults(bouncer.database, user)
    for view in views:
        assert view.settings == expected, f"server pid {view.pid}: {view.settings} != {expected}"
        assert view.prepared_statements == 0, f"server pid {view.pid} has prepared statements"
    return views


StartPgBouncer = Callable[..., PgBouncer]


@pytest.fixture
def pgbouncer(pg_admin_url: str) -> Iterator[StartPgBouncer]:
    """``pgbouncer(db, pool_mode="transaction", pool_size=4, ...)`` starts one; all are
    stopped (by pid) after the test."""
    binary = pgbouncer_or_skip()
    started: list[PgBouncer] = []

    def start(database: Database, **kwargs: Any) -> PgBouncer:
        bouncer = start_pgbouncer(binary, database, **kwargs)
        started.append(bouncer)
        return bouncer

    try:
        yield start
    finally:
        for bouncer in started:
            bouncer.stop()
