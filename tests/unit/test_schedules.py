"""Schedule settings read at parse time (include/pin_airflow/schedules.py), as tables."""

from __future__ import annotations

import pytest

from include.pin_airflow.schedules import (
    Schedule,
    ScheduleSettingError,
    dag_schedule,
    parse_cron,
    parse_timezone,
    schedule_variable,
    timezone_variable,
)

RETENTION = "user_activity_retention"
SLOTS = "calendar_slot_expiration"


@pytest.mark.parametrize(
    ("dag_id", "schedule", "timezone"),
    [
        (
            "news_snapshot_detach_retry",
            "PIN_NEWS_SNAPSHOT_DETACH_RETRY_SCHEDULE",
            "PIN_NEWS_SNAPSHOT_DETACH_RETRY_TIMEZONE",
        ),
        (SLOTS, "PIN_CALENDAR_SLOT_EXPIRATION_SCHEDULE", "PIN_CALENDAR_SLOT_EXPIRATION_TIMEZONE"),
        (RETENTION, "PIN_USER_ACTIVITY_RETENTION_SCHEDULE", "PIN_USER_ACTIVITY_RETENTION_TIMEZONE"),
    ],
)
def test_setting_names(dag_id: str, schedule: str, timezone: str) -> None:
    assert schedule_variable(dag_id) == schedule
    assert timezone_variable(dag_id) == timezone


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("*/5 * * * *", "*/5 * * * *"),
        ("*/2 * * * *", "*/2 * * * *"),
        ("  0   3 * *  *  ", "0 3 * * *"),  # normalized spacing
        ("30 2 * * MON-FRI", "30 2 * * MON-FRI"),
        ("0 3 1,15 * *", "0 3 1,15 * *"),
    ],
)
def test_valid_cron(value: str, expected: str) -> None:
    assert parse_cron("PIN_X_SCHEDULE", value) == expected


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0 0 3 * * *", "drop the leading seconds field, e.g. '0 3 * * *'"),  # the seed's form
        ("5m", "not a cron expression of five fields"),
        ("@daily", "not a cron expression of five fields"),
        ("* * * *", "not a cron expression of five fields"),
        ("61 * * * *", "not a valid cron expression"),
        ("0 25 * * *", "not a valid cron expression"),
        ("0 3 * * 8", "not a valid cron expression"),
        ("a b c d e", "not a valid cron expression"),
        ("0 3 31 2 *", "not a valid cron expression"),  # parses, never fires
    ],
)
def test_invalid_cron_names_the_setting_and_the_value(value: str, says: str) -> None:
    with pytest.raises(ScheduleSettingError) as err:
        parse_cron("PIN_X_SCHEDULE", value)
    assert str(err.value).startswith(f"PIN_X_SCHEDULE={value!r}: ")
    assert says in str(err.value)


@pytest.mark.parametrize(
    "value",
    ["0 3 * * " + "8," * 50_000 + "8", "x" * 100_000, "0 " * 50_000, "* * * * " + "9" * 100_000],
    ids=["long-list", "one-word", "many-fields", "long-field"],
)
def test_a_huge_cron_setting_is_refused_in_a_short_line(value: str) -> None:
    with pytest.raises(ScheduleSettingError) as err:
        parse_cron("PIN_X_SCHEDULE", value)
    assert str(err.value).startswith(f"PIN_X_SCHEDULE={value[:40]!r}... ({len(value)} characters)")
    assert len(str(err.value)) <= 400, len(str(err.value))


def test_a_huge_timezone_setting_is_refused_in_a_short_line() -> None:
    with pytest.raises(ScheduleSettingError) as err:
        parse_timezone("PIN_X_TIMEZONE", "Europe/" * 20_000)
    assert len(str(err.value)) <= 400 and "(140000 characters)" in str(err.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("Europe/Moscow", "Europe/Moscow"), ("UTC", "UTC"), (" Asia/Tokyo ", "Asia/Tokyo")],
)
def test_valid_timezone(value: str, expected: str) -> None:
    assert parse_timezone("PIN_X_TIMEZONE", value) == expected


