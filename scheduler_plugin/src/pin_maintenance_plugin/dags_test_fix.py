"""Workaround for apache/airflow#73428: `airflow dags test` exits 1 for any DAG with `deadline=`.

DELETE THIS MODULE (its call in :mod:`.plugin`, tests/dags/test_deadline_dags_test_fix.py and
tests/unit/test_alerts_dags_test_fix.py) once the project runs an Airflow release that contains
apache/airflow#73430.

The bug (Airflow 3.3.2, read from its source): ``dag.test()`` runs on an in-memory
``deserialize(serialize(dag))`` copy whose ``deadline`` is the list of encoded alert dicts,
while the scheduler's copy (read from ``serialized_dag``) holds deadline-alert UUID strings.
When the run succeeds, ``DagRun.update_state`` calls
``DeadlineAlertModel.get_by_id(alert_id)`` for each entry of ``dag.deadline`` to decide whether
to prune the run's deadlines; with a dict it fails (``'dict' object has no attribute 'hex'``)
*after* the run was marked successful, and the CLI exits 1.

The fix here: ``get_by_id`` given a dict returns a transient (never added to a session)
``DeadlineAlertModel`` built from the encoded alert, which is all ``update_state`` needs
(``reference_class``). UUIDs and strings go to the original method unchanged, so the scheduler
path is untouched. It is installed only on Airflow versions up to :data:`LAST_AFFECTED_VERSION`;
a unit test fails when Airflow is upgraded past it, so someone re-checks the upstream fix.

Hook point: ``PinMaintenancePlugin.on_load`` (:mod:`.plugin`). ``airflow dags test`` loads
plugins (lazily) before the failing call: decoding the project's custom deadline reference at
DagRun creation needs the plugin registry, and the task run itself loads plugins;
tests/dags/test_deadline_dags_test_fix.py proves it on a DAG with a builtin reference too.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

LAST_AFFECTED_VERSION = "3.3.2"
_MARKER = "_pin_airflow_73428_fix"


def is_affected(version: str) -> bool:
    """Whether ``version`` of Airflow still has apache/airflow#73428 (3.1 introduced deadlines)."""
    from packaging.version import Version

    v = Version(version)
    return Version("3.1.0") <= Version(v.base_version) <= Version(LAST_AFFECTED_VERSION)


def alert_from_encoded(model: type, encoded: dict[str, Any]) -> Any:
    """A transient ``DeadlineAlertModel`` from an alert as the serialized DAG encodes it."""
    data = encoded.get("__var", encoded)
    return model(
        name=data.get("name"),
        reference=data["reference"],
        interval=data["interval"],
        callback_def=data["callback"],
    )


def install() -> bool:
    """Wrap ``DeadlineAlertModel.get_by_id`` (idempotent); True when the wrapper is in place."""
    import airflow
    from airflow.models.deadline_alert import DeadlineAlert as DeadlineAlertModel

    if not is_affected(airflow.__version__):
        log.info("apache/airflow#73428 fix not needed on Airflow %s", airflow.__version__)
        return False
    current = DeadlineAlertModel.get_by_id
    if getattr(current, _MARKER, False):
        return True
    original = current  # bound classmethod

    def get_by_id(cls, deadline_alert_id, *args, **kwargs):
        if isinstance(deadline_alert_id, dict):
            return alert_from_encoded(cls, deadline_alert_id)
        return original(deadline_alert_id, *args, **kwargs)

    setattr(get_by_id, _MARKER, True)
    get_by_id.__wrapped_original__ = original.__func__  # lets tests undo the patch
    get_by_id.__doc__ = original.__doc__
    wrapped = classmethod(get_by_id)
    DeadlineAlertModel.get_by_id = wrapped
    return True


def is_installed() -> bool:
    from airflow.models.deadline_alert import DeadlineAlert as DeadlineAlertModel

    return bool(getattr(DeadlineAlertModel.get_by_id, _MARKER, False))
