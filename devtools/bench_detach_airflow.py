"""The detach job through Airflow against services a real one resembles, and what their other
callers feel while it drains (``detach_capacity`` section, question 3).

Services (``devtools/selections_service.py`` in its own process, 20 ms of work per call):

- a plain threaded server with the standard library's defaults (``--stdlib-defaults``:
  ``ThreadingHTTPServer``, HTTP/1.0 so one connection per call, a listen backlog of 5);
- the same with a latency tail (lognormal, median 20 ms, p99 about 80 ms);
- the keep-alive server (HTTP/1.1, backlog 256).

Each round measures, on the same service: its capacity at 16 client threads (the bench's
client, a new connection per call where the server closes it); a **neighbour**, another caller
making one call every 50 ms on a new connection, alone for a few seconds; and the job as the
user runs it, ``airflow dags test news_snapshot_detach_retry`` with the defaults on a fresh
clone of the outbox, with the neighbour calling beside it. The job's rate is reported both
ways: the due rows over the run's own ``duration_ms`` (its ``job_completed`` line; the goal is
judged on it), and the due rows over the process wall time minus the wall time of the same DAG
on an empty outbox (the fixed start-up of a task, measured once per bench). The neighbour's
latencies count from the job's first call to its last (the service's call log).

Then the small healthy queue: two ``airflow dags test`` runs started together (one takes the
lock, the other skips) on 80 due rows, ``batch_size`` 10, against the plain server, repeated;
every row must end Done, none Pending by a timeout or a connection error.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import statistics
import threading
import time
import uuid
from base64 import b64encode
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import psycopg

from devtools.bench_core import SELECTIONS_LOGIN, SELECTIONS_PASSWORD, start_selections
from devtools.selections_service import NEIGHBOUR_KEY_PREFIX

DAG_ID = "news_snapshot_detach_retry"
LATENCY_MS = 20.0
CLIENT_THREADS = 16
CAPACITY_GOAL = 0.8
NEIGHBOUR_GOAL = 2.0  # the neighbour's p99 during the drain, against its p99 alone
NEIGHBOUR_INTERVAL = 0.05  # one call every 50 ms
NEIGHBOUR_ALONE_SECONDS = {"smoke": 2.0, "default": 8.0}
SERVICES = (
    ("plain threaded server, stdlib defaults (HTTP/1.0, backlog 5)", ("--stdlib-defaults",)),
    (
        "plain threaded server, lognormal (median 20 ms, p99 ~80 ms)",
        ("--stdlib-defaults", "--latency-sigma", "0.6"),
    ),
    ("keep-alive server (HTTP/1.1, backlog 256)", ()),
)
ROWS = {"smoke": 200, "default": 5000}
TWO_RUNS = {"smoke": 1, "default": 10}  # tries of two runs started together on 80 rows
TWO_RUNS_ROWS = 80
TWO_RUNS_VARIABLES = {DAG_ID: {"batch_size": 10}}
_DURATION = re.compile(r"event=job_completed .*?duration_ms=(\d+)")
_LEFT_PENDING = """
select coalesce(split_part(last_error, ' ', 1), 'none'), count(*)
from news.snapshot_detach_outbox
where status = 'Pending' and updated_at >= %(since)s
group by 1
"""


@dataclass
class Neighbour:
    """Another caller of the service: one call every ``interval`` seconds, a new connection
    each, on its own thread; ``(sent at, seconds)`` per call (an error counts as 10 s)."""

    url: str
    interval: float = NEIGHBOUR_INTERVAL
    calls: list[tuple[float, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Neighbour:
        self._thread = threading.Thread(target=self._run, name="neighbour", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(15)

    def _run(self) -> None:
        parts = urlsplit(self.url)
        auth = b64encode(f"{SELECTIONS_LOGIN}:{SELECTIONS_PASSWORD}".encode()).decode()
        body = json.dumps({"reason": "BlockReplaced"}).encode()
        due = time.monotonic()
        while not self._stop.is_set():
            # open loop: a late call does not push the next one back
            self._stop.wait(max(0.0, due - time.monotonic()))
            due += self.interval
            key = f"{NEIGHBOUR_KEY_PREFIX}{uuid.uuid4()}"
            headers = {
                "Content-Type": "application/json",
                "Authorization": f"Basic {auth}",
                "Idempotency-Key": key,
                "Connection": "close",
            }
            sent, wall = time.monotonic(), time.time()
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
            try:
                conn.request("POST", f"/internal/snapshots/{uuid.uuid4()}/detach", body, headers)
                conn.getresponse().read()
                seconds = time.monotonic() - sent
            except (OSError, http.client.HTTPException):
                seconds = 10.0
            finally:
                conn.close()
            self.calls.append((wall, seconds))

    def latencies(self, start: float = -math.inf, end: float = math.inf) -> list[float]:
        return [s for at, s in self.calls if start <= at <= end]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def job_window(calls: list[list]) -> tuple[float, float]:
    """First and last call of the job in the service's log (the neighbour's left out)."""
    times = [c[0] for c in calls if not (len(c) > 3 and c[3])]
    return (min(times), max(times)) if times else (math.nan, math.nan)


def left_pending(url: str, since: Any) -> dict[str, int]:
    """Rows a run touched and left Pending, by the first word of their last error."""
    with psycopg.connect(url) as conn:
        return dict(conn.execute(_LEFT_PENDING, {"since": since}).fetchall())


def _db_now(url: str) -> Any:
    with psycopg.connect(url) as conn:
        return conn.execute("select now()").fetchone()[0]


def median(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def fmt(values: list[float], digits: int = 2, unit: str = "") -> str:
    """``median (min .. max)`` of the values that are numbers, for a bench table cell."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    med = f"{median(values):.{digits}f}{unit}"
    if len(values) == 1:
        return med
    return f"{med} ({min(values):.{digits}f} .. {max(values):.{digits}f})"


