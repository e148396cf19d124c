"""The concurrency limit's rule on answer sequences of services with and without a knee.

A small closed-loop simulation stands in for time: calls start whenever the limit has a free
slot, each service model says how long a call takes (and whether it is refused) from the
calls in flight at its start, and completions are fed back the way ``CallGate`` feeds them
(a call slower than the stall time is congestion; a refusal is congestion; an answer goes
into the window).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from include.pin_maintenance.jobs.snapshot_detach_gate import (
    CEILING_SECONDS,
    CUT_ABOVE,
    GROW_BELOW,
    STALL_MIN_SECONDS,
    WINDOW_MIN_CALLS,
    AdaptiveLimit,
)

REFUSED = -1.0  # a model's latency for a call refused at once (503 / 429)
Model = Callable[[int, random.Random], float]


@dataclass
class Trace:
    calls: int = 0
    refused: int = 0
    stalls: int = 0
    answered: int = 0
    slots: list[tuple[float, int]] = field(default_factory=list)  # (time, slots) per start
    seconds: float = 0.0

    def slots_after(self, t: float) -> list[int]:
        return [s for at, s in self.slots if at >= t]

    @property
    def rate(self) -> float:
        return self.answered / self.seconds


def simulate(model: Model, limit: AdaptiveLimit, seconds: float, seed: int = 7) -> Trace:
    rng = random.Random(seed)
    trace = Trace()
    now = 0.0
    pending: list[tuple[float, int, float, int, bool]] = []  # (end, n, start, epoch, refused)
    stalled: set[int] = set()
    while now < seconds:
        while len(pending) < limit.slots:
            in_flight = len(pending) + 1
            limit.on_start(in_flight)
            latency = model(in_flight, rng)
            refused = latency == REFUSED
            end = now + (0.0005 if refused else latency)
            heapq.heappush(pending, (end, trace.calls, now, limit.epoch, refused))
            trace.calls += 1
            trace.slots.append((now, limit.slots))
        end, number, started, epoch, refused = heapq.heappop(pending)
        now = end
        # as the gate does on every release: each call in flight past the stall time, once
        for _, other, other_started, other_epoch, _ in [*pending, (end, number, started, epoch, 0)]:
            if other not in stalled and now - other_started > limit.stall_seconds:
                stalled.add(other)
                trace.stalls += 1
                limit.on_congestion(other_epoch, now)
        if refused:
            trace.refused += 1
            limit.on_congestion(epoch, now)
        else:
            trace.answered += 1
            if number not in stalled:
                limit.on_answer(started, now)
    trace.seconds = now
    return trace


def constant(ms: float) -> Model:
    return lambda in_flight, rng: ms / 1000


def lognormal(median_ms: float, sigma: float) -> Model:
    return lambda in_flight, rng: rng.lognormvariate(math.log(median_ms / 1000), sigma)


def accept_queue_cliff(knee: int, ms: float = 20.0) -> Model:
    """A thread-per-connection server with a short listen backlog: past ``knee`` connections
    at once some attempts are dropped and retried by TCP a second later; the rest stay fast."""

    def model(in_flight: int, rng: random.Random) -> float:
        over = max(0, in_flight - knee)
        if over and rng.random() < min(0.5, 0.05 * over):
            return 1.0 + ms / 1000
        return ms / 1000

    return model


def saturating(capacity_per_second: float, ms: float = 20.0) -> Model:
    """A CPU-bound service: answers stay at ``ms`` until the calls in flight exceed what it
    turns around at that latency, then every answer waits its share (latency rises slowly)."""
    return lambda in_flight, rng: max(ms / 1000, in_flight / capacity_per_second)


def test_no_knee_grows_to_the_maximum():
    limit = AdaptiveLimit(1, 32)
    trace = simulate(constant(20), limit, seconds=5)
    assert limit.slots == 32
    assert trace.stalls == trace.refused == 0
    assert limit.cuts == limit.knee_cuts == 0


def test_a_latency_tail_without_a_knee_does_not_hold_the_limit_down():
    # lognormal, p99 about 4x the median: window means jitter, none looks like queueing
    limit = AdaptiveLimit(1, 32)
    trace = simulate(lognormal(20, 0.6), limit, seconds=10)
    assert statistics.median(trace.slots_after(3.0)) >= 24
    assert trace.stalls <= 0.001 * trace.calls


def test_a_knee_with_a_cliff_is_found_and_held_below_it():
    # 12 connections at once are fine; beyond, dropped attempts take a second. The old
    # limit, which grew on a median that stayed at 20 ms, sat at its maximum of 32.
    limit = AdaptiveLimit(1, 32)
    trace = simulate(accept_queue_cliff(12), limit, seconds=30)
    steady = trace.slots_after(5.0)
    assert 6 <= statistics.median(steady) <= 16
    assert max(steady) < 32
    assert trace.stalls <= 0.01 * trace.calls  # the cliff is touched, not lived on
    # it turns around most of what the knee allows (12 calls / 20 ms = 600/s)
    assert trace.rate >= 0.6 * 600


def test_a_slow_rise_of_latency_brings_the_limit_back_to_the_knee():
    # capacity 500/s at 20 ms: the knee is 10 calls in flight; past it the median rises
    limit = AdaptiveLimit(1, 32)
    trace = simulate(saturating(500), limit, seconds=20)
    steady = trace.slots_after(3.0)
    assert 8 <= statistics.median(steady) <= 10 * CUT_ABOVE + 1
    assert limit.knee_cuts >= 1
    assert trace.rate >= 0.9 * 500


def test_one_fast_outlier_does_not_pin_the_limit():
    # the first answer in 1 ms, then every answer in 3 s: a window mean, not the fastest
    # answer, is the base, so the limit grows as on any service without a knee
    answers = iter([0.001])

    def model(in_flight: int, rng: random.Random) -> float:
        return next(answers, 3.0)

    limit = AdaptiveLimit(1, 32)
    simulate(model, limit, seconds=600)
    assert limit.slots == 32
    assert limit.base == pytest.approx(3.0, rel=0.01)


def test_a_burst_of_refusals_cuts_once_and_the_limit_recovers():
    limit = AdaptiveLimit(1, 32)
    t = 0.0

    def healthy_windows(count: int) -> None:
        """``count`` windows of 20 ms answers, ``limit.slots`` calls in flight."""
        nonlocal t
        target = limit.windows + count
        while limit.windows < target:
            limit.on_start(limit.slots)
            limit.on_answer(t, t + 0.02)
            t += 0.02 / limit.slots

    healthy_windows(20)  # slow start 1, 2, 4, 8, 16, then +1 per window
    assert limit.slots == 32
    epoch = limit.epoch
    cuts = [limit.on_congestion(epoch, t) for _ in range(20)]  # 20 x 503 from one window
    assert cuts.count(True) == 1
    assert limit.slots == 16
    healthy_windows(40)
    assert limit.slots == 25  # +1 per healthy window, a fifth below where it was refused
    t += CEILING_SECONDS
    healthy_windows(1)
    assert limit.slots == 26  # and, a while later, it probes above again


def test_a_cliff_hit_again_within_the_ceiling_brings_the_ceiling_down():
    limit = AdaptiveLimit(1, 32)
    limit.limit, limit.slow_start = 32.0, False
    ceilings = []
    for second in range(3):  # a stall at the ceiling, once a second
        limit.on_congestion(limit.epoch, float(second))
        limit.limit = limit.ceiling  # grown back to it
        ceilings.append(limit.slots)
    assert ceilings == [25, 20, 16]


def test_a_service_that_refuses_beyond_four_settles_at_four():
    def model(in_flight: int, rng: random.Random) -> float:
        return REFUSED if in_flight > 4 else 0.02

    limit = AdaptiveLimit(1, 32)
    trace = simulate(model, limit, seconds=30)
    steady = trace.slots_after(5.0)
    assert max(steady) <= 5
    assert trace.calls / (trace.calls - trace.refused) <= 1.05


def test_a_window_judges_only_calls_started_in_it():
    limit = AdaptiveLimit(1, 32)
    for i in range(WINDOW_MIN_CALLS):  # first window at 20 ms: base 20 ms, limit 2
        limit.on_start(1)
        limit.on_answer(i * 0.02, i * 0.02 + 0.02)
    assert (limit.slots, limit.base) == (2, pytest.approx(0.02))
    closed_at = WINDOW_MIN_CALLS * 0.02
    limit.on_answer(closed_at - 0.01, closed_at + 5.0)  # started before the window: ignored
    assert limit.slots == 2 and limit.base == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        (1.0, 9.0),  # nothing queues: +1
        (GROW_BELOW + 0.05, 8.0),  # queueing begins: hold
        (CUT_ABOVE + 0.5, 0.8 * 8),  # calls queue: back towards the knee, a fifth at most
        (8.0, 0.8 * 8),
    ],
)
def test_window_rule(ratio, expected):
    limit = AdaptiveLimit(1, 32, slow_start=False)
    limit.limit = 8.0
    limit.adjust(0.02 * ratio, 0.02, used=True)
    assert limit.limit == pytest.approx(expected)


def test_an_unused_limit_does_not_grow():
    limit = AdaptiveLimit(1, 32, slow_start=False)
    limit.limit = 8.0
    limit.adjust(0.02, 0.02, used=False)
    assert limit.limit == 8.0


def test_stall_time_follows_the_base_with_a_floor():
    limit = AdaptiveLimit(1, 32)
    assert limit.stall_seconds == math.inf  # no base yet: nothing is a stall
    limit.base = 0.002
    assert limit.stall_seconds == STALL_MIN_SECONDS
    limit.base = 0.5
    assert limit.stall_seconds == pytest.approx(5.0)


def test_limit_rejects_bad_bounds():
    with pytest.raises(ValueError, match="minimum <= maximum"):
        AdaptiveLimit(4, 2)
