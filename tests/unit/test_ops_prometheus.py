"""ops/prometheus/alerts.yml: structure (always) and promtool (when installed).

Every seed "Alerts" row has a rule (annotation ``seed_alert``), every rule has a severity and
a summary and a runbook that exists, and every series it reads is one the jobs emit.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.test_ops_promql import known_series, promql_series

REPO = Path(__file__).resolve().parents[2]
RULES_FILE = REPO / "ops" / "prometheus" / "alerts.yml"
RULES_TEST_FILES = [
    REPO / "ops" / "prometheus" / "alerts_test.yml",  # minute-scale rules
    REPO / "ops" / "prometheus" / "alerts_test_daily.yml",  # day-scale rules, 15 min evaluation
]

# The rows of the seeds' "Alerts" tables (000 detach, 002 slots, 003 retention).
SEED_ALERT_ROWS = {
    "000 pending growing",
    "000 oldest_age_seconds growing",
    "000 quarantined_total > 0",
    "000 failed_total / 5xx spike",
    "000 no successful run > 15 min",
    "002 no successful cycle > 30 min",
    "002 backlog > 5000 sustained",
    "002 errors_total rate > 0 sustained",
    "003 not run > 26 h",
    "003 eligible_backlog growing N days",
    "003 run error rate",
    "003 run_duration near max",
}
JOB_DAGS = {"news_snapshot_detach_retry", "calendar_slot_expiration", "user_activity_retention"}


def rules() -> list[dict]:
    doc = yaml.safe_load(RULES_FILE.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_every_seed_alert_row_has_a_rule() -> None:
    covered = {rule["annotations"]["seed_alert"] for rule in rules()}
    assert covered == SEED_ALERT_ROWS


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_rule_shape(rule) -> None:
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["labels"]["dag_id"] in JOB_DAGS
    assert rule["annotations"]["summary"].strip()
    runbook = rule["annotations"]["runbook_url"]
    assert runbook.startswith("docs/runbooks/") and runbook.endswith(".md")
    assert (REPO / runbook).is_file(), runbook


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_rule_reads_only_emitted_series(rule) -> None:
    used = promql_series(rule["expr"])
    assert used, rule["expr"]
    assert used <= known_series(), used - known_series()


def test_alert_names_are_unique() -> None:
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names))


def promtool() -> str:
    """promtool, installed from Debian's ``prometheus`` package when we may (root, apt-get)."""
    if shutil.which("promtool") is None:
        subprocess.run(
            ["bash", str(REPO / "devtools" / "ensure_system_packages.sh"), "prometheus:promtool"],
            capture_output=True,
            check=False,
        )
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool not installed and not installable here (Debian: apt-get install "
            "prometheus, as root); structural checks above still ran"
        )
    return path


def test_promtool_check_rules() -> None:
    done = subprocess.run(
        [promtool(), "check", "rules", str(RULES_FILE)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_rule_unit_tests() -> None:
    """ops/prometheus/alerts_test*.yml: each rule fires on a synthetic series, and not before."""
    done = subprocess.run(
        [promtool(), "test", "rules", *(f.name for f in RULES_TEST_FILES)],
        capture_output=True,
        text=True,
        check=False,
        cwd=RULES_TEST_FILES[0].parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_rule_unit_tests_cover_every_rule() -> None:
    tested = {
        case["alertname"]
        for path in RULES_TEST_FILES
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert tested == {rule["alert"] for rule in rules()}
