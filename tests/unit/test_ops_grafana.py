"""ops/grafana/pin-maintenance.json: valid dashboard JSON whose queries use only known series."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.unit.test_ops_promql import known_series, promql_series

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((REPO / "ops" / "grafana" / "pin-maintenance.json").read_text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def test_dashboard_identity() -> None:
    assert DASHBOARD["uid"] == "pin-maintenance"
    assert DASHBOARD["title"]
    assert [v["name"] for v in DASHBOARD["templating"]["list"]] == ["datasource"]
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("panel", PANELS, ids=lambda p: f"{p['id']}-{p['title']}")
def test_panel_queries_use_known_series(panel) -> None:
    assert panel["datasource"]["uid"] == "${datasource}"
    assert panel["targets"]
    for target in panel["targets"]:
        used = promql_series(target["expr"])
        assert used, target["expr"]
        assert used <= known_series(), used - known_series()


def test_every_job_metric_is_on_the_dashboard() -> None:
    """Throughput, backlog, age, durations, errors, quarantines, lock contention: all shown."""
    used = {s for p in PANELS for t in p["targets"] for s in promql_series(t["expr"])}
    shown = {s.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for s in used}
    exporter_own = set(
        yaml.safe_load((REPO / "ops" / "metrics.yml").read_text())["exporter_metrics"]
    )
    catalog = {
        s.removesuffix("_bucket") for s in known_series() if not s.endswith(("_sum", "_count"))
    } - exporter_own
    assert catalog <= shown, catalog - shown


def test_panels_do_not_overlap() -> None:
    cells = set()
    for panel in DASHBOARD["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))
