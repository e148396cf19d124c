"""Neighbour bench: what a drain costs the services that share its primary, and the replica.

An operator's database, on this host: a primary with a streaming replica (``devtools.pg_cluster``:
the embedded server's ``initdb``, ``pg_basebackup -R`` and ``pg_ctl``), the services' own traffic
from the real ``pgbench`` of the same binaries, in open loop at a fixed rate (a booking + activity
mix on the contract schema), and the job run the way users run it, ``airflow dags test``:

- ``calendar_slot_expiration`` with the runbook's drain settings (batch_size 2000,
  max_batches_per_cycle raised, runners 2);
- ``user_activity_retention`` with its defaults and its run limits raised.

Per round and per case, each on a fresh clone of the dataset: the job alone (its drain rate, the
replica's lag with nobody else there), then (or first, on odd rounds) the job under traffic:
``baseline`` seconds of traffic alone, then the job. OLTP latency = pgbench's transaction time +
its schedule lag, per transaction, p50/p95/p99 over the job's database window (from its start to
its end line in the task log) against the baseline window of the same run. Replica lag is
sampled every ``SAMPLE_SECONDS`` (bytes the replica has not replayed, from the primary's
``pg_stat_replication``; seconds, from the replica, ``now() - pg_last_xact_replay_timestamp()``
while WAL is pending). Ratios are taken within a run, then the median over the rounds.

Cases: a list of config dicts per job (``--neighbour-configs``), each over the job's base
config, so one bench prints the trade-off between the services' p99 and the drain's rate.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import re
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psycopg
from psycopg import sql

from devtools import bench_data as bd
from devtools import pg
from devtools.bench_core import DAG_IDS, Bench, BenchError, SectionSpec, _secs, _verdict, md_table
from devtools.bench_retention import AIRFLOW_CONFIG as RETENTION_AIRFLOW_CONFIG
from devtools.bench_slots import AIRFLOW_DRAIN_CONFIG
from devtools.pg_cluster import Cluster
from include.pin_maintenance.pacing_config import PACING_OFF

log = logging.getLogger("devtools.bench")

# the services' traffic: pgbench in open loop
RATE = 300  # transactions per second, all clients together
CLIENTS = 4
THREADS = 2
WARMUP_SECONDS = 2.0  # connections made, caches warm, before the baseline window opens
TAIL_SECONDS = 5.0  # traffic after the job's window, so pgbench's unflushed log tail is outside it
SAMPLE_SECONDS = 0.25  # replica lag and CPU sampling interval
GOAL_P99_RATIO = 3.0  # the services' p99 during a drain may be at most this times their baseline
GOAL_REPLICA_SECONDS = 2.0
# A round's baseline p99 above this many times the median baseline p99 of the whole section
# (every run's baseline is the same traffic alone) is an outlier: its case gets no verdict.
BASELINE_OUTLIER_FACTOR = 3.0
BASELINE_OUTLIER = "baseline outlier: rerun"
SERVICE_SESSIONS = 20_000  # the activity service's own sessions (read by its traffic)
SERVICE_FUTURE_SLOTS = 250_000  # the booking service's table beside a retention dataset
TAG = "bench"  # retention_data ids: md5('bench:s:' || i)

# booking: take one future Available slot, then read the next ten (what a booking page shows)
BOOKING_SQL = """\
\\set off random(7500, 2500000)
BEGIN;
UPDATE calendar.availability_slots
SET status = 'Booked', version = version + 1, updated_at = now()
WHERE id = (
  SELECT id FROM calendar.availability_slots
  WHERE status = 'Available' AND start_at >= now() + make_interval(secs => :off)
  ORDER BY start_at LIMIT 1 FOR UPDATE SKIP LOCKED
);
SELECT id, consultant_id, start_at, end_at FROM calendar.availability_slots
WHERE status = 'Available' AND start_at > now() + make_interval(secs => :off)
ORDER BY start_at LIMIT 10;
END;
"""
# activity: a new session with three events, then one (older) session's events
ACTIVITY_SQL = """\
\\set s random(:first_session, :last_session)
BEGIN;
WITH s AS (
  INSERT INTO user_activity.sessions
    (id, user_id, anonymous_id, status, started_at, last_activity_at, ended_at, created_at)
  VALUES (gen_random_uuid(), NULL, gen_random_uuid(), 'Active', now(), now(), NULL, now())
  RETURNING id
)
INSERT INTO user_activity.action_events
  (id, session_id, property_object_view_id, type, occurred_at, payload)
