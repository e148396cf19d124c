"""pin_maintenance_plugin.dags_test_fix: version gate, decoding, and the upgrade tripwire.

The module is the installed distribution's (scheduler_plugin/), as every Airflow process loads it.
"""

from __future__ import annotations

from collections.abc import Iterator

import airflow
import pytest

from include.pin_airflow.deadlines import deadline_alert
from pin_maintenance_plugin import dags_test_fix


@pytest.fixture
def fix() -> Iterator:
    """The module on an unpatched ``get_by_id`` (the entry-point plugin may have patched it in
    this process already), with whatever was there restored afterwards: no test sees another's
    patch, in any order."""
    from airflow.models.deadline_alert import DeadlineAlert as DeadlineAlertModel

    before = DeadlineAlertModel.__dict__["get_by_id"]
    if dags_test_fix.is_installed():
        DeadlineAlertModel.get_by_id = classmethod(before.__func__.__wrapped_original__)
    assert not dags_test_fix.is_installed()
    yield dags_test_fix
    DeadlineAlertModel.get_by_id = before


def test_tripwire_airflow_upgrade_means_recheck_upstream_fix(fix) -> None:
    assert airflow.__version__ == fix.LAST_AFFECTED_VERSION, (
        f"Airflow is now {airflow.__version__}. Check whether apache/airflow#73430 (fix for "
        "#73428, `airflow dags test` exits 1 with deadline=) is in this release: if it is, "
        "delete pin_maintenance_plugin/dags_test_fix.py (scheduler_plugin/) and its tests; "
        "if not, raise "
        "LAST_AFFECTED_VERSION there (tests/dags/test_deadline_dags_test_fix.py tells you which)."
    )


@pytest.mark.parametrize(
    ("version", "affected"),
    [
        ("3.0.6", False),  # no deadline alerts yet
        ("3.1.0", True),
        ("3.3.2", True),
        ("3.3.2rc1", True),
        ("3.3.3", False),
        ("3.4.0", False),
    ],
)
def test_version_gate(fix, version, affected) -> None:
    assert fix.is_affected(version) is affected


@pytest.mark.parametrize("wrapped", [False, True])
def test_encoded_alert_decodes_to_a_transient_model(fix, wrapped) -> None:
    from airflow.models.deadline_alert import DeadlineAlert as DeadlineAlertModel
    from airflow.serialization.definitions.deadline import SerializedReferenceModels
    from airflow.serialization.encoders import encode_deadline_alert
    from sqlalchemy import inspect

    encoded = encode_deadline_alert(deadline_alert("news_snapshot_detach_retry"))
    if wrapped:
        encoded = {"__type": "deadline_alert", "__var": encoded}
    model = fix.alert_from_encoded(DeadlineAlertModel, encoded)
    assert model.reference_class is SerializedReferenceModels.SerializedCustomReference
    assert model.reference_class in SerializedReferenceModels.TYPES.DAGRUN  # -> prune deadlines
    assert inspect(model).transient  # never written anywhere


def test_install_wraps_get_by_id_once_and_decodes_dicts(fix) -> None:
    from airflow.models.deadline_alert import DeadlineAlert as DeadlineAlertModel
    from airflow.serialization.encoders import encode_deadline_alert

    assert fix.install() is True
    wrapper = DeadlineAlertModel.__dict__["get_by_id"]
    assert fix.install() is True
    assert DeadlineAlertModel.__dict__["get_by_id"] is wrapper  # idempotent: no double wrap
    assert fix.is_installed()
    encoded = encode_deadline_alert(deadline_alert("user_activity_retention"))
    model = DeadlineAlertModel.get_by_id(encoded)  # no DB: a dict never reaches SQL
    assert model.reference["variable"] == "user_activity_retention_deadline_seconds"


def test_plugin_installs_the_fix_on_load_unless_switched_off(fix, monkeypatch) -> None:
    from pin_maintenance_plugin.plugin import FIX_SWITCH_ENV, PinMaintenancePlugin

    monkeypatch.setenv(FIX_SWITCH_ENV, "off")
    PinMaintenancePlugin.on_load()
    assert not fix.is_installed()
    monkeypatch.delenv(FIX_SWITCH_ENV)
    PinMaintenancePlugin.on_load()
    assert fix.is_installed()
