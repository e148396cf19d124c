"""The privilege check's pure part: the server's answers -> the shortfalls -> the words.

The queries and the grants themselves run against a real Postgres in
tests/integration/test_privileges.py.
"""

from __future__ import annotations

import pytest

from include.pin_maintenance import privileges as p
from include.pin_maintenance.jobs import (
    activity_retention,
    slot_expiration,
    snapshot_detach,
    snapshot_requeue,
)
from tests.job_db import JOB_CONN_IDS

LOCKS = p.row_locks(p.SESSIONS, "row locks of the batch claim")
DELETE = p.table("DELETE", p.SESSIONS, "the sessions delete step")
OUTCOMES = p.columns("UPDATE", p.OUTBOX, ("status", "last_error"), "the recorded outcomes")
SCHEMA = p.usage("news", "every statement on the outbox")
LOCK_FN = p.ADVISORY_LOCK


def test_every_job_has_its_requirements_and_a_connection() -> None:
    jobs = {snapshot_detach.JOB, snapshot_requeue.JOB, slot_expiration.JOB, activity_retention.JOB}
    assert set(p.REQUIREMENTS) == jobs == set(JOB_CONN_IDS)
    for job, reqs in p.REQUIREMENTS.items():
        assert reqs and len(set(reqs)) == len(reqs), job
        assert all(r.purpose for r in reqs), job


def test_retention_checks_every_delete_step_up_front() -> None:
    needs = {(r.kind, r.privilege, r.name) for r in p.REQUIREMENTS[activity_retention.JOB]}
    for table in (p.SESSIONS, p.VIEWS, p.EVENTS):
        assert ("table", "DELETE", table) in needs
        assert ("table", "SELECT", table) in needs
    assert ("any_column", "UPDATE", p.SESSIONS) in needs  # the claim's FOR UPDATE
    assert not any("property_object_view_stats" in name for _, _, name in needs)


def test_items_ask_once_per_column_and_once_for_anything_else() -> None:
    asked = p.items([SCHEMA, OUTCOMES, LOCKS, LOCK_FN])
    assert [(i.requirement, i.kind, i.schema, i.name, i.column) for i in asked] == [
        (0, "schema", "news", "news", ""),
        (1, "column", "news", "snapshot_detach_outbox", "status"),
        (1, "column", "news", "snapshot_detach_outbox", "last_error"),
        (2, "any_column", "user_activity", "sessions", ""),
        (3, "function", "pg_catalog", "pg_try_advisory_xact_lock(bigint)", ""),
    ]
    assert [i.privilege for i in asked] == [
        "USAGE",
        "UPDATE",
        "UPDATE",
        "UPDATE",
        "EXECUTE",
    ]


def test_shortfalls_keep_the_requirements_order_and_name_the_missing_columns() -> None:
    reqs = [SCHEMA, OUTCOMES, LOCKS, DELETE]
    answers = [True, True, False, False, True]  # last_error missing, no row locks, delete ok
    assert p.shortfalls(reqs, answers) == [
        p.Shortfall(OUTCOMES, columns=("last_error",)),
        p.Shortfall(LOCKS),
    ]
    assert p.shortfalls(reqs, [True] * 5) == []


def test_an_object_that_does_not_exist_is_a_shortfall_of_its_own() -> None:
    assert p.shortfalls([DELETE, OUTCOMES], [None, None, None]) == [
        p.Shortfall(DELETE, absent=True),
        p.Shortfall(OUTCOMES, absent=True),
    ]


def test_answers_that_do_not_match_the_questions_are_refused() -> None:
    with pytest.raises(ValueError, match="2 answers for 3 questions"):
        p.shortfalls([SCHEMA, OUTCOMES], [True, True])


