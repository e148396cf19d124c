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
    """A thread-safe "please stop" flag, set by SIGTERM or by a caller; a child (``parent``
    given) is set by its own :meth:`set` or its parent's, and :meth:`wait` wakes on either."""

    def __init__(self, parent: StopSignal | None = None) -> None:
        self._event, self._reason, self._parent = threading.Event(), "", parent
        self._children: list[StopSignal] = []
        if parent is not None:
            parent._children.append(self)
            if parent.is_set():
                self._event.set()

    @property
    def reason(self) -> str:
        return self._reason or (self._parent.reason if self._parent is not None else "")

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
        """Set this signal on SIGTERM inside the block, then chain to the old handler (Airflow's
        ``on_kill``); a no-op off the main thread, which alone may install handlers."""
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
