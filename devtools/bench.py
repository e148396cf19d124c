"""Benchmarks: each job's real code path against the physical limit of the same data.

    python -m devtools.bench            # default sizes (~10 min), writes docs/benchmarks.md
    python -m devtools.bench --full     # adds 1M eligible retention sessions (slow)
    python -m devtools.bench --smoke    # tiny sizes, .local/bench/benchmarks-smoke.md
                                        # (without neighbours: `--smoke --only neighbours`)
    python -m devtools.bench --only slots detach --runs 5 --out /tmp/b.md
    python -m devtools.bench --only neighbours --neighbour-configs '[{}, {"runners": 1}]'

What is measured (docs/benchmarks.md explains how to read it):

- Each job through its job function ``include.pin_maintenance.jobs.<job>.run(...)``, exactly as
  the DAG task calls it but with ``RecordingMetrics`` / ``LogOnlyAlerts``, in a fresh Python
  subprocess: its time inside ``run()`` and the peak RSS of that process (``wait4`` rusage).
- Against the same data in the same run, the physical limit: one set-based statement chain in
  one transaction (retention, slots) or the selections service's own capacity at the job's
  concurrency (detach). Every timed run starts from an identical copy of the dataset (a
  template database cloned with ``CREATE DATABASE ... TEMPLATE``) and runs alternate job/limit.
- The neighbours (``devtools.bench_neighbours``): what a drain through ``airflow dags test``
  costs the services' own traffic (the real ``pgbench``, open loop) on the same primary and
  a streaming replica of it, both servers its own (``devtools.pg_cluster``).
- Once per job the DAG through ``airflow dags test`` (docs/design.md, "Running a
  DAG the standard way"), the
  fixed Airflow overhead of a run on an empty dataset, and the parse time of every DAG file.

The server is the embedded Postgres in ``.local/bench-pg`` (started and stopped here) unless
``PIN_PG_URL`` names one; every database the bench creates is named ``pin_bench_<pid>_*`` and
dropped at the end. Each section lives in its own module (``devtools.bench_<section>``; the
shared machinery in ``devtools.bench_core``); ``REGISTRY`` below lists them in report order.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from devtools import (
    bench_airflow,
    bench_detach,
    bench_neighbours,
    bench_retention,
    bench_slots,
    bench_tracing,
    pg,
)
from devtools.bench_core import (
    BENCH_PGDATA,
    DAG_IDS,
    DEFAULT,
    DEFAULT_OUT,
    FULL,
    SMOKE,
    SMOKE_OUT,
    Bench,
    Plan,
    SectionSpec,
    _secs,
    job_child_main,
    md_table,
)
from devtools.bench_data import RETENTION_SHAPES

NOTES_MARKER = (
    "<!-- hand-written notes below this line are kept when the bench rewrites the file -->"
)

# The sections, in report order. A new one: its module's SectionSpec, one line here.
REGISTRY: tuple[SectionSpec, ...] = (
    bench_retention.SECTION,
    bench_slots.SECTION,
    bench_detach.SECTION,
    bench_detach.CAPACITY,
    bench_tracing.SECTION,
    bench_neighbours.SECTION,
    bench_airflow.PARSE,
    bench_airflow.AIRFLOW,
)
SECTIONS = tuple(spec.key for spec in REGISTRY)
TITLES = {spec.key: spec.title for spec in REGISTRY}
__all__ = [
    "DAG_IDS",
    "NOTES_MARKER",
    "REGISTRY",
    "SECTIONS",
    "TITLES",
    "default_sections",
    "main",
]

log = logging.getLogger("devtools.bench")

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


def default_sections(*, smoke: bool) -> tuple[str, ...]:
    """The sections a run without ``--only`` measures: all, or at smoke size those that
    fit the smoke run's time."""
    return tuple(spec.key for spec in REGISTRY if spec.in_smoke or not smoke)


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
    parser.add_argument(
        "--keep-workdir",
        action="store_true",
        help="keep the run's logs (pgbench's, airflow dags test's) in its temporary directory",
    )
    sizes = parser.add_argument_group("sizes (override the plan's)")
    sizes.add_argument("--retention", type=int, nargs="+", metavar="ELIGIBLE")
    sizes.add_argument(
        "--retention-shapes", nargs="+", choices=tuple(RETENTION_SHAPES), metavar="SHAPE"
    )
    sizes.add_argument("--slots", nargs="+", metavar="ROWS:DUE")
    sizes.add_argument("--empty-slots", type=int, nargs="+", metavar="ROWS")
    sizes.add_argument("--detach-rows", type=int)
    sizes.add_argument("--detach-seq-rows", type=int)
    neighbours = parser.add_argument_group("neighbours (the services' latency during a drain)")
    neighbours.add_argument("--neighbour-slots", metavar="ROWS:DUE")
    neighbours.add_argument("--neighbour-retention", type=int, metavar="ELIGIBLE")
    neighbours.add_argument("--neighbour-baseline", type=float, metavar="SECONDS")
    neighbours.add_argument(
        "--neighbour-alone",
        action="store_true",
        help="only the runs without traffic: the drain's rate and the replica's lag alone",
    )
    neighbours.add_argument(
        "--neighbour-configs",
        type=bench_neighbours.parse_configs,
        metavar="JSON",
        help="cases: a JSON list of config dicts over each job's base config (both jobs), or "
        '{"slots": [...], "retention": [...]}',
    )
    return parser.parse_args(argv)


def plan_for(args: argparse.Namespace) -> Plan:
    plan = SMOKE if args.smoke else FULL if args.full else DEFAULT
    changes: dict[str, object] = {}
    if args.retention:
        changes["retention"] = tuple(args.retention)
    if args.retention_shapes:
        changes["retention_shapes"] = tuple(args.retention_shapes)
    if args.slots:
        changes["slots"] = tuple(tuple(int(x) for x in pair.split(":")) for pair in args.slots)
    if args.empty_slots:
        changes["empty_slots"] = tuple(args.empty_slots)
    if args.detach_rows:
        changes["detach_rows"] = args.detach_rows
    if args.detach_seq_rows:
        changes["detach_seq_rows"] = args.detach_seq_rows
    if args.neighbour_slots:
        changes["neighbour_slots"] = tuple(int(x) for x in args.neighbour_slots.split(":"))
    if args.neighbour_retention:
        changes["neighbour_retention"] = args.neighbour_retention
    if args.neighbour_baseline:
        changes["neighbour_baseline_seconds"] = args.neighbour_baseline
    if args.neighbour_configs is not None:
        changes["neighbour_configs"] = args.neighbour_configs
    if args.neighbour_alone:
        changes["neighbour_alone"] = True
    if changes:
        plan = dataclasses.replace(plan, name=f"{plan.name} (custom sizes)", **changes)
    return plan


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["_job"]:
        return job_child_main(argv[1], bench_tracing.child_tracer)
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
    bench = Bench(plan, admin, workdir, args.runs, REGISTRY)
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
        for key in args.only or default_sections(smoke=args.smoke):
            section = Section(key, load_before=_loadavg())
            log.info("section %s (load %s)", key, section.load_before)
            t0 = time.perf_counter()
            try:
                REGISTRY[SECTIONS.index(key)].run(bench, section.lines)
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
        if args.keep_workdir:
            log.info("logs kept in %s", workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(report())
    print(f"\nwritten to {out}")
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
