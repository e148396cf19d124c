"""Benchmarks: each job's real code path against the physical limit of the same data.

    python -m devtools.bench            # default sizes (~10 min), writes docs/benchmarks.md
    python -m devtools.bench --full     # adds 1M eligible retention sessions (slow)
    python -m devtools.bench --smoke    # tiny sizes, < 60 s, .local/bench/benchmarks-smoke.md
    python -m devtools.bench --only slots detach --runs 5 --out /tmp/b.md

What is measured (docs/benchmarks.md explains how to read it):

- Each job through its job function ``include.pin_maintenance.jobs.<job>.run(...)``, exactly as
  the DAG task calls it but with ``RecordingMetrics`` / ``LogOnlyAlerts``, in a fresh Python
  subprocess: its time inside ``run()`` and the peak RSS of that process (``wait4`` rusage).
- Against the same data in the same run, the physical limit: one set-based statement chain in
  one transaction (retention, slots) or the selections service's own capacity at the job's
  concurrency (detach). Every timed run starts from an identical copy of the dataset (a
  template database cloned with ``CREATE DATABASE ... TEMPLATE``) and runs alternate job/limit.
- Once per job the DAG through ``airflow dags test`` (the standard way, DESIGN section 3), the
  fixed Airflow overhead of a run on an empty dataset, and the parse time of every DAG file.

The server is the embedded Postgres in ``.local/bench-pg`` (started and stopped here) unless
``PIN_PG_URL`` names one; every database the bench creates is named ``pin_bench_<pid>_*`` and
dropped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import importlib
import itertools
import json
import logging
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from base64 import b64encode
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import psycopg

from devtools import airflow_env as ae
from devtools import bench_data as bd
from devtools import bench_tracing, pg

REPO = Path(__file__).resolve().parent.parent
BENCH_PGDATA = REPO / ".local" / "bench-pg"
DEFAULT_OUT = REPO / "docs" / "benchmarks.md"
SMOKE_OUT = REPO / ".local" / "bench" / "benchmarks-smoke.md"
NOTES_MARKER = (
    "<!-- hand-written notes below this line are kept when the bench rewrites the file -->"
)

SECTIONS = ("retention", "slots", "detach", "detach_capacity", "tracing", "parse", "airflow")
TITLES = {
    "retention": "Retention (user_activity_retention)",
    "slots": "Slot expiration (calendar_slot_expiration)",
    "detach": "Snapshot detach retry (news_snapshot_detach_retry)",
    "detach_capacity": "Snapshot detach at the service's capacity (adaptive concurrency)",
    "tracing": "Tracing overhead (OpenTelemetry spans on / off)",
    "parse": "DAG parse time",
    "airflow": "Airflow overhead (airflow dags test)",
}
DAG_IDS = {
    "retention": "user_activity_retention",
    "slots": "calendar_slot_expiration",
    "detach": "news_snapshot_detach_retry",
}
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


SMOKE = Plan(
    name="smoke",
    runs=1,
    retention=(200,),
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
)
DEFAULT = Plan(
    name="default",
    runs=3,
    retention=(10_000, 100_000),
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
        from include.pin_maintenance.jobs.snapshot_detach_client import (
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


def job_child_main(spec_json: str) -> int:
    """The child side: run one job function once and print its timing and result as JSON."""
    from include.pin_maintenance.db import configured
    from include.pin_maintenance.runloop import StopSignal
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
    job_log = JobLog(module.CONFIG.job, f"bench__{uuid.uuid4().hex[:8]}")
    metrics = RecordingMetrics()
    alerts = LogOnlyAlerts(job_log)
    telemetry = Telemetry(job_log, metrics, alerts)
    tracer, flush_spans = bench_tracing.child_tracer(spec)  # None unless the tracing section
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

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_selections(latency_ms: float, log_file: Path) -> Service:
    """``devtools/selections_service.py`` (stdlib HTTP server) on a free loopback port."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "devtools.selections_service",
        "--port",
        str(port),
        "--latency-ms",
        str(latency_ms),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log_file, "ab") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"selections service exited with {proc.returncode}; see {log_file}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return Service(url, proc)
        time.sleep(0.05)
    Service(url, proc).stop()
    raise BenchError(f"selections service did not listen on {url}; see {log_file}")


