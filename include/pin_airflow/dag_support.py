"""DAG-definition helpers: the params a job exposes and the defaults every DAG shares.

Imported at parse time, so nothing here does I/O.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pendulum

from include.pin_airflow.alerts import on_task_failed
from include.pin_maintenance.config import ConfigSpec, Setting

START_DATE = pendulum.datetime(2026, 1, 1, tz="UTC")

# Airflow retries are for infrastructure failures only (a lost connection, a killed worker);
# the jobs' own retry bookkeeping lives in the business tables.
DEFAULT_ARGS: dict[str, Any] = {
    "owner": "pin-platform",
    "retries": 1,
    "retry_delay": timedelta(seconds=30),
    # one task_failed alert once the retries are used up (include/pin_airflow/alerts.py)
    "on_failure_callback": on_task_failed,
}


def config_params(spec: ConfigSpec) -> dict[str, Any]:
    """One trigger param per config key, defaulting to None ("use the Variable or default").

    The JSON schema carries the same ranges as the config spec, so the UI and the REST API
    refuse an out-of-range value before a run is even created; the task validates again (the
    Variable layer and cross-key rules can only be checked at run time).
    """
    from airflow.sdk import Param

    return {s.name: Param(None, **_schema(s)) for s in spec.settings}


def _schema(setting: Setting) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": ["null", "integer" if setting.kind is int else "number"],
        "title": setting.name,
        "description": (
            f"{setting.help} Default {setting.default}; allowed {setting.allowed()}. "
            "Empty = the Variable's value or the default."
        ).strip(),
    }
    if setting.minimum is not None:
        key = "exclusiveMinimum" if setting.exclusive_minimum else "minimum"
        schema[key] = setting.minimum
    if setting.maximum is not None:
        schema["maximum"] = setting.maximum
    return schema


# What the trigger form and the REST API check before a run exists (jsonschema `pattern`):
# a canonical uuid, any case. The task normalizes and checks again (the CLI's --conf too).
UUID_PATTERN = "^[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$"
# Airflow's schema error quotes the refused value twice, in full (jsonschema's message and its
# "On instance" part): only strings up to this length are matched there; a longer one reaches
# the task, whose refusal quotes it cut short.
SCHEMA_CHECKED_CHARS = 64

# Shown under every dry_run switch of the trigger form. Airflow 3.3.2: a paused DAG's runs stay
# queued until it is unpaused; the dialog's "Unpause <dag> on trigger" (ticked by default) and
# any unpause make the scheduler start the latest missed tick at once (catchup=False), a real
# run ahead of the dry run. `airflow dags test` runs once in-process and ignores the pause.
DRY_RUN_HELP = (
    "Report what the run would change and change nothing. Paused DAG? Unpausing it (also "
    "'Unpause on trigger') first starts its latest scheduled tick as a real run; preview a "
    "paused DAG with: airflow dags test <dag_id> --conf '{\"dry_run\": true}'."
)


def flag_param(title: str, description: str) -> Any:
    """A false-by-default boolean param.

    ``null`` is in the type so the trigger form does not mark the switch "required" (it always
    has a value); the task reads None as false.
    """
    from airflow.sdk import Param

    return Param(False, type=["boolean", "null"], title=title, description=description)


def dry_run_param() -> Any:
    return flag_param("dry_run", DRY_RUN_HELP)


def uuid_list_param(title: str, description: str, *, max_items: int) -> Any:
    """An optional list of uuid strings; a short malformed id is refused before a run exists.

    The count (at most ``max_items``) is not in the schema: a ``maxItems`` error would print
    every id (4 MB for 100,000). The task checks it and names the count and the limit.
    """
    from airflow.sdk import Param

    return Param(
        None,
        type=["null", "array"],
        items={
            "type": "string",
            "if": {"maxLength": SCHEMA_CHECKED_CHARS},
            "then": {"pattern": UUID_PATTERN},
        },
        title=title,
        description=f"{description} At most {max_items} per run.",
    )
