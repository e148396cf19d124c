"""The gate every detach call passes: how many are in flight, and when calls stop (the rules:
docs/design/detach.md). The rules are plain objects; :class:`CallGate` is the thread-safe part."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from include.pin_maintenance.jobs.snapshot_detach_answers import Answer, Load, Route, Streak
from include.pin_maintenance.jobs.snapshot_detach_config import DetachConfig
from include.pin_maintenance.parallel import Deadline

WAIT_SLICE_SECONDS = 0.2  # a waiting worker rechecks the stop signal at least this often
STALL_SCAN_SECONDS = 0.05  # calls in flight are looked at no more often (a stall is >= 0.5 s)
MAX_PAUSE_SECONDS = 30.0  # a longer Retry-After stops calling for the run instead of pausing
WINDOW_MIN_CALLS = 16  # fewer answers say too little about a mean latency
WINDOW_ROUNDS = 4  # a window holds about this many rounds of the limit
CEILING_SECONDS = 10.0  # after a congestion cut the limit stays below it this long
GROW_BELOW = 2.0  # window mean below this times the base: nothing much queues, grow
CUT_ABOVE = 2.5  # at or above this times the base: calls queue, back to the knee
KNEE_STEP = 0.8  # a window of queueing lowers the limit by at most a fifth
DECREASE_FACTOR = 0.5  # cut on a congestion signal
NOISE_Z = 2.0  # a window mean is judged by its confidence bounds, this many standard errors
STALL_FACTOR = 10.0  # a call in flight this many times the base is stalled
STALL_MIN_SECONDS = 0.5  # never shorter: a garbage collection pauses every thread for longer


@dataclass
class AdaptiveLimit:
    """How many detach calls the job keeps in flight (docs/design/detach.md, "Finding the knee")."""

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
        if self._window_calls >= max(WINDOW_MIN_CALLS, WINDOW_ROUNDS * self.slots):
            self._close_window(now)

    def on_congestion(self, started_epoch: int, now: float) -> bool:
        """Cut once per epoch: a call started before the last cut does not cut again."""
        if started_epoch < self.epoch:
            return False
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
        self.windows += 1
        self.base = min(self.base, mean + error)
        self.adjust(mean, self.base, used=self._window_peak >= self.slots, error=error)
        if now < self.ceiling_until:
            self.limit = min(self.limit, max(self.ceiling, float(self.minimum)))
        self._window_started = now
        self._window_sum = self._window_squares = 0.0
        self._window_calls = self._window_peak = 0

    def adjust(self, mean: float, base: float, *, used: bool, error: float = 0.0) -> None:
        """Judge one window: its mean latency (± ``error``) against the base."""
        ratio = (mean - error) / base if base > 0 else 1.0
        if ratio >= CUT_ABOVE or (self.slow_start and ratio >= GROW_BELOW):
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


@dataclass
class Breaker:
    """Consecutive failed calls open it; the rows of that streak are the outage's evidence."""

    threshold: int
    is_open: bool = False
    streak: list[str] = field(default_factory=list)  # row ids of the current failure streak
    stale_rows: list[str] = field(default_factory=list)  # failures in it that did not count
    outage_rows: set[str] = field(default_factory=set)
    failures_at_open: int = 0

    def record(self, row_id: str, streak: Streak, *, stale: bool = False) -> bool:
        """Count one finished call; True when this call opened the breaker. ``stale``: started
        before the limit's last cut, its failure joins the streak without counting."""
        if self.is_open:
            if streak is Streak.FAILURE:
                self.outage_rows.add(row_id)  # in flight when it opened, failed the same way
            return False
        if streak is Streak.RESET:
            self.streak.clear()
            self.stale_rows.clear()
        elif streak is Streak.FAILURE:
            (self.stale_rows if stale else self.streak).append(row_id)
        if len(self.streak) < self.threshold:
            return False
        self.is_open = True
        self.failures_at_open = len(self.streak)
        self.outage_rows.update(self.streak)
        self.outage_rows.update(self.stale_rows)
        return True


@dataclass
class Misroute:
    """404s with no 2xx in the run: after ``limit`` of them the route looks wrong."""

    limit: int
    is_open: bool = False
    successes: int = 0
    quarantined_404s: int = 0  # 404s let through to quarantine while no 2xx was seen
    rows: set[str] = field(default_factory=set)  # 404 rows given back as the misroute's evidence

    def record(self, row_id: str, route: Route) -> None:
        """Count one finished call's route; the 404 past the limit opens the breaker."""
        if route is Route.WORKS:
            self.successes += 1
        elif route is Route.NOT_FOUND:
            if not (self.is_open or self.successes or self.quarantined_404s < self.limit):
                self.is_open = True
            if self.is_open:
                self.rows.add(row_id)
            elif not self.successes:
                self.quarantined_404s += 1


@dataclass(eq=False)
class Ticket:
    """One admitted call: the epoch it started in, when, and whether it was seen stalled."""

    epoch: int
    started: float
    stalled: bool = False


@dataclass
class GateStats:
    """What the gate saw, under the run result's names (``DetachResult``)."""

    calls: int = 0
    throttled: int = 0  # answers that throttle (answer table)
    concurrency_peak: int = 0  # most calls in flight at once
    call_stalls: int = 0  # calls seen in flight past the limit's stall time
    call_retries: int = 0  # calls lost to the job's own overload and made once more
    retry_after_paused_seconds: float = 0.0