class _NoDelayConnection(http.client.HTTPConnection):
    """TCP_NODELAY like urllib3 (the job's client) sets on every connection."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def hammer(base_url: str, snapshot_ids: Sequence[str], concurrency: int) -> tuple[float, int]:
    """POST detach for every id with ``concurrency`` keep-alive clients; (seconds, errors)."""
    parts = urlsplit(base_url)
    auth = b64encode(f"{SELECTIONS_LOGIN}:{SELECTIONS_PASSWORD}".encode()).decode()
    headers = {"Content-Type": "application/json", "Authorization": f"Basic {auth}"}
    body = json.dumps({"reason": "BlockReplaced"}).encode()  # bytes: one send with headers
    counter = itertools.count()  # next() on itertools.count is atomic under the GIL
    errors: list[str] = []

    def client() -> None:
        conn = _NoDelayConnection(parts.hostname, parts.port, timeout=10)
        try:
            while (i := next(counter)) < len(snapshot_ids):
                try:
                    conn.request(
                        "POST",
                        f"/internal/snapshots/{snapshot_ids[i]}/detach",
                        body=body,
                        headers=headers,
                    )
                    response = conn.getresponse()
                    response.read()
                    if response.status >= 300:
                        errors.append(str(response.status))
                except (OSError, http.client.HTTPException) as exc:
                    errors.append(type(exc).__name__)
                    conn.close()
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started, len(errors)


# ---------------------------------------------------------------------------------------------
# the bench


@dataclass
class Section:
    key: str
    lines: list[str] = field(default_factory=list)
    error: str | None = None
    load_before: str = ""
    load_after: str = ""
    seconds: float = 0.0


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


class Bench:
    def __init__(self, plan: Plan, admin_url: str, workdir: Path, runs: int | None) -> None:
        self.plan = plan
        self.admin = admin_url
        self.workdir = workdir
        self.runs = runs or plan.runs
        self.prefix = f"pin_bench_{os.getpid()}"
        self.databases: list[str] = []
        self.templates: dict[tuple, pg.Database] = {}
        self.generation: list[tuple[str, str, float, str]] = []  # dataset, rows, secs, size
        self.job_medians: dict[tuple[str, str], float] = {}  # (job, dataset) -> seconds
        self.overhead: dict[str, Series] = {}
        self._airflow_home: Path | None = None
        self._service: Service | None = None
        self.concurrency: int | None = None

    # -- databases --------------------------------------------------------------------------

    def new_database(self, tag: str, template: str | None = None) -> pg.Database:
        name = f"{self.prefix}_{tag}"[:63]
        db = pg.create_database(self.admin, name, template=template)
        self.databases.append(name)
        return db

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

    def retention_template(self, eligible: int) -> tuple[pg.Database, bd.RetentionDataset]:
        ds = bd.retention_dataset(eligible)
        label = (
            f"retention: {ds.eligible:,} eligible + {ds.keep:,} young/Active sessions, "
            f"{ds.views_per_session} views + {ds.events_per_session} events each"
        )
        db = self.dataset(label, ds.rows, ("ret", eligible), lambda url: bd.load_retention(url, ds))
        return db, ds

    def slots_template(self, total: int, due: int) -> pg.Database:
        label = f"slots: {total:,} rows, {due:,} due"
        return self.dataset(
            label, total, ("slots", total, due), lambda url: bd.load_slots(url, total, due)
        )

    def outbox_template(self, due: int) -> pg.Database:
        others = 5 * due + due // 2 + due // 10
        label = f"outbox: {due:,} due Pending + {others:,} Done/backing-off/Quarantined rows"
        return self.dataset(
            label, due + others, ("outbox", due), lambda url: bd.load_outbox(url, due)
        )

    def empty_template(self) -> pg.Database:
        return self.dataset("empty schema", 0, ("empty",), lambda url: None)

    # -- running things ---------------------------------------------------------------------

    def run_job(self, job: str, db: pg.Database, config: dict, **extra: object) -> JobRun:
        spec = {
            "job": job,
            "url": db.url,
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

    def alternate(self, i: int) -> tuple[str, str]:
        """Job first on even runs, limit first on odd ones (cache warmth favours neither)."""
        return ("job", "limit") if i % 2 == 0 else ("limit", "job")

    # -- sections ---------------------------------------------------------------------------

    def bench_retention(self, out: list[str]) -> None:
        rows = []
        for eligible in self.plan.retention:
            template, ds = self.retention_template(eligible)
            deleted = ds.eligible_rows
            before = bd.retention_state(template.url, RETENTION_DAYS)
            config = {
                "retention_period_days": RETENTION_DAYS,
                "max_batches_per_run": 50_000,
                "max_run_duration_seconds": 7200,
            }
            job, limit, rss, cpu, batches = Series(), Series(), [], Series(), set()
            # a 1M-session run takes minutes per clone and per measurement: once is enough to
            # show the trend (time per row, peak RSS) against the smaller scales
            runs = self.runs if eligible < BIG_RETENTION else 1
            for i in range(runs):
                for what in self.alternate(i):
                    db = self.clone(template, "ret")
                    try:
                        if what == "job":
                            run = self.run_job("retention", db, config)
                            job.add(run.seconds)
                            rss.append(run.proc.maxrss_kb)
                            cpu.add(run.cpu)
                            batches.add(str(run.result.get("BatchesProcessed", "?")))
                            self.check_retention(db, before, ds, run.result)
                        else:
                            limit.add(self.timed_sql(db, RETENTION_LIMIT, {"days": RETENTION_DAYS}))
                            self.check_retention(db, before, ds, None)
                    finally:
                        self.drop(db)
            self.job_medians[("retention", str(eligible))] = job.median
            ratio = _ratio(limit.median, job.median)
            rows.append(
                [
                    f"{ds.eligible:,}" + ("" if runs == self.runs else f" ({runs} run)"),
                    f"{deleted:,}",
                    job.fmt(),
                    limit.fmt(),
                    f"{ratio:.2f}x",
                    _rate(deleted, job.median),
                    _rate(deleted, limit.median),
                    f"{1e6 * job.median / deleted:.1f} µs" if deleted else "n/a",
                    _mb(max(rss)),
                    _secs(cpu.median),
                    ", ".join(sorted(batches)),
                    _verdict(ratio >= 0.9),
                ]
            )
        out.append(
            "Job: `activity_retention.run()` with defaults (batch_size 5000), "
            "`max_batches_per_run` and `max_run_duration_seconds` raised so one run drains the "
            "backlog. Limit: one transaction deleting the action_events, then the "
            "property_object_views, then the sessions of every eligible id (three set-based "
            "statements). Each timed run starts from a fresh clone of the dataset; young "
            "Inactive and Active sessions (20% as many) and property_object_view_stats are "
            "checked unchanged after every run."
        )
        out.append("")
        out.append(
            md_table(
                [
                    "eligible sessions",
                    "rows deleted",
                    "job",
                    "limit",
                    "limit/job",
                    "job rows/s",
                    "limit rows/s",
                    "job time per row",
                    "job peak RSS",
                    "job CPU in run()",
                    "batches",
                    "goal >= 0.9x",
                ],
                rows,
            )
        )

    def check_retention(
        self, db: pg.Database, before: dict, ds: bd.RetentionDataset, result: dict | None
    ) -> None:
        after = bd.retention_state(db.url, RETENTION_DAYS)
        keep = ds.keep
        expected = {
            "eligible_left": 0,
            "sessions": keep,
            "views": keep * ds.views_per_session,
            "events": keep * ds.events_per_session,
            "stats_views": before["stats_views"],
        }
        if after != expected:
            raise BenchError(f"retention left {after}, expected {expected}")
        if result is not None:
            want = {
                "DeletedSessions": ds.eligible,
                "DeletedPropertyObjectViews": ds.eligible * ds.views_per_session,
                "DeletedActionEvents": ds.eligible * ds.events_per_session,
            }
            got = {k: result.get(k) for k in want}
            if got != want:
                raise BenchError(f"retention result {got}, expected {want}")

    def bench_slots(self, out: list[str]) -> None:
        config = {"max_run_duration_seconds": 3600}
        module = importlib.import_module(JOB_MODULES["slots"])
        defaults = module.CONFIG.defaults
        batch_size, runners = int(defaults["batch_size"]), int(defaults["runners"])
        rows = []
        for total, due in self.plan.slots:
            template = self.slots_template(total, due)
            series = {what: Series() for what in ("job", "one", "limit", "chunks")}
            rss, cpu = [], Series()
            for i in range(self.runs):
                variants = list(series)
                for what in variants[i % 4 :] + variants[: i % 4]:
                    seconds, run = self.slots_timed(what, template, due, config, batch_size)
                    series[what].add(seconds)
                    if what == "job" and run is not None:
                        rss.append(run.proc.maxrss_kb)
                        cpu.add(run.cpu)
            job, one, limit, chunks = (series[k] for k in ("job", "one", "limit", "chunks"))
            self.job_medians[("slots", f"{total}/{due}")] = job.median
            ratio = _ratio(limit.median, job.median)
            rows.append(
                [
                    f"{total:,}",
                    f"{due:,}",
                    job.fmt(),
                    one.fmt(),
                    limit.fmt(),
                    f"{ratio:.2f}x",
                    f"{_ratio(limit.median, one.median):.2f}x",
                    _rate(due, job.median),
                    _rate(due, limit.median),
                    chunks.fmt(),
                    f"{_ratio(limit.median, chunks.median):.2f}x",
                    _mb(max(rss)),
                    _secs(cpu.median),
                    _verdict(ratio >= 0.9),
                ]
            )
        out.append(_slots_text(batch_size, runners))
        out.append("")
        out.append(
            md_table(
                [
                    "table rows",
                    "due",
                    "job",
                    "job, 1 runner",
                    "limit",
                    "limit/job",
                    "limit/job (1 runner)",
                    "job rows/s",
                    "limit rows/s",
                    f"raw UPDATE in {batch_size}-row transactions",
                    "limit/that",
                    "job peak RSS",
                    "job CPU in run()",
                    "goal >= 0.9x",
                ],
                rows,
            )
        )
        # the empty cycle: nothing is due; the cost must not grow with the table
        empty_rows, medians = [], []
        for total in self.plan.empty_slots:
            template = self.slots_template(total, 0)
            job, limit, rss = Series(), Series(), []
            for _ in range(max(self.runs, self.plan.empty_runs)):
                run = self.run_job("slots", template, config)
                if run.result.get("ExpiredCount") != 0:
                    raise BenchError(f"empty cycle expired {run.result}")
                job.add(run.seconds)
                rss.append(run.proc.maxrss_kb)
                limit.add(self.timed_sql(template, [SLOTS_LIMIT], {}))
            medians.append(job.median)
            empty_rows.append([f"{total:,}", job.fmt(), limit.fmt(), _mb(max(rss))])
        growth = medians[-1] / medians[0] if len(medians) > 1 and medians[0] else math.nan
        out.append("")
        out.append(
            f"Empty cycle (no due slot; the job still reads its backlog gauge): "
            f"{self.plan.empty_slots[-1]:,} vs {self.plan.empty_slots[0]:,} rows = "
            f"**{growth:.2f}x** (goal <= 2x: {_verdict(growth <= 2)})."
        )
        out.append("")
        out.append(
            md_table(
                ["table rows", "job (empty cycle)", "raw UPDATE finding nothing", "job peak RSS"],
                empty_rows,
            )
        )

    def slots_timed(
        self, what: str, template: pg.Database, due: int, config: dict, batch_size: int
    ) -> tuple[float, JobRun | None]:
        """One timed slots variant on a fresh clone: job, one (runners 1), limit or chunks."""
        db = self.clone(template, "slots")
        try:
            run = None
            if what in {"job", "one"}:
                run = self.run_job("slots", db, config | ({"runners": 1} if what == "one" else {}))
                seconds = run.seconds
                if run.result.get("ExpiredCount") != due:
                    raise BenchError(f"slots job result {run.result}, due {due}")
            elif what == "limit":
                seconds = self.timed_sql(db, [SLOTS_LIMIT], {})
            else:
                seconds = self.slots_limit_in_chunks(db, batch_size)
            state = bd.slots_state(db.url)
            if state["due"] != 0:
                raise BenchError(f"{what} left {state['due']} due slots")
            return seconds, run
        finally:
            self.drop(db)

    def slots_limit_in_chunks(self, db: pg.Database, batch_size: int) -> float:
        """The limit's UPDATE cut into ``batch_size``-row transactions (by start_at ranges)."""
        with psycopg.connect(db.url) as conn:
            conn.execute("select set_config('synchronous_commit', 'off', false)")
            bounds = [
                row[0] for row in conn.execute(SLOTS_CHUNK_BOUNDS, {"batch_size": batch_size})
            ]
            conn.commit()
            started = time.perf_counter()
            lower = None
            for upper in [*bounds, None]:
                conn.execute(SLOTS_CHUNK, {"lower": lower, "upper": upper})
                conn.commit()
                lower = upper
            return time.perf_counter() - started

    def selections(self) -> Service:
        if self._service is None:
            self._service = start_selections(self.plan.latency_ms, self.workdir / "selections.log")
        return self._service

    def detach_concurrency(self) -> int:
        if self.concurrency is None:
            module = importlib.import_module(JOB_MODULES["detach"])
            defaults = module.CONFIG.defaults
            self.concurrency = int(defaults.get("detach_concurrency", 1))
        return self.concurrency

    def bench_detach(self, out: list[str]) -> None:
        service = self.selections()
        concurrency = self.detach_concurrency()
        config = {"max_run_duration_seconds": 3000, "lock_ttl_seconds": 3600}
        seq = self.plan.detach_seq_rows
        cases = [
            (concurrency, self.plan.detach_rows, "(default)", {}),
            (1, seq, "(sequential baseline)", {"detach_concurrency": 1}),
        ]
        rows = []
        for conc, due, note, overrides in cases:
            # the limit: the service alone, hammered with the job's concurrency
            ids = [str(uuid.UUID(bytes=_md5(f"capacity{conc}-{i}"))) for i in range(due)]
            capacity = Series()
            for _ in range(self.runs):
                seconds, errors = hammer(service.url, ids, conc)
                if errors:
                    raise BenchError(f"capacity client saw {errors} failed calls")
                capacity.add(seconds)
            template = self.outbox_template(due)
            job, rss, cpu = Series(), [], Series()
            for _ in range(self.runs):
                db = self.clone(template, "outbox")
                try:
                    run = self.run_job(
                        "detach", db, {**config, **overrides}, selections_url=service.url
                    )
                    state = bd.outbox_state(db.url)
                    if state["due"] != 0 or run.result.get("Succeeded") != due:
                        raise BenchError(f"detach left {state}, result {run.result}")
                    job.add(run.seconds)
                    rss.append(run.proc.maxrss_kb)
                    cpu.add(run.cpu)
                finally:
                    self.drop(db)
            if not overrides:
                self.job_medians[("detach", str(due))] = job.median
            ratio = _ratio(capacity.median, job.median)
            rows.append(
                [
                    f"{conc} {note}",
                    f"{due:,}",
                    capacity.fmt(),
                    job.fmt(),
                    f"{ratio:.2f}x",
                    _rate(due, capacity.median),
                    _rate(due, job.median),
                    f"{1000 * conc / self.plan.latency_ms:,.0f}",
                    _mb(max(rss)),
                    _secs(cpu.median),
                    "(reference)" if overrides else _verdict(ratio >= 0.8),
                ]
            )
        out.append(
            f"Selections service: `devtools/selections_service.py --latency-ms "
            f"{self.plan.latency_ms:g}` (every call sleeps {self.plan.latency_ms:g} ms; the "
            "service sets TCP_NODELAY, see the notes). Limit: the service's capacity measured "
            "alone, by a client that keeps the same number of keep-alive connections busy as "
            "the job has calls in flight. Job: `snapshot_detach.run()` on a fresh clone of the "
            "outbox each time (batch_size 100; every due row must end Done)."
        )
        out.append("")
        out.append(
            md_table(
                [
                    "detach_concurrency",
                    "due rows",
                    "service alone",
                    "job",
                    "limit/job",
                    "service rows/s",
                    "job rows/s",
                    "ideal rows/s",
                    "job peak RSS",
                    "job CPU in run()",
                    "goal >= 0.8x",
                ],
                rows,
            )
        )

    def bench_detach_capacity(self, out: list[str]) -> None:
        """Issue 16: devtools/bench_detach_capacity.py (healthy and capacity-limited service)."""
        from devtools import bench_detach_capacity

        bench_detach_capacity.run_section(
            self, out, hammer=hammer, md_table=md_table, error=BenchError
        )

    def bench_tracing(self, out: list[str]) -> None:
        bench_tracing.bench_tracing(self, out)

    def bench_parse(self, out: list[str]) -> None:
        files = sorted(p for p in (REPO / "dags").glob("*.py") if p.name != "__init__.py")
        if not files:
            raise BenchError("no DAG files in dags/")
        env = {**os.environ, "PYTHONPATH": str(REPO), **self.airflow_env_extra()}
        reference = self.workdir / REFERENCE_DAG_NAME
        reference.write_text(REFERENCE_DAG, encoding="utf-8")
        files.append(reference)
        base, per_file = Series(), {p.name: Series() for p in files}
        for _ in range(self.plan.parse_runs):
            cmd = [sys.executable, "-c", PARSE_PROBE, *map(str, files)]
            proc = measure_process(cmd, env=env)
            if proc.returncode != 0:
                raise BenchError(f"parse probe failed:\n{proc.tail()}")
            probe = json.loads(proc.stdout.strip().splitlines()[-1])
            base.add(probe["sdk"])
            for name, timing in probe["files"].items():
                if "error" in timing:
                    raise BenchError(f"importing dags/{name} failed: {timing['error']}")
                per_file[name].add(timing["seconds"])
        dagbag = self.dagbag_stats(env)
        rows = [
            [
                f"`dags/{name}`",
                series.fmt(),
                dagbag.get(name, "n/a"),
                _verdict(series.median < 0.2),
            ]
            for name, series in per_file.items()
            if name != REFERENCE_DAG_NAME
        ]
        rows.append(
            [
                "(reference: a one-task DAG that imports nothing else)",
                per_file[REFERENCE_DAG_NAME].fmt(),
                "",
                "",
            ]
        )
        out.append(
            "Per file: a fresh interpreter imports `airflow.sdk` (the baseline every DAG file "
            f"pays anyway: {base.fmt()}), then forks once per DAG file and times the file's "
            "import in the child (its own imports included: job package, psycopg, ...); the "
            "reference row is what any DAG with a @task costs beyond airflow.sdk. "
            f"{self.plan.parse_runs} run(s). DagBag column: the duration "
            "`DagBag(dag_folder=dags/)` records for the file (one process, all files)."
        )
        out.append("")
        out.append(
            md_table(
                ["DAG file", "import after airflow.sdk", "DagBag", "goal < 0.2 s"],
                rows,
            )
        )

    def dagbag_stats(self, env: dict[str, str]) -> dict[str, str]:
        proc = measure_process([sys.executable, "-c", DAGBAG_PROBE, str(REPO / "dags")], env=env)
        if proc.returncode != 0:
            return {}
        try:
            stats = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {}
        return {name: _secs(seconds) for name, seconds in stats.items()}

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

    def dags_test(self, dag_id: str, db: pg.Database, variables: dict | None = None) -> Proc:
        env = ae.airflow_env(
            self.airflow_home(),
            job_db_url=db.url,
            selections_url=self.selections().url,
            selections_login=SELECTIONS_LOGIN,
            selections_password=SELECTIONS_PASSWORD,
            variables=variables,
        )
        cmd = [str(ae.VENV_BIN / "airflow"), "dags", "test", dag_id]
        proc = measure_process(cmd, env=env, timeout=3600)
        if proc.returncode != 0:
            raise BenchError(f"airflow dags test {dag_id} exited {proc.returncode}:\n{proc.tail()}")
        return proc

    def bench_airflow(self, out: list[str]) -> None:
        self.airflow_home()
        empty = self.empty_template()
        problems: list[str] = []
        overhead_rows = []
        for dag_id in self.plan.overhead_dags:
            if not (REPO / "dags" / f"{dag_id}.py").exists():
                problems.append(f"no dags/{dag_id}.py")
                overhead_rows.append([f"`{dag_id}`", "no DAG file", ""])
                continue
            series, rss = Series(), []
            try:
                for _ in range(self.plan.airflow_runs):
                    db = self.clone(empty, "af_empty")
                    try:
                        proc = self.dags_test(dag_id, db)
                    finally:
                        self.drop(db)
                    series.add(proc.wall)
                    rss.append(proc.maxrss_kb)
            except BenchError as exc:
                problems.append(str(exc))
                overhead_rows.append([f"`{dag_id}`", "failed", ""])
                continue
            self.overhead[dag_id] = series
            overhead_rows.append([f"`{dag_id}`", series.fmt(), _mb(max(rss))])
        out.append(
            "Fixed cost of one run: `airflow dags test <dag_id>` (the standard way, SQLite "
            "metadata DB, AIRFLOW_CONN_* connections) on an empty dataset: CLI start, DAG "
            "parse, DagRun and task instances, the task process, the no-op job."
        )
        out.append("")
        out.append(md_table(["DAG", "wall (empty dataset)", "peak RSS"], overhead_rows))
        self.bench_dags_on_data(out, problems)
        if problems:
            summary = "; ".join(dict.fromkeys(p.splitlines()[0] for p in problems))
            raise BenchError(summary + "\n\n" + "\n\n".join(problems))

    def bench_dags_on_data(self, out: list[str], problems: list[str]) -> None:
        """Once per job: the DAG on the job section's largest default dataset."""
        fixed = (
            statistics.median([s.median for s in self.overhead.values()])
            if self.overhead
            else math.nan
        )
        data_rows = []
        for job in self.plan.dags_on_data:
            dag_id = DAG_IDS[job]
            if not (REPO / "dags" / f"{dag_id}.py").exists():
                problems.append(f"no dags/{dag_id}.py")
                data_rows.append([f"`{dag_id}`", "no DAG file", *[""] * 6])
                continue
            try:
                proc, rows, label, fn_key, check = self.dag_on_data(job)
                check()
            except BenchError as exc:
                problems.append(str(exc))
                data_rows.append([f"`{dag_id}`", "failed", *[""] * 6])
                continue
            fixed_dag = self.overhead.get(dag_id, Series()).median
            if math.isnan(fixed_dag):
                fixed_dag = fixed
            data_rows.append(
                [
                    f"`{dag_id}`",
                    label,
                    _secs(proc.wall),
                    _secs(fixed_dag),
                    _secs(proc.wall - fixed_dag),
                    _secs(self.job_medians.get(fn_key, math.nan)),
                    _rate(rows, proc.wall),
                    _mb(proc.maxrss_kb),
                ]
            )
        out.append("")
        out.append(
            "Once per job, the DAG on the benchmark data (same config overrides, through "
            "`AIRFLOW_VAR_<DAG_ID>`): wall time of `airflow dags test`, minus the fixed "
            "overhead above (of the same DAG, else the median of the others), against the job "
            "function's median on the same dataset (n/a when that section did not run)."
        )
        out.append("")
        out.append(
            md_table(
                [
                    "DAG",
                    "data",
                    "dags test wall",
                    "fixed overhead",
                    "wall - overhead",
                    "job function (median)",
                    "rows/s incl. Airflow",
                    "peak RSS",
                ],
                data_rows,
            )
        )

    def dag_on_data(self, job: str):
        dag_id = DAG_IDS[job]
        if job == "retention":
            eligible = self.plan.retention[min(1, len(self.plan.retention) - 1)]
            template, ds = self.retention_template(eligible)
            before = bd.retention_state(template.url, RETENTION_DAYS)
            variables = {dag_id: {"max_batches_per_run": 50_000, "max_run_duration_seconds": 7200}}
            db = self.clone(template, "af_ret")
            proc = self.dags_test(dag_id, db, variables)

            def check() -> None:
                try:
                    self.check_retention(db, before, ds, None)
                finally:
                    self.drop(db)

            return (
                proc,
                ds.eligible_rows,
                f"{ds.eligible:,} eligible sessions",
                (
                    "retention",
                    str(eligible),
                ),
                check,
            )
        if job == "slots":
            total, due = self.plan.slots[-1]
            template = self.slots_template(total, due)
            db = self.clone(template, "af_slots")
            proc = self.dags_test(dag_id, db, {dag_id: {"max_run_duration_seconds": 3600}})

            def check() -> None:
                try:
                    left = bd.slots_state(db.url)["due"]
                    if left:
                        raise BenchError(f"DAG run left {left} due slots")
                finally:
                    self.drop(db)

            return proc, due, f"{due:,} due of {total:,}", ("slots", f"{total}/{due}"), check
        n = self.plan.detach_rows
        template = self.outbox_template(n)
        db = self.clone(template, "af_outbox")
        proc = self.dags_test(
            dag_id, db, {dag_id: {"max_run_duration_seconds": 3000, "lock_ttl_seconds": 3600}}
        )

        def check() -> None:
            try:
                left = bd.outbox_state(db.url)["due"]
                if left:
                    raise BenchError(f"DAG run left {left} due outbox rows")
            finally:
                self.drop(db)

        return proc, n, f"{n:,} due rows", ("detach", str(n)), check

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        if self._service is not None:
            self._service.stop()
        for name in list(self.databases):
            with contextlib.suppress(psycopg.Error):
                pg.drop_database(self.admin, name)


