"""The jobs' way to run database work side by side: lanes under one deadline, stopped as one.

Every job that runs in parallel (slot runners, retention's batch loops) has the same needs,
each of which a bad night tests (docs/design.md, "Running side by side"):

- one :class:`Deadline` that every wait takes its timeout from (a join, a condition wait, an
  HTTP call, a pause), so no wait outlives the run's bound;
- any exception in any lane, ``BaseException`` included (the Task SDK's ``AirflowTaskTimeout``
  is one, raised by SIGALRM in the main thread), stops every sibling: the crew's stop signal is
  set and each lane's cancel hook runs (e.g. ``conn.cancel_safe()``, which interrupts a
  statement in flight), so a sibling never waits for a lane that is gone;
- a bounded join: the caller gets its lanes back within the deadline plus a grace it states
  (the longest single statement or call a lane may still be in), or an error naming the lanes
  that did not stop;
- the first exception is re-raised as is, so the task fails with the original error.

Lane 0 runs on the caller's thread (signals, and Airflow hooks that read connections through
the task runner, only work there); the others on daemon threads. Nothing here knows about
databases or HTTP: a lane registers how it can be interrupted.

:func:`run_batch_loops` is the one batch loop the batch jobs run on those lanes: each lane
repeats one batch (its own transaction) until a batch comes back short, a bound is reached or
the crew stops; the bounds are checked between batches only.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from include.pin_maintenance.stopping import StopReason, StopSignal

T = TypeVar("T")


class Deadline:
    """A fixed point on a monotonic clock; every wait of a run takes its timeout from it."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._at = clock() + max(0.0, float(seconds))

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def remaining(self) -> float:
        """Seconds left, never below 0."""
        return max(0.0, self._at - self._clock())

    def expired(self) -> bool:
        return self._clock() >= self._at

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
    """What one lane gets: its number, the crew's stop signal and the run's deadline."""

    index: int
    stop: StopSignal
    deadline: Deadline
    _crew: _Crew = field(repr=False)

    def on_cancel(self, hook: Callable[[], object]) -> None:
        """Run ``hook`` (from another thread) when the crew is cancelled: it must interrupt
        whatever this lane may be blocked in, e.g. ``conn.cancel_safe``. Runs at once if the
        crew is already cancelled."""
        self._crew.add_hook(hook)


class _Crew(Generic[T]):
    def __init__(self, count: int, stop: StopSignal) -> None:
        self.stop = StopSignal(parent=stop)
        self.results: list[T | None] = [None] * count
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
            first = not self._cancelled
            self._cancelled = True
            hooks = list(self._hooks)
        if not first:
            return
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
    """Run ``lanes`` side by side and return their results in order.

    ``stop`` is the run's own stop signal (SIGTERM); each lane sees a child of it that is also
    set when any lane fails. A lane returns normally when it is done, when its ``stop`` is set,
    or when ``deadline`` has passed, checking them between units of work. The join waits at most
    ``deadline.remaining() + grace_seconds``; lanes still running then are cancelled and given
    ``grace_seconds`` more, after which :class:`LanesDidNotStop` is raised. The first exception
    of any lane (or one that reaches the caller's thread while it waits) is re-raised.
    """
    if not lanes:
        return []
    crew: _Crew[T] = _Crew(len(lanes), stop)
    # A lane is over when its event is set. Not Thread.is_alive()/join(): on CPython 3.11 a
    # join interrupted by an exception from a signal handler (SIGALRM's AirflowTaskTimeout)
    # can mark a running thread as stopped, and every later join returns at once.
    done = [threading.Event() for _ in lanes]

    def body(index: int) -> None:
        lane = Lane(index, crew.stop, deadline, crew)
        try:
            crew.results[index] = lanes[index](lane)
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
    return crew.results  # type: ignore[return-value]


def _join(events: Sequence[threading.Event], seconds: float) -> None:
    until = time.monotonic() + max(0.0, seconds)
    for event in events:
        event.wait(max(0.0, until - time.monotonic()))


class BatchBudget:
    """A bound on the batches a crew of loops may take together (None: no bound), counted in
    batches of ``batch_size``: a smaller batch takes its share, so the bound stays one of rows."""

    def __init__(self, limit: int | None, batch_size: int | None = None) -> None:
        self.limit = limit
        self.batch_size = batch_size
        self.taken = 0.0
        self._lock = threading.Lock()

    def take(self, rows: int | None = None) -> bool:
        """Take a batch of ``rows`` (None: a whole one) from the budget; False when it is
        spent."""
        share = 1.0 if rows is None or not self.batch_size else rows / self.batch_size
        with self._lock:
            if self.spent:
                return False
            self.taken += share
            return True

    @property
    def spent(self) -> bool:
        """No batch is left to take."""
        return self.limit is not None and self.taken >= self.limit - 1e-9


class BatchPacing(Protocol):
    """How a crew of batch loops yields to the database's other users (:mod:`pacing`)."""

    def start(self) -> None:
        """Before the crew's first batch, on the caller's thread."""
        ...

    def turn(self, stop: StopSignal) -> AbstractContextManager[int | None]:
        """Held around each batch and its pace, giving the batch's size (None: the job's own
        batch_size): may wait for the crew's pause or for other loops' batches; returns on
        ``stop``."""
        ...

    def pace(self, lane: int, stop: StopSignal, batch_seconds: float, rows: int | None) -> None:
        """After each full batch of ``rows`` that leaves the budget a batch: may wait."""
        ...


def run_batch_loops(
    batches: Sequence[Callable[[Lane, int | None], bool]],
    *,
    stop: StopSignal,
    deadline: Deadline,
    budget: BatchBudget,
    grace_seconds: float,
    pacing: BatchPacing | None = None,
) -> StopReason:
    """Run one batch loop per lane (:func:`run_lanes`) and return why the crew stopped.

    ``batches[i](lane, size)`` does one whole batch of lane ``i``, of ``size`` rows (the
    ``pacing`` turn's; None: the job's batch_size), and returns True when it came back full
    (more may be due). Each batch runs in its turn; before it a loop stops on the crew's stop
    signal, on the deadline (except for the crew's first batch, so a run always makes
    progress) and on the shared budget, which counts a smaller batch by its share of a whole
    one. The crew's reason is the strongest of its loops': cancelled, then a bound, then
    drained. A sibling's failure is re-raised by :func:`run_lanes`.
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
