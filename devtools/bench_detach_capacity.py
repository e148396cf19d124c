"""Benchmark section ``detach_capacity``: the detach job against the service's capacity.

Called by ``devtools.bench_detach`` (section ``detach_capacity``), which hands over the bench
object, the capacity client, ``md_table`` and ``BenchError``; the selections service comes from
``devtools.bench_core.start_selections``.

Two questions, each answered with medians of several rounds in the same run:

1. **Healthy service** (``--latency-ms 20``, no limit): the job with its default config
   (adaptive concurrency, ``detach_concurrency`` = its maximum) against the service's capacity
   at 16 client threads, measured by the bench's keep-alive client on the same service right
   before. Goal: job rows/s >= 0.8x that capacity. For reference the job pinned at the old
   fixed concurrency 8 (``detach_concurrency_min = detach_concurrency = 8``).
2. **Service limited to 4 calls in flight** (refuses the rest at once: 503 without
   ``Retry-After``, and 429 with ``Retry-After: 1``): from the service's own call log,
   the time after which the job stays at or below 4 in flight (no run of 25 calls with more
   refused calls than 20 % of its accepted ones) and the job's calls per second against the
   calls per second the service accepted. Goals: settled within 5 s, calls/accepted <= 1.2.
3. **Through Airflow**, against services a real one resembles, with what the service's
   other callers feel while the job drains: ``devtools.bench_detach_airflow``.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

from devtools import bench_detach_airflow
from devtools.bench_core import Service, start_selections
from devtools.bench_detach_airflow import fmt as _fmt
from devtools.bench_detach_airflow import median as _median

REPO = Path(__file__).resolve().parent.parent
LATENCY_MS = 20.0
CLIENT_THREADS = 16
LIMIT_IN_FLIGHT = 4
SETTLE_GOAL_SECONDS = 5.0
CALLS_RATIO_GOAL = 1.2
CAPACITY_GOAL = 0.8
# (healthy due rows, limited due rows) per plan
SIZES = {"smoke": (200, 60), "default": (6000, 2000)}
# the job's run bound is raised so one run handles the whole outbox
RUN_CONFIG = {"max_run_duration_seconds": 3000, "lock_ttl_seconds": 3600}
# against the limited service one run lasts its bound (batches of 100 start until then)
LIMITED_RUN_SECONDS = {"smoke": 3, "default": 15}


def _start_service(log_file: Path, *extra: str) -> Service:
    return start_selections(LATENCY_MS, log_file, *extra)


def settle_and_ratio(calls: list[list], chunk: int = 25) -> tuple[float, float, float]:
    """(seconds until the job stays at the limit, calls/accepted after that, overall).

    ``calls`` is the service's log: ``[arrival time, in flight, refused]``. Cut into chunks of
    ``chunk`` consecutive calls, a chunk is "over the limit" when its refused calls exceed
    20 % of its accepted ones (calls/accepted > 1.2); the job has settled at the arrival of
    the first call after the last such chunk (0 when there is none).
    """
    if not calls:
        return math.nan, math.nan, math.nan
    calls = sorted(calls)
    start = calls[0][0]
    # chunk boundaries; a short last chunk joins the one before (too few calls to judge)
    bounds = [*range(chunk, len(calls), chunk), len(calls)]
    if len(bounds) > 1 and bounds[-1] - bounds[-2] < chunk:
        bounds.pop(-2)
    settled_index, lower = 0, 0
    for upper in bounds:
        part = calls[lower:upper]
        refused = sum(1 for c in part if c[2])
        if refused > (CALLS_RATIO_GOAL - 1) * max(len(part) - refused, 1):
            settled_index = upper
        lower = upper
    if settled_index >= len(calls):  # still over the limit at the end: never settled
        return math.inf, math.nan, _ratio(calls)
    settled = calls[settled_index][0] - start if settled_index else 0.0
    return settled, _ratio(calls[settled_index:]), _ratio(calls)


def _ratio(calls: list[list]) -> float:
    accepted = sum(1 for c in calls if not c[2])
    return len(calls) / accepted if accepted else math.nan


def run_section(bench: Any, out: list[str], *, hammer, md_table, error: type[Exception]) -> None:
    plan = bench.plan.name.split()[0]
    healthy_rows, limited_rows = SIZES.get(plan, SIZES["default"])
    bound = LIMITED_RUN_SECONDS.get(plan, LIMITED_RUN_SECONDS["default"])
    _healthy(bench, out, healthy_rows, hammer=hammer, md_table=md_table, error=error)
    _limited(bench, out, limited_rows, bound, md_table=md_table, error=error)
    bench_detach_airflow.run_section(bench, out, hammer=hammer, md_table=md_table, error=error)


def _healthy(bench: Any, out: list[str], healthy_rows: int, *, hammer, md_table, error) -> None:
    """Question 1: the job with its defaults against the capacity at 16 client threads."""
    runs = bench.runs
    rows_out = []
    service = _start_service(bench.workdir / "selections-capacity.log")
    try:
        capacity, job, pinned, limits = [], [], [], []
        ratios: dict[str, list[float]] = {"job": [], "pinned": []}
        template = bench.outbox_template(healthy_rows)
        for i in range(runs):
            ids = [str(uuid.uuid4()) for _ in range(healthy_rows)]
            order = ("capacity", "job", "pinned") if i % 2 == 0 else ("job", "pinned", "capacity")
            for what in order:
                if what == "capacity":
                    seconds, errors = hammer(service.url, ids, CLIENT_THREADS)
                    if errors:
                        raise error(f"capacity client saw {errors} failed calls")
                    capacity.append(healthy_rows / seconds)
                    continue
                config = dict(RUN_CONFIG)
                if what == "pinned":
                    config |= {"detach_concurrency": 8, "detach_concurrency_min": 8}
                db = bench.clone(template, "outbox")
                try:
                    run = bench.run_job("detach", db, config, selections_url=service.url)
                finally:
                    bench.drop(db)
                if run.result.get("Succeeded") != healthy_rows:
                    raise error(f"detach ({what}) did not detach every row: {run.result}")
                (job if what == "job" else pinned).append(healthy_rows / run.seconds)
                # paired with this round's capacity (the load drifts between rounds)
                ratios[what].append(healthy_rows / run.seconds)
                if what == "job":
                    limits.append(float(run.result.get("ConcurrencyPeak", 0)))
    finally:
        service.stop()
    for what, rates in ratios.items():
        ratios[what] = [rate / cap for rate, cap in zip(rates, capacity, strict=True)]
    for label, series, paired in (
        ("defaults (adaptive)", job, ratios["job"]),
        ("fixed at 8 (the old default)", pinned, ratios["pinned"]),
    ):
        ratio = _median(paired)
        rows_out.append(
            [
                label,
                f"{healthy_rows:,}",
                _fmt(capacity, 0),
                _fmt(series, 0),
                _fmt(paired, 2, "x"),
                _fmt(limits, 0) if series is job else "8",
                (
                    ("met" if ratio >= CAPACITY_GOAL else "**missed**")
                    if series is job
                    else "(reference)"
                ),
            ]
        )
    out.append(
        f"Selections service: `devtools/selections_service.py --latency-ms {LATENCY_MS:g}` in "
        f"its own process. Capacity: the bench's keep-alive client with {CLIENT_THREADS} "
        "threads on the same service, in the same round (rounds alternate the order). Job: "
        "`snapshot_detach.run()` with its default config on a fresh clone of the outbox "
        "(every due row must end Done); `rows/s` counts from the start to the end of `run()`. "
        "*job/capacity* is taken per round (the job against that round's capacity), then the "
        f"median over the rounds. {runs} round(s); cells are `median (min .. max)`."
    )
    out.append("")
    out.append(
        md_table(
            [
                "job config",
                "due rows",
                f"service capacity, {CLIENT_THREADS} threads (rows/s)",
                "job rows/s",
                "job/capacity",
                "job peak in flight",
                f"goal >= {CAPACITY_GOAL}x",
            ],
            rows_out,
        )
    )


def _limited(bench: Any, out: list[str], limited_rows: int, bound: float, *, md_table, error):
    """Question 2: a service that refuses calls beyond 4 in flight."""
    runs = bench.runs
    workdir: Path = bench.workdir
    variants = [
        ("503, no Retry-After", ["--overload-status", "503"]),
        ("429, Retry-After: 1", ["--overload-status", "429", "--overload-retry-after", "1"]),
    ]
    limited = []
    template = bench.outbox_template(limited_rows)
    for label, extra in variants:
        service = _start_service(
            workdir / "selections-limited.log", "--max-in-flight", str(LIMIT_IN_FLIGHT), *extra
        )
        settles, ratios, overall, accepted_rate, limits, done = [], [], [], [], [], []
        try:
            for _ in range(runs):
                service.reset()
                db = bench.clone(template, "outbox")
                try:
                    config = {"max_run_duration_seconds": bound, "lock_ttl_seconds": 3600}
                    run = bench.run_job("detach", db, config, selections_url=service.url)
                finally:
                    bench.drop(db)
                stats = service.stats()
                settled, after, total = settle_and_ratio(stats["calls"])
                times = [c[0] for c in stats["calls"]]
                span = max(times) - min(times) if len(times) > 1 else math.nan
                settles.append(settled)
                ratios.append(after)
                overall.append(total)
                accepted_rate.append(stats["accepted"] / span if span else math.nan)
                limits.append(float(run.result.get("ConcurrencyLimit", 0)))
                done.append(float(run.result.get("Succeeded", 0)))
                if stats["peak_in_flight"] > LIMIT_IN_FLIGHT:
                    raise error(f"service admitted {stats['peak_in_flight']} calls at once")
        finally:
            service.stop()
        ok = _median(settles) <= SETTLE_GOAL_SECONDS and _median(ratios) <= CALLS_RATIO_GOAL
        limited.append(
            [
                label,
                f"{limited_rows:,}",
                _fmt(done, 0),
                _fmt(accepted_rate, 0),
                _fmt(settles, 1, " s"),
                _fmt(ratios, 2, "x"),
                _fmt(overall, 2, "x"),
                _fmt(limits, 0),
                "met" if ok else "**missed**",
            ]
        )
    out.append("")
    out.append(
        f"The same service refusing every call beyond {LIMIT_IN_FLIGHT} in flight at once "
        "(answered at once, before the 20 ms of work). From the service's call log, cut into "
        "runs of 25 consecutive calls: *settled after* = seconds from the first call to the end "
        "of the last run of 25 in which refused calls exceeded 20 % of accepted ones (0 = "
        "never); *calls/accepted* = every call the job made per call the "
        "service accepted, after settling and over the whole run. Rows refused stay Pending "
        "with their backoff (one attempt spent, as the seed says). Each run has "
        f"`max_run_duration_seconds` {bound:g} (no batch starts after that), so *Done in the "
        f"run* is what {bound:g} s (plus the last batch) detach. {runs} round(s), "
        "`median (min .. max)`."
    )
    out.append("")
    out.append(
        md_table(
            [
                "service refuses with",
                "due rows",
                "Done in the run",
                "accepted calls/s",
                "settled after",
                "calls/accepted after settling",
                "calls/accepted, whole run",
                "job limit at the end",
                f"goal: settled <= {SETTLE_GOAL_SECONDS:g} s, <= {CALLS_RATIO_GOAL}x",
            ],
            limited,
        )
    )
