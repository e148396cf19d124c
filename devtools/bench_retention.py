"""Retention benchmark: ``activity_retention.run()`` against one set-based delete chain."""

from __future__ import annotations

import importlib

from devtools import bench_data as bd
from devtools import pg
from devtools.bench_core import (
    BIG_RETENTION,
    DAG_IDS,
    JOB_MODULES,
    RETENTION_DAYS,
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


def retention_template(
    bench: Bench, eligible: int, shape: str = "project"
) -> tuple[pg.Database, bd.RetentionDataset]:
    ds = bd.retention_dataset(eligible, shape)
    label = (
        f"retention ({shape}): {ds.eligible:,} eligible + {ds.keep:,} young/Active sessions, "
        f"{_children(ds.shape)} each"
    )
    db = bench.dataset(
        label, ds.rows, ("ret", shape, eligible), lambda url: bd.load_retention(url, ds)
    )
    return db, ds


def _children(shape: bd.RetentionShape) -> str:
    views = f"{shape.views} view" + ("s" if shape.views != 1 else "")
    events = f"{shape.events} event" + ("s" if shape.events != 1 else "")
    refs = "every view" if shape.apply_filter == "all" else "the first view"
    return f"{views} + {events}, apply_filter_event_id set on {refs}"


# The job as its DAG runs it by default, bounds raised so that one run drains the backlog.
JOB_CONFIG = {
    "retention_period_days": RETENTION_DAYS,
    "max_batches_per_run": 50_000,
    "max_run_duration_seconds": 7200,
}
# through `airflow dags test`: a delete task's 2-hour execution_timeout holds the sessions
# step's share of the run (all of it) plus its stop grace
AIRFLOW_CONFIG = {"max_batches_per_run": 50_000, "max_run_duration_seconds": 3600}
GOAL = 1.0  # limit/job
BIG_RUNS = 3  # rounds at BIG_RETENTION and above: medians of 3, like the smaller scales


def retention_timed(
    bench: Bench, what: str, template: pg.Database, ds: bd.RetentionDataset, before: dict
) -> tuple[float, JobRun | None]:
    """One timed retention variant on a fresh clone: job, one (runners 1) or limit."""
    db = bench.clone(template, "ret")
    try:
        if what == "limit":
            seconds = bench.timed_sql(db, RETENTION_LIMIT, {"days": RETENTION_DAYS})
            check_retention(bench, db, before, ds, None)
            return seconds, None
        config = JOB_CONFIG | ({"runners": 1} if what == "one" else {})
        run = bench.run_job("retention", db, config)
        check_retention(bench, db, before, ds, run.result)
        return run.seconds, run
    finally:
        bench.drop(db)


def bench_retention(bench: Bench, out: list[str]) -> None:
    module = importlib.import_module(JOB_MODULES["retention"])
    defaults = module.CONFIG.defaults
    rows = []
    for eligible in bench.plan.retention:
        for shape in bench.plan.retention_shapes:
            rows.append(_measure(bench, eligible, shape))
    out.append(
        f"Job: `activity_retention.run()` with defaults (batch_size {defaults.batch_size}, "
        f"runners {defaults.runners}), `max_batches_per_run` and `max_run_duration_seconds` "
        "raised so one run drains the backlog; also with `runners` 1 (one batch loop per "
        "delete step). Limit: one transaction deleting the action_events, then the "
        "property_object_views, then the sessions of every eligible id (three set-based "
        "statements). Each timed run starts from a fresh clone of the dataset, job, one-loop "
        "job and limit in rotating order; young Inactive and Active sessions (20% as many) "
        "and property_object_view_stats are checked unchanged after every run. Shapes: "
        + "; ".join(
            f"*{s.key}* = {s.title} ({_children(s)} per session)"
            for s in bd.RETENTION_SHAPES.values()
            if s.key in bench.plan.retention_shapes
        )
        + "."
    )
    out.append("")
    out.append(
        md_table(
            [
                "shape",
                "eligible sessions",
                "rows deleted",
                "job",
                "limit",
                "limit/job",
                "job, 1 runner",
                "limit/job (1 runner)",
                "job rows/s",
                "limit rows/s",
                "job time per row",
                "job peak RSS",
                "job CPU in run()",
                "batches",
                f"goal >= {GOAL:.1f}x",
            ],
            rows,
        )
    )


def _measure(bench: Bench, eligible: int, shape: str) -> list[object]:
    template, ds = retention_template(bench, eligible, shape)
    deleted = ds.eligible_rows
    before = bd.retention_state(template.url, RETENTION_DAYS)
    # a 1M-session run takes minutes per clone and per measurement: job and limit only, in
    # alternating order (no one-loop variant)
    big = eligible >= BIG_RETENTION
    runs = min(bench.runs, BIG_RUNS) if big else bench.runs
    variants = ["job", "limit"] if big else ["job", "one", "limit"]
    series = {what: Series() for what in variants}
    rss, cpu, batches = [], Series(), set()
    for i in range(runs):
        for what in variants[i % len(variants) :] + variants[: i % len(variants)]:
            seconds, run = retention_timed(bench, what, template, ds, before)
            series[what].add(seconds)
            if what == "job" and run is not None:
                rss.append(run.proc.maxrss_kb)
                cpu.add(run.cpu)
                batches.add(str(run.result.get("BatchesProcessed", "?")))
    job, limit = series["job"], series["limit"]
    one = series.get("one", Series())
    if shape == "project":
        bench.job_medians[("retention", str(eligible))] = job.median
    ratio = _ratio(limit.median, job.median)
    return [
        shape,
        f"{ds.eligible:,}" + ("" if runs == bench.runs else f" ({_runs(runs)})"),
        f"{deleted:,}",
        job.fmt(),
        limit.fmt(),
        f"{ratio:.2f}x",
        one.fmt(),
        f"{_ratio(limit.median, one.median):.2f}x" if one.values else "n/a",
        _rate(deleted, job.median),
        _rate(deleted, limit.median),
        f"{1e6 * job.median / deleted:.1f} µs" if deleted else "n/a",
        _mb(max(rss)),
        _secs(cpu.median),
        ", ".join(sorted(batches)),
        _verdict(ratio >= GOAL),
    ]


def _runs(n: int) -> str:
    return f"{n} run" + ("s" if n != 1 else "")


def check_retention(
    bench, db: pg.Database, before: dict, ds: bd.RetentionDataset, result: dict | None
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


def dag_on_data(bench: Bench) -> DagOnData:
    """The DAG once on the section's second scale (its largest default one)."""
    dag_id = DAG_IDS["retention"]
    eligible = bench.plan.retention[min(1, len(bench.plan.retention) - 1)]
    template, ds = retention_template(bench, eligible)
    before = bd.retention_state(template.url, RETENTION_DAYS)
    variables = {dag_id: dict(AIRFLOW_CONFIG)}
    db = bench.clone(template, "af_ret")
    proc = bench.dags_test(dag_id, db, variables)

    def check() -> None:
        try:
            check_retention(bench, db, before, ds, None)
        finally:
            bench.drop(db)

    return DagOnData(
        proc,
        ds.eligible_rows,
        f"{ds.eligible:,} eligible sessions",
        ("retention", str(eligible)),
        check,
    )


SECTION = SectionSpec(
    key="retention",
    title="Retention (user_activity_retention)",
    run=bench_retention,
    dag_id=DAG_IDS["retention"],
    dag_on_data=dag_on_data,
)
