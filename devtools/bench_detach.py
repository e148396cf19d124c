"""Snapshot detach benchmark: ``snapshot_detach.run()`` against the selections service alone."""

from __future__ import annotations

import hashlib
import http.client
import importlib
import itertools
import json
import socket
import threading
import time
import uuid
from base64 import b64encode
from collections.abc import Sequence
from urllib.parse import urlsplit

from devtools import bench_data as bd
from devtools.bench_core import (
    DAG_IDS,
    JOB_MODULES,
    SELECTIONS_LOGIN,
    SELECTIONS_PASSWORD,
    Bench,
    BenchError,
    DagOnData,
    SectionSpec,
    Series,
    _mb,
    _rate,
    _ratio,
    _secs,
    _verdict,
    md_table,
)


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


def _md5(text: str) -> bytes:

    return hashlib.md5(text.encode(), usedforsecurity=False).digest()


# through `airflow dags test`: the task's 10-min execution_timeout holds the run bound + call
# timeout + margin, and the lock's lease outlasts them
AIRFLOW_CONFIG = {"max_run_duration_seconds": 540, "lock_ttl_seconds": 600}


def detach_concurrency(bench) -> int:
    if bench.concurrency is None:
        module = importlib.import_module(JOB_MODULES["detach"])
        bench.concurrency = module.CONFIG.defaults.detach_concurrency
    return bench.concurrency


def bench_detach(bench: Bench, out: list[str]) -> None:
    service = bench.selections()
    concurrency = detach_concurrency(bench)
    config = {"max_run_duration_seconds": 3000, "lock_ttl_seconds": 3600}
    seq = bench.plan.detach_seq_rows
    cases = [
        (concurrency, bench.plan.detach_rows, "(default)", {}),
        (1, seq, "(sequential baseline)", {"detach_concurrency": 1}),
    ]
    rows = []
    for conc, due, note, overrides in cases:
        # the limit: the service alone, hammered with the job's concurrency
        ids = [str(uuid.UUID(bytes=_md5(f"capacity{conc}-{i}"))) for i in range(due)]
        capacity = Series()
        for _ in range(bench.runs):
            seconds, errors = hammer(service.url, ids, conc)
            if errors:
                raise BenchError(f"capacity client saw {errors} failed calls")
            capacity.add(seconds)
        template = bench.outbox_template(due)
        job, rss, cpu = Series(), [], Series()
        for _ in range(bench.runs):
            db = bench.clone(template, "outbox")
            try:
                run = bench.run_job(
                    "detach", db, {**config, **overrides}, selections_url=service.url
                )
                state = bd.outbox_state(db.url)
                if state["due"] != 0 or run.result.get("Succeeded") != due:
                    raise BenchError(f"detach left {state}, result {run.result}")
                job.add(run.seconds)
                rss.append(run.proc.maxrss_kb)
                cpu.add(run.cpu)
            finally:
                bench.drop(db)
        if not overrides:
            bench.job_medians[("detach", str(due))] = job.median
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
                f"{1000 * conc / bench.plan.latency_ms:,.0f}",
                _mb(max(rss)),
                _secs(cpu.median),
                "(reference)" if overrides else _verdict(ratio >= 0.8),
            ]
        )
    out.append(
        f"Selections service: `devtools/selections_service.py --latency-ms "
        f"{bench.plan.latency_ms:g}` (every call sleeps {bench.plan.latency_ms:g} ms; the "
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


def dag_on_data(bench: Bench) -> DagOnData:
    """The DAG once on the section's default dataset."""
    dag_id = DAG_IDS["detach"]
    n = bench.plan.detach_rows
    template = bench.outbox_template(n)
    db = bench.clone(template, "af_outbox")
    proc = bench.dags_test(dag_id, db, {dag_id: dict(AIRFLOW_CONFIG)})

    def check() -> None:
        try:
            left = bd.outbox_state(db.url)["due"]
            if left:
                raise BenchError(f"DAG run left {left} due outbox rows")
        finally:
            bench.drop(db)

    return DagOnData(proc, n, f"{n:,} due rows", ("detach", str(n)), check)


SECTION = SectionSpec(
    key="detach",
    title="Snapshot detach retry (news_snapshot_detach_retry)",
    run=bench_detach,
    dag_id=DAG_IDS["detach"],
    dag_on_data=dag_on_data,
)


def bench_detach_capacity(bench: Bench, out: list[str]) -> None:
    """The section of devtools/bench_detach_capacity.py (healthy and capacity-limited service)."""
    from devtools import bench_detach_capacity as capacity

    capacity.run_section(bench, out, hammer=hammer, md_table=md_table, error=BenchError)


CAPACITY = SectionSpec(
    key="detach_capacity",
    title="Snapshot detach at the service's capacity (adaptive concurrency)",
    run=bench_detach_capacity,
    in_smoke=False,  # a loopback service per case and an `airflow dags test`: make bench-smoke
)
