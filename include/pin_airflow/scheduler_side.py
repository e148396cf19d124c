"""The installed scheduler-side distribution, imported in one place with a clear error.

The DAGs and the task-side glue use ``pin_maintenance_plugin`` (scheduler_plugin/ of this
repository): the deadline mechanism and alert delivery. It is installed in the image (the
Dockerfile) and in ``.venv`` (the Makefile), never shipped in the bundle. A deployment that lacks
it, or carries an incompatible major version, fails at parse time with a message naming the
distribution, instead of a bare ``No module named ...``.
"""

from __future__ import annotations

DISTRIBUTION = "pin-maintenance-airflow-plugin"
# The major version of the distribution this bundle is written against. Bump both together
# when the plugin's interface (deadline_alert, Notifier) changes incompatibly.
REQUIRED_MAJOR = 1


class SchedulerSideMissingError(ImportError):
    """The scheduler-side distribution is not installed, or its major version does not fit."""


def _check_version(found: str) -> None:
    major = found.split(".", 1)[0]
    if major != str(REQUIRED_MAJOR):
        raise SchedulerSideMissingError(
            f"{DISTRIBUTION} {found} is installed, this bundle needs {REQUIRED_MAJOR}.x: "
            "rebuild the image (or `make venv`) from the bundle's scheduler_plugin/; "
            "see docs/deploying.md"
        )


try:
    import pin_maintenance_plugin
    from pin_maintenance_plugin import deadlines, notify
except ModuleNotFoundError as exc:
    if exc.name is None or not exc.name.startswith("pin_maintenance_plugin"):
        raise
    raise SchedulerSideMissingError(
        f"{DISTRIBUTION} is not installed in this Airflow environment (no module "
        f"{exc.name!r}): install scheduler_plugin/ of this repository into the image of every "
        "Airflow component (the Dockerfile does; `make venv` does for .venv); "
        "see docs/deploying.md"
    ) from None

_check_version(pin_maintenance_plugin.__version__)

__all__ = ["DISTRIBUTION", "SchedulerSideMissingError", "deadlines", "notify"]
