"""Pure rules of the detach retry job: Retry-After, config, requeue (the answer table:
test_snapshot_detach_answers.py)."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from include.pin_maintenance.config import ConfigError
from include.pin_maintenance.jobs.snapshot_detach import CONFIG
from include.pin_maintenance.jobs.snapshot_detach_http import parse_retry_after
from include.pin_maintenance.jobs.snapshot_requeue import RequeueRequestError, parse_choice


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("", None),
        ("120", 120.0),
        (" 7 ", 7.0),
        ("-5", 0.0),
        ("nonsense", None),
        ("999999999", 86400.0),  # bounded to a day
    ],
)
def test_parse_retry_after_seconds(header, expected):
    assert parse_retry_after(header) == expected


def test_parse_retry_after_http_date():
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    later = (now + timedelta(minutes=5)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert parse_retry_after(later, now) == pytest.approx(300)


def test_config_defaults_match_design():
    assert dataclasses.asdict(CONFIG.resolve(None, None)) == {
        "batch_size": 100,
        "max_run_duration_seconds": 240,
        "max_attempts": 12,
        "backoff_base_seconds": 60,
        "backoff_factor": 2.0,
        "backoff_cap_seconds": 1800,
        "detach_call_timeout_seconds": 5,
        "lock_ttl_seconds": 360,
        "detach_concurrency": 32,
        "detach_concurrency_min": 1,
        "breaker_failure_threshold": 5,
        "misroute_quarantine_limit": 5,
    }


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 10_001}, "batch_size"),
        ({"max_run_duration_seconds": 0}, "max_run_duration_seconds"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"backoff_base_seconds": 0}, "backoff_base_seconds"),
        ({"backoff_factor": 0.5}, "backoff_factor"),
        ({"backoff_cap_seconds": 30}, "backoff_cap_seconds"),  # < base 60
        ({"detach_call_timeout_seconds": 0}, "detach_call_timeout_seconds"),
        ({"lock_ttl_seconds": 240}, "lock_ttl_seconds"),  # not > max run duration
        ({"detach_concurrency": 0}, "detach_concurrency"),
        ({"detach_concurrency": 65}, "detach_concurrency"),
        ({"detach_concurrency_min": 0}, "detach_concurrency_min"),
        ({"breaker_failure_threshold": 0}, "breaker_failure_threshold"),
        ({"breaker_failure_threshold": 1001}, "breaker_failure_threshold"),
    ],
)
def test_invalid_config_names_the_key(params, key):
    with pytest.raises(ConfigError, match=key):
        CONFIG.resolve(None, params)


def test_concurrency_min_above_max_names_both_and_the_range():
    with pytest.raises(ConfigError) as err:
        CONFIG.resolve('{"detach_concurrency": 4}', {"detach_concurrency_min": 6})
    message = str(err.value)
    assert "detach_concurrency_min = 6 (from trigger params)" in message
    assert "allowed: <= detach_concurrency (4)" in message


def test_breaker_threshold_message_names_value_and_range():
    with pytest.raises(ConfigError) as err:
        CONFIG.resolve(None, {"breaker_failure_threshold": 0})
    assert "breaker_failure_threshold = 0 (from trigger params) is out of range" in str(err.value)
    assert "allowed: integer 1..1000" in str(err.value)


SID = "0b5c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3"


def test_requeue_choice_by_ids_normalizes_and_dedupes():
    choice = parse_choice([SID.upper(), SID], None)
    assert choice.snapshot_ids == (SID,)
    assert not choice.all_quarantined


def test_requeue_choice_accepts_a_pasted_string():
    other = "1b5c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3"
    assert parse_choice(f"{SID}, {other}\n", False).snapshot_ids == (SID, other)


def test_requeue_choice_all():
    assert parse_choice(None, True).all_quarantined
    assert parse_choice([], True).all_quarantined


@pytest.mark.parametrize(
    ("ids", "all_q", "message"),
    [
        (None, False, "nothing chosen"),
        ([], None, "nothing chosen"),
        ("", False, "nothing chosen"),
        ([SID], True, "not both"),
        ([SID, "not-a-uuid"], False, r"'not-a-uuid' \(id 2 of 2, from trigger params\) is not"),
        ([123], False, r"123 \(id 1 of 1, from trigger params\) is not a valid uuid"),
        ({"a": 1}, False, "not valid"),
        (None, "yes", "all_quarantined"),
    ],
)
def test_requeue_choice_refusals(ids, all_q, message):
    with pytest.raises(RequeueRequestError, match=message):
        parse_choice(ids, all_q)


def test_requeue_refusal_of_both_choices_names_where_they_came_from():
    with pytest.raises(RequeueRequestError) as err:
        parse_choice([SID], True)
    assert str(err.value) == (
        "give either snapshot_ids or all_quarantined: true, not both (got 1 snapshot id(s) "
        "and all_quarantined = true from trigger params); nothing was changed"
    )
    with pytest.raises(RequeueRequestError, match="from --config"):
        parse_choice([SID], True, source="--config")


def _hundred_thousand_ids() -> list[str]:
    return [str(uuid.UUID(int=n)) for n in range(100_000)]


@pytest.mark.parametrize(
    ("ids", "all_q", "says"),
    [
        (
            _hundred_thousand_ids(),
            False,
            "snapshot_ids has 100000 ids (from trigger params); allowed at most 10000 per run",
        ),
        (" ".join(_hundred_thousand_ids()), None, "snapshot_ids has 100000 ids"),
        (_hundred_thousand_ids(), True, "got 100000 snapshot id(s) and all_quarantined"),
        (
            [SID, "z" * 100_000],
            False,
            f"snapshot_ids: {'z' * 40!r}... (100000 characters) (id 2 of 2, from trigger params)",
        ),
        ({"k": "v" * 100_000}, False, "snapshot_ids = an object of 1 key (from trigger params)"),
        (None, "y" * 100_000, f"all_quarantined = {'y' * 40!r}... (100000 characters)"),
    ],
    ids=["100k-ids", "100k-ids-pasted", "100k-ids-and-all", "long-id", "object", "long-flag"],
)
def test_requeue_refuses_a_huge_choice_in_one_short_line(ids, all_q, says):
    with pytest.raises(RequeueRequestError) as err:
        parse_choice(ids, all_q)
    message = str(err.value)
    assert says in message
    assert len(message) <= 400 and "\n" not in message, len(message)
    assert "trigger params" in message


def test_pg_array_literals():
    from datetime import UTC, datetime

    from include.pin_maintenance.jobs.snapshot_detach import pg_array

    when = datetime(2026, 12, 1, 22, 6, 12, 123456, tzinfo=UTC)
    assert pg_array([]) == "{}"
    assert pg_array([1, 12]) == "{1,12}"
    assert pg_array([True, False]) == "{t,f}"
    assert pg_array([None, "HttpNotFound 404"]) == '{NULL,"HttpNotFound 404"}'
    assert pg_array(['a"b\\c']) == '{"a\\"b\\\\c"}'
    assert pg_array([when]) == '{"2026-12-01T22:06:12.123456+00:00"}'


@pytest.mark.parametrize(
    ("overrides", "ok"),
    [
        ({}, True),  # 360 > 240 + 5 + 5
        ({"lock_ttl_seconds": 250}, False),  # not above the worst-case run
        ({"lock_ttl_seconds": 250.5}, True),
        ({"detach_call_timeout_seconds": 120}, False),  # 240 + 120 + 5 > 360
        ({"max_run_duration_seconds": 15, "lock_ttl_seconds": 45}, True),  # the case
    ],
)
def test_the_lease_must_exceed_the_worst_case_run(overrides, ok):
    if ok:
        CONFIG.resolve(None, overrides)
    else:
        with pytest.raises(ConfigError, match=r"lock_ttl_seconds.*worst-case run"):
            CONFIG.resolve(None, overrides)


def test_pool_alerts_wait_within_their_bound_and_log_a_failing_sink(caplog):
    import logging
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from include.pin_maintenance.jobs.snapshot_detach import PoolAlerts
    from include.pin_maintenance.telemetry import Alert, JobLog

    release = threading.Event()
    sent = []

    class Sink:
        def send(self, alert):
            if alert.name == "broken":
                raise RuntimeError("webhook down")
            if alert.name == "slow":
                release.wait(10)
            sent.append(alert.name)

    caplog.set_level(logging.ERROR)
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        alerts = PoolAlerts(Sink(), pool, JobLog("news_snapshot_detach_retry", "t"))
        started = time.monotonic()
        for name in ("broken", "ok", "slow"):
            alerts.send(Alert(name, "warning", name, {}))
        assert alerts.flush(0.3) == 1  # the slow one is still out; send() never waited
        assert time.monotonic() - started < 2
        assert "ok" in sent and "slow" not in sent
        assert any("event=alert_failed" in r.getMessage() for r in caplog.records)
        release.set()
        assert alerts.flush(5) == 0
    finally:
        release.set()
        pool.shutdown(wait=True)
