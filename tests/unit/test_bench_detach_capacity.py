"""The capacity bench's reading of the selections service's call log (pure)."""

from __future__ import annotations

import math

import pytest

from devtools.bench_detach_capacity import settle_and_ratio


def _log(windows):
    """One entry per call: (second, accepted, refused) per window -> [at, in_flight, refused]."""
    calls = []
    for second, accepted, refused in windows:
        calls += [[second + i / 1000, 4, False] for i in range(accepted)]
        calls += [[second + 0.5 + i / 1000, 4, True] for i in range(refused)]
    return calls


def test_never_over_the_limit_is_settled_at_once():
    settled, after, total = settle_and_ratio(_log([(0, 100, 5), (1, 100, 10), (2, 100, 0)]))
    assert settled == 0.0
    assert after == total == pytest.approx(315 / 300)


def test_settles_after_the_last_window_with_too_many_refusals():
    log = _log([(0, 20, 40), (1, 100, 30), (2, 100, 10), (3, 100, 5)])
    settled, after, total = settle_and_ratio(log)
    assert settled == 2.0  # window 1 still refused 30 % of what was accepted
    assert after == pytest.approx(215 / 200)
    assert total == pytest.approx(405 / 320)


def test_empty_log_is_not_a_number():
    assert all(math.isnan(v) for v in settle_and_ratio([]))