def _md5(text: str) -> bytes:
    import hashlib

    return hashlib.md5(text.encode(), usedforsecurity=False).digest()


RETENTION_LIMIT = [
    """
    delete from user_activity.action_events e using user_activity.sessions s
    where e.session_id = s.id
      and s.status = 'Inactive' and s.ended_at < now() - make_interval(days => %(days)s)
    """,
    """
    delete from user_activity.property_object_views v using user_activity.sessions s
    where v.session_id = s.id
      and s.status = 'Inactive' and s.ended_at < now() - make_interval(days => %(days)s)
    """,
    """
    delete from user_activity.sessions
    where status = 'Inactive' and ended_at < now() - make_interval(days => %(days)s)
    """,
]
SLOTS_LIMIT = """
update calendar.availability_slots
set status = 'Expired', updated_at = now(), version = version + 1
where status = 'Available' and start_at <= now()
"""
# every batch_size-th due start_at: the upper bounds of the chunks of SLOTS_CHUNK
SLOTS_CHUNK_BOUNDS = """
select start_at from (
  select start_at, row_number() over (order by start_at) as n
  from calendar.availability_slots
  where status = 'Available' and start_at <= now()
) as due
where n %% %(batch_size)s = 0
order by start_at
"""
SLOTS_CHUNK = """
update calendar.availability_slots
set status = 'Expired', updated_at = now(), version = version + 1
where status = 'Available' and start_at <= now()
  and start_at > coalesce(%(lower)s::timestamptz, '-infinity')
  and start_at <= coalesce(%(upper)s::timestamptz, 'infinity')
"""

