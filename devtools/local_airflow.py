"""A local Airflow (UI included) on the embedded Postgres: ``make up`` / ``make down``.

    python -m devtools.local_airflow up              # foreground until Ctrl-C
    python -m devtools.local_airflow up --detach     # start, print the URL, return
    python -m devtools.local_airflow down            # stop everything `up` started

What ``up`` runs (each process in its own process group, listed in ``.local/local-airflow.json``
so that ``down`` ends whole groups, LocalExecutor's task workers included; docs/design.md,
"Known Airflow 3.3.2 behaviour"):

- the embedded Postgres (``.local/pg``; or ``PIN_PG_URL``), with the Airflow metadata in database
  ``airflow_meta`` and the job tables in ``pin_dev`` (reference schema applied when created; the
  grant script ``include/sql/schema/job_roles.sql`` applied on every start: the job connections
  log in as ``pin_news``, ``pin_calendar`` and ``pin_activity``, password ``local-dev-secret``);
- ``airflow api-server`` (UI and REST API), ``scheduler``, ``dag-processor``, ``triggerer``, with
  LocalExecutor and the metadata on Postgres (psycopg 3);
- a webhook sink for the ``alerts_webhook`` connection (alerts land in ``.local/webhook.jsonl``);
- the local selections service (``devtools.selections_service``) when it is importable.

Connections and Variables come from ``AIRFLOW_CONN_*`` / ``AIRFLOW_VAR_*`` in the processes'
environment (``devtools.airflow_env``), so they are not editable in the UI.

Login: the simple auth manager with one user, ``admin`` / ``admin`` (role admin): the users
come from ``AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS=admin:admin`` and the password from the
passwords file ``.local/airflow/simple_auth_manager_passwords.json`` which this script writes
(``{"admin": "admin"}``) before the api-server starts; the auth manager only generates a random
password for a user that file lacks. ``--no-login`` sets ``simple_auth_manager_all_admins`` (no
login page at all). Local development only: SimpleAuthManager keeps passwords in plain text.

The same :class:`AirflowStack` runs the end-to-end tests (temp home, fresh databases, random
ports, optionally CeleryExecutor with a Redis broker and two workers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import TypeVar

import psycopg

from devtools import airflow_forkserver, pg
from devtools.airflow_env import REPO, VENV_BIN, airflow, airflow_cli, airflow_env

LOCAL = REPO / ".local"
PID_FILE = LOCAL / "local-airflow.json"
ADMIN_USER = "admin"
ADMIN_PASSWORD = "admin"
META_DB = "airflow_meta"
JOB_DB = "pin_dev"
DEFAULT_PORT = 8080
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")

T = TypeVar("T")

# Per-DAG config Variables (docs/design.md, "Configuration") for local development; none by
# default, since a missing Variable means the job defaults. An empty `{}` Variable would mean
# the same, but a task masks every Variable value it reads, and one shorter than 5 characters
# put "Skipping masking for a secret as it's too short" at the top of every task log. `up --var
# KEY=JSON`.
LOCAL_VARIABLES: dict[str, object] = {}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_for(
    check: Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.5,
    what: str = "",
    retry_errors: bool = True,
) -> T:
    """Poll ``check`` until it returns something truthy; raise TimeoutError after ``timeout``.

    ``retry_errors``: an exception from ``check`` counts as "not yet" (a component still
    starting answers with errors); False lets it propagate at once (fail fast, e.g. when
    ``check`` asserts that the components are still running).
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = check()
        except Exception as exc:
            if not retry_errors:
                raise
            last_error = exc
        else:
            if result:
                return result
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last_error!r})")


# ---------------------------------------------------------------------------------------------
# process groups


@dataclass
class Proc:
    name: str
    pid: int
    pgid: int
    log: str
    popen: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    log_offset: int = field(default=0, repr=False, compare=False)  # the log's size at spawn

    def as_dict(self) -> dict:
        return {"name": self.name, "pid": self.pid, "pgid": self.pgid, "log": self.log}