SELECT gen_random_uuid(), s.id, NULL, 'ViewPropertyObject', now(), jsonb_build_object('n', g)
FROM s, generate_series(1, 3) AS g;
SELECT id, type, occurred_at, payload FROM user_activity.action_events
WHERE session_id = md5('bench:s:' || :s)::uuid ORDER BY occurred_at;
END;
"""


# ---------------------------------------------------------------------------------------------
# the jobs


@dataclass(frozen=True)
class NeighbourJob:
    key: str
    dag_id: str
    base: dict  # the config every case starts from
    base_text: str
    start_event: str  # the task log lines that open and close the job's database window
    end_event: str


JOBS = {
    "slots": NeighbourJob(
        key="slots",
        dag_id=DAG_IDS["slots"],
        base=AIRFLOW_DRAIN_CONFIG | {"runners": 2},
        base_text=(
            "the runbook's drain: batch_size 2000, max_batches_per_cycle 100000, runners 2, "
            "max_run_duration_seconds 540"
        ),
        start_event="job_started",
        end_event="job_completed",
    ),
    "retention": NeighbourJob(
        key="retention",
        dag_id=DAG_IDS["retention"],
        base=RETENTION_AIRFLOW_CONFIG,
        base_text="defaults, max_batches_per_run 50000 and max_run_duration_seconds 3600",
        start_event="job_started",
        end_event="job_completed",
    ),
}
# The trade-off curve: the defaults (paced), a tighter and a looser WAL budget, and no pacing at
# all (the speed with nobody there is measured against the unpaced case alone);
# --neighbour-configs for others.
UNPACED = PACING_OFF
GOAL_ALONE_RATIO = 0.7  # a paced drain with nobody there keeps this share of the unpaced speed
DEFAULT_CASES: dict[str, tuple[dict, ...]] = {
    key: ({}, {"max_wal_mb_per_second": 8}, {"max_wal_mb_per_second": 16}, UNPACED)
    for key in ("slots", "retention")
}


def parse_configs(text: str) -> dict[str, tuple[dict, ...]]:
    """``--neighbour-configs``: a JSON list of config dicts (the cases of both jobs), or an
    object ``{"slots": [...], "retention": [...]}`` (keys: job keys or DAG ids)."""
    value = json.loads(text)
    if isinstance(value, list):
        value = {key: value for key in JOBS}
    if not isinstance(value, dict):
        raise ValueError("--neighbour-configs: a JSON list of objects, or {job: [objects]}")
    by_dag = {job.dag_id: key for key, job in JOBS.items()}
    cases: dict[str, tuple[dict, ...]] = {}
    for name, configs in value.items():
        key = by_dag.get(name, name)
        if key not in JOBS:
            raise ValueError(f"--neighbour-configs: unknown job {name!r}; one of {sorted(JOBS)}")
        if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
            raise ValueError(f"--neighbour-configs: {name!r} needs a list of objects")
        cases[key] = tuple(configs)
    return cases


# ---------------------------------------------------------------------------------------------
# what one run measures


@dataclass
class Transaction:
    scheduled: float  # epoch seconds the open loop scheduled it for
    latency_ms: float  # transaction time + schedule lag


@dataclass
class Sample:
    at: float  # epoch seconds
    behind_bytes: float | None  # None: no streaming replica in pg_stat_replication
    behind_seconds: float
    cpu_busy: int  # /proc/stat jiffies, all CPUs
    cpu_total: int


@dataclass
class Window:
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Latency:
    count: int
    p50: float
    p95: float
    p99: float
    tps: float


@dataclass
class RunResult:
    traffic: bool
    rows: int
    window: Window
    behind_seconds: float
    behind_bytes: float
    sample_gap: float  # longest interval between two lag samples in the window
    cpu_busy: float  # share of both cores busy over the window
    job: Latency | None = None
    baseline: Latency | None = None

    @property
    def rate(self) -> float:
        return self.rows / self.window.seconds if self.window.seconds > 0 else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_in(txs: Sequence[Transaction], window: Window) -> Latency:
    inside = [t.latency_ms for t in txs if window.start <= t.scheduled < window.end]
    if not inside:
        raise BenchError(f"no pgbench transaction scheduled in the window {window}")
    return Latency(
        count=len(inside),
        p50=percentile(inside, 0.50),
        p95=percentile(inside, 0.95),
        p99=percentile(inside, 0.99),
        tps=len(inside) / window.seconds,
    )


_LOG_LINE = re.compile(r"^(\S+) \[\s*\w+\s*\] event=(\w+) job=(\S+)")


def job_window(stdout: str, job: NeighbourJob) -> Window:
    """The job's database window from its task log lines (first start line, last end line)."""
    start = end = None
    for line in stdout.splitlines():
        match = _LOG_LINE.match(line)
        if not match or match.group(3) != job.dag_id:
            continue
        at = datetime.fromisoformat(match.group(1)).timestamp()
        if match.group(2) == job.start_event and start is None:
            start = at
        elif match.group(2) == job.end_event:
            end = at
    if start is None or end is None or end < start:
        raise BenchError(
            f"no event={job.start_event} .. event={job.end_event} lines of {job.dag_id} in "
            f"the output of airflow dags test:\n{stdout[-3000:]}"
        )
    return Window(start, end)