SLOTS_TEXT = (
    "Job: `slot_expiration.run()` with defaults (batch_size {batch}, one transaction per batch, "
    "runners {runners}: the first batch loop starts the others once its first batch comes back "
    "full), `max_run_duration_seconds` raised so one run expires the whole backlog; also with "
    "`runners` 1 (one loop, one connection). Limit: one `UPDATE ... SET status = 'Expired', "
    "updated_at = now(), version = version + 1 WHERE status = 'Available' AND start_at <= "
    "now()`. Fresh clone per timed run. Diagnostic column: the same raw UPDATE cut into "
    "{batch}-row transactions by `start_at` ranges computed beforehand (not timed), one "
    "connection, no row locks, `synchronous_commit = off` like the job: what any design that "
    "commits every {batch} rows on one connection costs before it locks anything."
)


def _slots_text(batch_size: int, runners: int) -> str:
    return SLOTS_TEXT.format(batch=batch_size, runners=runners)


REFERENCE_DAG_NAME = "reference_one_task_dag.py"
REFERENCE_DAG = """
from airflow.sdk import dag, task
import pendulum


@dag(dag_id="bench_reference", schedule=None, start_date=pendulum.datetime(2026, 1, 1))
def bench_reference():
    @task
    def noop():
        return None

    noop()


bench_reference()
"""
PARSE_PROBE = """
import importlib.util, json, os, sys, time
started = time.perf_counter()
import airflow.sdk
out = {"sdk": time.perf_counter() - started, "files": {}}
for path in sys.argv[1:]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # a fresh copy of the interpreter with airflow.sdk loaded, nothing else
        os.close(read_end)
        try:
            t0 = time.perf_counter()
            spec = importlib.util.spec_from_file_location("bench_parsed_dag", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            message = {"seconds": time.perf_counter() - t0}
        except BaseException as exc:
            message = {"error": repr(exc)}
        os.write(write_end, json.dumps(message).encode())
        os._exit(0)
    os.close(write_end)
    data = b""
    while chunk := os.read(read_end, 65536):
        data += chunk
    os.close(read_end)
    os.waitpid(pid, 0)
    out["files"][os.path.basename(path)] = json.loads(data)
print(json.dumps(out))
"""
DAGBAG_PROBE = """
import json, os, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
out = {}
for stat in bag.dagbag_stats:
    d = stat.duration
    out[os.path.basename(stat.file)] = d.total_seconds() if hasattr(d, "total_seconds") else d
print(json.dumps(out))
"""


