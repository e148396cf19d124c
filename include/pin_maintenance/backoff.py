"""Retry backoff for the detach outbox (docs/design.md, "Selections API"): pure functions, no I/O.

After claim number ``n`` (``attempts`` after the pre-increment) the next attempt is due at
``now + min(base * factor ** (n - 1), cap) + jitter`` with ``jitter`` uniform in
``[0, 0.1 * delay]``. Jitter spreads a backlog that failed together (a selections outage) so it
does not come back as one burst.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

JITTER_FRACTION = 0.1


@dataclass(frozen=True)
class Backoff:
    base_seconds: float
    factor: float
    cap_seconds: float

    def delay(self, attempts: int) -> float:
        """The backoff in seconds after claim number ``attempts`` (>= 1), without jitter."""
        return backoff_delay(attempts, self.base_seconds, self.factor, self.cap_seconds)

    def delay_with_jitter(self, attempts: int, uniform: Callable[[float, float], float]) -> float:
        """``delay + jitter``; ``uniform`` is e.g. ``random.Random().uniform`` (injectable)."""
        base = self.delay(attempts)
        return base + jitter(base, uniform)


def backoff_delay(attempts: int, base: float, factor: float, cap: float) -> float:
    """``min(base * factor ** (attempts - 1), cap)``; attempts below 1 count as 1.

    Computed in log space so that a huge attempt count (a row requeued many times, a factor of
    10) cannot overflow a float before the cap applies.
    """
    n = max(int(attempts), 1) - 1
    if base <= 0:
        raise ValueError(f"backoff base must be > 0, got {base!r}")
    if factor < 1:
        raise ValueError(f"backoff factor must be >= 1, got {factor!r}")
    if n == 0 or factor == 1:
        return min(base, cap)
    if math.log(base) + n * math.log(factor) >= math.log(cap):
        return cap
    return min(base * factor**n, cap)


def jitter(delay: float, uniform: Callable[[float, float], float] = random.uniform) -> float:
    """A jitter uniform in ``[0, JITTER_FRACTION * delay]``."""
    return uniform(0.0, JITTER_FRACTION * delay)