# ---------------------------------------------------------------------------------------------
# the services' traffic


class Traffic:
    """``pgbench`` in open loop against one database of the primary, logging every
    transaction (``--log``: time, schedule lag, completion time)."""

    def __init__(self, cluster: Cluster, dbname: str, workdir: Path, tag: str, sessions: range):
        self.workdir = workdir
        self.prefix = workdir / f"pgbench_{tag}"
        for name, text in (("booking.sql", BOOKING_SQL), ("activity.sql", ACTIVITY_SQL)):
            (workdir / name).write_text(text, encoding="utf-8")
        cmd = [
            str(cluster.bindir / "pgbench"),
            *("-h", "127.0.0.1", "-p", str(cluster.primary.port), "-U", "postgres"),
            "-n",  # no pgbench tables to vacuum
            *("--rate", str(RATE), "-c", str(CLIENTS), "-j", str(THREADS)),
            *("-T", "86400"),  # stopped by pid once the job's window is over
            *("-f", str(workdir / "booking.sql"), "-f", str(workdir / "activity.sql")),
            *("-D", f"first_session={sessions.start}", "-D", f"last_session={sessions.stop - 1}"),
            *("--log", "--log-prefix", str(self.prefix)),
            dbname,
        ]
        self.output = (workdir / f"pgbench_{tag}.out").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.output, stderr=subprocess.STDOUT, cwd=workdir)
        self.started = time.time()

    def stop(self) -> None:
        """Stop it by its pid. pgbench has no clean stop before -T: its per-thread logs lose
        their unflushed tail (under a second at this rate), which TAIL_SECONDS keeps outside
        every window; :meth:`transactions` drops a line cut in half."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.output.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self) -> str:
        return (self.workdir / f"{self.prefix.name}.out").read_text(errors="replace")[-2000:]

    def transactions(self) -> list[Transaction]:
        return read_pgbench_logs(self.workdir, self.prefix.name)


def read_pgbench_logs(directory: Path, prefix: str) -> list[Transaction]:
    """Every transaction in pgbench's per-thread logs ``<prefix>.<pid>[.<thread>]``; a last
    line cut off by the stop is dropped."""
    txs = []
    for path in sorted(directory.glob(prefix + ".*")):
        if path.suffix == ".out":
            continue
        text = path.read_text(errors="replace")
        lines = text.splitlines()
        if text and not text.endswith("\n"):
            lines = lines[:-1]
        for line in lines:
            fields = line.split()
            # client_id transaction_no time script_no time_epoch time_us schedule_lag
            if len(fields) != 7 or not fields[2].isdigit():
                continue
            spent_us = int(fields[2]) + int(fields[6])
            done = int(fields[4]) + int(fields[5]) / 1e6
            txs.append(Transaction(done - spent_us / 1e6, spent_us / 1000))
    return txs


# ---------------------------------------------------------------------------------------------
# replica lag and CPU, sampled


def _cpu() -> tuple[int, int]:
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields) - idle, sum(fields)
    return 0, 0


class Sampler(threading.Thread):
    """Every SAMPLE_SECONDS: how far the replica is behind, in bytes (the primary's
    ``pg_stat_replication``) and in seconds (the replica's last replayed commit, while WAL is
    pending), and the machine's CPU counters; then a heartbeat commit on the primary."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(name="neighbour-sampler", daemon=True)
        self.cluster = cluster
        self.samples: list[Sample] = []
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            with (
                psycopg.connect(self.cluster.primary_url(), autocommit=True) as primary,
                psycopg.connect(self.cluster.replica_url(), autocommit=True) as replica,
            ):
                tick = time.monotonic()
                while not self._stop_event.is_set():
                    self.samples.append(self._sample(primary, replica))
                    tick += SAMPLE_SECONDS
                    self._stop_event.wait(max(0.0, tick - time.monotonic()))
        except BaseException as exc:  # reported by stop()
            self.error = exc

    @staticmethod
    def _sample(primary: psycopg.Connection, replica: psycopg.Connection) -> Sample:
        at = time.time()
        row = primary.execute(
            "select pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn) from pg_stat_replication"
        ).fetchone()
        behind_bytes = float(row[0]) if row and row[0] is not None else None
        seconds = 0.0
        if behind_bytes:
            (value,) = replica.execute(
                "select extract(epoch from clock_timestamp() - pg_last_xact_replay_timestamp())"
            ).fetchone()
            seconds = max(0.0, float(value or 0.0))
        busy, total = _cpu()
        # the heartbeat (pt-heartbeat's idea): a commit on the primary every tick, so the
        # replica's last replayed commit is at most a tick old when it keeps up, even when
        # nothing else commits (a job alone, before its first batch commits)
        primary.execute("select pg_current_xact_id()")
        return Sample(at, behind_bytes, seconds, busy, total)

    def stop(self) -> list[Sample]:
        self._stop_event.set()
        self.join(30)
        if self.error is not None:
            raise BenchError(f"lag sampler failed: {self.error!r}")
        return self.samples

    @staticmethod
    def summary(samples: Sequence[Sample], window: Window) -> tuple[float, float, float, float]:
        """(max seconds behind, max bytes behind, longest sampling gap, CPU busy share)."""
        inside = [s for s in samples if window.start <= s.at <= window.end]
        around = [s for s in samples if window.start - SAMPLE_SECONDS <= s.at]
        around = [s for s in around if s.at <= window.end + SAMPLE_SECONDS] or inside
        if len(around) < 2:
            raise BenchError(f"fewer than two lag samples around the window {window}")
        if any(s.behind_bytes is None for s in around):
            raise BenchError("the replica left pg_stat_replication during the run")
        behind_s = max((s.behind_seconds for s in inside), default=0.0)
        behind_b = max((s.behind_bytes or 0.0 for s in inside), default=0.0)
        gap = max(b.at - a.at for a, b in itertools.pairwise(around))
        first, last = around[0], around[-1]
        total = last.cpu_total - first.cpu_total
        busy = (last.cpu_busy - first.cpu_busy) / total if total > 0 else math.nan
        return behind_s, behind_b, gap, busy


