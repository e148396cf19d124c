"""Lanes side by side and the batch loop on them: any exception stops every lane, the join
is bounded, bounds are checked between batches (pure; no DB)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import pytest

from include.pin_maintenance.parallel import (
    BatchBudget,
    Deadline,
    LanesDidNotStop,
    run_batch_loops,
    run_lanes,
    strongest_stop_reason,
)
from include.pin_maintenance.stopping import StopReason, StopSignal


class Boom(BaseException):
    """Not an Exception: what AirflowTaskTimeout or a KeyboardInterrupt look like to a lane."""


def waiting_lane(seen: list[str]):
    """A lane that works until its stop is set, then says so."""

    def lane(ln):
        while not ln.stop.is_set():
            time.sleep(0.01)
        seen.append(f"lane {ln.index} stopped: {ln.stop.reason}")
        return ln.index

    return lane


def test_results_come_back_in_lane_order():
    deadline = Deadline(10)
    out = run_lanes(
        [lambda ln, i=i: (ln.index, i * 10) for i in range(4)],
        stop=StopSignal(),
        deadline=deadline,
        grace_seconds=1,
    )
    assert out == [(0, 0), (1, 10), (2, 20), (3, 30)]


def test_base_exception_in_a_side_lane_stops_the_others_and_is_reraised():
    seen: list[str] = []

    def failing(ln):
        time.sleep(0.05)
        raise Boom("side lane died")

    started = time.monotonic()
    with pytest.raises(Boom, match="side lane died"):
        run_lanes(
            [waiting_lane(seen), failing, waiting_lane(seen)],
            stop=StopSignal(),
            deadline=Deadline(60),
            grace_seconds=5,
        )
    assert time.monotonic() - started < 5  # not the deadline: the crew stopped at once
    assert sorted(seen) == [
        "lane 0 stopped: Boom in a lane",
        "lane 2 stopped: Boom in a lane",
    ]


def test_exception_in_the_callers_lane_stops_side_lanes():
    seen: list[str] = []

    def failing(ln):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        run_lanes(
            [failing, waiting_lane(seen), waiting_lane(seen)],
            stop=StopSignal(),
            deadline=Deadline(60),
            grace_seconds=5,
        )
    assert len(seen) == 2


def test_cancel_hooks_interrupt_a_blocked_lane():
    """A lane blocked in something that ignores the stop flag (a statement in flight) is
    released by its hook, as ``conn.cancel_safe`` releases a statement."""
    released = threading.Event()

    def blocked(ln):
        ln.on_cancel(released.set)
        assert released.wait(30), "never released"
        raise RuntimeError("statement cancelled")

    def failing(ln):
        time.sleep(0.05)
        raise KeyError("first error")

    started = time.monotonic()
    with pytest.raises(KeyError, match="first error"):  # the first error, not the follow-up
        run_lanes([blocked, failing], stop=StopSignal(), deadline=Deadline(60), grace_seconds=5)
    assert time.monotonic() - started < 5


def test_the_runs_stop_signal_reaches_every_lane():
    run_stop = StopSignal()
    seen: list[str] = []
    timer = threading.Timer(0.1, run_stop.set, args=("SIGTERM received",))
    timer.start()
    out = run_lanes(
        [waiting_lane(seen), waiting_lane(seen)],
        stop=run_stop,
        deadline=Deadline(60),
        grace_seconds=5,
    )
    timer.join()
    assert out == [0, 1]
    assert sorted(seen) == ["lane 0 stopped: SIGTERM received", "lane 1 stopped: SIGTERM received"]


def test_join_is_bounded_by_deadline_plus_grace_even_when_a_lane_never_stops():
    forever = threading.Event()

    def stubborn(ln):
        forever.wait(30)  # ignores the stop and registers no hook

    started = time.monotonic()
    with pytest.raises(LanesDidNotStop, match="pin-lane-1"):
        run_lanes(
            [lambda ln: None, stubborn],
            stop=StopSignal(),
            deadline=Deadline(0.2),
            grace_seconds=0.3,
        )
    took = time.monotonic() - started
    forever.set()
    assert took < 0.2 + 0.3 + 0.3 + 1.0  # deadline + grace, then grace after the cancel


def test_a_signal_raised_in_the_callers_thread_while_it_joins_stops_every_lane():
    """What ``execution_timeout`` does: SIGALRM raises AirflowTaskTimeout (a BaseException)
    in the main thread, here while lane 0 is done and the caller waits for the others."""
    seen: list[str] = []

    def on_alarm(signum, frame):
        raise Boom("execution_timeout")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    started = time.monotonic()
    try:
        with pytest.raises(Boom, match="execution_timeout"):
            run_lanes(
                [lambda ln: None, waiting_lane(seen), waiting_lane(seen)],
                stop=StopSignal(),
                deadline=Deadline(60),
                grace_seconds=5,
            )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 5
    assert len(seen) == 2


def test_deadline_timeout_is_what_is_left_capped():
    now = [100.0]
    deadline = Deadline(10, clock=lambda: now[0])
    assert deadline.timeout() == 10
    assert deadline.timeout(3) == 3
    assert deadline.allows(10) and not deadline.allows(10.5)
    now[0] = 108.0
    assert deadline.timeout(5) == 2
    now[0] = 200.0
    assert deadline.remaining() == 0 and deadline.expired() and deadline.timeout(5) == 0


# -- the shared batch loop -------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_loop_stops_on_its_first_short_batch():
    calls = []

    def batch(lane, size):
        calls.append(lane.index)
        return len(calls) < 3

    reason = run_batch_loops(
        [batch], stop=StopSignal(), deadline=Deadline(60), budget=BatchBudget(None), grace_seconds=1
    )
    assert reason is StopReason.DRAINED
    assert calls == [0, 0, 0]


def test_the_budget_bounds_the_batches_of_all_loops_together():
    counts = [0, 0, 0]

    def batch(lane, size):
        counts[lane.index] += 1
        time.sleep(0.001)
        return True

    budget = BatchBudget(10)
    reason = run_batch_loops(
        [batch] * 3, stop=StopSignal(), deadline=Deadline(60), budget=budget, grace_seconds=1
    )
    assert reason is StopReason.MAX_BATCHES
    assert sum(counts) == 10 == budget.taken


def test_the_deadline_is_checked_between_batches_and_the_first_batch_always_runs():
    clock = FakeClock()
    clock.now = 100.0
    deadline = Deadline(0, clock=clock)  # already expired
    calls = []

    def batch(lane, size):
        calls.append(clock.now)
        return True

    reason = run_batch_loops(
        [batch], stop=StopSignal(), deadline=deadline, budget=BatchBudget(None), grace_seconds=1
    )
    assert reason is StopReason.MAX_DURATION
    assert calls == [100.0]


def test_a_stop_ends_every_loop_after_the_batch_in_hand():
    stop = StopSignal()
    calls = []

    def batch(lane, size):
        calls.append(lane.index)
        if len(calls) == 2:
            stop.set("test")
        return True

    reason = run_batch_loops(
        [batch], stop=stop, deadline=Deadline(60), budget=BatchBudget(None), grace_seconds=1
    )
    assert reason is StopReason.CANCELLED
    assert calls == [0, 0]


def test_a_failing_loop_stops_its_siblings_and_its_error_is_raised():
    seen = []

    def failing(lane, size):
        raise Boom("lane 1 broke")

    def steady(lane, size):
        seen.append(lane.stop.is_set())
        time.sleep(0.01)
        return True

    with pytest.raises(Boom, match="lane 1 broke"):
        run_batch_loops(
            [steady, failing],
            stop=StopSignal(),
            deadline=Deadline(60),
            budget=BatchBudget(None),
            grace_seconds=1,
        )
    # lane 0 (endless on its own) returned: no batch of it started once the crew was stopped
    assert not any(seen)


@pytest.mark.parametrize(
    ("reasons", "expected"),
    [
        ([StopReason.DRAINED, StopReason.DRAINED], StopReason.DRAINED),
        ([StopReason.DRAINED, StopReason.MAX_BATCHES], StopReason.MAX_BATCHES),
        ([StopReason.MAX_BATCHES, StopReason.MAX_DURATION], StopReason.MAX_DURATION),
        ([StopReason.MAX_DURATION, StopReason.CANCELLED], StopReason.CANCELLED),
    ],
)
def test_the_crew_reports_its_strongest_stop_reason(reasons, expected):
    assert strongest_stop_reason(reasons) is expected


class RecordingPacing:
    """A pacing that notes when it started, waited and paced, and sizes every batch at
    ``limit``."""

    def __init__(self, limit: int | None = None) -> None:
        self.events: list[str] = []
        self.limit = limit
        self.inside = False

    def start(self):
        self.events.append("start")

    @contextlib.contextmanager
    def turn(self, stop):
        self.events.append("turn")
        self.inside = True
        try:
            yield self.limit
        finally:
            self.inside = False

    def pace(self, lane, stop, batch_seconds, rows):
        assert self.inside  # in the turn: the crew's next batch follows the pause
        self.events.append(f"pace {batch_seconds >= 0.01} {rows}")


def test_each_batch_and_its_pace_run_in_a_turn_and_only_full_batches_are_paced():
    pacing = RecordingPacing()
    calls = []

    def batch(lane, size):
        assert pacing.inside  # the batch (and the checks before it) hold the turn
        calls.append(lane.index)
        time.sleep(0.01)
        return len(calls) < 3

    reason = run_batch_loops(
        [batch],
        stop=StopSignal(),
        deadline=Deadline(60),
        budget=BatchBudget(None),
        grace_seconds=1,
        pacing=pacing,
    )
    assert reason is StopReason.DRAINED
    assert pacing.events == [
        "start", "turn", "pace True None", "turn", "pace True None", "turn"
    ]  # fmt: skip


def test_a_batch_sized_by_pacing_takes_its_share_of_the_budget():
    # a budget of 2 batches of 100: batches of 40 fit five times (200 rows), not twice
    pacing = RecordingPacing(limit=40)
    sizes = []

    def batch(lane, size):
        sizes.append(size)
        return True

    reason = run_batch_loops(
        [batch],
        stop=StopSignal(),
        deadline=Deadline(60),
        budget=BatchBudget(2, batch_size=100),
        grace_seconds=1,
        pacing=pacing,
    )
    assert reason is StopReason.MAX_BATCHES
    assert sizes == [40] * 5
    assert pacing.events.count("pace False 40") == 4  # each batch but the last, by its size


def test_the_batch_that_spends_the_budget_is_not_paced():
    # the pause is for the batch after it: a run at its bound ends without one
    pacing = RecordingPacing()

    def batch(lane, size):
        time.sleep(0.01)
        return True

    reason = run_batch_loops(
        [batch],
        stop=StopSignal(),
        deadline=Deadline(60),
        budget=BatchBudget(3),
        grace_seconds=1,
        pacing=pacing,
    )
    assert reason is StopReason.MAX_BATCHES
    assert pacing.events == [
        "start", "turn", "pace True None", "turn", "pace True None", "turn", "turn"
    ]  # fmt: skip


def test_a_budget_without_a_batch_size_counts_whole_batches():
    budget = BatchBudget(2)
    assert budget.take(10) and budget.take(10) and not budget.take(10)


def test_a_stop_seen_inside_the_turn_ends_the_loop_before_its_batch():
    pacing = RecordingPacing()
    stop = StopSignal()
    calls = []

    def batch(lane, size):
        calls.append(lane.index)
        stop.set("test")
        return True

    reason = run_batch_loops(
        [batch],
        stop=stop,
        deadline=Deadline(60),
        budget=BatchBudget(None),
        grace_seconds=1,
        pacing=pacing,
    )
    assert reason is StopReason.CANCELLED
    assert calls == [0] and pacing.events == ["start", "turn", "pace False None", "turn"]