@pytest.mark.parametrize(
    ("shortfall", "text"),
    [
        (
            p.Shortfall(LOCKS),
            "role pin_activity lacks UPDATE on user_activity.sessions (row locks of the batch "
            "claim: a row lock needs UPDATE on at least one column)",
        ),
        (
            p.Shortfall(DELETE),
            "role pin_activity lacks DELETE on user_activity.sessions (the sessions delete step)",
        ),
        (
            p.Shortfall(OUTCOMES, columns=("status", "last_error")),
            "role pin_activity lacks UPDATE on news.snapshot_detach_outbox columns status, "
            "last_error (the recorded outcomes)",
        ),
        (
            p.Shortfall(OUTCOMES, columns=("status",)),
            "role pin_activity lacks UPDATE on news.snapshot_detach_outbox column status "
            "(the recorded outcomes)",
        ),
        (
            p.Shortfall(SCHEMA),
            "role pin_activity lacks USAGE on schema news (every statement on the outbox)",
        ),
        (
            p.Shortfall(LOCK_FN),
            "role pin_activity lacks EXECUTE on function "
            "pg_catalog.pg_try_advisory_xact_lock(bigint) (the single-runner advisory lock)",
        ),
        (
            p.Shortfall(DELETE, absent=True),
            "table user_activity.sessions does not exist (the sessions delete step)",
        ),
        (
            p.Shortfall(SCHEMA, absent=True),
            "schema news does not exist (every statement on the outbox)",
        ),
    ],
    ids=[
        "row-locks",
        "table",
        "columns",
        "column",
        "schema",
        "function",
        "absent",
        "no-schema",
    ],
)
def test_each_shortfall_names_the_role_the_object_the_privilege_and_its_use(
    shortfall: p.Shortfall, text: str
) -> None:
    assert p.describe("pin_activity", shortfall) == text


def test_the_error_lists_every_shortfall_says_nothing_changed_and_how_to_fix() -> None:
    text = str(
        p.MissingPrivileges(
            "user_activity_retention", "pin_activity", [p.Shortfall(LOCKS), p.Shortfall(DELETE)]
        )
    )
    assert text == (
        "user_activity_retention: role pin_activity lacks UPDATE on user_activity.sessions "
        "(row locks of the batch claim: a row lock needs UPDATE on at least one column); "
        "role pin_activity lacks DELETE on user_activity.sessions (the sessions delete step). "
        "Nothing was changed: apply include/sql/schema/job_roles.sql to this database as the "
        'tables\' owner (docs/deploying.md, "Database roles")'
    )
    error = p.MissingPrivileges("user_activity_retention", "pin_activity", [p.Shortfall(DELETE)])
    assert (error.job, error.role, error.missing) == (
        "user_activity_retention",
        "pin_activity",
        (p.Shortfall(DELETE),),
    )
    assert error.alert_event == p.ALERT  # the task_failed that follows names it


def test_the_alert_says_configuration_and_names_what_is_missing() -> None:
    alert = p.MissingPrivileges(
        "calendar_slot_expiration", "pin_calendar", [p.Shortfall(DELETE)]
    ).alert()
    assert (alert.name, alert.severity) == ("database_privileges_missing", "critical")
    assert alert.summary == (
        "calendar_slot_expiration: role pin_calendar lacks 1 database privilege the job needs; "
        "a configuration problem, nothing was changed"
    )
    assert dict(alert.details) == {
        "problem": "configuration",
        "role": "pin_calendar",
        "missing": [p.describe("pin_calendar", p.Shortfall(DELETE))],
        "fix": "include/sql/schema/job_roles.sql",
    }
    two = p.MissingPrivileges("x", "r", [p.Shortfall(DELETE), p.Shortfall(LOCKS)]).alert()
    assert "lacks 2 database privileges" in two.summary


def test_the_airflow_glue_fails_a_refused_run_without_a_retry() -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from include.pin_airflow import runtime

    error = p.MissingPrivileges("calendar_slot_expiration", "pin_calendar", [p.Shortfall(DELETE)])
    refused = runtime.refuse_run(error)
    assert isinstance(refused, AirflowFailException)
    assert isinstance(refused, p.MissingPrivileges)
    assert str(refused) == str(error)
    assert (refused.job, refused.role, refused.missing) == (error.job, error.role, error.missing)
    other = RuntimeError("not a refusal")
    assert runtime.refuse_run(other) is other