# ---------------------------------------------------------------------------------------------
# datasets on the cluster's primary


@dataclass
class Dataset:
    job: str
    template: str
    rows: int  # rows the job must change or delete
    sessions: range  # the activity service's sessions its traffic reads
    check: Callable[[str], None]  # the end state after the job, given the clone's URL


@dataclass
class Neighbours:
    """The section's state: the cluster, its datasets and the databases made from them."""

    bench: Bench
    cluster: Cluster
    workdir: Path
    datasets: dict[str, Dataset] = field(default_factory=dict)
    clones: itertools.count = field(default_factory=itertools.count)
    roles: dict[str, pg.JobRole] = field(default_factory=dict)

    def admin(self) -> psycopg.Connection:
        return psycopg.connect(self.cluster.primary_url(), autocommit=True)

    def create_template(self, name: str, label: str, rows: int, load) -> None:
        with self.admin() as conn:
            conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
        url = self.cluster.primary_url(name)
        pg.apply_schema(url)
        # the jobs run as their grant-script roles (its clones carry the grants); the batch
        # jobs' roles in pg_monitor, as docs/deploying.md says, to see the replica they pace by
        pg.apply_job_roles(url, self.bench.role_names)
        if not self.roles:
            self.roles = pg.set_role_passwords(self.cluster.primary_url(), self.bench.role_names)
            with self.admin() as conn:
                for conn_id in ("calendar_db", "user_activity_db"):
                    role = sql.Identifier(self.bench.role_names[conn_id])
                    conn.execute(sql.SQL("grant pg_monitor to {}").format(role))
        started = time.perf_counter()
        load(url)
        seconds = time.perf_counter() - started
        with psycopg.connect(url) as conn:
            (size,) = conn.execute(
                "select pg_size_pretty(pg_database_size(current_database()))"
            ).fetchone()
        self.bench.generation.append((f"neighbours, {label}", f"{rows:,}", seconds, size))

    def slots_dataset(self, total: int, due: int) -> Dataset:
        name = "nb_tpl_slots"
        activity = bd.RetentionDataset(eligible=0, keep=SERVICE_SESSIONS)

        def load(url: str) -> None:
            bd.load_slots(url, total, due)
            bd.load_retention(url, activity)

        label = (
            f"slots: {total:,} rows, {due:,} due (+ {activity.sessions:,} service sessions "
            f"with their views and events)"
        )
        self.create_template(name, label, total, load)

        def check(url: str) -> None:
            left = bd.slots_state(url)["due"]
            if left:
                raise BenchError(f"the slot drain left {left} due slots")

        return Dataset("slots", name, due, range(1, activity.sessions + 1), check)

    def retention_dataset(self, eligible: int) -> Dataset:
        name = "nb_tpl_retention"
        ds = bd.retention_dataset(eligible)

        def load(url: str) -> None:
            bd.load_retention(url, ds)
            bd.load_slots(url, SERVICE_FUTURE_SLOTS, 0)

        label = (
            f"retention: {ds.eligible:,} eligible + {ds.keep:,} young/Active sessions, "
            f"{ds.views_per_session} views + {ds.events_per_session} events each "
            f"(+ {SERVICE_FUTURE_SLOTS:,} slots for the booking traffic)"
        )
        self.create_template(name, label, ds.rows, load)

        def check(url: str) -> None:
            left = bd.retention_state(url)["eligible_left"]
            if left:
                raise BenchError(f"the retention run left {left} eligible sessions")

        # the young sessions stay: the service reads those (the eligible ones are being deleted)
        return Dataset(
            "retention", name, ds.eligible_rows, range(ds.eligible + 1, ds.sessions + 1), check
        )

    def clone(self, dataset: Dataset) -> pg.Database:
        """A fresh copy of a dataset (FILE_COPY: the replica copies the files itself rather
        than replaying the copy from WAL), the replica caught up, then a CHECKPOINT."""
        name = f"nb_run_{next(self.clones)}"
        with self.admin() as conn:
            conn.execute(
                sql.SQL("create database {} template {} strategy file_copy").format(
                    sql.Identifier(name), sql.Identifier(dataset.template)
                )
            )
            conn.execute("checkpoint")
        self.cluster.wait_replica_caught_up()
        return pg.Database(self.cluster.primary_url(name), name).with_roles(self.roles)

    def drop(self, db: pg.Database) -> None:
        with self.admin() as conn:
            conn.execute(
                sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(db.name))
            )

    # -- one run ------------------------------------------------------------------------

    def run(self, job: NeighbourJob, config: dict, *, traffic: bool, tag: str) -> RunResult:
        dataset = self.datasets[job.key]
        db = self.clone(dataset)
        sampler = Sampler(self.cluster)
        pgbench: Traffic | None = None
        try:
            sampler.start()
            baseline = None
            if traffic:
                pgbench = Traffic(self.cluster, db.name, self.workdir, tag, dataset.sessions)
                time.sleep(WARMUP_SECONDS)
                opened = time.time()
                time.sleep(self.bench.plan.neighbour_baseline_seconds)
                baseline = Window(opened, time.time())
                if not pgbench.alive():
                    raise BenchError(f"pgbench exited early:\n{pgbench.tail()}")
            proc = self.bench.dags_test(job.dag_id, db, {job.dag_id: job.base | config})
            # beside pgbench's log of the same run: when the services slowed, and what the job did
            (self.workdir / f"airflow_{tag}.log").write_text(proc.stdout, encoding="utf-8")
            window = job_window(proc.stdout, job)
            if pgbench is not None:
                time.sleep(max(0.0, window.end + TAIL_SECONDS - time.time()))
                if not pgbench.alive():
                    raise BenchError(f"pgbench exited during the run:\n{pgbench.tail()}")
                pgbench.stop()
            samples = sampler.stop()
            dataset.check(db.url)
            behind_s, behind_b, gap, busy = Sampler.summary(samples, window)
            result = RunResult(traffic, dataset.rows, window, behind_s, behind_b, gap, busy)
            if pgbench is not None and baseline is not None:
                txs = pgbench.transactions()
                last = max((t.scheduled for t in txs), default=0.0)
                if last < window.end:
                    raise BenchError("pgbench's log ends before the job's window does")
                result.baseline = latency_in(txs, baseline)
                result.job = latency_in(txs, window)
            return result
        finally:
            if pgbench is not None:
                pgbench.stop()
            if sampler.is_alive():
                with contextlib.suppress(BenchError):
                    sampler.stop()
            self.drop(db)