@dataclass(frozen=True)
class _Stat:
    pid: int
    state: str
    ppid: int
    pgid: int


def _process_table() -> list[_Stat]:
    """Every process in /proc with its state, parent and process group (Linux)."""
    table = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        table.append(_Stat(int(entry.name), fields[0], int(fields[1]), int(fields[2])))
    return table


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids of process group ``pgid`` (from /proc)."""
    return [p.pid for p in _process_table() if p.pgid == pgid and p.state != "Z"]


def descendants(roots: Iterable[int], table: Sequence[_Stat] | None = None) -> set[int]:
    """All live descendants of the pids ``roots`` (from /proc, or ``table``)."""
    children: dict[int, list[int]] = {}
    for p in _process_table() if table is None else table:
        if p.state != "Z":
            children.setdefault(p.ppid, []).append(p.pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _child_groups(groups: Mapping[int, str]) -> dict[int, str]:
    """Process groups that descendants of ``groups``' members moved to ({pgid: label}).

    LocalExecutor's task and callback supervisors put themselves in process groups of their
    own (``setpgid``), so signalling the components' groups alone does not reach them; once
    their component has exited they are reparented and no longer found this way, hence the
    walk before any signal is sent.
    """
    table = _process_table()
    pgid_of = {p.pid: p.pgid for p in table}
    found: dict[int, str] = {}
    for pgid, name in groups.items():
        members = [p.pid for p in table if p.pgid == pgid and p.state != "Z"]
        for pid in descendants(members, table):
            child = pgid_of.get(pid)
            if child is None or child in groups or child in found:
                continue
            if child in (0, 1, os.getpgrp()):  # never our own group (or nonsense)
                continue
            found[child] = f"{name}: process group {child}"
    return found


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(procs: Sequence[Proc], *, grace: float = 20.0) -> list[str]:
    """SIGTERM every group, and every process group that a descendant of one moved to (task
    supervisors), wait up to ``grace`` s, SIGKILL what is left; names killed hard."""
    groups: dict[int, str] = {}
    for proc in procs:
        groups.setdefault(proc.pgid, proc.name)
    groups.update(_child_groups(groups))
    for pgid in groups:
        _killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    pending = dict(groups)
    while pending and time.monotonic() < deadline:
        for proc in procs:
            if proc.popen is not None:
                proc.popen.poll()  # reap our own child so a zombie leader does not count
        pending.update(_child_groups(pending))  # groups created while stopping
        pending = {g: name for g, name in pending.items() if group_members(g)}
        if pending:
            time.sleep(0.2)
    pending.update(_child_groups(pending))
    killed = []
    for pgid, name in pending.items():
        if group_members(pgid):
            killed.append(name)
            _killpg(pgid, signal.SIGKILL)
    for proc in procs:
        if proc.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
    return killed


# ---------------------------------------------------------------------------------------------
# the stack


LOCAL_BUNDLE = "airflow.dag_processing.bundles.local.LocalDagBundle"
GIT_BUNDLE = "airflow.providers.git.bundles.git.GitDagBundle"
ROOT_BUNDLE_NAME = "pin-maintenance"


def root_bundle(path: Path = REPO, name: str = ROOT_BUNDLE_NAME) -> dict[str, object]:
    """The repository root as a ``LocalDagBundle`` (its ``.airflowignore`` keeps it to dags/)."""
    return {"name": name, "classpath": LOCAL_BUNDLE, "kwargs": {"path": str(path)}}


def git_bundle(
    repo_url: str,
    *,
    tracking_ref: str = "main",
    refresh_interval: int = 300,
    name: str = ROOT_BUNDLE_NAME,
) -> dict[str, object]:
    """The repository root as a ``GitDagBundle`` (apache-airflow-providers-git)."""
    return {
        "name": name,
        "classpath": GIT_BUNDLE,
        "kwargs": {
            "repo_url": repo_url,
            "tracking_ref": tracking_ref,
            "refresh_interval": refresh_interval,
        },
    }


@dataclass
class AirflowStack:
    """Airflow's components plus the local services they talk to, as process groups.

    ``admin_url``: the Postgres server; ``meta_db`` / ``job_db`` are (created and) used there.
    ``executor``: "LocalExecutor" or "CeleryExecutor" (then ``broker_url`` and ``celery_workers``).
    ``bundles``: extra DAG folders besides ``dags/`` as {bundle name: path}.
    ``dags_folder``: the ``dags-folder`` bundle's folder instead of the repo's ``dags/``.
    ``bundle_config``: the whole ``[dag_processor] dag_bundle_config_list`` instead of the two
    above (e.g. :func:`root_bundle`, or a ``GitDagBundle``).
    ``repo_on_path``: False runs Airflow as a deployment sees this repository: no ``PYTHONPATH``
    entry for it, an empty plugins folder, working directory outside it; DAGs and job code then
    import from their bundle only, the scheduler side from the installed distribution.
    ``components``: the Airflow components to run (a subset of :data:`COMPONENTS`).
    ``webhook_url``: where the ``alerts_webhook`` connection points; None starts a sink.
    ``job_schema``: apply the reference schema to the job database when it lacks it, and the
    grant script (every time): the job connections log in as ``job_roles``, or the dev roles
    (``pin_news``...; ``devtools.pg.dev_job_roles``); without it they log in as the owner (a
    stack whose DAGs open no job table).
    ``demo_data``: seed the demo rows (:func:`devtools.demo.seed_ui_data`) when every job table
    is empty, so that a run triggered from the UI has something to do (``make up``).
    """

    home: Path
    run_dir: Path
    admin_url: str
    job_admin_url: str | None = None  # the job tables' server, when not the metadata's
    meta_db: str = META_DB
    job_db: str = JOB_DB
    port: int = DEFAULT_PORT
    executor: str = "LocalExecutor"
    broker_url: str | None = None
    redis_server: str | None = None  # path of redis-server: start a broker on loopback
    celery_workers: int = 2
    bundles: Mapping[str, Path] = field(default_factory=dict)
    dags_folder: Path | None = None
    bundle_config: Sequence[Mapping[str, object]] | None = None
    repo_on_path: bool = True
    components: Sequence[str] = COMPONENTS
    variables: Mapping[str, object] = field(default_factory=dict)
    extra_env: Mapping[str, str] = field(default_factory=dict)
    paused_at_creation: bool = True
    all_admins: bool = False
    start_selections: bool = True
    parallelism: int = 4
    job_schema: bool = True
    job_roles: Mapping[str, pg.JobRole] | None = None
    demo_data: bool = False
    seeded: str | None = None  # what demo_data put in, for the start-up message
    procs: list[Proc] = field(default_factory=list)
    webhook_url: str | None = None
    webhook_log: Path | None = None
    selections_url: str | None = None
    _env: dict[str, str] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def meta_url(self) -> str:
        return pg.with_database(self.admin_url, self.meta_db)

    @property
    def job_url(self) -> str:
        """The job database's owner URL (set-up, demo data, assertions)."""
        return pg.with_database(self.job_admin_url or self.admin_url, self.job_db)

    def job_connection_urls(self) -> dict[str, str] | str:
        """What the job connections log in with: their roles, once the grants are applied."""
        if not self.job_roles:
            return self.job_url
        return pg.Database(self.job_url, self.job_db, self.job_roles).job_urls()

    @property
    def pid_file(self) -> Path:
        return self.run_dir / "local-airflow.json"

    @property
    def passwords_file(self) -> Path:
        return self.home / "simple_auth_manager_passwords.json"

    # -- databases ------------------------------------------------------------------------

    def ensure_databases(self, *, meta_template: str | None = None) -> None:
        """Create the metadata and job databases when missing (never drops data)."""
        for server, name, template in (
            (self.admin_url, self.meta_db, meta_template),
            (self.job_admin_url or self.admin_url, self.job_db, None),
        ):
            with psycopg.connect(server, autocommit=True) as conn:
                exists = conn.execute(
                    "select 1 from pg_database where datname = %s", (name,)
                ).fetchone()
            if not exists:
                pg.create_database(server, name, template=template, drop=False)
        if not self.job_schema:
            return
        with psycopg.connect(self.job_url) as conn:
            has_schema = conn.execute(
                "select to_regclass('news.snapshot_detach_outbox') is not null"
            ).fetchone()[0]
        if not has_schema:
            pg.apply_schema(self.job_url)
        roles = dict(self.job_roles or pg.dev_job_roles())
        pg.apply_job_roles(self.job_url, {conn_id: role.name for conn_id, role in roles.items()})
        self.job_roles = pg.set_role_passwords(self.job_admin_url or self.admin_url, roles)
        self._env = None  # the connections change with the roles
        if self.demo_data:
            from devtools.demo import seed_ui_data

            with psycopg.connect(self.job_url) as conn:
                self.seeded = seed_ui_data(conn)

    # -- environment ----------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        if self._env is not None:
            return dict(self._env)
        extra: dict[str, str] = {
            "AIRFLOW__CORE__EXECUTOR": self.executor,
            "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": str(self.paused_at_creation),
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.passwords_file),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": str(self.all_admins),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__WORKERS": "1",
            # one secret shared by every component, so task tokens verify across processes
            "AIRFLOW__API_AUTH__JWT_SECRET": self._secret("jwt_secret"),
            "AIRFLOW__API__SECRET_KEY": self._secret("api_secret_key"),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "120",
            "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(self._bundle_config()),
            # bundle clones are kept per bundle *name*, by default under the system temp dir:
            # one place per Airflow home, or two stacks would share (and mix up) a clone
            "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH": str(self.home / "dag_bundles"),
            # log servers on free ports: several stacks (other engineers, tests) share a host
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
        }
        if self.dags_folder is not None:
            extra["AIRFLOW__CORE__DAGS_FOLDER"] = str(self.dags_folder)
        if not self.repo_on_path:
            for folder in ("dags", "plugins"):  # nothing of the repository's through these
                (self.home / folder).mkdir(parents=True, exist_ok=True)
            extra["AIRFLOW__CORE__DAGS_FOLDER"] = str(self.home / "dags")
            extra["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(self.home / "plugins")
        if self.executor == "CeleryExecutor":
            if not self.broker_url:
                raise ValueError("CeleryExecutor needs broker_url (redis://...)")
            extra.update(
                {
                    "AIRFLOW__CELERY__BROKER_URL": self.broker_url,
                    "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + pg.sqlalchemy_url(self.meta_url),
                    "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
                    "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "21600",
                }
            )
        extra.update(self.extra_env)
        env = airflow_env(
            self.home,
            job_db_url=self.job_connection_urls(),
            selections_url=self.selections_url,
            webhook_url=self.webhook_url,
            metadata_url=pg.sqlalchemy_url(self.meta_url),
            variables=dict(self.variables),
            extra=extra,
        )
        # keep what the caller put on PYTHONPATH (e.g. an extra site dir) after the repo
        paths = [str(REPO)] if self.repo_on_path else []
        paths += [
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)
        ]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        if not paths:
            del env["PYTHONPATH"]
        self._env = env
        return dict(env)

    def _secret(self, name: str) -> str:
        path = self.home / f".{name}"
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            path.write_text(secrets.token_urlsafe(32))
            path.chmod(0o600)
        return path.read_text().strip()

    def _bundle_config(self) -> list[dict]:
        if self.bundle_config is not None:
            return [dict(b) for b in self.bundle_config]
        bundles = [{"name": "dags-folder", "classpath": LOCAL_BUNDLE, "kwargs": {}}]
        for name, path in self.bundles.items():
            bundles.append({"name": name, "classpath": LOCAL_BUNDLE, "kwargs": {"path": str(path)}})
        return bundles

    # -- processes ------------------------------------------------------------------------

    def spawn(self, name: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> Proc:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0  # logs are appended to
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                list(args),
                env=dict(env if env is not None else self.env()),
                cwd=str(REPO if self.repo_on_path else self.run_dir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: `down` ends it whole
            )
        proc = Proc(name, popen.pid, popen.pid, str(log_path), popen, offset)
        self.procs.append(proc)
        self._write_pid_file()
        return proc

    def _write_pid_file(self, extra: Mapping[str, object] | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        data = json.loads(self.pid_file.read_text()) if self.pid_file.exists() else {}
        data["procs"] = [p.as_dict() for p in self.procs]
        data.update(extra or {})
        self.pid_file.write_text(json.dumps(data, indent=2))

    def airflow_cmd(self, *args: str) -> list[str]:
        return [str(VENV_BIN / "airflow"), *args]

    def start_services(self) -> None:
        """The webhook sink, the selections service (when importable), a Redis broker."""
        if self.executor == "CeleryExecutor" and self.broker_url is None and self.redis_server:
            redis_port = free_port()
            self.spawn(
                "redis",
                [
                    self.redis_server,
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    str(redis_port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.run_dir),
                ],
                env=_plain_env(),
            )
            wait_for(lambda: _port_open(redis_port), timeout=30, what="redis-server")
            self.broker_url = f"redis://127.0.0.1:{redis_port}/0"
        if self.webhook_url is None:  # not given by the caller: a sink of our own
            self.webhook_log = self.run_dir / "webhook.jsonl"
            # port 0: the sink binds a free port itself and prints its URL (no pick-then-bind race)
            sink = self.spawn(
                "webhook-sink",
                [
                    sys.executable,
                    "-m",
                    "devtools.webhook_sink",
                    "--port",
                    "0",
                    "--out",
                    str(self.webhook_log),
                ],
                env=_plain_env(),
            )
            sink_url = self._announced_url(sink, r"webhook sink on (http://\S+)", "webhook sink")
            wait_for(lambda: _http_ok(sink_url), timeout=30, what="webhook sink")
            self.webhook_url = sink_url
        if (
            self.selections_url is None  # not given by the caller (the e2e tests run their own)
            and self.start_selections
            and find_spec("devtools.selections_service") is not None
        ):
            service = self.spawn(
                "selections-service",
                [sys.executable, "-m", "devtools.selections_service", "--port", "0"],
                env=_plain_env(),
            )
            self.selections_url = self._announced_url(
                service, r"selections service listening on (http://\S+)", "selections service"
            )
        self._env = None  # the URLs are part of the environment

    def _announced_url(self, proc: Proc, pattern: str, what: str, timeout: float = 30) -> str:
        """The URL a service printed to its log once it listened (it bound port 0 itself)."""
        import re

        def announced() -> str | None:
            self.check_alive()
            with Path(proc.log).open("rb") as log:  # this start's lines only
                log.seek(proc.log_offset)
                found = re.search(pattern, log.read().decode(errors="replace"))
            return found.group(1).rstrip("/") if found else None

        return wait_for(announced, timeout=timeout, what=f"{what} to listen", retry_errors=False)  # type: ignore[return-value]

    def write_passwords(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        passwords = {}
        if self.passwords_file.exists():
            try:
                passwords = json.loads(self.passwords_file.read_text() or "{}")
            except ValueError:
                passwords = {}
        passwords[ADMIN_USER] = ADMIN_PASSWORD
        self.passwords_file.write_text(json.dumps(passwords) + "\n")

    def migrate(self) -> None:
        done = subprocess.run(
            airflow_cli("db", "migrate"),
            env=self.env(),
            capture_output=True,
            text=True,
            check=False,
            timeout=900,
        )
        if done.returncode != 0:
            raise RuntimeError(f"airflow db migrate failed:\n{done.stdout}\n{done.stderr}")

    def start_airflow(self) -> None:
        unknown = set(self.components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown Airflow components: {sorted(unknown)}")
        for name in COMPONENTS:  # in this order
            if name not in self.components:
                continue
            args = ["--host", "127.0.0.1", "--port", str(self.port)] if name == "api-server" else []
            self.spawn(name, self.airflow_cmd(name, *args))
        if self.executor == "CeleryExecutor":
            for i in range(1, self.celery_workers + 1):
                env = self.env()
                env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] = str(free_port())
                self.spawn(
                    f"celery-worker-{i}",
                    self.airflow_cmd(
                        "celery",
                        "worker",
                        "--celery-hostname",
                        f"pin-worker-{i}@%h",
                        "--concurrency",
                        "2",
                        "--without-mingle",
                        "--without-gossip",
                    ),
                    env=env,
                )

    def wait_healthy(self, timeout: float = 300) -> dict:
        def healthy() -> dict | None:
            self.check_alive()
            with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=10) as r:
                health = json.load(r)
            checked = ["metadatabase", "scheduler"]
            if "triggerer" in self.components:
                checked.append("triggerer")
            parts = [health.get(k, {}) for k in checked]
            if "dag-processor" in self.components and "dag_processor" in health:
                parts.append(health["dag_processor"] or {})
            return health if all(p.get("status") == "healthy" for p in parts) else None

        return wait_for(healthy, timeout=timeout, interval=1, what="Airflow health")  # type: ignore[return-value]

    def check_alive(self) -> None:
        """Raise when a component exited (with the tail of its log)."""
        for proc in self.procs:
            if proc.popen is not None and proc.popen.poll() is not None:
                tail = Path(proc.log).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{tail}")

    def tail_logs(self, lines: int = 40) -> str:
        """The last ``lines`` of every Airflow component's log (for assertion messages)."""
        chunks = []
        for proc in self.procs:
            path = Path(proc.log)
            if proc.name in COMPONENTS and path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                chunks.append(f"--- {proc.name}\n" + "\n".join(text))
        return "\n".join(chunks)

    def start(self, *, migrate: bool = True, meta_template: str | None = None) -> None:
        """Everything, in order; on any failure what was started is stopped again."""
        try:
            self.ensure_databases(meta_template=meta_template)
            self.start_services()
            self.write_passwords()
            if migrate:
                self.migrate()
            self.start_airflow()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> list[str]:
        killed = stop_groups(list(reversed(self.procs)))
        airflow_forkserver.close(home=self.home)  # the CLI's warm interpreters (cli below)
        if self.pid_file.exists():
            self.pid_file.unlink()
        return killed

    # -- clients --------------------------------------------------------------------------

    def token(self, username: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> str:
        """A JWT from ``POST /auth/token``, as the UI's login form gets it."""
        body = json.dumps({"username": username, "password": password}).encode()
        req = urllib.request.Request(
            f"{self.url}/auth/token",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)["access_token"]

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """One ``airflow`` CLI command against this stack (devtools.airflow_env.airflow)."""
        return airflow(list(args), self.env(), timeout=timeout)


def _plain_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    return env


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status == 200


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------------------------------------
# commands


def read_pid_file(path: Path = PID_FILE) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def cmd_down(pid_file: Path = PID_FILE) -> int:
    data = read_pid_file(pid_file)
    procs = [Proc(p["name"], p["pid"], p["pgid"], p["log"]) for p in data.get("procs", [])]
    live = [p for p in procs if group_members(p.pgid)]
    if live:
        killed = stop_groups(list(reversed(live)))
        print(f"stopped: {', '.join(p.name for p in live)}")
        if killed:
            print(f"(had to SIGKILL: {', '.join(killed)})")
    else:
        print("no local Airflow process running")
    if data.get("started_embedded_pg"):
        print("embedded Postgres:", "stopped" if pg.stop_embedded() else "not running")
    if pid_file.exists():
        pid_file.unlink()
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    data = read_pid_file()
    if any(group_members(p["pgid"]) for p in data.get("procs", [])):
        print(f"already running (see {PID_FILE}); `make down` first", file=sys.stderr)
        return 1
    PID_FILE.unlink(missing_ok=True)

    external = os.environ.get(pg.EXTERNAL_URL_ENV)
    started_pg = not external and not (pg.DEFAULT_PGDATA / "postmaster.pid").exists()
    admin = pg.admin_url()

    port = args.port
    if not port_is_free(port):
        port = free_port()
        print(f"port {args.port} is busy, using {port}")
    variables = dict(LOCAL_VARIABLES)
    for item in args.var:
        key, _, value = item.partition("=")
        variables[key] = value
    stack = AirflowStack(
        home=LOCAL / "airflow",
        run_dir=LOCAL,
        admin_url=admin,
        port=port,
        variables=variables,
        all_admins=args.no_login,
        # as deployed: the repository root is the DAG bundle (edits show up on the next parse),
        # the scheduler side is the installed pin-maintenance-airflow-plugin
        bundle_config=[root_bundle()],
        repo_on_path=False,
        demo_data=not args.no_demo_data,
    )
    stack._write_pid_file({"started_embedded_pg": started_pg, "url": stack.url})
    print(f"metadata: {META_DB}, job tables: {JOB_DB} on {_redact(admin)}")
    print("starting Airflow (first start migrates the metadata DB, about a minute) ...")
    try:
        stack.start()
    except BaseException as exc:
        print(f"failed to start: {exc}", file=sys.stderr)
        if started_pg:
            pg.stop_embedded()
        return 1
    stack._write_pid_file({"started_embedded_pg": started_pg, "url": stack.url})
    login = "no login (all admins)" if args.no_login else f"{ADMIN_USER} / {ADMIN_PASSWORD}"
    print(
        f"\nAirflow UI: {stack.url}\nlogin:      {login}\n"
        f"job DB:     {stack.job_url}"
        f" ({stack.seeded or 'existing rows kept, no demo data added'})\n"
        f"job roles:  {', '.join(r.name for r in (stack.job_roles or {}).values())}"
        " (include/sql/schema/job_roles.sql; what the job connections log in as)\n"
        f"alerts:     {stack.webhook_log}\n"
        f"selections: {stack.selections_url or 'not started (no devtools.selections_service)'}\n"
        f"logs:       {stack.run_dir / 'logs'}  (Airflow home {stack.home})"
    )
    if args.detach:
        print("\nrunning in the background; `make down` stops it")
        return 0
    print("\nCtrl-C stops everything")
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stopping:
            try:
                stack.check_alive()
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                break
            time.sleep(1)
    finally:
        print("stopping ...")
        stack.stop()
        if started_pg:
            pg.stop_embedded()
    return 0


def _redact(url: str) -> str:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(url)
    if params.get("password"):
        params["password"] = "***"
    return make_conninfo(**params)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="devtools.local_airflow", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a local Airflow (foreground unless --detach)")
    up.add_argument("--detach", action="store_true", help="start and return")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="api-server / UI port")
    up.add_argument("--no-login", action="store_true", help="everyone is admin, no login page")
    up.add_argument("--var", action="append", default=[], help="KEY=JSON Airflow Variable")
    up.add_argument(
        "--no-demo-data",
        action="store_true",
        help="do not seed demo rows into empty job tables",
    )
    sub.add_parser("down", help="stop everything `up` started")
    args = parser.parse_args(argv)
    if args.cmd == "up":
        return cmd_up(args)
    return cmd_down()


if __name__ == "__main__":
    sys.exit(main())
