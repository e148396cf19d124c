"""Database work side by side: lanes under one deadline, stopped as one, and the batch loop
the batch jobs run on them (docs/design.md, "Running side by side")."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from include.pin_maintenance.stopping import StopReason, StopSignal

if TYPE_CHECKING:
    from include.pin_maintenance.pacing import Pacer

T = TypeVar("T")


class Deadline:
    """A fixed point on a monotonic clock; every wait of a run takes its timeout from it."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._at = clock() + max(0.0, float(seconds))

    def remaining(self) -> float:
        return max(0.0, self._at - self.clock())

    def expired(self) -> bool:
        return self.clock() >= self._at

    def timeout(self, cap: float | None = None) -> float:
        """The timeout for one wait: what is left of the run, at most ``cap``."""
        left = self.remaining()
        return left if cap is None else min(left, max(0.0, cap))

    def allows(self, seconds: float) -> bool:
        """Whether something that may take ``seconds`` can still finish before the deadline."""
        return self.remaining() >= seconds


class LanesDidNotStop(RuntimeError):
    """Some lanes were still running after the bounded join (they were asked to stop)."""


@dataclass
class Lane:
    """What one lane gets: its number, the crew's stop signal, the run's deadline, and
    ``on_cancel(hook)``: ``hook`` runs (from another thread, or now if already cancelled) when
    the crew is cancelled, to interrupt what the lane may block in (``conn.cancel_safe``)."""

    index: int
    stop: StopSignal
    deadline: Deadline
    on_cancel: Callable[[Callable[[], object]], None] = field(repr=False)


class _Crew:
    def __init__(self, stop: StopSignal) -> None:
        self.stop = StopSignal(parent=stop)
        self.errors: list[BaseException] = []
        self._hooks: list[Callable[[], object]] = []
        self._lock = threading.Lock()
        self._cancelled = False

    def add_hook(self, hook: Callable[[], object]) -> None:
        with self._lock:
            self._hooks.append(hook)
            run_now = self._cancelled
        if run_now:
            _quietly(hook)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(exc)
        self.cancel(f"{type(exc).__name__} in a lane")

    def cancel(self, reason: str) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            hooks = list(self._hooks)
        self.stop.set(reason)
        for hook in hooks:
            _quietly(hook)


def _quietly(hook: Callable[[], object]) -> None:
    # a cancel hook that fails (connection already closed) must not hide the lane's own error
    with contextlib.suppress(Exception):
        hook()


def run_lanes(
    lanes: Sequence[Callable[[Lane], T]],
    *,
    stop: StopSignal,
    deadline: Deadline,
    grace_seconds: float,
) -> list[T]:
    """Run ``lanes`` side by side (lane 0 on the caller's thread) and return their results in
    order. Any lane's exception cancels the others and the first is re-raised; the join waits
    ``deadline.remaining() + grace_seconds``, then cancels and waits ``grace_seconds`` more
    before :class:`LanesDidNotStop`."""
    if not lanes:
        return []
    crew = _Crew(stop)
    results: list[T | None] = [None] * len(lanes)
    # Events, not Thread.join(): on CPython 3.11 a join interrupted by a signal handler's
    # exception (SIGALRM) can mark a running thread as stopped.
    done = [threading.Event() for _ in lanes]

    def body(index: int) -> None:
        try:
            results[index] = lanes[index](Lane(index, crew.stop, deadline, crew.add_hook))
        except BaseException as exc:  # every kind: a sibling must never wait for a dead lane
            crew.fail(exc)
        finally:
            done[index].set()

    threads = [
        threading.Thread(target=body, args=(i,), name=f"pin-lane-{i}", daemon=True)
        for i in range(1, len(lanes))
    ]
    side = done[1:]
    try:
        for thread in threads:
            thread.start()
        body(0)
        _join(side, deadline.remaining() + grace_seconds)
        if not all(event.is_set() for event in side):
            crew.cancel("the run's deadline and grace passed")
            _join(side, grace_seconds)
    except BaseException as exc:  # reached the caller's thread while it waited (SIGALRM, ^C)
        crew.fail(exc)
        _join(side, grace_seconds)
    stuck = [t.name for t, event in zip(threads, side, strict=True) if not event.is_set()]
    if crew.errors:
        raise crew.errors[0]
    if stuck:
        raise LanesDidNotStop(
            f"{', '.join(stuck)} still running {grace_seconds:.0f}s after being cancelled"
        )
    return results  # type: ignore[return-value]


def _join(events: Sequence[threading.Event], seconds: float) -> None:
    until = time.monotonic() + max(0.0, seconds)
    for event in events:
        event.wait(max(0.0, until - time.monotonic()))


class BatchBudget:
    """A bound on the batches a crew of loops takes together (None: no bound); a batch smaller
    than ``batch_size`` takes its share, so the bound stays one of rows."""

    def __init__(self, limit: int | None, batch_size: int | None = None) -> None:
        self.limit, self.batch_size = limit, batch_size
        self.taken = 0.0
        self._lock = threading.Lock()

    def take(self, rows: int | None = None) -> bool:
        """Take a batch of ``rows`` (None: a whole one); False when the budget is spent."""
        share = 1.0 if rows is None or not self.batch_size else rows / self.batch_size
        with self._lock:
            if self.spent:
                return False
            self.taken += share
            return True

    @property
    def spent(self) -> bool:
        return self.limit is not None and self.taken >= self.limit - 1e-9


def run_batch_loops(
    batches: Sequence[Callable[[Lane, int | None], bool]],
    *,
    stop: StopSignal,
    deadline: Deadline,
    budget: BatchBudget,
    grace_seconds: float,
    pacing: Pacer | None = None,
) -> StopReason:
    """Run one batch loop per lane and return why the crew stopped (the strongest reason).

    ``batches[i](lane, size)`` does one batch of ``size`` rows (the pacing turn's; None: the
    job's batch_size) and returns True when it came back full. Before each batch a loop stops
    on the stop signal, the deadline (not before the crew's first batch: a run always makes
    progress) and the budget; ``pacing`` (a :class:`pacing.Pacer`) gives the turn around each
    batch and the pace after each full one that leaves the budget a batch.
    """
    if pacing is not None:
        pacing.start()

    def loop(lane: Lane, batch: Callable[[Lane, int | None], bool]) -> StopReason:
        while True:
            turn = pacing.turn(lane.stop) if pacing is not None else contextlib.nullcontext()
            with turn as size:
                if lane.stop.is_set():
                    return StopReason.CANCELLED
                if budget.taken and deadline.expired():
                    return StopReason.MAX_DURATION
                if not budget.take(size):
                    return StopReason.MAX_BATCHES
                started = time.monotonic()
                if not batch(lane, size):
                    return StopReason.DRAINED
                if pacing is not None and not budget.spent:  # no pause ends a run at its bound
                    pacing.pace(lane.index, lane.stop, time.monotonic() - started, size)

    lanes = [lambda lane, batch=batch: loop(lane, batch) for batch in batches]
    reasons = run_lanes(lanes, stop=stop, deadline=deadline, grace_seconds=grace_seconds)
    return strongest_stop_reason(reasons)


def strongest_stop_reason(reasons: Sequence[StopReason]) -> StopReason:
    """Cancelled if any loop was, else a bound if any loop hit one, else drained."""
    for reason in (StopReason.CANCELLED, StopReason.MAX_DURATION, StopReason.MAX_BATCHES):
        if reason in reasons:
            return reason
    return StopReason.DRAINED
