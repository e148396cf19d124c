"""ops/alertmanager/alertmanager.yml: one page per event with both alert paths on.

Structure always; ``amtool check-config`` when Debian's ``prometheus-alertmanager`` is installed.
The behaviour with a real Alertmanager (one quarantine, one notification; a second quarantine
pages again) is proven in tests/e2e/test_alert_chain.py with this file loaded as shipped, its
timings scaled down (tests/e2e/chain_fixtures.py, TEST_TIMINGS): the shipped timings are
checked here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pin_maintenance_plugin import notify

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "ops" / "alertmanager" / "alertmanager.yml"
RULES = REPO / "ops" / "prometheus" / "alerts.yml"
ENSURE = REPO / "devtools" / "ensure_system_packages.sh"


def config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def test_one_receiver_takes_every_alert_grouped_by_name_and_dag() -> None:
    route = config()["route"]
    assert route["receiver"] == "pin-pager"
    assert route["group_by"] == ["alertname", "dag_id"]
    # a page waits 30 s for the rest of its group; a later event of the group pages at most
    # 2 min after the last page; an unresolved one is repeated twice a day
    assert (route["group_wait"], route["group_interval"], route["repeat_interval"]) == (
        "30s",
        "2m",
        "12h",
    )
    assert "routes" not in route  # nothing routed away from the pager
    assert [r["name"] for r in config()["receivers"]] == ["pin-pager"]


def test_the_detail_alert_of_an_event_inhibits_the_others_of_that_event() -> None:
    [rule] = config()["inhibit_rules"]
    assert rule["source_matchers"] == ['pin_detail="true"', 'pin_event=~".+"']
    assert rule["target_matchers"] == ['pin_detail!="true"', 'pin_event=~".+"']
    assert rule["equal"] == ["pin_event", "dag_id"]


def test_every_rule_that_names_an_event_has_its_task_alert() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    paired = {r["alert"]: r["labels"]["pin_event"] for r in rules if "pin_event" in r["labels"]}
    assert paired == {
        "NewsSnapshotDetachQuarantined": "snapshot_detach_quarantined",
        "CalendarSlotExpirationErrors": "slot_expiration_poison_row",
        "NewsSnapshotDetachLockHeldTooLong": "lock_held_too_long",
        "ActivityRetentionLockHeldTooLong": "lock_held_too_long",
    }
    assert set(paired.values()) <= set(notify.EVENTS)
    assert not any("pin_detail" in r["labels"] for r in rules)  # rules are never the source


def amtool() -> str:
    if shutil.which("amtool") is None and ENSURE.exists():
        subprocess.run(
            ["bash", str(ENSURE), "prometheus-alertmanager:amtool"],
            capture_output=True,
            check=False,
        )
    path = shutil.which("amtool")
    if path is None:
        pytest.skip(
            "amtool not installed and not installable here (Debian: apt-get install "
            "prometheus-alertmanager, as root); structural checks above still ran"
        )
    return path


def test_amtool_check_config() -> None:
    done = subprocess.run(
        [amtool(), "check-config", str(CONFIG)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