# ---------------------------------------------------------------------------------------------
# the report


def machine_info(admin_url: str) -> list[tuple[str, str]]:
    from importlib.metadata import version

    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    with psycopg.connect(admin_url) as conn:
        server = conn.execute("select version()").fetchone()[0].split(" on ")[0]
        settings = conn.execute(
            "select name, setting, unit from pg_settings where name = any(%(n)s) order by name",
            {
                "n": [
                    "shared_buffers",
                    "work_mem",
                    "maintenance_work_mem",
                    "max_wal_size",
                    "synchronous_commit",
                    "fsync",
                ]
            },
        ).fetchall()
    pg_settings = ", ".join(f"{n}={_pg_setting(s, u)}" for n, s, u in settings)
    where = "external (PIN_PG_URL)" if os.environ.get(pg.EXTERNAL_URL_ENV) else "embedded"
    return [
        ("CPU", f"{cpu}, {os.cpu_count()} cores"),
        ("RAM", mem),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("Python", platform.python_version()),
        ("Airflow", version("apache-airflow")),
        ("psycopg", version("psycopg")),
        ("PostgreSQL", f"{server} ({where}, same machine, Unix socket)"),
        ("Postgres settings", pg_settings),
    ]


def _pg_setting(value: str, unit: str | None) -> str:
    if unit == "8kB":
        return f"{int(value) * 8 // 1024}MB"
    if unit == "kB":
        return f"{int(value) // 1024}MB"
    if unit == "MB":
        return f"{value}MB"
    return value


