"""The ``AirflowPlugin`` of this distribution (``airflow.plugins`` entry point ``pin_maintenance``).

Every Airflow process that has this distribution installed loads it at start-up, whatever its
``[core] plugins_folder`` says:

- ``deadline_references`` registers :class:`~pin_maintenance_plugin.deadlines.
  QueuedAtPlusTunableInterval`. Airflow decodes a custom deadline reference only when a plugin
  lists its class (``find_registered_custom_deadline_reference`` in
  ``airflow/serialization/helpers.py``); without it the scheduler and ``airflow dags test`` fail
  to create a run of a DAG that uses it (``DeadlineReferenceNotRegistered``).
- ``on_load`` installs the apache/airflow#73428 workaround (:mod:`.dags_test_fix`) unless
  ``PIN_AIRFLOW_73428_FIX=off``.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.plugins_manager import AirflowPlugin

from pin_maintenance_plugin import dags_test_fix
from pin_maintenance_plugin.deadlines import QueuedAtPlusTunableInterval

FIX_SWITCH_ENV = "PIN_AIRFLOW_73428_FIX"


class PinMaintenancePlugin(AirflowPlugin):
    name = "pin_maintenance"
    deadline_references = [QueuedAtPlusTunableInterval]

    @classmethod
    def on_load(cls, *args: Any, **kwargs: Any) -> None:
        if os.environ.get(FIX_SWITCH_ENV, "on").strip().lower() in {"off", "0", "false"}:
            return
        dags_test_fix.install()
