"""Retry backoff for the detach outbox (docs/design.md, "Selections API"): pure functions, no I/O.

After claim number ``n`` (``attempts`` after the pre-increment) the next attempt is due at
``now + min(base * factor ** (n - 1), cap) + jitter`` with ``jitter`` uniform in
``[0, 0.1 * delay]``. Jitter spreads a backlog that failed together (a selections outage) so it
does not come back as one burst.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

JITTER_FRACTION = 0.1


@dataclass(frozen=True)
class Backoff:
    base_seconds: float
    factor: float
    cap_seconds: float

    def __post_init__(self) -> None:
        if self.base_seconds <= 0:
            raise ValueError(f"backoff base must be > 0, got {self.base_seconds!r}")
        if self.factor < 1:
            raise ValueError(f"backoff factor must be >= 1, got {self.factor!r}")

    def delay(self, attempts: int) -> float:
        """``min(base * factor ** (attempts - 1), cap)``, without jitter; attempts below 1
        count as 1.

        Computed in log space so that a huge attempt count (a row requeued many times, a factor
        of 10) cannot overflow a float before the cap applies.
        """
        base, factor, cap = self.base_seconds, self.factor, self.cap_seconds
        n = max(int(attempts), 1) - 1
        if n == 0 or factor == 1:
            return min(base, cap)
        if math.log(base) + n * math.log(factor) >= math.log(cap):
            return cap
        return min(base * factor**n, cap)

    def delay_with_jitter(self, attempts: int, uniform: Callable[[float, float], float]) -> float:
        """``delay`` plus a jitter uniform in ``[0, JITTER_FRACTION * delay]``; ``uniform`` is
        e.g. ``random.Random().uniform`` (injectable)."""
        delay = self.delay(attempts)
        return delay + uniform(0.0, JITTER_FRACTION * delay)
