"""The bench's shared machinery: plans (sizes), processes, series, the Bench (databases, job
subprocesses, Airflow) and the section registry type. Each job's benchmark lives in its own
module (``bench_retention``, ``bench_slots``, ``bench_detach``, ``bench_airflow``: data,
measurement, report); ``devtools.bench`` is the entry point that runs the registered sections.
The import graph is one-way: the sections import this module, the entry point imports the
sections (and holds their registry); this module imports no section.

A new section is a module with ``SECTION = SectionSpec(key, title, run)`` (``run(bench, out)``
appends markdown lines to ``out``) and one line in ``devtools.bench.REGISTRY``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from devtools import airflow_env as ae
from devtools import bench_data as bd
from devtools import pg

REPO = Path(__file__).resolve().parent.parent
BENCH_PGDATA = REPO / ".local" / "bench-pg"
DEFAULT_OUT = REPO / "docs" / "benchmarks.md"
SMOKE_OUT = REPO / ".local" / "bench" / "benchmarks-smoke.md"
DAG_IDS = {
    "retention": "user_activity_retention",
    "slots": "calendar_slot_expiration",
    "detach": "news_snapshot_detach_retry",
}
# each job's connection, so the role it runs as (include/sql/schema/job_roles.sql)
JOB_CONN_IDS = {"retention": "user_activity_db", "slots": "calendar_db", "detach": "news_db"}
JOB_MODULES = {
    "retention": "include.pin_maintenance.jobs.activity_retention",
    "slots": "include.pin_maintenance.jobs.slot_expiration",
    "detach": "include.pin_maintenance.jobs.snapshot_detach",
}
RETENTION_DAYS = 365
BIG_RETENTION = 1_000_000  # eligible sessions from which a scale is measured once
SELECTIONS_LOGIN = "pin-maintenance"
SELECTIONS_PASSWORD = "local-dev-secret"

log = logging.getLogger("devtools.bench")


# ---------------------------------------------------------------------------------------------
# plans (sizes)


@dataclass(frozen=True)
class Plan:
    name: str
    runs: int  # timed repetitions of each job / limit measurement
    retention: tuple[int, ...]  # eligible sessions, one scale each
    retention_shapes: tuple[str, ...]  # bench_data.RETENTION_SHAPES keys, each at every scale
    slots: tuple[tuple[int, int], ...]  # (table rows, due rows), one scale each
    empty_slots: tuple[int, ...]  # table rows for the empty cycle (no due row)
    empty_runs: int
    detach_rows: int
    detach_seq_rows: int  # the sequential baseline (detach_concurrency=1) is ~50 rows/s
    latency_ms: float
    parse_runs: int
    airflow_runs: int  # `airflow dags test` runs per DAG on an empty dataset
    overhead_dags: tuple[str, ...]  # DAG ids run on an empty dataset
    dags_on_data: tuple[str, ...]  # jobs whose DAG runs once on the benchmark data
    # the neighbour bench (devtools.bench_neighbours): its own primary and replica
    neighbour_slots: tuple[int, int] = (2_000_000, 1_500_000)  # (table rows, due rows)
    neighbour_retention: int = 100_000  # eligible sessions (project shape)
    neighbour_baseline_seconds: float = 15.0  # traffic alone before each job run
    # job -> config dicts, one case each (over the job's base config); None: the module's
    neighbour_configs: dict[str, tuple[dict, ...]] | None = None
    neighbour_alone: bool = False  # only the runs with nobody else there (the replica's bound)


SMOKE = Plan(
    name="smoke",
    runs=1,
    retention=(200,),
    retention_shapes=("project", "setnull"),  # each shape costs ~3 job subprocesses
    slots=((2_000, 300),),
    empty_slots=(1_000, 5_000),
    empty_runs=1,
    detach_rows=100,
    detach_seq_rows=10,
    latency_ms=20,
    parse_runs=1,
    airflow_runs=1,
    # each `airflow dags test` costs ~10 s: one empty run, one run on data, to stay < 60 s
    overhead_dags=("calendar_slot_expiration",),
    dags_on_data=("retention",),
    neighbour_slots=(20_000, 15_000),
    neighbour_retention=1_000,
    neighbour_baseline_seconds=2.0,
    neighbour_configs={"slots": ({},), "retention": ({},)},  # the defaults only
)
DEFAULT = Plan(
    name="default",
    runs=3,
    retention=(10_000, 100_000),
    retention_shapes=("project", "few", "events", "setnull"),
    slots=((200_000, 20_000), (2_000_000, 200_000)),
    empty_slots=(10_000, 10_000_000),
    empty_runs=5,
    detach_rows=10_000,
    detach_seq_rows=300,
    latency_ms=20,
    parse_runs=3,
    airflow_runs=3,
    overhead_dags=tuple(DAG_IDS.values()),
    dags_on_data=tuple(DAG_IDS),
)
FULL = dataclasses.replace(DEFAULT, name="full", retention=(10_000, 100_000, 1_000_000))


# ---------------------------------------------------------------------------------------------
# measurements


class BenchError(RuntimeError):
    """A measurement could not be taken or its result is wrong (the section is marked failed)."""


@dataclass
class Proc:
    """A finished subprocess: wall time, peak RSS (ru_maxrss of it and its children), output."""

    returncode: int
    wall: float
    maxrss_kb: int
    cpu: float  # user + system seconds of the process (and the children it waited for)
    stdout: str
    stderr: str

    def tail(self, lines: int = 30) -> str:
        text = (self.stdout + "\n" + self.stderr).strip().splitlines()
        return "\n".join(text[-lines:])


def measure_process(
    cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 1800
) -> Proc:
    """Run ``cmd``; its rusage comes from ``wait4`` on that very child (not all children)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=err, env=env, cwd=REPO)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Proc(
            returncode=proc.returncode,
            wall=wall,
            maxrss_kb=usage.ru_maxrss,
            cpu=usage.ru_utime + usage.ru_stime,
            stdout=out.read().decode("utf-8", "replace"),
            stderr=err.read().decode("utf-8", "replace"),
        )