@dataclass
class _Round:
    capacity: list[float] = field(default_factory=list)
    by_duration: list[float] = field(default_factory=list)
    by_wall: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    peaks: list[float] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)
    alone_p99: list[float] = field(default_factory=list)
    during_p99: list[float] = field(default_factory=list)
    neighbour_ratios: list[float] = field(default_factory=list)
    lost: int = 0  # due rows left Pending by a timeout or a connection error


def run_section(bench: Any, out: list[str], *, hammer, md_table, error) -> None:
    plan = bench.plan.name.split()[0]
    rows = ROWS.get(plan, ROWS["default"])
    alone = NEIGHBOUR_ALONE_SECONDS.get(plan, NEIGHBOUR_ALONE_SECONDS["default"])
    services = SERVICES[:1] if plan == "smoke" else SERVICES
    empty_wall = _empty_run_wall(bench)
    table = []
    template = bench.outbox_template(rows)
    for label, extra in services:
        service = start_selections(LATENCY_MS, bench.workdir / "selections-airflow.log", *extra)
        r = _Round()
        try:
            for i in range(bench.runs):
                ids = [str(uuid.uuid4()) for _ in range(rows)]
                job = {
                    "template": template,
                    "rows": rows,
                    "empty_wall": empty_wall,
                    "alone": alone,
                    "error": error,
                }
                if i % 2:  # rounds alternate which of the two goes first
                    _job_round(bench, service, r, **job)
                    _capacity(hammer, service.url, ids, r, error)
                else:
                    _capacity(hammer, service.url, ids, r, error)
                    _job_round(bench, service, r, **job)
                r.ratios.append(r.by_duration[-1] / r.capacity[-1])
        finally:
            service.stop()
        met = (
            median(r.ratios) >= CAPACITY_GOAL
            and median(r.neighbour_ratios) <= NEIGHBOUR_GOAL
            and r.lost == 0
        )
        table.append(
            [
                label,
                fmt(r.capacity, 0),
                fmt(r.by_duration, 0),
                fmt(r.by_wall, 0),
                fmt(r.ratios, 2, "x"),
                fmt(r.peaks, 0),
                fmt(r.stalls, 0),
                str(r.lost),
                fmt([v * 1000 for v in r.alone_p99], 1, " ms"),
                fmt([v * 1000 for v in r.during_p99], 1, " ms"),
                fmt(r.neighbour_ratios, 2, "x"),
                "met" if met else "**missed**",
            ]
        )
    out.append("")
    out.append(
        f"Through Airflow: `airflow dags test {DAG_ID}` with the DAG's defaults on a fresh "
        f"clone of {rows:,} due rows, against a service a real one resembles. *by run* = due "
        "rows over the run's own `duration_ms` (the goal is judged on it); *by task* = due rows "
        "over the process wall time minus the same DAG's wall time on an empty outbox "
        f"({empty_wall:.1f} s here: the task's start-up). Capacity: the bench's client with "
        f"{CLIENT_THREADS} threads on the same service in the same round. *Neighbour*: another "
        f"caller making one call every {NEIGHBOUR_INTERVAL * 1000:.0f} ms on a new connection, "
        f"p99 alone ({alone:g} s before the job) and during the job's calls (first to last "
        "call in the service's log); goal: at most "
        f"{NEIGHBOUR_GOAL:g}x. *Lost*: due rows the run left Pending by a timeout or a "
        f"connection error (goal 0). {bench.runs} round(s), `median (min .. max)`."
    )
    out.append("")
    out.append(
        md_table(
            [
                "service",
                f"capacity, {CLIENT_THREADS} threads (rows/s)",
                "job rows/s, by run",
                "job rows/s, by task",
                "job/capacity (by run)",
                "peak in flight",
                "stalls seen",
                "lost",
                "neighbour p99 alone",
                "neighbour p99 during",
                "neighbour during/alone",
                f"goal: >= {CAPACITY_GOAL}x, neighbour <= {NEIGHBOUR_GOAL:g}x, 0 lost",
            ],
            table,
        )
    )
    _two_runs(bench, out, TWO_RUNS.get(plan, TWO_RUNS["default"]), md_table=md_table)


