"""Adaptive concurrency, Retry-After pauses and the outage breaker (pure rules + the gate).

The gate reads each call's answer (tests/unit/test_snapshot_detach_answers.py has the table)."""

from __future__ import annotations

import threading
import time

import pytest

from include.pin_maintenance.jobs.snapshot_detach_answers import CallOutcome, Streak, answer_of
from include.pin_maintenance.jobs.snapshot_detach_config import CONFIG
from include.pin_maintenance.jobs.snapshot_detach_gate import (
    MAX_PAUSE_SECONDS,
    WINDOW_MIN_CALLS,
    Breaker,
    CallGate,
)
from include.pin_maintenance.parallel import Deadline


def answer(*args, **kwargs):
    """A call's answer, as the worker hands it to the gate."""
    return answer_of(CallOutcome(*args, **kwargs))


def test_breaker_opens_on_consecutive_failures_only():
    breaker = Breaker(3)
    for row, code in [("a", 500), ("b", 503), ("c", 200)]:
        assert not breaker.record(row, answer(code).streak)
    assert not breaker.record("d", answer(429).streak)  # 429: the service answers, resets
    assert not breaker.record("e", answer(500).streak)
    client_error = answer(error_class="ClientError:RuntimeError")
    assert client_error.streak is Streak.NONE
    assert not breaker.record("x", client_error.streak)  # our own client error: neither
    assert not breaker.record("f", answer(error_class="Timeout").streak)
    assert breaker.record("g", answer(500).streak)
    assert breaker.is_open and breaker.failures_at_open == 3
    assert breaker.outage_rows == {"e", "f", "g"}
    assert not breaker.record("h", Streak.FAILURE)  # in flight when it opened
    assert not breaker.record("i", Streak.RESET)
    assert breaker.outage_rows == {"e", "f", "g", "h"}


def _gate(minimum=1, maximum=8, threshold=3, **kwargs):
    """A gate with these bounds and breaker threshold; a call may start until the deadline."""
    config = CONFIG.resolve(
        None,
        {
            "detach_concurrency_min": minimum,
            "detach_concurrency": maximum,
            "breaker_failure_threshold": threshold,
            "detach_call_timeout_seconds": 0.001,
        },
    )
    defaults = {"deadline": Deadline(60), "stopped": lambda: False}
    return CallGate(config, **{**defaults, **kwargs})


def test_gate_admits_up_to_the_limit_and_grows():
    gate = _gate()
    first = gate.acquire()
    assert first is not None
    blocked = threading.Event()
    got = []

    def second():
        got.append(gate.acquire())
        blocked.set()

    waiter = threading.Thread(target=second, daemon=True)
    waiter.start()
    assert not blocked.wait(0.3)  # limit 1: the second call waits for the first
    gate.release(first, "r1", answer(200))
    assert blocked.wait(2)
    waiter.join(2)
    assert gate.limit.slots == 1 and gate.stats.concurrency_peak == 1
    gate.release(got[0], "r2", answer(200))
    for i in range(WINDOW_MIN_CALLS):  # a window of healthy answers at the limit: it grows
        gate.release(gate.acquire(), f"w{i}", answer(200))
    assert gate.limit.slots == 2


def _gate_at_base():
    """A gate on a settable clock (``now[0]``), 8 calls allowed, base latency 20 ms."""
    now = [0.0]
    gate = _gate(deadline=Deadline(600, clock=lambda: now[0]))
    gate.limit.limit = 8.0
    gate.limit.base = 0.02
    return gate, now


def _traffic(gate, now, until, step=0.1):
    """Other calls passing the gate every ``step`` seconds until ``until`` (20 ms each)."""
    while now[0] + step < until:
        now[0] += step
        ticket = gate.acquire()
        now[0] += 0.02
        gate.release(ticket, "other", answer(200))


def test_gate_counts_a_call_stalled_in_flight_as_congestion_before_it_ends():
    gate, now = _gate_at_base()  # stall time: at least 0.5 s
    stuck = gate.acquire()  # a dropped connection attempt: no answer for a second
    _traffic(gate, now, 0.55)  # while the others get through
    now[0] = 0.6
    ticket = gate.acquire()  # the gate looks at the calls in flight whenever it admits one
    assert gate.stats.call_stalls == 1 and gate.limit.slots == 4
    assert not gate.release(ticket, "fast", answer(200))
    now[0] = 1.02
    assert not gate.release(stuck, "slow", answer(200))  # counted once, not again
    assert gate.stats.call_stalls == 1 and gate.limit.cuts == 1


