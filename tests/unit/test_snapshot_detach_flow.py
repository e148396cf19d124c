"""Adaptive concurrency, Retry-After pauses and the outage breaker (pure rules + the gate)."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest

from include.pin_maintenance.jobs.snapshot_detach import Verdict, classify
from include.pin_maintenance.jobs.snapshot_detach_client import CallOutcome
from include.pin_maintenance.jobs.snapshot_detach_flow import (
    BASELINE_MIN_SAMPLES,
    BASELINE_WINDOW,
    MAX_PAUSE_SECONDS,
    AdaptiveLimit,
    Breaker,
    CallGate,
    Signal,
    call_signal,
)
from include.pin_maintenance.parallel import Deadline


@pytest.mark.parametrize(
    ("outcome", "signal"),
    [
        (CallOutcome(200), Signal.HEALTHY),
        (CallOutcome(204), Signal.HEALTHY),
        (CallOutcome(404), Signal.ANSWERED),
        (CallOutcome(400), Signal.ANSWERED),
        (CallOutcome(401), Signal.ANSWERED),
        (CallOutcome(429), Signal.THROTTLED),
        (CallOutcome(503), Signal.OVERLOADED),
        (CallOutcome(502), Signal.OVERLOADED),
        (CallOutcome(504), Signal.OVERLOADED),
        (CallOutcome(500), Signal.FAILED),
        (CallOutcome(error_class="Timeout"), Signal.OVERLOADED),
        (CallOutcome(error_class="ConnectionError"), Signal.OVERLOADED),
        (CallOutcome(error_class="ChunkedEncodingError"), Signal.FAILED),
        (CallOutcome(error_class="ClientError:RuntimeError"), Signal.OTHER),
        (CallOutcome(302), Signal.OTHER),
    ],
)
def test_call_signal(outcome, signal):
    assert call_signal(outcome) is signal


def test_limit_slow_starts_then_grows_by_one_per_window():
    limit = AdaptiveLimit(1, 32)
    seen = []
    for _ in range(5):
        limit.on_healthy(0.02)
        seen.append(limit.slots)
    assert seen == [2, 3, 4, 5, 6]  # +1 per success below the threshold (doubling per window)
    for _ in range(40):
        limit.on_healthy(0.02)
    assert limit.slots == 32  # capped at the maximum
    assert limit.on_congestion(limit.epoch)
    assert limit.slots == 16
    for _ in range(16):  # one window of successes above the threshold: +1 only
        limit.on_healthy(0.02)
    assert limit.limit == pytest.approx(17, abs=0.05)


def test_limit_cuts_once_per_window_and_never_below_the_minimum():
    limit = AdaptiveLimit(2, 64)
    for _ in range(30):
        limit.on_healthy(0.02)
    epoch = limit.epoch
    assert limit.on_congestion(epoch)
    after_first = limit.slots
    assert not limit.on_congestion(epoch)  # same window: a burst of 503s cuts once
    assert limit.slots == after_first
    for _ in range(10):
        limit.on_congestion(limit.epoch)
    assert limit.slots == 2


def test_limit_probes_slowly_near_the_last_congestion_point_then_forgets_it():
    limit = AdaptiveLimit(1, 32)
    for _ in range(4):
        limit.on_healthy(0.02)
    assert limit.slots == 5
    limit.on_congestion(limit.epoch)  # a service that takes 4 at once refused the 5th
    assert (limit.slots, limit.ceiling) == (2, 5.0)
    successes = 0
    while limit.slots < 4:
        limit.on_healthy(0.02)
        successes += 1
    assert successes <= 6  # back to 4 in a few calls
    while limit.slots < 5:
        limit.on_healthy(0.02)
        successes += 1
    assert successes >= 40  # the step to 5, where it was refused, is 10x slower
    while limit.limit <= 5.0:
        limit.on_healthy(0.02)
    assert limit.ceiling == float("inf")  # passed it without a complaint: forgotten


def test_limit_holds_when_latency_does_not():
    limit = AdaptiveLimit(1, 32)
    for _ in range(BASELINE_MIN_SAMPLES):
        limit.on_healthy(0.02)
    grown = limit.limit
    limit.on_healthy(0.05)  # > 2x the baseline (median 20 ms): hold
    assert limit.limit == grown
    limit.on_healthy(0.03)
    assert limit.limit == grown + 1


def test_one_fast_outlier_does_not_pin_the_limit():
    # the first answer in 1 ms, then every answer in 3 s. Judged against the
    # fastest answer ever seen the limit never grew; against the moving median it does.
    limit = AdaptiveLimit(1, 32)
    limit.on_healthy(0.001)
    for _ in range(BASELINE_WINDOW):
        limit.on_healthy(3.0)
    assert limit.baseline == 3.0
    assert limit.slots == 32


def test_a_latency_tail_holds_the_limit_rarely():
    # lognormal, median 20 ms, p99 ~80 ms: most answers are within 2x the median
    rng = random.Random(7)
    limit = AdaptiveLimit(1, 32)
    for _ in range(200):
        limit.on_healthy(rng.lognormvariate(math.log(0.02), 0.6))
    assert limit.slots == 32
    assert 0.015 < limit.baseline < 0.026


def test_a_slowing_service_holds_the_limit():
    limit = AdaptiveLimit(1, 32)
    for _ in range(BASELINE_WINDOW):
        limit.on_healthy(0.02)
    held = limit.limit
    for _ in range(20):  # queueing: answers at 3x the median, not yet enough to move it
        limit.on_healthy(0.06)
    assert limit.limit == held


def test_limit_rejects_bad_bounds():
    with pytest.raises(ValueError, match="minimum <= maximum"):
        AdaptiveLimit(5, 4)


def test_breaker_opens_on_consecutive_failures_only():
    breaker = Breaker(3)
    for row, signal in [("a", Signal.FAILED), ("b", Signal.OVERLOADED), ("c", Signal.HEALTHY)]:
        assert not breaker.record(row, signal)
    assert not breaker.record("d", Signal.THROTTLED)  # 429: the service answers, resets
    assert not breaker.record("e", Signal.FAILED)
    assert not breaker.record("x", Signal.OTHER)  # our own client error: neither
    assert not breaker.record("f", Signal.OVERLOADED)
    assert breaker.record("g", Signal.FAILED)
    assert breaker.is_open and breaker.failures_at_open == 3
    assert breaker.outage_rows == {"e", "f", "g"}
    assert not breaker.record("h", Signal.FAILED)  # in flight when it opened
    assert not breaker.record("i", Signal.HEALTHY)
    assert breaker.outage_rows == {"e", "f", "g", "h"}


def test_outage_decision_gives_the_attempt_back_even_at_max_attempts():
    decision = classify(CallOutcome(503, retry_after_seconds=30), 12, 12, outage=True)
    assert decision.verdict is Verdict.OUTAGE
    assert decision.error == "HttpServerError 503 retry_after=30s"
    assert decision.retry_after_seconds == 30
    assert decision.is_failed_call
    # an outage does not change final answers
    assert classify(CallOutcome(200), 3, 12, outage=True).verdict is Verdict.DONE
    assert classify(CallOutcome(404), 3, 12, outage=True).verdict is Verdict.QUARANTINE


def _gate(**kwargs):
    defaults = {"deadline": Deadline(60), "stopped": lambda: False}
    return CallGate(1, 8, 3, **{**defaults, **kwargs})


def test_gate_admits_up_to_the_limit_and_grows():
    gate = _gate()
    first = gate.acquire()
    assert first is not None
    blocked = threading.Event()

    def second():
        gate.acquire()
        blocked.set()

    threading.Thread(target=second, daemon=True).start()
    assert not blocked.wait(0.3)  # limit 1: the second call waits for the first
    gate.release(first, "r1", CallOutcome(200))
    assert blocked.wait(2)
    assert gate.limit.slots == 2 and gate.stats.peak_in_flight == 1


def test_gate_pauses_for_retry_after_and_stops_past_the_deadline():
    gate = _gate()
    ticket = gate.acquire()
    gate.release(ticket, "r1", CallOutcome(429, retry_after_seconds=0.4))
    started = time.monotonic()
    assert gate.acquire() is not None
    assert time.monotonic() - started >= 0.35
    assert gate.stats.throttled == 1 and gate.stats.paused_seconds == pytest.approx(0.4, 0.1)

    short = _gate(deadline=Deadline(1))
    ticket = short.acquire()
    short.release(ticket, "r1", CallOutcome(503, retry_after_seconds=120))
    started = time.monotonic()
    assert short.acquire() is None  # the pause outlasts the run: stop calling at once
    assert time.monotonic() - started < 0.5
    assert short.stats.stopped_by_retry_after

    long = _gate()
    ticket = long.acquire()
    long.release(ticket, "r1", CallOutcome(429, retry_after_seconds=MAX_PAUSE_SECONDS + 1))
    assert long.acquire() is None  # too long to sit out: stop calling for this run
    assert long.stats.stopped_by_retry_after


def test_gate_refuses_calls_once_the_breaker_is_open():
    opened = []
    gate = _gate(on_open=lambda breaker, outcome: opened.append(outcome.status_code))
    for i in range(3):
        ticket = gate.acquire()
        gate.release(ticket, f"r{i}", CallOutcome(500))
    assert gate.is_open and opened == [500]
    assert gate.acquire() is None
    assert gate.outage_row("r0") and not gate.outage_row("r9")


def test_gate_stop_signal_wakes_waiting_calls():
    stop = threading.Event()
    gate = _gate(stopped=stop.is_set)
    gate.acquire()  # holds the only slot
    got = []
    waiter = threading.Thread(target=lambda: got.append(gate.acquire()), daemon=True)
    waiter.start()
    stop.set()
    waiter.join(2)
    assert got == [None]


def test_an_overshoot_burst_of_refusals_does_not_open_the_breaker():
    # 9 calls in flight against a service serving 4: the 5 refusals come back at once
    gate = CallGate(9, 32, 3, deadline=Deadline(60), stopped=lambda: False)
    tickets = [gate.acquire() for _ in range(9)]
    for i, ticket in enumerate(tickets[:5]):
        gate.release(ticket, f"r{i}", CallOutcome(503))
    assert not gate.is_open  # one cut, one congestion event
    assert gate.limit.cuts == 1
    for i, ticket in enumerate(tickets[5:]):
        gate.release(ticket, f"ok{i}", CallOutcome(200))
    # a real outage still opens it: each call after a cut fails again
    for i in range(3):
        ticket = gate.acquire()
        gate.release(ticket, f"o{i}", CallOutcome(503))
    assert gate.is_open


def test_stale_failures_of_a_streak_that_opens_are_given_back_too():
    gate = CallGate(4, 32, 2, deadline=Deadline(60), stopped=lambda: False)
    tickets = [gate.acquire() for _ in range(4)]
    for i, ticket in enumerate(tickets):
        gate.release(ticket, f"s{i}", CallOutcome(503))  # one cut, three stale
    ticket = gate.acquire()
    gate.release(ticket, "next", CallOutcome(503))  # started after the cut: counts
    assert gate.is_open
    assert all(gate.outage_row(r) for r in ("s0", "s1", "s2", "s3", "next"))