def _capacity(hammer, url: str, ids: list[str], r: _Round, error) -> None:
    seconds, errors = hammer(url, ids, CLIENT_THREADS)
    if errors:
        raise error(f"capacity client saw {errors} failed calls")
    r.capacity.append(len(ids) / seconds)


def _job_round(bench, service, r: _Round, *, template, rows, empty_wall, alone, error) -> None:
    with Neighbour(service.url) as before:
        time.sleep(alone)
    service.reset()
    db = bench.clone(template, "af_capacity")
    try:
        since = _db_now(db.url)
        with Neighbour(service.url) as during:
            proc = bench.dags_test(DAG_ID, db, None, selections_url=service.url)
        lost = left_pending(db.url, since)
    finally:
        bench.drop(db)
    output = proc.stdout + "\n" + proc.stderr
    seconds = job_duration_seconds(output)
    if sum(lost.values()) and not set(lost) <= {"Timeout", "ConnectionError"}:
        raise error(f"airflow dags test left rows Pending: {lost}")
    r.lost += sum(lost.values())
    r.by_duration.append(rows / seconds)
    task = proc.wall - empty_wall
    r.by_wall.append(rows / task if task > 0 else math.nan)
    r.peaks.append(_field(output, "concurrency_peak"))
    r.stalls.append(_field(output, "call_stalls"))
    start, end = job_window(service.stats()["calls"])
    alone_p99 = percentile(before.latencies(), 0.99)
    during_p99 = percentile(during.latencies(start, end), 0.99)
    r.alone_p99.append(alone_p99)
    r.during_p99.append(during_p99)
    r.neighbour_ratios.append(during_p99 / alone_p99)


def job_duration_seconds(output: str) -> float:
    """The run's own duration from its ``job_completed`` line (the last one in ``output``)."""
    found = _DURATION.findall(output)
    if not found:
        raise ValueError("no job_completed line with duration_ms in the DAG run's output")
    return int(found[-1]) / 1000


def _field(output: str, name: str) -> float:
    found = re.findall(rf"event=job_completed .*?{name}=(\d+)", output)
    return float(found[-1]) if found else math.nan


def _empty_run_wall(bench) -> float:
    db = bench.clone(bench.empty_template(), "af_empty")
    try:
        return bench.dags_test(DAG_ID, db, None).wall
    finally:
        bench.drop(db)


def _two_runs(bench, out: list[str], tries: int, *, md_table) -> None:
    """Two runs started together on a small healthy queue, against the plain server."""
    service = start_selections(
        LATENCY_MS, bench.workdir / "selections-two-runs.log", "--stdlib-defaults"
    )
    template = bench.outbox_template(TWO_RUNS_ROWS)
    done, lost, calls, peaks = [], [], [], []
    try:
        for _ in range(tries):
            service.reset()
            db = bench.clone(template, "af_two")
            try:
                since = _db_now(db.url)
                procs: list = [None, None]

                def run(i: int, db=db, procs=procs) -> None:
                    procs[i] = bench.dags_test(
                        DAG_ID, db, TWO_RUNS_VARIABLES, selections_url=service.url
                    )

                threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                left = left_pending(db.url, since)
                with psycopg.connect(db.url) as conn:
                    (n_done,) = conn.execute(
                        "select count(*) from news.snapshot_detach_outbox "
                        "where status = 'Done' and updated_at >= %(since)s",
                        {"since": since},
                    ).fetchone()
            finally:
                bench.drop(db)
            done.append(n_done)
            lost.append(sum(v for k, v in left.items() if k in ("Timeout", "ConnectionError")))
            stats = service.stats()
            calls.append(len(stats["calls"]))
            peaks.append(stats["peak_in_flight"])
    finally:
        service.stop()
    out.append("")
    out.append(
        f"Two `airflow dags test {DAG_ID}` runs started together (one takes the lock, the "
        f"other skips) on {TWO_RUNS_ROWS} due rows, `batch_size` 10, against the plain threaded "
        f"server (stdlib defaults, 20 ms), {tries} tries. *Lost* = rows left Pending by a "
        "timeout or a connection error (goal: 0 in every try)."
    )
    out.append("")
    out.append(
        md_table(
            [
                "tries",
                "rows Done per try",
                "lost, all tries",
                "calls the service received per try",
                "service peak in flight",
                "goal",
            ],
            [
                [
                    str(tries),
                    fmt([float(d) for d in done], 0),
                    str(sum(lost)),
                    fmt([float(c) for c in calls], 0),
                    fmt([float(p) for p in peaks], 0),
                    "met" if sum(lost) == 0 and min(done) == TWO_RUNS_ROWS else "**missed**",
                ]
            ],
        )
    )