@dataclass
class Series:
    """Repeated measurements of one thing, in seconds."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    def fmt(self) -> str:
        if not self.values:
            return "n/a"
        if len(self.values) == 1:
            return _secs(self.values[0])
        return f"{_secs(self.median)} ({_secs(min(self.values))} .. {_secs(max(self.values))})"


def _secs(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if value < 0.1:
        return f"{value * 1000:.1f} ms"
    if value < 10:
        return f"{value:.2f} s"
    return f"{value:.1f} s"


def _rate(rows: float, seconds: float) -> str:
    if not seconds or math.isnan(seconds):
        return "n/a"
    per_s = rows / seconds
    return f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:,.1f}"


def _mb(kb: float) -> str:
    return f"{kb / 1024:.0f} MB"


def _ratio(limit: float, job: float) -> float:
    return limit / job if job and not math.isnan(job) else math.nan


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "| " + " | ".join(headers) + " |"
    rule = "|" + "|".join("---" for _ in headers) + "|"
    body = ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join([head, rule, *body])


# ---------------------------------------------------------------------------------------------
# the job functions, run in a subprocess (``python -m devtools.bench _job SPEC``)


@dataclass
class JobRun:
    seconds: float  # inside run(), imports and interpreter start excluded
    cpu: float  # CPU seconds of the job process inside run() (all threads)
    proc: Proc
    result: dict
    counters: dict
    alerts: int


def _job_args(job: str, spec: dict) -> tuple[list, Callable[[], None]]:
    """Positional arguments a job's ``run`` takes after (connect, config, telemetry, stop),
    built as its DAG task builds them, and what to close afterwards."""
    if job == "detach":
        from include.pin_maintenance.jobs.snapshot_detach_http import (
            HttpDetachClient,
            basic_auth_session,
        )

        client = HttpDetachClient(
            spec["selections_url"],
            lambda: basic_auth_session(SELECTIONS_LOGIN, SELECTIONS_PASSWORD),
        )
        return [client], client.close
    return [], lambda: None


def _session_settings(module: object, job_name: str):
    """The job's own session settings (what its DAG passes to postgres_connect)."""
    from include.pin_maintenance.db import SessionSettings

    for name in ("SESSION_SETTINGS", "SESSION"):
        settings = getattr(module, name, None)
        if isinstance(settings, SessionSettings):
            return settings
    return SessionSettings(application_name=job_name)


