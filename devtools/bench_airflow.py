"""DAG parse time and the Airflow overhead (``airflow dags test`` per DAG, empty and on data)."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys

from devtools.bench_core import (
    REPO,
    Bench,
    BenchError,
    SectionSpec,
    Series,
    _mb,
    _rate,
    _secs,
    _verdict,
    md_table,
    measure_process,
)

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


def bench_parse(bench: Bench, out: list[str]) -> None:
    files = sorted(p for p in (REPO / "dags").glob("*.py") if p.name != "__init__.py")
    if not files:
        raise BenchError("no DAG files in dags/")
    env = {**os.environ, "PYTHONPATH": str(REPO), **bench.airflow_env_extra()}
    reference = bench.workdir / REFERENCE_DAG_NAME
    reference.write_text(REFERENCE_DAG, encoding="utf-8")
    files.append(reference)
    base, per_file = Series(), {p.name: Series() for p in files}
    for _ in range(bench.plan.parse_runs):
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
    dagbag = dagbag_stats(bench, env)
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
        f"{bench.plan.parse_runs} run(s). DagBag column: the duration "
        "`DagBag(dag_folder=dags/)` records for the file (one process, all files)."
    )
    out.append("")
    out.append(
        md_table(
            ["DAG file", "import after airflow.sdk", "DagBag", "goal < 0.2 s"],
            rows,
        )
    )


def dagbag_stats(bench: Bench, env: dict[str, str]) -> dict[str, str]:
    proc = measure_process([sys.executable, "-c", DAGBAG_PROBE, str(REPO / "dags")], env=env)
    if proc.returncode != 0:
        return {}
    try:
        stats = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}
    return {name: _secs(seconds) for name, seconds in stats.items()}


def bench_airflow(bench: Bench, out: list[str]) -> None:
    bench.airflow_home()
    empty = bench.empty_template()
    problems: list[str] = []
    overhead_rows = []
    for dag_id in bench.plan.overhead_dags:
        if not (REPO / "dags" / f"{dag_id}.py").exists():
            problems.append(f"no dags/{dag_id}.py")
            overhead_rows.append([f"`{dag_id}`", "no DAG file", ""])
            continue
        series, rss = Series(), []
        try:
            for _ in range(bench.plan.airflow_runs):
                db = bench.clone(empty, "af_empty")
                try:
                    proc = bench.dags_test(dag_id, db)
                finally:
                    bench.drop(db)
                series.add(proc.wall)
                rss.append(proc.maxrss_kb)
        except BenchError as exc:
            problems.append(str(exc))
            overhead_rows.append([f"`{dag_id}`", "failed", ""])
            continue
        bench.overhead[dag_id] = series
        overhead_rows.append([f"`{dag_id}`", series.fmt(), _mb(max(rss))])
    out.append(
        "Fixed cost of one run: `airflow dags test <dag_id>` (the standard way, SQLite "
        "metadata DB, AIRFLOW_CONN_* connections) on an empty dataset: CLI start, DAG "
        "parse, DagRun and task instances, the task process, the no-op job."
    )
    out.append("")
    out.append(md_table(["DAG", "wall (empty dataset)", "peak RSS"], overhead_rows))
    bench_dags_on_data(bench, out, problems)
    if problems:
        summary = "; ".join(dict.fromkeys(p.splitlines()[0] for p in problems))
        raise BenchError(summary + "\n\n" + "\n\n".join(problems))


def bench_dags_on_data(bench: Bench, out: list[str], problems: list[str]) -> None:
    """Once per job: the DAG on the job section's largest default dataset."""
    fixed = (
        statistics.median([s.median for s in bench.overhead.values()])
        if bench.overhead
        else math.nan
    )
    data_rows = []
    specs = {spec.key: spec for spec in bench.registry if spec.dag_on_data is not None}
    for job in bench.plan.dags_on_data:
        spec = specs[job]
        dag_id = spec.dag_id
        if not (REPO / "dags" / f"{dag_id}.py").exists():
            problems.append(f"no dags/{dag_id}.py")
            data_rows.append([f"`{dag_id}`", "no DAG file", *[""] * 6])
            continue
        try:
            run = spec.dag_on_data(bench)
            run.check()
        except BenchError as exc:
            problems.append(str(exc))
            data_rows.append([f"`{dag_id}`", "failed", *[""] * 6])
            continue
        fixed_dag = bench.overhead.get(dag_id, Series()).median
        if math.isnan(fixed_dag):
            fixed_dag = fixed
        data_rows.append(
            [
                f"`{dag_id}`",
                run.label,
                _secs(run.proc.wall),
                _secs(fixed_dag),
                _secs(run.proc.wall - fixed_dag),
                _secs(bench.job_medians.get(run.fn_key, math.nan)),
                _rate(run.rows, run.proc.wall),
                _mb(run.proc.maxrss_kb),
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


PARSE = SectionSpec(key="parse", title="DAG parse time", run=bench_parse)
AIRFLOW = SectionSpec(
    key="airflow",
    title="Airflow overhead (airflow dags test)",
    run=bench_airflow,
    in_smoke=False,  # an `airflow dags test` per DAG and per job's data: make bench-smoke
)