def render(
    *,
    plan: Plan,
    argv: Sequence[str],
    info: list[tuple[str, str]],
    bench: Bench,
    sections: list[Section],
    started: datetime,
    total_seconds: float,
) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `python -m devtools.bench {' '.join(argv)}`".rstrip() + " "
        f"(plan: {plan.name}, {bench.runs} timed runs per measurement unless noted) on "
        f"{started:%Y-%m-%d %H:%M} UTC in {total_seconds / 60:.1f} min. "
        "Re-run with `make bench` (default sizes) or `python -m devtools.bench --full`.",
        "",
        "Cells read `median (min .. max)` over the timed runs. *Job* = the job function's "
        "`run()` in a fresh subprocess (interpreter start and imports excluded; peak RSS is "
        "that process's `ru_maxrss`). *Limit* = the same work as raw set-based SQL in one "
        "transaction on the same data, or the service's own capacity: `limit/job` >= 1 would "
        "mean the job is as fast as the limit. The machine was shared with other work; the "
        "load average is shown per section.",
        "",
        "## Machine",
        "",
        md_table(["", ""], info),
        "",
        "## Data generation",
        "",
        "One `INSERT ... SELECT generate_series` per table with indexes and foreign keys "
        "dropped, then rebuilt from the catalog, then `VACUUM (ANALYZE, FREEZE)`; generated "
        "once per bench into a template database and cloned per timed run.",
        "",
        md_table(
            ["dataset", "rows (top table)", "generation", "database size"],
            [[label, rows, _secs(sec), size] for label, rows, sec, size in bench.generation],
        ),
    ]
    for section in sections:
        lines += ["", f"## {TITLES[section.key]}", ""]
        lines.append(
            f"_Load average before/after: {section.load_before} / {section.load_after}; "
            f"section took {section.seconds:.0f} s._"
        )
        lines.append("")
        if section.error:
            lines.append(f"**Not measured: {section.error}**")
        lines += section.lines
    lines.append("")
    return "\n".join(lines)


