"""Metrics reach StatsD from a task run by ``airflow dags test`` (``[metrics] statsd_on=True``).

A UDP listener on loopback plays the StatsD server (statsd_exporter in production). The fixture
DAG emits every metric of ops/metrics.yml through include.pin_airflow.runtime.StatsMetrics; each
must arrive as ``airflow.<name>`` with the StatsD type the mapping expects (``|c``, ``|g``,
``|ms``): none is dropped by Airflow's name validators, and none collides with Airflow's
MetricsRegistry of legacy names (which would emit it twice).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from devtools.pg import Database
from tests.e2e.loopback import UdpListener

pytestmark = pytest.mark.dags

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures_dags" / "metrics"
CATALOG = yaml.safe_load((REPO / "ops" / "metrics.yml").read_text())["metrics"]
STATSD_TYPE = {"counter": "c", "gauge": "g", "timing": "ms"}
NO_JOB_DB = Database(url="postgresql:///unused", name="unused")  # the fixture touches no DB


@pytest.fixture
def statsd() -> Iterator[UdpListener]:
    with UdpListener() as listener:
        yield listener


def emit_plan() -> list[list]:
    """Distinct values per metric: counters 1.., gauges 100.., timings 1.5 s."""
    plan = []
    for i, (name, spec) in enumerate(sorted(CATALOG.items()), start=1):
        value = {"counter": i, "gauge": 100 + i, "timing": 1.5}[spec["type"]]
        plan.append([name, spec["type"], value])
    return plan


def statsd_env(listener: UdpListener, **extra: str) -> dict[str, str]:
    return {"AIRFLOW__CORE__DAGS_FOLDER": str(FIXTURES), **listener.airflow_env(), **extra}


def ours(lines: list[str]) -> dict[str, list[tuple[float, str]]]:
    """Our datagrams by metric name: {"news_snapshot_detach_pending": [(101.0, "g")], ...}."""
    found: dict[str, list[tuple[float, str]]] = {}
    for line in lines:
        name, _, rest = line.partition(":")
        name = name.removeprefix("airflow.")
        if name in CATALOG:
            value, _, kind = rest.partition("|")
            found.setdefault(name, []).append((float(value), kind))
    return found


def expected(plan: list[list]) -> dict[str, list[tuple[float, str]]]:
    """StatsD timings are milliseconds (statsd_exporter's mapping turns them into seconds)."""
    out = {}
    for name, kind, value in plan:
        shown = float(value) * 1000 if kind == "timing" else float(value)
        out[name] = [(shown, STATSD_TYPE[kind])]
    return out


def test_every_metric_arrives_once_with_prefix_and_type(run_dag, statsd) -> None:
    plan = emit_plan()
    done = run_dag(
        "pin_fixture_metrics", NO_JOB_DB, conf={"emit": plan}, extra_env=statsd_env(statsd)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert ours(statsd.lines) == expected(plan)
    assert all(line.startswith("airflow.") for line in statsd.lines if ":" in line), (
        "statsd_prefix applies to every name"
    )
    # (Airflow's own airflow.dagrun.duration.<outcome>.<dag_id> is sent by the scheduler, not by
    # `airflow dags test`: tests/e2e/test_deadline_alerts.py checks it arrives.)


def test_metrics_allow_list_must_name_our_prefixes(run_dag, statsd) -> None:
    """Operators who set ``metrics_allow_list`` must add our three prefixes (docs in mapping)."""
    plan = emit_plan()
    allow = "news_snapshot_detach,calendar_slot_expiration,activity_retention"
    done = run_dag(
        "pin_fixture_metrics",
        NO_JOB_DB,
        conf={"emit": plan},
        extra_env=statsd_env(statsd, AIRFLOW__METRICS__METRICS_ALLOW_LIST=allow),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert ours(statsd.lines) == expected(plan)
    others = [
        line
        for line in statsd.lines
        if line.partition(":")[0].removeprefix("airflow.") not in CATALOG
    ]
    assert all(
        line.removeprefix("airflow.").startswith(tuple(allow.split(","))) for line in others
    ), others[:5]