# ---------------------------------------------------------------------------------------------
# the section


@dataclass
class Case:
    job: NeighbourJob
    config: dict
    alone: list[RunResult] = field(default_factory=list)
    loaded: list[RunResult] = field(default_factory=list)

    @property
    def label(self) -> str:
        if not self.config:
            return "defaults (paced)"
        return "`" + json.dumps(self.config, sort_keys=True) + "`"

    @property
    def replica_held(self) -> bool:
        return self.config.get("max_replica_lag_seconds", 2) != 0

    def ratios(self, what: Callable[[RunResult, RunResult], float]) -> list[float]:
        """``what(alone, loaded)`` per round (the rounds' runs paired in order)."""
        return [what(a, b) for a, b in zip(self.alone, self.loaded, strict=False)]


def _med(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.median(values))} ({fmt(min(values))} .. {fmt(max(values))})"


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _x(value: float) -> str:
    return f"{value:.1f}x" if value < 100 else f"{value:.0f}x"


def _rows_s(value: float) -> str:
    return f"{value:,.0f}"


def _mb(value: float) -> str:
    return f"{value / 1024 / 1024:.1f} MB" if value < 1024**3 else f"{value / 1024**3:.2f} GB"


def _s(value: float) -> str:
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def _pct(value: float) -> str:
    return f"{100 * value:.0f} %"


