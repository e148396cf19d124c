"""Pure rules of the slot-expiration job: config, error classification, result.

The poison isolation itself is measured on a real Postgres
(tests/integration/test_slot_expiration_branches.py).
"""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime

import psycopg
import pytest

from include.pin_maintenance import sql
from include.pin_maintenance.config import ConfigError
from include.pin_maintenance.db import is_row_error
from include.pin_maintenance.jobs import slot_expiration as se
from include.pin_maintenance.jobs.slot_expiration_batch import M_ERRORS, CycleState, PoisonSlot
from include.pin_maintenance.pacing import paced_metrics
from include.pin_maintenance.stopping import StopSignal
from include.pin_maintenance.telemetry import RecordingMetrics
from tests.job_db import job_telemetry


def test_config_defaults_match_the_contract():
    assert se.CONFIG.job == "calendar_slot_expiration"
    # batch_size and max_run_duration_seconds: docs/design.md, "Configuration"; runners and
    # max_batches_per_cycle are ours (README); 1 batch per cycle is seed 002's bound; the
    # pacing keys are shared with retention (docs/design.md, "Pacing")
    assert dataclasses.asdict(se.CONFIG.resolve(None, None)) == {
        "batch_size": 500,
        "max_batches_per_cycle": 1,
        "runners": 2,
        "max_run_duration_seconds": 30,
        "max_replica_lag_seconds": 2,
        "max_wal_mb_per_second": 4,
    }


@pytest.mark.parametrize(
    ("variable", "params", "message"),
    [
        (None, {"batch_size": 0}, "batch_size = 0 (from trigger params) is out of range"),
        (None, {"batch_size": 10_001}, "allowed: integer 1..10000"),
        (None, {"batch_size": 1.5}, "batch_size = 1.5"),
        ('{"max_run_duration_seconds": 0}', None, "max_run_duration_seconds = 0"),
        (None, {"max_run_duration_seconds": -3}, "allowed: number > 0"),
        (None, {"runners": 0}, "runners = 0 (from trigger params) is out of range"),
        ('{"runners": 9}', None, "allowed: integer 1..8"),
        (None, {"max_batches_per_cycle": 0}, "max_batches_per_cycle = 0 (from trigger params)"),
        ('{"max_batches_per_cycle": 100001}', None, "allowed: integer 1..100000"),
        (None, {"max_batches_per_cycle": 2.5}, "max_batches_per_cycle = 2.5"),
        (None, {"max_batches_per_cycle": True}, "max_batches_per_cycle = True"),
        ('{"lock_ttl_seconds": 60}', None, "unknown config key 'lock_ttl_seconds'"),
        (None, {"max_replica_lag_seconds": -1}, "max_replica_lag_seconds = -1"),
        (None, {"max_replica_lag_seconds": 3601}, "allowed: number 0..3600"),
        # a key this version no longer has (the canary's): refused, not silently ignored
        ('{"max_neighbour_slowdown": 2}', None, "unknown config key 'max_neighbour_slowdown'"),
        (None, {"max_wal_mb_per_second": -1}, "max_wal_mb_per_second = -1"),
        ('{"max_wal_mb_per_second": 10001}', None, "allowed: number 0..10000"),
    ],
)
def test_invalid_config_names_the_key_value_and_range(variable, params, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        se.CONFIG.resolve(variable, params)


def test_dry_run_param_is_not_a_config_key():
    assert se.CONFIG.resolve(None, {"dry_run": True, "batch_size": None}) == se.CONFIG.defaults


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, {}),
        ({"batch_size": 1}, {"batch_size": 1}),
        ({"runners": 1}, {"runners": 1}),
        ({"max_run_duration_seconds": 0.5}, {"max_run_duration_seconds": 0.5}),
        ({"max_batches_per_cycle": 100_000}, {"max_batches_per_cycle": 100_000}),
    ],
)
def test_a_run_takes_a_partial_config_with_the_defaults(config, expected):
    # what run() does with the config it is handed (the CLI's, a test's, the task's)
    resolved = se.CONFIG.resolve(config, variable_source="config")
    assert resolved == dataclasses.replace(se.CONFIG.defaults, **expected)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"batch_size": 0}, "batch_size = 0 (from config) is out of range"),
        ({"batch_size": "500"}, "batch_size = '500' (from config) is not valid"),
        ({"max_run_duration_seconds": 0}, "max_run_duration_seconds = 0 (from config)"),
        ({"max_attempts": 3}, "unknown config key 'max_attempts'"),
        ({"max_neighbour_slowdown": 2}, "unknown config key 'max_neighbour_slowdown'"),
    ],
)
def test_a_run_refuses_a_bad_config_before_it_connects(config, message):
    def connect():
        raise AssertionError("must not connect")

    with pytest.raises(ConfigError, match=re.escape(message)):
        se.run(connect, config, job_telemetry(se.JOB), StopSignal())