def _preparing(connect, threshold: int):
    """The job's connections, but with psycopg's auto-prepare back on (its default is 5):
    what the job would gain from server-side prepared statements on a direct connection."""

    def open_preparing():
        conn = connect()
        conn.prepare_threshold = threshold
        return conn

    return open_preparing


def _as_dict(result: object) -> dict:
    for name in ("as_dict", "to_dict", "asdict"):
        method = getattr(result, name, None)
        if callable(method):
            return dict(method())
    if dataclasses.is_dataclass(result):
        return dataclasses.asdict(result)
    return {"result": repr(result)}


def _cpu_seconds() -> float:
    """User + system CPU of this process so far, all threads."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


ChildTracer = Callable[[dict], tuple[Any, Callable[[], None]]]


def _no_tracer(spec: dict) -> tuple[Any, Callable[[], None]]:
    return None, lambda: None


def job_child_main(spec_json: str, child_tracer: ChildTracer = _no_tracer) -> int:
    """The child side: run one job function once and print its timing and result as JSON.

    ``child_tracer(spec)`` gives (tracer or None, flush): the entry point passes the tracing
    section's (``devtools.bench_tracing.child_tracer``); this module imports no section."""
    from include.pin_maintenance.db import configured
    from include.pin_maintenance.stopping import StopSignal
    from include.pin_maintenance.telemetry import (
        JobLog,
        LogOnlyAlerts,
        RecordingMetrics,
        Telemetry,
    )

    spec = json.loads(spec_json)
    logging.basicConfig(
        level=logging.INFO,
        filename=spec["log_file"],
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    module = importlib.import_module(JOB_MODULES[spec["job"]])
    config = module.CONFIG.resolve(None, spec["config"])
    url = spec["url"]
    connect = configured(lambda: psycopg.connect(url), _session_settings(module, module.CONFIG.job))
    if spec.get("prepare_threshold") is not None:  # the bench's "with prepared statements" case
        connect = _preparing(connect, int(spec["prepare_threshold"]))
    job_log = JobLog(module.CONFIG.job, f"bench__{uuid.uuid4().hex[:8]}")
    metrics = RecordingMetrics()
    alerts = LogOnlyAlerts(job_log)
    telemetry = Telemetry(job_log, metrics, alerts)
    tracer, flush_spans = child_tracer(spec)  # None unless the tracing section
    if tracer is not None:
        telemetry.tracer = tracer
    args, close = _job_args(spec["job"], spec)
    try:
        cpu_before = _cpu_seconds()
        started = time.perf_counter()
        result = module.run(connect, config, telemetry, StopSignal(), *args)
        flush_spans()
        seconds = time.perf_counter() - started
        cpu = _cpu_seconds() - cpu_before
    finally:
        close()
    payload = {
        "seconds": seconds,
        "cpu": cpu,
        "result": _as_dict(result),
        "counters": metrics.counters,
        "alerts": len(alerts.sent),
    }
    print("BENCH_RESULT " + json.dumps(payload, default=str), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# the selections service and a client that measures its capacity alone


@dataclass
class Service:
    url: str
    proc: subprocess.Popen

    def stats(self) -> dict[str, Any]:
        """The service's own counts (``/stats``: accepted, refused, peak in flight, call log)."""
        with urllib.request.urlopen(self.url + "/stats", timeout=30) as response:
            return json.load(response)

    def reset(self) -> None:
        with urllib.request.urlopen(self.url + "/reset", timeout=30) as response:
            response.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# the line devtools/selections_service.py prints once it is bound (here to port 0: no port is
# picked and released first, so no other process can take it in between)
_LISTENING = re.compile(rb"selections service listening on (http://127\.0\.0\.1:\d+)")


def start_selections(latency_ms: float, log_file: Path, *extra: str) -> Service:
    """``devtools/selections_service.py`` (stdlib HTTP server) on a loopback port it binds
    itself; ``extra``: more of its command-line options (e.g. an admission limit)."""
    cmd = [
        sys.executable,
        "-m",
        "devtools.selections_service",
        "--port",
        "0",
        "--latency-ms",
        f"{latency_ms:g}",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log_file, "ab") as sink:
        offset = sink.tell()  # the log is shared by the services of one bench
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"selections service exited with {proc.returncode}; see {log_file}")
        with open(log_file, "rb") as log_text:
            log_text.seek(offset)
            listening = _LISTENING.search(log_text.read())
        if listening:
            return Service(listening.group(1).decode(), proc)
        time.sleep(0.05)
    proc.kill()
    proc.wait(10)
    raise BenchError(f"selections service did not start listening; see {log_file}")


# ---------------------------------------------------------------------------------------------
# the bench


class Bench:
    """What every section shares: the plan, the server, template datasets, job subprocesses."""

    def __init__(
        self,
        plan: Plan,
        admin_url: str,
        workdir: Path,
        runs: int | None,
        registry: Sequence[SectionSpec] = (),
    ) -> None:
        self.plan = plan
        self.registry = tuple(registry)
        self.admin = admin_url
        self.workdir = workdir
        self.runs = runs or plan.runs
        self.prefix = f"pin_bench_{os.getpid()}"
        # the jobs run as the roles of the grant script, as in production; these names are
        # this bench's own (dropped at the end), and the datasets' owner sets them up
        self.role_names = {c: f"{n}_{self.prefix}" for c, n in pg.DEV_ROLE_NAMES.items()}
        self.roles: dict[str, pg.JobRole] = {}
        self.databases: list[str] = []
        self.templates: dict[tuple, pg.Database] = {}
        self.generation: list[tuple[str, str, float, str]] = []  # dataset, rows, secs, size
        self.job_medians: dict[tuple[str, str], float] = {}  # (job, dataset) -> seconds
        self.overhead: dict[str, Series] = {}
        self._airflow_home: Path | None = None
        self._service: Service | None = None
        self.concurrency: int | None = None  # the detach job's default, read once

    # -- databases --------------------------------------------------------------------------

    def new_database(self, tag: str, template: str | None = None) -> pg.Database:
        name = f"{self.prefix}_{tag}"[:63]
        db = pg.create_database(self.admin, name, template=template)
        self.databases.append(name)
        return db.with_roles(self.roles)

    def drop(self, db: pg.Database) -> None:
        pg.drop_database(self.admin, db.name)
        with contextlib.suppress(ValueError):
            self.databases.remove(db.name)

    def clone(self, template: pg.Database, tag: str) -> pg.Database:
        """A fresh copy of a dataset, then a CHECKPOINT so no copy I/O spills into a timing."""
        db = self.new_database(f"{tag}_{uuid.uuid4().hex[:6]}", template=template.name)
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute("checkpoint")
        return db

    def dataset(self, label: str, rows: int, key: tuple, load: Callable[[str], None]):
        """A template database holding a dataset, generated once per bench and timed."""
        if key in self.templates:
            return self.templates[key]
        db = self.new_database("tpl_" + "_".join(str(k) for k in key))
        pg.apply_schema(db.url)
        pg.apply_job_roles(db.url, self.role_names)  # its clones carry the grants
        if not self.roles:
            self.roles = pg.set_role_passwords(self.admin, self.role_names)
        db = db.with_roles(self.roles)
        started = time.perf_counter()
        load(db.url)
        seconds = time.perf_counter() - started
        with psycopg.connect(db.url) as conn:
            (size,) = conn.execute(
                "select pg_size_pretty(pg_database_size(current_database()))"
            ).fetchone()
        self.generation.append((label, f"{rows:,}", seconds, size))
        self.templates[key] = db
        return db

    def empty_template(self) -> pg.Database:
        return self.dataset("empty schema", 0, ("empty",), lambda url: None)

    def outbox_template(self, due: int) -> pg.Database:
        """The detach dataset: ``due`` due Pending rows among Done/backing-off/Quarantined."""
        others = 5 * due + due // 2 + due // 10
        label = f"outbox: {due:,} due Pending + {others:,} Done/backing-off/Quarantined rows"
        return self.dataset(
            label, due + others, ("outbox", due), lambda url: bd.load_outbox(url, due)
        )

    def slots_template(self, total: int, due: int) -> pg.Database:
        """The slots dataset: ``total`` rows, ``due`` of them Available and due."""
        label = f"slots: {total:,} rows, {due:,} due"
        return self.dataset(
            label, total, ("slots", total, due), lambda url: bd.load_slots(url, total, due)
        )

    # -- running things ---------------------------------------------------------------------

    def run_job(self, job: str, db: pg.Database, config: dict, **extra: object) -> JobRun:
        spec = {
            "job": job,
            "url": db.job_url(JOB_CONN_IDS[job]),
            "config": config,
            "log_file": str(self.workdir / f"{job}.log"),
            **extra,
        }
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "devtools.bench", "_job", json.dumps(spec)]
        proc = measure_process(cmd, env=env)
        line = next(
            (ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("BENCH_RESULT ")),
            None,
        )
        if proc.returncode != 0 or line is None:
            raise BenchError(f"{job} job exited {proc.returncode}:\n{proc.tail()}")
        payload = json.loads(line.removeprefix("BENCH_RESULT "))
        return JobRun(
            seconds=payload["seconds"],
            cpu=payload["cpu"],
            proc=proc,
            result=payload["result"],
            counters=payload["counters"],
            alerts=payload["alerts"],
        )

    def timed_sql(self, db: pg.Database, statements: Sequence[str], params: dict) -> float:
        """Connect, run the statements in one transaction, commit: the physical limit."""
        started = time.perf_counter()
        with psycopg.connect(db.url) as conn:
            for statement in statements:
                conn.execute(statement, params)
            conn.commit()
        return time.perf_counter() - started

    # -- sections ---------------------------------------------------------------------------

    def selections(self) -> Service:
        if self._service is None:
            self._service = start_selections(self.plan.latency_ms, self.workdir / "selections.log")
        return self._service

    def airflow_env_extra(self) -> dict[str, str]:
        home = self.workdir / "airflow-home"
        return {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        }

    def airflow_home(self) -> Path:
        if self._airflow_home is None:
            home = self.workdir / "airflow-home"
            ae.migrate(ae.airflow_env(home, job_db_url="postgresql:///unused"))
            self._airflow_home = home
        return self._airflow_home

    def dags_test(
        self,
        dag_id: str,
        db: pg.Database,
        variables: dict | None = None,
        *,
        selections_url: str | None = None,
    ) -> Proc:
        env = ae.airflow_env(
            self.airflow_home(),
            job_db_url=db.job_urls(),
            selections_url=selections_url or self.selections().url,
            selections_login=SELECTIONS_LOGIN,
            selections_password=SELECTIONS_PASSWORD,
            variables=variables,
        )
        cmd = [str(ae.VENV_BIN / "airflow"), "dags", "test", dag_id]
        proc = measure_process(cmd, env=env, timeout=3600)
        if proc.returncode != 0:
            raise BenchError(f"airflow dags test {dag_id} exited {proc.returncode}:\n{proc.tail()}")
        return proc

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        if self._service is not None:
            self._service.stop()
        for name in list(self.databases):
            with contextlib.suppress(psycopg.Error):
                pg.drop_database(self.admin, name)
        with contextlib.suppress(psycopg.Error):
            pg.drop_roles(self.admin, self.role_names)


# ---------------------------------------------------------------------------------------------
# the section registry


@dataclass(frozen=True)
class DagOnData:
    """One ``airflow dags test`` run of a job's DAG on that job's benchmark data."""

    proc: Proc
    rows: int
    label: str
    fn_key: tuple[str, str]  # the job_medians key of the job function on the same data
    check: Callable[[], None]  # asserts the end state and drops the database


@dataclass(frozen=True)
class SectionSpec:
    """One benchmark section: ``run(bench, out)`` appends markdown lines to ``out``.

    ``dag_on_data`` (jobs only) runs the job's DAG once on its data for the Airflow section.
    ``in_smoke`` False: ``--smoke`` runs it only when ``--only`` names it (a section too slow
    for the smoke run that ``make test`` includes; its own smoke test names it).
    """

    key: str
    title: str
    run: Callable[[Bench, list[str]], None]
    dag_id: str | None = None
    dag_on_data: Callable[[Bench], DagOnData] | None = None
    in_smoke: bool = True