def bench_neighbours(bench: Bench, out: list[str]) -> None:
    plan = bench.plan
    cases_by_job = plan.neighbour_configs or DEFAULT_CASES
    cases = [Case(JOBS[key], dict(c)) for key in JOBS for c in cases_by_job.get(key, ())]
    if not cases:
        raise BenchError("no neighbour case to run")
    workdir = bench.workdir / "neighbours"
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster.start()
    try:
        state = Neighbours(bench, cluster, workdir)
        jobs = {case.job.key for case in cases}
        if "slots" in jobs:
            state.datasets["slots"] = state.slots_dataset(*plan.neighbour_slots)
        if "retention" in jobs:
            state.datasets["retention"] = state.retention_dataset(plan.neighbour_retention)
        with state.admin() as conn:
            settings = _settings(conn)
        cluster.wait_replica_caught_up()
        runs = itertools.count()
        for round_no in range(bench.runs):
            for case in cases:
                # the order alternates by round: neither variant always meets a cold cache
                phases = (False, True) if round_no % 2 == 0 else (True, False)
                for traffic in (False,) if plan.neighbour_alone else phases:
                    n = next(runs)
                    result = state.run(case.job, case.config, traffic=traffic, tag=f"run{n}")
                    (case.loaded if traffic else case.alone).append(result)
                    log.info(
                        "neighbours round %d %s %s %s: window %.1f s, %.0f rows/s, p99 %s, "
                        "replica behind %.2f s / %.0f MB",
                        round_no + 1,
                        case.job.key,
                        case.label,
                        "with traffic" if traffic else "alone",
                        result.window.seconds,
                        result.rate,
                        f"{result.job.p99:.1f} ms (baseline {result.baseline.p99:.1f} ms)"
                        if result.job and result.baseline
                        else "-",
                        result.behind_seconds,
                        result.behind_bytes / 1024 / 1024,
                    )
    finally:
        cluster.stop()
    _report(bench, cases, settings, out)


def _settings(conn: psycopg.Connection) -> str:
    (version,) = conn.execute("show server_version").fetchone()
    rows = conn.execute(
        "select name, setting, unit from pg_settings where name = any(%s) order by name",
        (["shared_buffers", "max_wal_size", "synchronous_commit", "wal_level", "fsync"],),
    ).fetchall()
    parts = []
    for name, setting, unit in rows:
        shown = f"{int(setting) * 8 // 1024}MB" if unit == "8kB" else setting + (unit or "")
        parts.append(f"{name}={shown}")
    return f"PostgreSQL {version}, " + ", ".join(parts)