@pytest.mark.parametrize("value", ["Mars/Olympus", "+03:00", "MSK+1", "Europe/"])
def test_invalid_timezone_names_the_setting_and_the_value(value: str) -> None:
    with pytest.raises(ScheduleSettingError, match=r"not an IANA timezone name") as err:
        parse_timezone("PIN_X_TIMEZONE", value)
    assert str(err.value).startswith(f"PIN_X_TIMEZONE={value!r}: ")


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, Schedule("0 3 * * *", "Europe/Moscow")),  # the defaults stay as they are
        ({"PIN_USER_ACTIVITY_RETENTION_SCHEDULE": ""}, Schedule("0 3 * * *", "Europe/Moscow")),
        ({"PIN_USER_ACTIVITY_RETENTION_TIMEZONE": "  "}, Schedule("0 3 * * *", "Europe/Moscow")),
        (
            {"PIN_USER_ACTIVITY_RETENTION_SCHEDULE": "30 1 * * *"},
            Schedule("30 1 * * *", "Europe/Moscow"),
        ),
        ({"PIN_USER_ACTIVITY_RETENTION_TIMEZONE": "UTC"}, Schedule("0 3 * * *", "UTC")),
        (
            {
                "PIN_USER_ACTIVITY_RETENTION_SCHEDULE": "0 2 * * 0",
                "PIN_USER_ACTIVITY_RETENTION_TIMEZONE": "Asia/Yekaterinburg",
            },
            Schedule("0 2 * * 0", "Asia/Yekaterinburg"),
        ),
        (
            {"PIN_CALENDAR_SLOT_EXPIRATION_SCHEDULE": "*/1 * * * *"},
            Schedule("0 3 * * *", "Europe/Moscow"),
        ),
    ],
)
def test_retention_schedule_from_the_environment(environ: dict, expected: Schedule) -> None:
    got = dag_schedule(
        RETENTION, "0 3 * * *", "Europe/Moscow", timezone_settable=True, environ=environ
    )
    assert got == expected


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, Schedule("*/5 * * * *", "UTC")),
        (
            {"PIN_CALENDAR_SLOT_EXPIRATION_SCHEDULE": "*/10 * * * *"},
            Schedule("*/10 * * * *", "UTC"),
        ),
    ],
)
def test_utc_job_schedule_from_the_environment(environ: dict, expected: Schedule) -> None:
    assert dag_schedule(SLOTS, "*/5 * * * *", "UTC", environ=environ) == expected


def test_a_timezone_for_a_utc_job_is_refused_not_ignored() -> None:
    environ = {"PIN_CALENDAR_SLOT_EXPIRATION_TIMEZONE": "Europe/Moscow"}
    with pytest.raises(ScheduleSettingError) as err:
        dag_schedule(SLOTS, "*/5 * * * *", "UTC", environ=environ)
    assert str(err.value).startswith("PIN_CALENDAR_SLOT_EXPIRATION_TIMEZONE='Europe/Moscow': ")


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        (
            {"PIN_USER_ACTIVITY_RETENTION_SCHEDULE": "0 0 3 * * *"},
            "PIN_USER_ACTIVITY_RETENTION_SCHEDULE='0 0 3 * * *'",
        ),
        (
            {"PIN_USER_ACTIVITY_RETENTION_TIMEZONE": "Moscow"},
            "PIN_USER_ACTIVITY_RETENTION_TIMEZONE='Moscow'",
        ),
    ],
)
def test_a_bad_value_is_refused_naming_it(environ: dict, named: str) -> None:
    with pytest.raises(ScheduleSettingError, match=f"^{named}: ".replace("*", r"\*")):
        dag_schedule(
            RETENTION, "0 3 * * *", "Europe/Moscow", timezone_settable=True, environ=environ
        )


def test_the_timetable_carries_cron_and_zone() -> None:
    timetable = Schedule("0 3 * * *", "Europe/Moscow").timetable()
    assert timetable.expression == "0 3 * * *"
    assert timetable.timezone.name == "Europe/Moscow"
