"""How many detach calls the job keeps in flight: a limit that finds the service's knee.

A service has a knee: up to some number of calls in flight it answers more calls per second
the more it is given; past it, the extra calls only wait (in a worker pool, an accept queue,
a load balancer) and every other caller waits with them. Little's law says where the knee is:
with ``L`` calls in flight and a mean latency ``W`` the service turns around ``L / W`` calls a
second, so once more calls in flight bring no more answers, the *mean* latency grows with
``L``. The rule (docs/design/detach.md, "Finding the knee"), after TCP Vegas and the
Gradient limits of Netflix's concurrency-limits:

- **Windows.** Answers are judged a window at a time: a window closes after
  ``max(WINDOW_MIN_CALLS, WINDOW_ROUNDS x limit)`` answers of calls started in it (2xx and
  other 4xx: the service did the work), about four rounds of the limit. Its mean latency
  ``W`` counts a tail that a median cannot see: one call in a hundred held a second in a
  full accept queue lifts the mean by half.
- **Base.** ``W0`` is the run's lowest window mean: the latency with nothing queued (Vegas's
  base RTT). Each mean is taken with its noise (``NOISE_Z`` standard errors): the base is the
  lowest upper bound and a window is judged by its lower bound, so a latency tail neither sets
  a base too low nor crosses a bar by chance. It is kept for the run (a base that expired
  would drift up with the job's own queueing); the next run measures afresh.
- **Growth.** ``W < GROW_BELOW x W0``: nothing much queues, and the limit grows if the window
  used it (a run with less work does not raise a limit it never reached): doubling per window
  up to half the maximum, then a quarter per window (slow start), then ``+1`` per window.
- **Back to the knee.** ``W >= CUT_ABOVE x W0`` (or ``GROW_BELOW`` in slow start): the calls
  queue. The limit comes back towards the knee it has just measured, the calls the service
  turns around at its base latency, ``limit x W0 / W + 1``, at most ``KNEE_STEP`` lower per
  window (part of the rise may be the job's own queueing). In between: hold.
- **Congestion** (429, 502/503/504, a timeout, a connection error, a **stall**) halves the
  limit, at most once per epoch (calls started before the cut do not cut again), never below the
  minimum, and for ``CEILING_SECONDS`` the limit stays a fifth (at least one call) below where
  it was cut, so a cliff hit again within that time brings the ceiling down. A stall is a call
  in flight longer than ``STALL_FACTOR x W0`` (at least :data:`STALL_MIN_SECONDS`): a dropped
  connection attempt, which TCP retries only after a second, or a caller parked behind a full
  pool. It counts once, when the gate first sees it, not when it ends.

Plain object without threads or clocks: the gate passes the times; table-tested in
``tests/unit/test_snapshot_detach_limit.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WINDOW_MIN_CALLS = 16  # fewer answers say too little about a mean latency
WINDOW_ROUNDS = 4  # a window holds about this many rounds of the limit
CEILING_SECONDS = 10.0  # after a congestion cut the limit stays below it this long
GROW_BELOW = 2.0  # window mean below this times the base: nothing much queues, grow
CUT_ABOVE = 2.5  # at or above this times the base: calls queue, back to the knee
KNEE_STEP = 0.8  # a window of queueing lowers the limit by at most a fifth
DECREASE_FACTOR = 0.5  # cut on a congestion signal
NOISE_Z = 2.0  # a window mean is judged by its confidence bounds, this many standard errors
STALL_FACTOR = 10.0  # a call in flight this many times the base is stalled
STALL_MIN_SECONDS = 0.5  # never shorter: a garbage collection of a big interpreter pauses
# every thread for a few hundred ms; a dropped connection attempt takes 1 s


@dataclass
class AdaptiveLimit:
    """The concurrency limit between ``minimum`` and ``maximum`` (no threads, no clock)."""

    minimum: int
    maximum: int
    limit: float = 0.0
    slow_start: bool = True
    epoch: int = 0  # cuts so far; a call remembers the epoch it started in
    cuts: int = 0  # congestion cuts (halvings)
    knee_cuts: int = 0  # latency-driven returns to the measured knee
    windows: int = 0  # windows judged so far
    base: float = math.inf  # the run's lowest window mean (inf before the first window)
    ceiling: float = math.inf  # the limit stays below it until ceiling_until
    ceiling_until: float = -math.inf
    _window_started: float = -math.inf
    _window_sum: float = 0.0
    _window_squares: float = 0.0
    _window_calls: int = 0
    _window_peak: int = 0  # most calls in flight at once in this window

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"need 1 <= minimum <= maximum, got {self.minimum}..{self.maximum}")
        self.limit = float(self.minimum)

    @property
    def slots(self) -> int:
        return max(self.minimum, min(self.maximum, int(self.limit)))

    @property
    def stall_seconds(self) -> float:
        """A call in flight longer than this is stalled (inf until there is a base)."""
        return max(STALL_FACTOR * self.base, STALL_MIN_SECONDS)

    def window_size(self) -> int:
        return max(WINDOW_MIN_CALLS, WINDOW_ROUNDS * self.slots)

    def on_start(self, in_flight: int) -> None:
        """A call started; ``in_flight`` counts it."""
        self._window_peak = max(self._window_peak, in_flight)

    def on_answer(self, started: float, now: float) -> None:
        """A call started at ``started`` was answered (2xx or another 4xx) at ``now``."""
        if started < self._window_started:
            return  # started under the previous window's limit: it would blur this one
        latency = now - started
        self._window_sum += latency
        self._window_squares += latency * latency
        self._window_calls += 1
        if self._window_calls >= self.window_size():
            self._close_window(now)

    def on_congestion(self, started_epoch: int, now: float) -> bool:
        """Cut once per epoch: a call started before the last cut does not cut again."""
        if started_epoch < self.epoch:
            return False
        # where the service pushed back is not probed again for a while, and a cliff hit
        # again within that while lowers the ceiling by a fifth each time
        self.ceiling = max(float(self.minimum), min(self.limit - 1, KNEE_STEP * self.limit))
        self.ceiling_until = now + CEILING_SECONDS
        self.limit = max(float(self.minimum), self.limit * DECREASE_FACTOR)
        self.slow_start = False
        self.epoch += 1
        self.cuts += 1
        return True

    def _close_window(self, now: float) -> None:
        n = self._window_calls
        mean = self._window_sum / n
        variance = max(0.0, self._window_squares - n * mean * mean) / (n - 1)
        error = NOISE_Z * math.sqrt(variance / n)
        # the base is the lowest upper bound, and a window queues only if even its lower
        # bound is above it: noise alone (a lognormal tail) neither sets nor crosses a bar
        self.windows += 1
        self.base = min(self.base, mean + error)
        self.adjust(mean, self.base, used=self._window_peak >= self.slots, error=error)
        if now < self.ceiling_until:
            self.limit = min(self.limit, max(self.ceiling, float(self.minimum)))
        self._window_started = now
        self._window_sum = self._window_squares = 0.0
        self._window_calls = 0
        self._window_peak = 0

    def adjust(self, mean: float, base: float, *, used: bool, error: float = 0.0) -> None:
        """Judge one window: its mean latency (± ``error``) against the base."""
        ratio = (mean - error) / base if base > 0 else 1.0
        if ratio >= CUT_ABOVE or (self.slow_start and ratio >= GROW_BELOW):
            # at most KNEE_STEP down per window: part of the rise may be the job's own
            # queueing (its threads share one interpreter), which costs the service nothing
            knee = max(self.limit * base / mean + 1, KNEE_STEP * self.limit)
            self.limit = max(float(self.minimum), min(self.limit, knee))
            self.slow_start = False
            self.knee_cuts += 1
        elif ratio >= GROW_BELOW:
            pass  # a little queueing: hold
        elif used:
            if not self.slow_start:
                grown = self.limit + 1
            elif self.limit < self.maximum / 2:
                grown = 2 * self.limit
            else:  # the upper half a quarter at a time: less to overshoot a cliff by
                grown = 1.25 * self.limit
            self.limit = min(float(self.maximum), grown)
