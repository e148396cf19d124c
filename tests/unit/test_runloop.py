"""The bounded batch loop and the stop signal (pure; no DB)."""

from __future__ import annotations

import os
import signal

import pytest

from include.pin_maintenance.runloop import (
    JobCancelled,
    LoopLimits,
    StopReason,
    StopSignal,
    run_batches,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stops_on_short_batch_and_reports_no_more():
    calls = []
    result = run_batches(lambda i: calls.append(i) or i < 2, LoopLimits(60), StopSignal())
    assert calls == [0, 1, 2]
    assert result.batches == 3
    assert result.stop_reason is StopReason.DRAINED
    assert result.has_more is False


def test_max_batches_bound_reports_has_more():
    result = run_batches(lambda i: True, LoopLimits(60, max_batches=4), StopSignal())
    assert (result.batches, result.stop_reason, result.has_more) == (
        4,
        StopReason.MAX_BATCHES,
        True,
    )


def test_max_duration_checked_between_batches_first_batch_always_runs():
    clock = FakeClock()

    def batch(i: int) -> bool:
        clock.now += 10  # each batch takes 10 s
        return True

    result = run_batches(batch, LoopLimits(25), StopSignal(), clock=clock)
    assert result.batches == 3  # 0 s, 10 s, 20 s start; at 30 s the bound stops it
    assert result.stop_reason is StopReason.MAX_DURATION
    assert result.has_more


def test_stop_signal_ends_loop_between_batches():
    stop = StopSignal()

    def batch(i: int) -> bool:
        if i == 1:
            stop.set("test")
        return True

    result = run_batches(batch, LoopLimits(60), stop)
    assert result.batches == 2  # the batch in hand finished, no new one started
    assert result.stop_reason is StopReason.CANCELLED
    with pytest.raises(JobCancelled, match="test"):
        stop.raise_if_set()


def test_sigterm_sets_signal_and_chains_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        stop = StopSignal()
        with stop.on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.is_set()
            assert stop.reason == "SIGTERM received"
        assert seen == [signal.SIGTERM]
        # the previous handler is back in place after the block
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_child_signal_follows_its_parent_but_not_the_other_way():
    run = StopSignal()
    loop = StopSignal(parent=run)
    assert not loop.is_set()

    run.set("SIGTERM received")
    assert loop.is_set() and loop.reason == "SIGTERM received"

    other_run = StopSignal()
    sibling = StopSignal(parent=other_run)
    sibling.set("runner 2 failed")
    assert sibling.is_set() and sibling.reason == "runner 2 failed"
    assert not other_run.is_set() and other_run.reason == ""