def write_report(path: Path, text: str) -> None:
    notes = ""
    if path.exists():
        old = path.read_text(encoding="utf-8")
        if NOTES_MARKER in old:
            notes = old[old.index(NOTES_MARKER) :]
    if not notes:
        notes = NOTES_MARKER + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n" + notes, encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# entry point


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.bench", description=__doc__.split("\n")[0]
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="tiny sizes, < 60 s (make test)")
    size.add_argument("--full", action="store_true", help="adds 1M eligible retention sessions")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run these sections only")
    parser.add_argument("--runs", type=int, help="timed runs per measurement")
    parser.add_argument("--out", type=Path, help="report path (a directory gets benchmarks.md)")
    sizes = parser.add_argument_group("sizes (override the plan's)")
    sizes.add_argument("--retention", type=int, nargs="+", metavar="ELIGIBLE")
    sizes.add_argument("--slots", nargs="+", metavar="ROWS:DUE")
    sizes.add_argument("--empty-slots", type=int, nargs="+", metavar="ROWS")
    sizes.add_argument("--detach-rows", type=int)
    sizes.add_argument("--detach-seq-rows", type=int)
    return parser.parse_args(argv)


def plan_for(args: argparse.Namespace) -> Plan:
    plan = SMOKE if args.smoke else FULL if args.full else DEFAULT
    changes: dict[str, object] = {}
    if args.retention:
        changes["retention"] = tuple(args.retention)
    if args.slots:
        changes["slots"] = tuple(tuple(int(x) for x in pair.split(":")) for pair in args.slots)
    if args.empty_slots:
        changes["empty_slots"] = tuple(args.empty_slots)
    if args.detach_rows:
        changes["detach_rows"] = args.detach_rows
    if args.detach_seq_rows:
        changes["detach_seq_rows"] = args.detach_seq_rows
    if changes:
        plan = dataclasses.replace(plan, name=f"{plan.name} (custom sizes)", **changes)
    return plan


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["_job"]:
        return job_child_main(argv[1])
    args = parse_args(argv)
    plan = plan_for(args)
    out = args.out or (SMOKE_OUT if args.smoke else DEFAULT_OUT)
    if out.is_dir():
        out = out / "benchmarks.md"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench %(message)s")
    started_at = datetime.now(UTC)
    started = time.perf_counter()

    own_server = not os.environ.get(pg.EXTERNAL_URL_ENV)
    admin = pg.admin_url() if not own_server else pg.start_embedded(BENCH_PGDATA, keep_running=True)
    workdir = Path(tempfile.mkdtemp(prefix="pin-bench-"))
    bench = Bench(plan, admin, workdir, args.runs)
    sections: list[Section] = []
    info: list[tuple[str, str]] = []

    def report() -> str:
        text = render(
            plan=plan,
            argv=argv,
            info=info,
            bench=bench,
            sections=sections,
            started=started_at,
            total_seconds=time.perf_counter() - started,
        )
        write_report(out, text)  # after every section: an interrupted bench keeps its figures
        return text

    try:
        info = machine_info(admin)
        for key in args.only or SECTIONS:
            section = Section(key, load_before=_loadavg())
            log.info("section %s (load %s)", key, section.load_before)
            t0 = time.perf_counter()
            try:
                getattr(bench, f"bench_{key}")(section.lines)
            except Exception as exc:  # one broken section must not hide the others
                log.exception("section %s failed", key)
                section.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                section.lines.append("")
                section.lines.append("```\n" + str(exc)[-3000:] + "\n```")
            section.seconds = time.perf_counter() - t0
            section.load_after = _loadavg()
            sections.append(section)
            log.info("section %s done in %.0f s", key, section.seconds)
            report()
    finally:
        bench.close()
        if own_server:
            pg.stop_embedded(BENCH_PGDATA)
        shutil.rmtree(workdir, ignore_errors=True)
    print(report())
    print(f"\nwritten to {out}")
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
