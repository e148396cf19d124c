"""Retry backoff for the detach outbox (docs/design.md, "Selections API"): pure, no I/O. Jitter
spreads a backlog that failed together (an outage) so it does not come back as one burst."""

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
        """``min(base * factor ** (attempts - 1), cap)``, attempts below 1 counting as 1; the
        cap is found in log space, so a huge attempt count cannot overflow a float first."""
        base, factor, cap = self.base_seconds, self.factor, self.cap_seconds
        n = max(int(attempts), 1) - 1
        if n == 0 or factor == 1:
            return min(base, cap)
        if math.log(base) + n * math.log(factor) >= math.log(cap):
            return cap
        return min(base * factor**n, cap)

    def delay_with_jitter(self, attempts: int, uniform: Callable[[float, float], float]) -> float:
        """``delay`` plus ``uniform(0, JITTER_FRACTION * delay)`` (e.g. ``random.uniform``)."""
        delay = self.delay(attempts)
        return delay + uniform(0.0, JITTER_FRACTION * delay)