class CallGate:
    """``acquire`` waits until a call may start (a :class:`Ticket`; None: it must not be made),
    ``release`` reports its answer; ``on_open`` runs once, when the outage breaker opens."""

    def __init__(
        self,
        config: DetachConfig,
        *,
        deadline: Deadline,
        stopped: Callable[[], bool],
        on_open: Callable[[Breaker, Answer], None] = lambda breaker, answer: None,
    ) -> None:
        self.limit = AdaptiveLimit(config.detach_concurrency_min, config.detach_concurrency)
        self.outage_breaker = Breaker(config.breaker_failure_threshold)
        self.misroute = Misroute(config.misroute_quarantine_limit)
        self.stats = GateStats()
        self.auth_rejected = False  # a 401/403 answer: the credentials are refused
        self.retry_after_stopped = False  # a Retry-After the run's bound cannot sit out
        self._deadline, self._clock = deadline, deadline.clock
        self._stopped, self._on_open = stopped, on_open
        self._call_seconds = config.detach_call_timeout_seconds
        self._cond = threading.Condition()
        self._active: set[Ticket] = set()  # calls in flight
        self._answered_started = float("-inf")  # the latest start of a call that was answered
        self._next_stall_scan = float("-inf")
        self._paused_until = 0.0

    @property
    def stop_reason(self) -> str | None:
        """Why no call starts for the rest of the run (refused credentials first), or None."""
        if self.auth_rejected:
            return "auth_failed"
        if self.outage_breaker.is_open:
            return "selections_unavailable"
        if self.misroute.is_open:
            return "selections_misrouted"
        if self.retry_after_stopped:
            return "retry_after"
        return None

    @property
    def deadline_reached(self) -> bool:
        """The deadline no longer allows a whole call: no call starts any more."""
        return not self._deadline.allows(self._call_seconds)

    def call_timeout(self) -> float:
        """A call's timeout: a whole call fitted when it started; never past the deadline."""
        return max(self._deadline.timeout(self._call_seconds), 0.001)

    def outage_row(self, row_id: str) -> bool:
        with self._cond:
            return row_id in self.outage_breaker.outage_rows

    def misroute_row(self, row_id: str) -> bool:
        with self._cond:
            return row_id in self.misroute.rows

    def close(self) -> None:
        """Wake every waiting worker (they then see the stop and return None)."""
        with self._cond:
            self._cond.notify_all()

    def acquire(self) -> Ticket | None:
        with self._cond:
            while True:
                if self.stop_reason or self._stopped() or self.deadline_reached:
                    return None
                now = self._clock()
                if self._paused_until > now:
                    # the pause must end while a whole call still fits before the deadline
                    if self._paused_until - now > self._deadline.remaining() - self._call_seconds:
                        self.retry_after_stopped = True
                        self._cond.notify_all()
                        return None
                    self._cond.wait(self._deadline.timeout(min(self._paused_until - now, 0.2)))
                    continue
                self._check_stalls(now)
                if len(self._active) < self.limit.slots:
                    ticket = Ticket(self.limit.epoch, now)
                    self._active.add(ticket)
                    self.stats.calls += 1
                    in_flight = len(self._active)
                    self.stats.concurrency_peak = max(self.stats.concurrency_peak, in_flight)
                    self.limit.on_start(in_flight)
                    return ticket
                # woken by a release; the timeout rechecks the stop signal and the deadline
                self._cond.wait(self._deadline.timeout(WAIT_SLICE_SECONDS))

    def _check_stalls(self, now: float) -> None:
        """Count each call in flight past the stall time once, as congestion (under the lock)."""
        if now >= self._next_stall_scan:
            self._next_stall_scan = now + STALL_SCAN_SECONDS
            for ticket in self._active:
                self._check_stall(ticket, now)

    def _check_stall(self, ticket: Ticket, now: float) -> None:
        if ticket.stalled:
            return
        if now - ticket.started > self.limit.stall_seconds:
            ticket.stalled = True
            self.stats.call_stalls += 1
            self.limit.on_congestion(ticket.epoch, now)

    def release(self, ticket: Ticket, row_id: str, answer: Answer) -> bool:
        """Report a call's answer; True when it may be made once more (lost in transport while
        the service answered calls started after it)."""
        with self._cond:
            now = self._clock()
            self._check_stalls(now)
            self._active.discard(ticket)
            self._check_stall(ticket, now)  # a stall is a stall however it ends
            if answer.load is Load.LATENCY:
                self.limit.on_answer(ticket.started, now)
                self._answered_started = max(self._answered_started, ticket.started)
            cut = answer.load is Load.CONGESTION and self.limit.on_congestion(ticket.epoch, now)
            if answer.throttles:
                self.stats.throttled += 1
                wait = answer.retry_after_seconds
                if wait and wait > MAX_PAUSE_SECONDS:
                    self.retry_after_stopped = True
                elif wait and now + wait > self._paused_until:
                    paused = now + wait - max(self._paused_until, now)
                    self.stats.retry_after_paused_seconds += paused
                    self._paused_until = now + wait
            # a failure of a call started before the last cut is that cut's congestion
            stale = not cut and ticket.epoch < self.limit.epoch
            opened = self.outage_breaker.record(row_id, answer.streak, stale=stale)
            self.misroute.record(row_id, answer.route)
            if answer.stops_calls:
                self.auth_rejected = True
            if self.stop_reason:
                self._cond.notify_all()  # every waiting worker returns
            else:  # wake only as many waiting workers as there are free slots
                self._cond.notify(max(1, self.limit.slots - len(self._active)))
            lost = answer.lost_in_transport and self._answered_started > ticket.started
            if retry := lost and not self.stop_reason:
                self.stats.call_retries += 1
        if opened:
            self._on_open(self.outage_breaker, answer)
        return retry
