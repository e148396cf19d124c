"""The stop signal that ends a job run between batches, and the reasons a run stops."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum


class JobCancelled(RuntimeError):
    """The run was asked to stop (SIGTERM, task killed) and stopped cleanly between batches."""


class StopSignal:
    """A thread-safe "please stop" flag, set by SIGTERM or by a caller.

    A signal made with a ``parent`` is also set while its parent is: a job's side loops stop
    on the run's own stop (SIGTERM) or on their own (a sibling loop failed). A parent sets its
    children's events too, so :meth:`wait` on a child wakes on either.
    """

    def __init__(self, parent: StopSignal | None = None) -> None:
        self._event = threading.Event()
        self._reason = ""
        self._parent = parent
        self._children: list[StopSignal] = []
        if parent is not None:
            parent._children.append(self)
            if parent.is_set():
                self._event.set()

    @property
    def reason(self) -> str:
        if self._reason or self._parent is None:
            return self._reason
        return self._parent.reason

    def set(self, reason: str = "stop requested") -> None:
        self._reason = reason
        self._event.set()
        for child in list(self._children):
            child._event.set()

    def is_set(self) -> bool:
        return self._event.is_set() or (self._parent is not None and self._parent.is_set())

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` or until the signal is set; True when it is set."""
        return self._event.wait(max(0.0, seconds)) or self.is_set()

    @contextmanager
    def on_sigterm(self) -> Iterator[StopSignal]:
        """Set this signal on SIGTERM while inside the block, then chain to the old handler.

        Airflow's task runner answers SIGTERM by calling ``on_kill`` and carries on; the
        supervisor kills the process after a grace period. Chaining keeps Airflow's behaviour
        and lets the job finish or roll back the batch in hand instead of dying mid-statement.
        Only the main thread may install handlers; elsewhere this is a no-op.
        """
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum, frame):
            self.set("SIGTERM received")
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)


class StopReason(StrEnum):
    DRAINED = "drained"  # a batch came back short: nothing more is due
    MAX_BATCHES = "max_batches"
    MAX_DURATION = "max_duration"
    CANCELLED = "cancelled"
