"""Slot expiration benchmark: ``slot_expiration.run()`` against one set-based UPDATE."""

from __future__ import annotations

import importlib
import math
import time

import psycopg

from devtools import bench_data as bd
from devtools import pg
from devtools.bench_core import (
    DAG_IDS,
    JOB_MODULES,
    Bench,
    BenchError,
    DagOnData,
    JobRun,
    SectionSpec,
    Series,
    _mb,
    _rate,
    _ratio,
    _secs,
    _verdict,
    md_table,
)

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

# Drain mode, as the README tells an operator to drain a backlog: the default cycle takes one
# batch (seed 002's bound); a drain cycle may take the whole backlog, with the time bound raised
# to match, in batches of DRAIN_BATCH rows. The default batch_size (500) is measured beside it.
DRAIN_BATCH = 2000
DRAIN_CONFIG = {
    "max_batches_per_cycle": 100_000,
    "max_run_duration_seconds": 3600,
    "batch_size": DRAIN_BATCH,
}
# through `airflow dags test`: the task's 10-min execution_timeout holds at most 565 s
AIRFLOW_DRAIN_CONFIG = DRAIN_CONFIG | {"max_run_duration_seconds": 540}

SLOTS_TEXT = (
    "Job: `slot_expiration.run()` in drain mode, the README's setting for a backlog "
    "(`max_batches_per_cycle` 100000, `max_run_duration_seconds` 3600, so one cycle expires the "
    "whole backlog, and `batch_size` {batch}; the default cycle takes a single batch of "
    "{default_batch}), otherwise defaults (one transaction per batch, runners {runners}: the "
    "first batch loop starts the others once its first batch comes back full); also with the "
    "default `batch_size` {default_batch}, with `runners` 1 (one loop, one connection), and with "
    "psycopg's auto-prepare back on (`prepare_threshold` 5, its default; the job runs with "
    "`None`, no server-side prepared statements, because a transaction pooler moves it between "
    "server connections): `prepared/job` is what that choice costs on a direct connection. "
    "Limit: one `UPDATE ... SET status = 'Expired', "
    "updated_at = now(), version = version + 1 WHERE status = 'Available' AND start_at <= "
    "now()`. Fresh clone per timed run. Diagnostic column: the same raw UPDATE cut into "
    "{batch}-row transactions by `start_at` ranges computed beforehand (not timed), one "
    "connection, no row locks, `synchronous_commit = off` like the job: what any design that "
    "commits every {batch} rows on one connection costs before it locks anything."
)


def _slots_text(default_batch: int, runners: int) -> str:
    return SLOTS_TEXT.format(batch=DRAIN_BATCH, default_batch=default_batch, runners=runners)


def bench_slots(bench: Bench, out: list[str]) -> None:
    config = dict(DRAIN_CONFIG)
    module = importlib.import_module(JOB_MODULES["slots"])
    defaults = module.CONFIG.defaults
    default_batch, runners = defaults.batch_size, defaults.runners
    rows = []
    for total, due in bench.plan.slots:
        template = bench.slots_template(total, due)
        kinds = ("job", "default_batch", "one", "limit", "chunks", "prepared")
        series = {what: Series() for what in kinds}
        rss, cpu = [], Series()
        for i in range(bench.runs):
            turn = i % len(kinds)  # each round starts with another variant
            for what in kinds[turn:] + kinds[:turn]:
                seconds, run = slots_timed(bench, what, template, due, config, default_batch)
                series[what].add(seconds)
                if what == "job" and run is not None:
                    rss.append(run.proc.maxrss_kb)
                    cpu.add(run.cpu)
        job, default, one, limit, chunks, prepared = (series[k] for k in kinds)
        bench.job_medians[("slots", f"{total}/{due}")] = job.median
        ratio = _ratio(limit.median, job.median)
        rows.append(
            [
                f"{total:,}",
                f"{due:,}",
                job.fmt(),
                one.fmt(),
                limit.fmt(),
                f"{ratio:.2f}x",
                default.fmt(),
                f"{_ratio(limit.median, default.median):.2f}x",
                f"{_ratio(limit.median, one.median):.2f}x",
                _rate(due, job.median),
                _rate(due, limit.median),
                chunks.fmt(),
                f"{_ratio(limit.median, chunks.median):.2f}x",
                prepared.fmt(),
                f"{_ratio(prepared.median, job.median):.2f}x",
                _mb(max(rss)),
                _secs(cpu.median),
                _verdict(ratio >= 1.0),
            ]
        )
    out.append(_slots_text(default_batch, runners))
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
                f"job, batch_size {default_batch}",
                f"limit/job (batch_size {default_batch})",
                "limit/job (1 runner)",
                "job rows/s",
                "limit rows/s",
                f"raw UPDATE in {DRAIN_BATCH}-row transactions",
                "limit/that",
                "job, prepared statements",
                "prepared/job",
                "job peak RSS",
                "job CPU in run()",
                "goal >= 1.0x",
            ],
            rows,
        )
    )
    # the empty cycle: nothing is due; the cost must not grow with the table
    empty_rows, medians = [], []
    for total in bench.plan.empty_slots:
        template = bench.slots_template(total, 0)
        job, limit, rss = Series(), Series(), []
        for _ in range(max(bench.runs, bench.plan.empty_runs)):
            run = bench.run_job("slots", template, config)
            if run.result.get("ExpiredCount") != 0:
                raise BenchError(f"empty cycle expired {run.result}")
            job.add(run.seconds)
            rss.append(run.proc.maxrss_kb)
            limit.add(bench.timed_sql(template, [SLOTS_LIMIT], {}))
        medians.append(job.median)
        empty_rows.append([f"{total:,}", job.fmt(), limit.fmt(), _mb(max(rss))])
    growth = medians[-1] / medians[0] if len(medians) > 1 and medians[0] else math.nan
    out.append("")
    out.append(
        f"Empty cycle (no due slot; the job still reads its backlog gauge): "
        f"{bench.plan.empty_slots[-1]:,} vs {bench.plan.empty_slots[0]:,} rows = "
        f"**{growth:.2f}x** (goal <= 2x: {_verdict(growth <= 2)})."
    )
    out.append("")
    out.append(
        md_table(
            ["table rows", "job (empty cycle)", "raw UPDATE finding nothing", "job peak RSS"],
            empty_rows,
        )
    )


