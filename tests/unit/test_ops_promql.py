"""A small PromQL reader for the ops tests: which series does an expression use?

Not a parser: it removes strings, label matchers, grouping clauses, durations and template
variables, then takes the identifiers that are not PromQL functions/keywords.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

PROMQL_WORDS = {
    # aggregations, functions and keywords used in ops/
    "sum", "min", "max", "avg", "count", "by", "without", "on", "ignoring", "group_left",
    "group_right", "and", "or", "unless", "offset", "bool", "rate", "irate", "increase",
    "delta", "deriv", "histogram_quantile", "time", "absent", "clamp_min", "clamp_max",
    "min_over_time", "max_over_time", "avg_over_time", "vector", "scalar", "topk", "bottomk",
    "abs", "ceil", "floor", "round", "timestamp", "last_over_time", "absent_over_time",
    "present_over_time",
}  # fmt: skip


def promql_series(expr: str) -> set[str]:
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)  # grouping labels
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    text = re.sub(r"\$\w+", "", text)  # Grafana variables
    text = re.sub(r"\boffset\s+\w+", "", text)
    names = set(re.findall(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", text))
    return {n for n in names if n not in PROMQL_WORDS}


def known_series() -> set[str]:
    """The Prometheus series the mapping produces from ops/metrics.yml."""
    catalog = yaml.safe_load((REPO / "ops" / "metrics.yml").read_text())
    series: set[str] = set()
    for section in ("metrics", "airflow_metrics", "exporter_metrics"):
        for name, spec in catalog[section].items():
            if spec["type"] == "timing":  # a histogram
                series |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            else:
                series.add(name)
    return series


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("news_snapshot_detach_pending > 0", {"news_snapshot_detach_pending"}),
        (
            'sum(increase(a_count{dag_id="x", outcome="failed"}[7d])) >= 2',
            {"a_count"},
        ),
        (
            "histogram_quantile(0.99, sum by (le) (rate(a_bucket[$__rate_interval])))",
            {"a_bucket"},
        ),
        ("time() - b > 26 * 3600 or absent(b)", {"b"}),
        ("c > c offset 1d", {"c"}),
    ],
)
def test_promql_series(expr, expected) -> None:
    assert promql_series(expr) == expected


def test_known_series_has_histogram_parts() -> None:
    known = known_series()
    assert "news_snapshot_detach_lag_seconds_bucket" in known
    assert "news_snapshot_detach_lag_seconds" not in known  # a histogram has no bare series
    assert "news_snapshot_detach_pending" in known
