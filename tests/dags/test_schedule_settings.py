"""Schedules set through the environment at parse time (docs/design.md, "Schedules").

The DagBag parses the DAG files in this process, so ``monkeypatch.setenv`` is what the dag
processor's environment would be. A bad value is an import error of that file naming the
setting and its value; a good one changes the timetable; nothing else reads it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.dags

DAG_DIR = Path(__file__).resolve().parents[2] / "dags"


def _bag(dag_id: str):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAG_DIR / f"{dag_id}.py"))


@pytest.mark.parametrize(
    ("dag_id", "variable", "value", "says"),
    [
        (
            "news_snapshot_detach_retry",
            "PIN_NEWS_SNAPSHOT_DETACH_RETRY_SCHEDULE",
            "every 5 minutes",
            "not a cron expression of five fields",
        ),
        (
            "calendar_slot_expiration",
            "PIN_CALENDAR_SLOT_EXPIRATION_SCHEDULE",
            "0 24 * * *",
            "not a valid cron expression",
        ),
        (
            "user_activity_retention",
            "PIN_USER_ACTIVITY_RETENTION_SCHEDULE",
            "0 0 3 * * *",
            "drop the leading seconds field",
        ),
        (
            "user_activity_retention",
            "PIN_USER_ACTIVITY_RETENTION_TIMEZONE",
            "Europe/Moskva",
            "not an IANA timezone name",
        ),
    ],
)
def test_a_bad_setting_is_an_import_error_naming_it_and_its_value(
    monkeypatch: pytest.MonkeyPatch, dag_id: str, variable: str, value: str, says: str
) -> None:
    monkeypatch.setenv(variable, value)
    bag = _bag(dag_id)
    assert dag_id not in bag.dag_ids
    (error,) = bag.import_errors.values()
    assert f"ScheduleSettingError: {variable}={value!r}: " in error, error
    assert says in error, error


@pytest.mark.parametrize(
    ("dag_id", "environ", "cron", "timezone"),
    [
        ("news_snapshot_detach_retry", {}, "*/5 * * * *", "UTC"),
        ("calendar_slot_expiration", {}, "*/5 * * * *", "UTC"),
        ("user_activity_retention", {}, "0 3 * * *", "Europe/Moscow"),
        (
            "news_snapshot_detach_retry",
            {"PIN_NEWS_SNAPSHOT_DETACH_RETRY_SCHEDULE": "*/2 * * * *"},
            "*/2 * * * *",
            "UTC",
        ),
        (
            "calendar_slot_expiration",
            {"PIN_CALENDAR_SLOT_EXPIRATION_SCHEDULE": "*/10 * * * *"},
            "*/10 * * * *",
            "UTC",
        ),
        (
            "user_activity_retention",
            {
                "PIN_USER_ACTIVITY_RETENTION_SCHEDULE": "30 1 * * *",
                "PIN_USER_ACTIVITY_RETENTION_TIMEZONE": "UTC",
            },
            "30 1 * * *",
            "UTC",
        ),
    ],
)
def test_the_setting_is_the_schedule(
    monkeypatch: pytest.MonkeyPatch, dag_id: str, environ: dict, cron: str, timezone: str
) -> None:
    for name in (
        "PIN_NEWS_SNAPSHOT_DETACH_RETRY_SCHEDULE",
        "PIN_CALENDAR_SLOT_EXPIRATION_SCHEDULE",
        "PIN_USER_ACTIVITY_RETENTION_SCHEDULE",
        "PIN_USER_ACTIVITY_RETENTION_TIMEZONE",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    bag = _bag(dag_id)
    assert bag.import_errors == {}
    timetable = bag.dags[dag_id].timetable
    assert (timetable.expression, timetable.timezone.name) == (cron, timezone)