def test_a_stalled_call_lost_while_the_service_answered_others_may_be_made_again():
    gate, now = _gate_at_base()
    lost = gate.acquire()
    _traffic(gate, now, 5.0)  # calls started after it are answered
    now[0] = 5.0
    assert gate.release(lost, "lost", answer(error_class="Timeout"))
    assert gate.stats.call_retries == 1
    # a service that answers nobody (an outage) gets no second call
    down = gate.acquire()
    now[0] = 10.0
    assert not gate.release(down, "down", answer(error_class="ConnectionError"))
    # nor does a call that failed fast (refused), stalled or not
    quick = gate.acquire()
    assert not gate.release(quick, "refused", answer(error_class="ConnectionError"))


def test_a_connection_lost_fast_while_the_service_answered_others_may_be_made_again():
    gate, now = _gate_at_base()
    reset = gate.acquire()
    now[0] = 0.01
    gate.release(gate.acquire(), "later", answer(200))  # started after it, answered
    now[0] = 0.03  # well before a stall: the connection was reset, not dropped
    assert gate.release(reset, "reset", answer(error_class="ConnectionError"))
    assert gate.stats.call_retries == 1 and gate.stats.call_stalls == 0


def test_gate_pauses_for_retry_after_and_stops_past_the_deadline():
    gate = _gate()
    ticket = gate.acquire()
    gate.release(ticket, "r1", answer(429, retry_after_seconds=0.4))
    started = time.monotonic()
    assert gate.acquire() is not None
    assert time.monotonic() - started >= 0.35
    assert gate.stats.throttled == 1 and gate.stats.retry_after_paused_seconds == pytest.approx(
        0.4, 0.1
    )

    short = _gate(deadline=Deadline(1))
    ticket = short.acquire()
    short.release(ticket, "r1", answer(503, retry_after_seconds=120))
    started = time.monotonic()
    assert short.acquire() is None  # the pause outlasts the run: stop calling at once
    assert time.monotonic() - started < 0.5
    assert short.retry_after_stopped

    long = _gate()
    ticket = long.acquire()
    long.release(ticket, "r1", answer(429, retry_after_seconds=MAX_PAUSE_SECONDS + 1))
    assert long.acquire() is None  # too long to sit out: stop calling for this run
    assert long.retry_after_stopped


def test_gate_refuses_calls_once_the_breaker_is_open():
    opened = []
    gate = _gate(on_open=lambda breaker, outcome: opened.append(outcome.status_code))
    for i in range(3):
        ticket = gate.acquire()
        gate.release(ticket, f"r{i}", answer(500))
    assert gate.outage_breaker.is_open and opened == [500]
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
    gate = _gate(9, 32, 3)
    tickets = [gate.acquire() for _ in range(9)]
    for i, ticket in enumerate(tickets[:5]):
        gate.release(ticket, f"r{i}", answer(503))
    assert not gate.outage_breaker.is_open  # one cut, one congestion event
    assert gate.limit.cuts == 1
    for i, ticket in enumerate(tickets[5:]):
        gate.release(ticket, f"ok{i}", answer(200))
    # a real outage still opens it: each call after a cut fails again
    for i in range(3):
        ticket = gate.acquire()
        gate.release(ticket, f"o{i}", answer(503))
    assert gate.outage_breaker.is_open


def test_stale_failures_of_a_streak_that_opens_are_given_back_too():
    gate = _gate(4, 32, 2)
    tickets = [gate.acquire() for _ in range(4)]
    for i, ticket in enumerate(tickets):
        gate.release(ticket, f"s{i}", answer(503))  # one cut, three stale
    ticket = gate.acquire()
    gate.release(ticket, "next", answer(503))  # started after the cut: counts
    assert gate.outage_breaker.is_open
    assert all(gate.outage_row(r) for r in ("s0", "s1", "s2", "s3", "next"))
