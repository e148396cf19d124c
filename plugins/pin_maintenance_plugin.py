"""Registers the project's custom deadline reference with Airflow (scheduler, dag-processor, API).

Airflow decodes a custom deadline reference only when an ``AirflowPlugin`` lists its class in
``deadline_references`` (see ``find_registered_custom_deadline_reference`` in
``airflow/serialization/helpers.py``).
Without this plugin the scheduler cannot create the DAGs' deadlines (see
``include/pin_airflow/deadlines.py`` for why the deadline is a custom reference).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from include.pin_airflow.deadlines import QueuedAtPlusTunableInterval


class PinMaintenancePlugin(AirflowPlugin):
    name = "pin_maintenance"
    deadline_references = [QueuedAtPlusTunableInterval]
