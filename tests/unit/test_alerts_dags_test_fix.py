"""plugins/airflow_73428_dags_test_fix.py: version gate, decoding, and the upgrade tripwire."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import airflow
import pytest

from include.pin_airflow.deadlines import deadline_alert

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "airflow_73428_dags_test_fix.py"


@pytest.fixture(scope="module")
def fix():
    spec = importlib.util.spec_from_file_location("airflow_73428_dags_test_fix", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tripwire_airflow_upgrade_means_recheck_upstream_fix(fix) -> None:
    assert airflow.__version__ == fix.LAST_AFFECTED_VERSION, (
        f"Airflow is now {airflow.__version__}. Check whether apache/airflow#73430 (fix for "
        "#73428, `airflow dags test` exits 1 with deadline=) is in this release: if it is, "
        "delete plugins/airflow_73428_dags_test_fix.py and its tests; if not, raise "
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


def test_plugin_class_installs_on_load(fix) -> None:
    assert fix.Airflow73428DagsTestFix.name == "airflow_73428_dags_test_fix"
    fix.Airflow73428DagsTestFix.on_load()
    assert fix.is_installed()
