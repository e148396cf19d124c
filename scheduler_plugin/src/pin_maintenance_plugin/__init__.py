"""Scheduler-side part of the PIN maintenance DAG bundle (an installed distribution).

Airflow loads plugins and custom deadline references only from ``[core] plugins_folder`` or an
``airflow.plugins`` entry point, never from a DAG bundle, and a deadline callback runs in a
process that may not have the bundle on its path. What those processes need lives here:

- :mod:`.deadlines`: the deadline reference ``QueuedAtPlusTunableInterval`` and the deadline
  callback ``on_deadline_missed``;
- :mod:`.notify`: alert delivery (one greppable log line, the ``alerts_webhook`` POST), used by
  the deadline callback here and by the jobs' alerts in the bundle;
- :mod:`.dags_test_fix`: the apache/airflow#73428 workaround for ``airflow dags test``;
- :mod:`.plugin`: the ``AirflowPlugin`` registered through the entry point.

No job code: the jobs run from the bundle version of each run. Nothing here does I/O at import.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pin-maintenance-airflow-plugin")
except PackageNotFoundError:  # imported from a source tree that was not installed
    __version__ = "0+unknown"
