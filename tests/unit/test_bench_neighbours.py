"""The neighbour bench's readings (pure): its cases, the job's window, pgbench's logs."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from devtools.bench_neighbours import (
    BASELINE_OUTLIER,
    JOBS,
    UNPACED,
    Case,
    Latency,
    RunResult,
    Transaction,
    Window,
    _report,
    case_verdict,
    job_window,
    latency_in,
    parse_configs,
    percentile,
    read_pgbench_logs,
    typical_baseline_p99,
)
from devtools.bench_neighbours import _alone_against_unpaced as alone_against_unpaced

SLOT_LOG = """\
2026-12-03T09:35:18.101000Z [info     ] Filling up the DagBag [airflow.models.dagbag.DagBag]
2026-12-03T09:35:56.944345Z [info     ] event=job_started job=calendar_slot_expiration \
run_id=manual__x batch_size=2000 [pin_maintenance.calendar_slot_expiration] loc=telemetry.py:110
2026-12-03T09:35:57.079122Z [info     ] event=batch_selected job=calendar_slot_expiration \
run_id=manual__x batch_index=1 runner=1 count=2000 [pin_maintenance.calendar_slot_expiration]
2026-12-03T09:35:58.500000Z [info     ] event=job_completed job=calendar_slot_expiration \
run_id=manual__x expired_count=2000 [pin_maintenance.calendar_slot_expiration]
2026-12-03T09:35:59.000000Z [info     ] event=job_completed job=other_dag run_id=y
"""


def test_a_list_of_configs_is_the_cases_of_both_jobs():
    assert parse_configs('[{}, {"runners": 1}]') == {
        "slots": ({}, {"runners": 1}),
        "retention": ({}, {"runners": 1}),
    }


def test_configs_per_job_by_key_or_dag_id():
    cases = parse_configs('{"calendar_slot_expiration": [{"batch_size": 500}], "retention": []}')
    assert cases == {"slots": ({"batch_size": 500},), "retention": ()}


@pytest.mark.parametrize(
    "text", ['{"detach": [{}]}', '{"slots": {"runners": 1}}', '"runners"', "[1]"]
)
def test_configs_that_name_no_job_or_no_list_of_objects_are_refused(text):
    with pytest.raises(ValueError, match="--neighbour-configs"):
        parse_configs(text)


def test_the_window_runs_from_the_jobs_start_line_to_its_end_line():
    window = job_window(SLOT_LOG, JOBS["slots"])
    assert window.seconds == pytest.approx(58.5 - 56.944345)


def test_a_log_without_the_end_line_is_an_error():
    cut = SLOT_LOG.split("2026-12-03T09:35:58.5", maxsplit=1)[0]
    with pytest.raises(RuntimeError, match="event=job_completed"):
        job_window(cut, JOBS["slots"])


def test_pgbench_logs_give_schedule_time_and_latency_and_drop_a_cut_line(tmp_path: Path):
    # time 2000 us + schedule lag 500 us, completed at 100.010000
    (tmp_path / "pgbench_run1.42").write_text("0 1 2000 0 100 10000 500\n1 1 10")
    (tmp_path / "pgbench_run1.42.1").write_text("2 1 1000 1 101 0 0\n")
    (tmp_path / "pgbench_run1.out").write_text("pgbench (18.4)\n")
    (tmp_path / "pgbench_run10.7").write_text("0 1 9 0 1 0 0\n")  # another run's log
    txs = sorted(read_pgbench_logs(tmp_path, "pgbench_run1"), key=lambda t: t.scheduled)
    assert [t.latency_ms for t in txs] == [2.5, 1.0]
    assert txs[0].scheduled == pytest.approx(100.0075)
    assert txs[1].scheduled == pytest.approx(100.999)


def test_percentiles_interpolate_and_latency_counts_only_the_window():
    assert percentile([1, 2, 3, 4], 0.5) == 2.5
    assert math.isnan(percentile([], 0.99))
    txs = [Transaction(float(t), float(t)) for t in range(100)]
    inside = latency_in(txs, Window(10, 20))
    assert (inside.count, inside.p50, inside.tps) == (10, 14.5, 1.0)
    with pytest.raises(RuntimeError, match="no pgbench transaction"):
        latency_in(txs, Window(200, 300))


class Alone:
    """A run with nobody there, as the speed comparison reads it."""

    def __init__(self, rate: float) -> None:
        self.rate = rate


def test_a_paced_case_alone_is_compared_with_the_unpaced_case_of_its_job_round_by_round():
    slots, retention = JOBS["slots"], JOBS["retention"]
    unpaced = Case(slots, dict(UNPACED), alone=[Alone(100.0), Alone(50.0), Alone(80.0)])
    paced = Case(slots, {}, alone=[Alone(90.0), Alone(45.0), Alone(40.0)])
    other_job = Case(retention, dict(UNPACED), alone=[Alone(1.0)] * 3)
    cases = [paced, other_job, unpaced]
    # per round 0.9, 0.9, 0.5: the median, then the range
    assert alone_against_unpaced(paced, cases) == "0.9x (0.5x .. 0.9x)"
    assert alone_against_unpaced(unpaced, cases) == "-"  # not against itself
    assert alone_against_unpaced(Case(retention, {}, alone=[Alone(2.0)]), [paced]) == "-"


def _loaded(baseline_p99: float, job_p99: float, behind: float = 0.05) -> RunResult:
    return RunResult(
        traffic=True,
        rows=1000,
        window=Window(0.0, 10.0),
        behind_seconds=behind,
        behind_bytes=1024.0,
        sample_gap=0.25,
        cpu_busy=0.5,
        job=Latency(3000, 1.0, 2.0, job_p99, 300.0),
        baseline=Latency(3000, 0.9, 1.3, baseline_p99, 300.0),
    )


def _alone(behind_seconds: float = 0.1) -> RunResult:
    return RunResult(False, 1000, Window(0.0, 1.0), behind_seconds, 1024.0, 0.25, 0.9)


def test_the_replica_bound_holds_alone_too_unless_the_case_turns_the_hold_off():
    slots = JOBS["slots"]
    loaded = [_loaded(1.8, 4.7)]
    assert case_verdict(Case(slots, {}, alone=[_alone(1.9)], loaded=loaded), 1.8) == "met"
    assert case_verdict(Case(slots, {}, alone=[_alone(2.1)], loaded=loaded), 1.8) == "**missed**"
    # the bench's alone-only runs (--neighbour-alone): judged by the replica alone
    assert case_verdict(Case(slots, {}, alone=[_alone(1.9)]), math.nan) == "met"
    assert case_verdict(Case(slots, {}, alone=[_alone(5.1)]), math.nan) == "**missed**"
    unheld = Case(slots, {"max_replica_lag_seconds": 0}, alone=[_alone(5.1)], loaded=loaded)
    assert case_verdict(unheld, 1.8) == "met"


def test_a_case_with_an_outlier_baseline_gets_no_verdict():
    slots, retention = JOBS["slots"], JOBS["retention"]
    # the unpaced slot drain of 2026-12-05: two of three baselines met a commit stall, so its
    # ratio read 0.6x and the goal "met"
    stalled = Case(slots, dict(UNPACED), loaded=[_loaded(33.3, 20.0), _loaded(80.9, 17.8),
                                                 _loaded(1.9, 20.1)])  # fmt: skip
    paced = Case(slots, {}, loaded=[_loaded(1.8, 4.7), _loaded(1.7, 4.3), _loaded(1.9, 4.7)])
    missed = Case(retention, {}, loaded=[_loaded(1.7, 33.3), _loaded(1.6, 30.1)])
    cases = [stalled, paced, missed]
    typical = typical_baseline_p99(cases)
    assert typical == pytest.approx(1.85)  # the median of the eight baselines
    assert case_verdict(stalled, typical) == BASELINE_OUTLIER
    assert case_verdict(paced, typical) == "met"
    assert case_verdict(missed, typical) == "**missed**"
    # up to 3x the median (5.55 ms) a baseline is not an outlier; above it, it is
    assert case_verdict(Case(slots, {}, loaded=[_loaded(5.5, 5.0)]), typical) == "met"
    assert case_verdict(Case(slots, {}, loaded=[_loaded(5.6, 5.0)]), typical) == BASELINE_OUTLIER
    # with nothing to compare against, the goal is judged as before
    assert case_verdict(Case(slots, {}), math.nan) == "**missed**"


def test_the_neighbour_table_prints_the_outlier_rule_and_no_verdict_for_the_outlier():
    slots = JOBS["slots"]
    stalled = Case(slots, dict(UNPACED), alone=[_alone()], loaded=[_loaded(50.0, 20.0)])
    paced = Case(slots, {}, alone=[_alone()], loaded=[_loaded(1.8, 4.7), _loaded(1.9, 4.6)])
    plan = SimpleNamespace(
        neighbour_slots=(600_000, 500_000), neighbour_retention=30_000,
        neighbour_baseline_seconds=15.0,
    )  # fmt: skip
    out: list[str] = []
    _report(SimpleNamespace(plan=plan, runs=2), [stalled, paced], "PostgreSQL 18", out)
    text = "\n".join(out)
    assert "exceeds 3x the median baseline p99" in text
    rows = [line for line in text.splitlines() if line.startswith("| `calendar_slot_expiration`")]
    verdicts = [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows[:2]]
    assert verdicts == [BASELINE_OUTLIER, "met"]
