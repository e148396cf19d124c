"""Pacing's rules on recorded readings (pure; no DB)."""

from __future__ import annotations

import pytest

from include.pin_maintenance.pacing_config import PacingConfig
from include.pin_maintenance.pacing_rules import (
    REPLAY_WINDOW_SECONDS,
    SHARED_BATCH_MIN,
    SHARED_BATCH_SECONDS,
    WAL_DEBT_MAX_SECONDS,
    Reading,
    database_shared,
    replay_seconds,
    replica_lag_seconds,
    shared_batch_size,
    wal_paid_until,
)


def reading(at: float, wal: int, replay: int | None, replay_lag: float | None = None) -> Reading:
    return Reading(at, wal, replay, replay_lag, others_active=True)


# four probes a second apart, the primary writing 100 bytes a second, the replica caught up
HISTORY = [reading(float(t), 100 * (t + 1), 100 * (t + 1)) for t in range(4)]


def test_no_replica_no_lag():
    assert replica_lag_seconds(HISTORY, reading(4.0, 500, None)) == 0.0


def test_a_replica_that_replayed_everything_the_job_saw_is_not_behind():
    assert replica_lag_seconds(HISTORY, reading(4.0, 500, 400)) == 0.0


def test_a_caught_up_replica_is_not_behind_whatever_its_stale_replay_lag_says():
    assert replica_lag_seconds(HISTORY, reading(4.0, 500, 500, replay_lag=5.5)) == 0.0


def test_a_stuck_replay_ages_with_the_first_position_past_it():
    # replay stopped at 250: the WAL past it was written no earlier than the sample at 2.0
    assert replica_lag_seconds(HISTORY, reading(9.0, 900, 250)) == pytest.approx(7.0)


def test_the_servers_own_replay_lag_counts_when_it_is_larger():
    assert replica_lag_seconds(HISTORY, reading(4.0, 500, 450, replay_lag=2.5)) == 2.5


def test_a_replica_behind_since_before_the_first_sample_is_at_least_that_old():
    assert replica_lag_seconds(HISTORY, reading(10.0, 900, 50)) == pytest.approx(10.0)


def test_pacing_is_on_while_either_signal_is():
    off = PacingConfig(max_replica_lag_seconds=0, max_wal_mb_per_second=0)
    assert not off.paced
    assert PacingConfig(max_replica_lag_seconds=2, max_wal_mb_per_second=0).paced
    assert PacingConfig(max_replica_lag_seconds=0, max_wal_mb_per_second=8).paced


MB = 1_000_000


def test_wal_under_the_budget_is_paid_before_it_is_read():
    # 1 MB in the second since the last read, at 2 MB/s: paid half a second ago
    assert wal_paid_until(0.0, 10.0, 11.0, MB, 2 * MB) == pytest.approx(10.5)


def test_wal_over_the_budget_is_a_debt_that_the_next_read_adds_to():
    paid = wal_paid_until(0.0, 10.0, 10.5, 4 * MB, 2 * MB)  # 4 MB in 0.5 s
    assert paid == pytest.approx(12.0)  # 1.5 s of sleep owed at 10.5
    # 1 MB more by 11.0: added after the earlier debt, not from the read
    assert wal_paid_until(paid, 10.5, 11.0, MB, 2 * MB) == pytest.approx(12.5)


def test_time_under_the_budget_buys_no_burst():
    # paid long ago, then 6 MB at once: owed from the last read, whatever was idle before
    assert wal_paid_until(0.0, 100.0, 100.1, 6 * MB, 4 * MB) == pytest.approx(101.5)


def test_the_debt_is_bounded():
    # a bulk load of 1 GB by someone else: the drain owes at most the bucket's depth
    assert wal_paid_until(0.0, 10.0, 11.0, 1000 * MB, 8 * MB) == 11.0 + WAL_DEBT_MAX_SECONDS


@pytest.mark.parametrize(
    ("probes", "shared"),
    [
        ([], False),  # no probe yet
        ([False] * 20, False),  # nobody else there
        ([True] + [False] * 19, False),  # a heartbeat of one commit a second, caught once
        ([True, False, False, False] * 5, False),  # a monitor polling a few times a second
        ([True] * 9 + [False], True),  # services' short transactions: nearly every probe
        ([True] * 20, True),  # a busy database
    ],
)
def test_the_database_is_shared_when_others_are_active_in_enough_probes(probes, shared):
    assert database_shared(probes) is shared


@pytest.mark.parametrize(
    ("seconds_per_row", "batch_size", "size"),
    [
        (None, 2000, SHARED_BATCH_MIN),  # nothing timed yet: the smallest
        (SHARED_BATCH_SECONDS / 500, 2000, 500),  # what takes the target time
        (SHARED_BATCH_SECONDS / 500, 300, 300),  # never more than the job's own
        (SHARED_BATCH_SECONDS / 5, 2000, SHARED_BATCH_MIN),  # slow rows: never less than this
        (None, 20, 20),  # a job's batch smaller than the minimum stays as it is
    ],
)
def test_a_shared_batch_takes_about_the_target_time(seconds_per_row, batch_size, size):
    assert shared_batch_size(seconds_per_row, batch_size) == size


# A drain alone writing 60 MB/s beside a replica that replays 10 MB/s: probes 0.25 s apart
REPLAYING = [reading(t, int((40 + 60 * t) * MB), int((40 + 10 * t) * MB)) for t in (0, 0.25, 0.5)]


def test_the_time_to_replay_what_the_replica_has_not_is_its_backlog_over_its_rate():
    # at 1.0 s: 100 MB written, 50 MB replayed, at 10 MB/s over the window: 5 s to go
    now = reading(1.0, 100 * MB, 50 * MB)
    assert replay_seconds(REPLAYING, now) == pytest.approx(5.0)
    # what the time lag shows at that moment is far less: the backlog is young
    assert replica_lag_seconds(REPLAYING, now) < 1.0


def test_replay_time_is_read_over_the_recent_window_only():
    # replay that stalled long ago and resumed at 10 MB/s in the window: the window's rate
    old = [reading(-10.0, 1 * MB, 1 * MB)]
    now = reading(1.0, 100 * MB, 50 * MB)
    assert replay_seconds(old + REPLAYING, now) == pytest.approx(5.0)
    assert REPLAY_WINDOW_SECONDS < 11.0


@pytest.mark.parametrize(
    ("history", "now"),
    [
        (REPLAYING, reading(1.0, 100 * MB, None)),  # no replica
        (REPLAYING, reading(1.0, 100 * MB, 100 * MB)),  # caught up
        ([], reading(1.0, 100 * MB, 50 * MB)),  # no rate yet: the time lag alone decides
        ([reading(0.5, 60 * MB, 50 * MB)], reading(1.0, 100 * MB, 50 * MB)),  # stalled
    ],
)
def test_no_replay_time_without_a_replica_a_backlog_or_a_rate(history, now):
    assert replay_seconds(history, now) == 0.0
