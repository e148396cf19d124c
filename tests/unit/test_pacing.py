"""Pacing's rules on recorded readings (pure; no DB)."""

from __future__ import annotations

import pytest

from include.pin_maintenance.pacing import (
    CANARY_SLACK_SECONDS,
    NICE_MAX,
    NICE_START,
    SHARED_BATCH_MIN,
    SHARED_BATCH_SECONDS,
    WAL_DEBT_MAX_SECONDS,
    PaceTotals,
    PacingLimits,
    Reading,
    canary_slow,
    database_shared,
    next_nice,
    replica_lag_seconds,
    shared_batch_size,
    wal_paid_until,
)


def reading(at: float, wal: int, replay: int | None, replay_lag: float | None = None) -> Reading:
    return Reading(at, wal, replay, replay_lag, others_active=1, canary_seconds=None)


HISTORY = [(0.0, 100), (1.0, 200), (2.0, 300), (3.0, 400)]


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


def test_the_sleep_multiple_doubles_while_slow_and_decays_when_healthy():
    nice = 0.0
    seen = []
    for _ in range(8):
        nice = next_nice(nice, slow=True)
        seen.append(nice)
    assert seen[0] == NICE_START
    assert seen[1] == 2 * NICE_START
    assert seen[-1] == NICE_MAX  # capped
    for _ in range(30):
        nice = next_nice(nice, slow=False)
    assert nice == 0.0  # decays to none, not to a residue


@pytest.mark.parametrize(
    ("recent_ms", "baseline_ms", "limit", "slow"),
    [
        ([1.0, 1.1, 0.9, 1.0, 1.2], 1.0, 2.0, False),  # as before the run
        ([2.4, 2.6, 2.5, 2.4, 2.3], 1.0, 2.0, False),  # over 2x, within the slack
        ([3.0, 3.1, 2.9, 3.2, 3.0], 1.0, 2.0, True),  # the mean is over 2x + slack
        ([9.0, 1.0, 1.0, 1.0, 1.0], 1.0, 2.0, True),  # a tail moves the mean: the services feel it
        ([2.0, 1.0, 1.0, 1.0, 1.0], 1.0, 2.0, False),  # a small outlier does not
        ([0.3, 0.3, 0.3, 0.3, 0.3], 0.1, 2.0, False),  # 3x, but 0.2 ms apart: nobody feels it
        ([9.0, 9.0, 9.0, 9.0, 9.0], 1.0, 0.0, False),  # the signal is off
    ],
)
def test_a_slow_canary_is_its_recent_mean_over_the_limit(recent_ms, baseline_ms, limit, slow):
    recent = [ms / 1000 for ms in recent_ms]
    assert canary_slow(recent, baseline_ms / 1000, limit) is slow


def test_the_slack_is_sub_millisecond():
    assert CANARY_SLACK_SECONDS < 0.001


def test_limits_from_config_and_off():
    assert PacingLimits.from_config({}).off
    limits = PacingLimits.from_config({"max_replica_lag_seconds": 2, "max_neighbour_slowdown": 0})
    assert not limits.off and limits.max_replica_lag_seconds == 2.0
    assert not PacingLimits.from_config({"max_wal_mb_per_second": 8}).off


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


def test_totals_add_up_every_reason():
    totals = PaceTotals()
    assert totals.total == 0.0
    totals.seconds["replica_lag"] += 1.5
    totals.seconds["neighbour_latency"] += 0.5
    totals.seconds["wal_rate"] += 3.0
    assert totals.total == 5.0


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
