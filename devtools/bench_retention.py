"""Retention benchmark: ``activity_retention.run()`` against one set-based delete chain."""

from __future__ import annotations

from devtools import bench_data as bd
from devtools import pg
from devtools.bench_core import (
    BIG_RETENTION,
    DAG_IDS,
    RETENTION_DAYS,
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


def retention_template(bench: Bench, eligible: int) -> tuple[pg.Database, bd.RetentionDataset]:
    ds = bd.retention_dataset(eligible)
    label = (
        f"retention: {ds.eligible:,} eligible + {ds.keep:,} young/Active sessions, "
        f"{ds.views_per_session} views + {ds.events_per_session} events each"
    )
    db = bench.dataset(label, ds.rows, ("ret", eligible), lambda url: bd.load_retention(url, ds))
    return db, ds


def bench_retention(bench: Bench, out: list[str]) -> None:
    rows = []
    for eligible in bench.plan.retention:
        template, ds = retention_template(bench, eligible)
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
        runs = bench.runs if eligible < BIG_RETENTION else 1
        for i in range(runs):
            for what in bench.alternate(i):
                db = bench.clone(template, "ret")
                try:
                    if what == "job":
                        run = bench.run_job("retention", db, config)
                        job.add(run.seconds)
                        rss.append(run.proc.maxrss_kb)
                        cpu.add(run.cpu)
                        batches.add(str(run.result.get("BatchesProcessed", "?")))
                        check_retention(bench, db, before, ds, run.result)
                    else:
                        limit.add(bench.timed_sql(db, RETENTION_LIMIT, {"days": RETENTION_DAYS}))
                        check_retention(bench, db, before, ds, None)
                finally:
                    bench.drop(db)
        bench.job_medians[("retention", str(eligible))] = job.median
        ratio = _ratio(limit.median, job.median)
        rows.append(
            [
                f"{ds.eligible:,}" + ("" if runs == bench.runs else f" ({runs} run)"),
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
    variables = {dag_id: {"max_batches_per_run": 50_000, "max_run_duration_seconds": 7200}}
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