@pytest.mark.parametrize(
    ("sqlstate", "row_error", "why"),
    [
        ("P0001", True, "raise_exception from a trigger"),
        ("22003", True, "numeric_value_out_of_range (version + 1 overflow)"),
        ("22P02", True, "invalid_text_representation"),
        ("23514", True, "check_violation"),
        ("23505", True, "unique_violation"),
        ("23503", True, "foreign_key_violation"),
        ("23502", True, "not_null_violation"),
        ("57014", False, "query_canceled / statement_timeout"),
        ("57P01", False, "admin_shutdown"),
        ("08006", False, "connection_failure"),
        ("40P01", False, "deadlock_detected"),
        ("40001", False, "serialization_failure"),
        ("55P03", False, "lock_not_available (lock_timeout)"),
        ("25006", False, "read_only_sql_transaction: a failover in progress, every row alike"),
        ("53100", False, "disk_full"),
        ("42501", False, "insufficient_privilege: every row would fail"),
        ("42P01", False, "undefined_table"),
        ("XX000", False, "internal_error"),
        (None, False, "no SQLSTATE: the connection is gone"),
        ("", False, "empty SQLSTATE"),
    ],
)
def test_error_classification(sqlstate, row_error, why):
    """The job isolates poison rows by the shared rule (db.is_row_error)."""
    assert is_row_error(sqlstate) is row_error, why


def test_result_dict_carries_the_seed_fields():
    as_of = datetime(2026, 6, 1, tzinfo=UTC)
    result = se.ExpirationResult(3, 1, 42, as_of, batches=1, backlog=0)
    assert result.as_dict() == {
        "ExpiredCount": 3,
        "SkippedLockedCount": 1,
        "DurationMs": 42,
        "ErrorsCount": 0,
        "Backlog": 0,
        "Batches": 1,
        "Runners": 1,
        "StopReason": "drained",
        "AsOf": "2026-06-01T00:00:00+00:00",
        "PacedMs": 0,
    }
    dry = se.ExpirationResult(0, 0, 1, as_of, dry_run=True, would_expire_count=9)
    assert dry.as_dict()["WouldExpireCount"] == 9


@pytest.mark.parametrize(
    "name",
    [
        "slots/expire_due_slots",
        "slots/lock_due_slots",
        "slots/expire_slots_by_id",
        "slots/count_due_slots",
        "slots/count_backlog",
    ],
)
def test_queries_exist_and_use_bound_parameters_only(name):
    text = sql.load(name)
    assert "%(" in text
    assert "{" not in text


def _selection(name: str) -> str:
    """The batch selection of a query: from the table up to its row lock, whitespace-folded."""
    text = " ".join(line.split("--")[0].strip() for line in sql.load(name).splitlines())
    start = text.index("from calendar.availability_slots")
    end = text.index("for update skip locked") + len("for update skip locked")
    return " ".join(text[start:end].split())


def test_poison_isolation_locks_the_same_selection_as_the_batch():
    assert _selection("slots/lock_due_slots") == _selection("slots/expire_due_slots")


def test_metric_names_are_the_contract():
    assert {
        se.M_CYCLE_DURATION,
        se.M_ITEMS,
        se.M_BACKLOG,
        se.M_SKIP_LOCKED,
        M_ERRORS,
        se.M_LAST_SUCCESS,
    } == {
        "calendar_slot_expiration_cycle_duration_seconds",
        "calendar_slot_expiration_items_total",
        "calendar_slot_expiration_backlog",
        "calendar_slot_expiration_skip_locked_total",
        "calendar_slot_expiration_errors_total",
        "calendar_slot_expiration_last_success_timestamp_seconds",
    }


def test_unreachable_database_fails_the_cycle_and_counts_an_error(tmp_path):
    metrics = RecordingMetrics()
    telemetry = job_telemetry(se.JOB, "unit", metrics=metrics)

    def connect():
        return psycopg.connect(f"postgresql:///none?host={tmp_path}", connect_timeout=2)

    with pytest.raises(psycopg.OperationalError):
        se.run(connect, {}, telemetry, StopSignal())
    paced = dict.fromkeys(paced_metrics(se.M_PACED_PREFIX), 0)  # sent at 0, never paced
    assert metrics.counters == {se.M_ITEMS: 0, se.M_SKIP_LOCKED: 0, M_ERRORS: 1} | paced
    assert se.M_LAST_SUCCESS not in metrics.gauges


def test_a_poison_slot_met_by_two_runners_counts_once():
    cycle = CycleState(as_of=datetime(2026, 6, 1, tzinfo=UTC), batch_size=10)
    first = PoisonSlot("slot-1", "P0001: rejected")

    assert cycle.batch_done(9, [first]) == (1, [first])
    assert cycle.batch_done(0, [PoisonSlot("slot-1", "P0001: rejected again")]) == (2, [])
    assert (cycle.expired, cycle.excluded_ids) == (9, ["slot-1"])
