"""Schedules settable without a code change: environment settings read when a DAG file is parsed.

``PIN_<DAG_ID>_SCHEDULE`` (a five-field cron expression) for every scheduled DAG and
``PIN_USER_ACTIVITY_RETENTION_TIMEZONE`` (an IANA zone) for retention; unset or empty = the
default (docs/design.md, "Schedules"). A DAG's schedule is what the scheduler reads from the
serialized DAG, so the settings belong in the dag processor's environment; set the same values
on the workers, which parse the file again before each task.

The parsing is pure (``environ`` is a plain mapping) and does no I/O: no Variable, connection or
metadata lookup at parse time. A bad value raises :class:`ScheduleSettingError`, which makes the
DAG file an import error naming the setting and its value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pendulum
from croniter import croniter

from include.pin_maintenance.config import brief

PREFIX = "PIN_"
_FIXED_START = pendulum.datetime(2026, 1, 1, tz="UTC")


class ScheduleSettingError(ValueError):
    """A schedule setting that cannot be used; the message names the setting and its value."""


@dataclass(frozen=True)
class Schedule:
    """A cron expression and the zone it is read in."""

    cron: str
    timezone: str

    def timetable(self) -> Any:
        """The Airflow timetable (imported here: the rules above stay importable without it)."""
        from airflow.sdk import CronTriggerTimetable

        return CronTriggerTimetable(self.cron, timezone=pendulum.timezone(self.timezone))

    def describe(self) -> str:
        return f"{self.cron} {self.timezone}"


def schedule_variable(dag_id: str) -> str:
    """``news_snapshot_detach_retry`` -> ``PIN_NEWS_SNAPSHOT_DETACH_RETRY_SCHEDULE``."""
    return f"{PREFIX}{dag_id.upper()}_SCHEDULE"


def timezone_variable(dag_id: str) -> str:
    """``user_activity_retention`` -> ``PIN_USER_ACTIVITY_RETENTION_TIMEZONE``."""
    return f"{PREFIX}{dag_id.upper()}_TIMEZONE"


def parse_cron(name: str, value: str) -> str:
    """A five-field cron expression (minute hour day-of-month month day-of-week), normalized."""
    fields = value.split()
    if len(fields) == 6:
        raise ScheduleSettingError(
            f"{name}={brief(value)}: six fields; Airflow's cron has five (minute hour day month "
            f"weekday), drop the leading seconds field, e.g. {brief(' '.join(fields[1:]))}"
        )
    if len(fields) != 5:
        raise ScheduleSettingError(
            f"{name}={brief(value)}: not a cron expression of five fields (minute hour day month "
            "weekday), e.g. '*/5 * * * *'"
        )
    cron = " ".join(fields)
    try:
        # one next time from a fixed point: an expression that never fires ("0 3 31 2 *")
        # fails here too, not only one that does not parse
        croniter(cron, _FIXED_START).get_next()
    except (ValueError, KeyError) as exc:  # croniter's errors are ValueError subclasses
        raise ScheduleSettingError(
            f"{name}={brief(value)}: not a valid cron expression ({brief(str(exc))})"
        ) from None
    return cron


def parse_timezone(name: str, value: str) -> str:
    """An IANA timezone name (``Europe/Moscow``, ``UTC``), as pendulum knows it."""
    try:
        return pendulum.timezone(value.strip()).name
    except Exception:  # pendulum raises its own InvalidTimezone (or ValueError for "")
        raise ScheduleSettingError(
            f"{name}={brief(value)}: not an IANA timezone name, e.g. 'Europe/Moscow' or 'UTC'"
        ) from None


def _setting(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    return value if value is not None and value.strip() else None


def dag_schedule(
    dag_id: str,
    default_cron: str,
    default_timezone: str,
    *,
    timezone_settable: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Schedule:
    """The DAG's schedule: the defaults, overridden by the environment settings.

    ``timezone_settable`` says whether ``PIN_<DAG_ID>_TIMEZONE`` is read at all (the UTC jobs
    keep UTC, as their seeds say; a set but unread zone is refused rather than ignored).
    """
    env = os.environ if environ is None else environ
    cron_name, tz_name = schedule_variable(dag_id), timezone_variable(dag_id)
    raw_cron = _setting(env, cron_name)
    cron = parse_cron(cron_name, raw_cron) if raw_cron else default_cron
    raw_tz = _setting(env, tz_name)
    if raw_tz and not timezone_settable:
        raise ScheduleSettingError(
            f"{tz_name}={brief(raw_tz)}: {dag_id} runs in {default_timezone} and has no timezone "
            f"setting; unset {tz_name}"
        )
    timezone = parse_timezone(tz_name, raw_tz) if raw_tz else default_timezone
    return Schedule(cron, timezone)
