"""Backoff of the detach outbox: min(base * factor^(n-1), cap) + jitter.

docs/design.md, "Selections API".
"""

from __future__ import annotations

import random

import pytest

from include.pin_maintenance.backoff import Backoff

DEFAULT = Backoff(base_seconds=60, factor=2.0, cap_seconds=1800)


@pytest.mark.parametrize(
    ("attempts", "expected"),
    [
        (0, 60),  # below 1 counts as the first attempt
        (1, 60),
        (2, 120),
        (3, 240),
        (4, 480),
        (5, 960),
        (6, 1800),  # 1920 capped
        (7, 1800),
        (12, 1800),
        (10_000, 1800),  # no overflow on absurd counts
    ],
)
def test_default_backoff_by_attempt(attempts, expected):
    assert DEFAULT.delay(attempts) == expected


@pytest.mark.parametrize(
    ("attempts", "base", "factor", "cap", "expected"),
    [
        (1, 5, 3.0, 100, 5),
        (2, 5, 3.0, 100, 15),
        (3, 5, 3.0, 100, 45),
        (4, 5, 3.0, 100, 100),
        (9, 10, 1.0, 50, 10),  # factor 1 = constant backoff
        (1, 60, 2.0, 60, 60),  # cap == base
        (3, 0.5, 2.0, 10, 2.0),  # sub-second bases work
        (500, 1, 10.0, 3600, 3600),
    ],
)
def test_backoff_table(attempts, base, factor, cap, expected):
    assert Backoff(base, factor, cap).delay(attempts) == pytest.approx(expected)


@pytest.mark.parametrize("attempts", [1, 2, 3, 5, 6, 20])
def test_jitter_stays_within_a_tenth_of_the_delay(attempts):
    rng = random.Random(attempts)
    base = DEFAULT.delay(attempts)
    samples = [DEFAULT.delay_with_jitter(attempts, rng.uniform) for _ in range(500)]
    assert all(base <= s <= base * 1.1 for s in samples)
    assert max(samples) > base  # jitter really is applied


def test_jitter_bounds_are_exact_at_the_extremes():
    hundred = Backoff(base_seconds=100, factor=1.0, cap_seconds=100)
    assert hundred.delay_with_jitter(1, lambda lo, hi: lo) == 100
    assert hundred.delay_with_jitter(1, lambda lo, hi: hi) == pytest.approx(110)
    assert DEFAULT.delay_with_jitter(6, lambda lo, hi: hi) == pytest.approx(1980)


@pytest.mark.parametrize(("base", "factor"), [(0, 2.0), (-1, 2.0), (60, 0.5)])
def test_invalid_parameters_are_refused(base, factor):
    with pytest.raises(ValueError):
        Backoff(base, factor, 1800)