def _report(bench: Bench, cases: list[Case], settings: str, out: list[str]) -> None:
    plan = bench.plan
    total, due = plan.neighbour_slots
    out.append(
        "An operator's database on this host: a primary and a streaming replica of it "
        "(`pg_basebackup -R` with a physical slot, same binaries; "
        f"{settings}, initdb defaults otherwise). The "
        f"services' traffic: the real `pgbench` in open loop, `--rate {RATE} -c {CLIENTS} -j "
        f"{THREADS}`, half *booking* (update one future Available slot, read the next ten), "
        "half *activity* (a new session with three events, read one existing session's "
        "events). The job: `airflow dags test <dag_id>` on a fresh clone per run; slots "
        f"{total:,} rows, {due:,} due, `{JOBS['slots'].dag_id}` with "
        f"{JOBS['slots'].base_text}; retention {plan.neighbour_retention:,} eligible sessions "
        "(6 views + 6 events each, + 20 % young/Active), "
        f"`{JOBS['retention'].dag_id}` with {JOBS['retention'].base_text}."
    )
    out.append("")
    out.append(
        "*OLTP latency* = pgbench's transaction time + its schedule lag (open loop: a "
        "transaction that waits to start counts its wait), per transaction, by the time it was "
        "scheduled for. *baseline*: the "
        f"{plan.neighbour_baseline_seconds:g} s of traffic alone just before the job, in the "
        "same run; *during the job*: the job's database window, from its "
        "`event=job_started` line to its `event=job_completed` line (retention: from its "
        "prepare task to its report). *Replica behind*: sampled every "
        f"{SAMPLE_SECONDS:g} s over the window, the most seconds "
        "(`now() - pg_last_xact_replay_timestamp()` on the replica while WAL is pending) and "
        "bytes (`pg_current_wal_lsn() - replay_lsn` of `pg_stat_replication` on the primary). "
        "*alone*: the same job on a fresh clone with no traffic (replica attached). Drain "
        "rate = rows changed or deleted over the window. Ratios are per round, then the median "
        f"over {bench.runs} round(s); cells read `median (min .. max)`. *CPU busy*: both cores, "
        "over the window. Goal: p99 <= "
        f"{GOAL_P99_RATIO:g}x its baseline and the replica <= {GOAL_REPLICA_SECONDS:g} s behind, "
        "with traffic and alone (alone, only for a case that keeps the replica's hold on). "
        f"A case with a round whose baseline p99 exceeds {BASELINE_OUTLIER_FACTOR:g}x the median "
        "baseline p99 of all runs with traffic in this section (a stall in the traffic alone) "
        f"gets no verdict: it reads `{BASELINE_OUTLIER}`."
    )
    out.append("")
    rows = []
    typical = typical_baseline_p99(cases)
    for case in cases:
        loaded = case.loaded
        p99_ratio = [r.job.p99 / r.baseline.p99 for r in loaded if r.job and r.baseline]
        rows.append(
            [
                f"`{case.job.dag_id}`",
                case.label,
                f"{case.alone[0].rows if case.alone else loaded[0].rows:,}",
                " / ".join(
                    _med([getattr(r.baseline, q) for r in loaded if r.baseline], _ms)
                    for q in ("p50", "p95", "p99")
                ),
                " / ".join(
                    _med([getattr(r.job, q) for r in loaded if r.job], _ms)
                    for q in ("p50", "p95", "p99")
                ),
                f"**{_med(p99_ratio, _x)}**",
                _med([r.behind_seconds for r in loaded], _s)
                + " / "
                + _med([r.behind_bytes for r in loaded], _mb),
                _med([r.behind_seconds for r in case.alone], _s)
                + " / "
                + _med([r.behind_bytes for r in case.alone], _mb),
                _med([r.window.seconds for r in case.alone], _s)
                + " -> "
                + _med([r.window.seconds for r in loaded], _s),
                _med([r.rate for r in case.alone], _rows_s)
                + " -> "
                + _med([r.rate for r in loaded], _rows_s),
                _med(case.ratios(lambda a, b: b.rate / a.rate), lambda v: f"{v:.2f}x"),
                _med([r.job.tps for r in loaded if r.job], lambda v: f"{v:.0f}"),
                _med([r.cpu_busy for r in case.alone], _pct)
                + " / "
                + _med([r.cpu_busy for r in loaded], _pct),
                case_verdict(case, typical),
            ]
        )
    out.append(
        md_table(
            [
                "DAG",
                "config over the base",
                "rows",
                "OLTP baseline p50 / p95 / p99 (ms)",
                "OLTP during the job p50 / p95 / p99 (ms)",
                "p99 / baseline",
                "replica behind, max (with traffic)",
                "replica behind, max (job alone)",
                "job window alone -> with traffic",
                "drain rows/s alone -> with traffic",
                "with / alone",
                "tx/s in the window",
                "CPU busy alone / with traffic",
                f"goal p99 <= {GOAL_P99_RATIO:g}x, replica <= {GOAL_REPLICA_SECONDS:g} s",
            ],
            rows,
        )
    )
    gaps = [r.sample_gap for c in cases for r in c.alone + c.loaded]
    out.append("")
    out.append(
        f"Lag samples: longest gap between two samples in any window {_secs(max(gaps))} "
        f"(target {SAMPLE_SECONDS:g} s, at least every 0.5 s)."
    )
    if not any(case.loaded for case in cases):
        return  # alone only (--neighbour-alone): no trade-off to draw
    out.append("")
    out.append(
        "Trade-off (one point per case, medians): what the services' p99 costs against the "
        "drain's rate under traffic; and, with nobody there, the drain's rate against the "
        f"unpaced case's in the same round (goal >= {GOAL_ALONE_RATIO:g}x)."
    )
    out.append("")
    curve = []
    for case in sorted(cases, key=lambda c: (c.job.key, _median([r.rate for r in c.loaded]))):
        ratio = [r.job.p99 / r.baseline.p99 for r in case.loaded if r.job and r.baseline]
        curve.append(
            [
                f"`{case.job.dag_id}`",
                case.label,
                _rows_s(_median([r.rate for r in case.loaded])),
                _x(_median(ratio)),
                _s(_median([r.behind_seconds for r in case.loaded])),
                _alone_against_unpaced(case, cases),
            ]
        )
    out.append(
        md_table(
            ["DAG", "config over the base", "drain rows/s with traffic", "p99 / baseline",
             "replica behind, max", "alone: rows/s / unpaced"],
            curve,
        )
    )  # fmt: skip