def slots_timed(  # noqa: PLR0917 (was a method with the same arguments)
    bench: Bench, what: str, template: pg.Database, due: int, config: dict, default_batch: int
) -> tuple[float, JobRun | None]:
    """One timed slots variant on a fresh clone: the job in drain mode (``job``; with the
    default batch_size, ``default_batch``; with runners 1, ``one``; with auto-prepare,
    ``prepared``), the limit, or the limit cut into drain-sized transactions (``chunks``)."""
    overrides = {"default_batch": {"batch_size": default_batch}, "one": {"runners": 1}}
    db = bench.clone(template, "slots")
    try:
        run = None
        if what in {"job", "default_batch", "one", "prepared"}:
            extra = {"prepare_threshold": 5} if what == "prepared" else {}
            run = bench.run_job("slots", db, config | overrides.get(what, {}), **extra)
            seconds = run.seconds
            if run.result.get("ExpiredCount") != due:
                raise BenchError(f"slots job result {run.result}, due {due}")
        elif what == "limit":
            seconds = bench.timed_sql(db, [SLOTS_LIMIT], {})
        else:
            seconds = slots_limit_in_chunks(bench, db, DRAIN_BATCH)
        state = bd.slots_state(db.url)
        if state["due"] != 0:
            raise BenchError(f"{what} left {state['due']} due slots")
        return seconds, run
    finally:
        bench.drop(db)


def slots_limit_in_chunks(bench: Bench, db: pg.Database, batch_size: int) -> float:
    """The limit's UPDATE cut into ``batch_size``-row transactions (by start_at ranges)."""
    with psycopg.connect(db.url) as conn:
        conn.execute("select set_config('synchronous_commit', 'off', false)")
        bounds = [row[0] for row in conn.execute(SLOTS_CHUNK_BOUNDS, {"batch_size": batch_size})]
        conn.commit()
        started = time.perf_counter()
        lower = None
        for upper in [*bounds, None]:
            conn.execute(SLOTS_CHUNK, {"lower": lower, "upper": upper})
            conn.commit()
            lower = upper
        return time.perf_counter() - started


def dag_on_data(bench: Bench) -> DagOnData:
    """The DAG once on the section's largest dataset."""
    dag_id = DAG_IDS["slots"]
    total, due = bench.plan.slots[-1]
    template = bench.slots_template(total, due)
    db = bench.clone(template, "af_slots")
    proc = bench.dags_test(dag_id, db, {dag_id: dict(AIRFLOW_DRAIN_CONFIG)})

    def check() -> None:
        try:
            left = bd.slots_state(db.url)["due"]
            if left:
                raise BenchError(f"DAG run left {left} due slots")
        finally:
            bench.drop(db)

    return DagOnData(proc, due, f"{due:,} due of {total:,}", ("slots", f"{total}/{due}"), check)


SECTION = SectionSpec(
    key="slots",
    title="Slot expiration (calendar_slot_expiration)",
    run=bench_slots,
    dag_id=DAG_IDS["slots"],
    dag_on_data=dag_on_data,
)