def typical_baseline_p99(cases: Sequence[Case]) -> float:
    """The median baseline p99 over every run with traffic of the section."""
    return _median([r.baseline.p99 for c in cases for r in c.loaded if r.baseline])


def case_verdict(case: Case, typical: float) -> str:
    """The goal's verdict for a case, or ``BASELINE_OUTLIER`` when one of its rounds' baseline
    p99 exceeds ``BASELINE_OUTLIER_FACTOR`` x ``typical`` (its ratio would flatter the job)."""
    baselines = [r.baseline.p99 for r in case.loaded if r.baseline]
    if not math.isnan(typical) and any(b > BASELINE_OUTLIER_FACTOR * typical for b in baselines):
        return BASELINE_OUTLIER
    p99_ratio = [r.job.p99 / r.baseline.p99 for r in case.loaded if r.job and r.baseline]
    behind = [r.behind_seconds for r in case.loaded]
    alone = [r.behind_seconds for r in case.alone]
    met = (
        (bool(p99_ratio) if case.loaded else bool(alone))  # something was measured
        and (not p99_ratio or statistics.median(p99_ratio) <= GOAL_P99_RATIO)
        and (not behind or statistics.median(behind) <= GOAL_REPLICA_SECONDS)
        # alone, only the replica's hold paces: its bound holds unless the case turned it off
        and (not alone or not case.replica_held or statistics.median(alone) <= GOAL_REPLICA_SECONDS)
    )
    return _verdict(met)


def _alone_against_unpaced(case: Case, cases: Sequence[Case]) -> str:
    """The case's drain rate with nobody there against the unpaced case's, round by round."""
    unpaced = [c for c in cases if c.job is case.job and c.config == UNPACED]
    if not unpaced or case.config == UNPACED:
        return "-"
    pairs = zip(case.alone, unpaced[0].alone, strict=False)
    return _med([mine.rate / theirs.rate for mine, theirs in pairs if theirs.rate], _x)


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


SECTION = SectionSpec(
    key="neighbours",
    title="Neighbours: the services' latency and the replica during a drain",
    run=bench_neighbours,
    in_smoke=False,  # four `airflow dags test` runs and a second server: its own smoke test
)
