"""The crew's pause and :class:`Pacer`, which applies :mod:`pacing_rules` to a crew of batch
loops (docs/design.md, "Pacing")."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import psycopg

from include.pin_maintenance.pacing_config import PacingConfig
from include.pin_maintenance.pacing_rules import (
    NEIGHBOURS_WINDOW_SECONDS,
    Reading,
    database_shared,
    fetch,
    read,
    replay_seconds,
    replica_lag_seconds,
    shared_batch_size,
    wal_paid_until,
)
from include.pin_maintenance.stopping import StopSignal
from include.pin_maintenance.telemetry import Telemetry

PROBE_INTERVAL_SECONDS = 0.25  # the crew reads the signals at most this often
REPLICA_RECHECK_SECONDS = 0.5  # a crew held by a replica looks again this often
TURN_WAIT_SECONDS = 0.2  # a loop waiting for its turn looks at its stop signal this often
START_READINGS = 7  # readings before the first batch, whether the database is shared
START_SPACING_SECONDS = 0.025  # between them: the 7 span 150 ms, three of a 50 ms recency
RECENT_BATCHES = 8  # batch times per row whose median sizes the next batch
HISTORY_SECONDS = 3600.0  # WAL positions kept for the lag estimate (one every probe)
WAL_PAUSE_MAX = 20.0  # a WAL-rate pause is at most this multiple of the batch's time
WAL_RESUME_SECONDS = 1.0  # this long without a WAL-rate pause ends a spell of them
MEGABYTE = 1_000_000

REASON_REPLICA_LAG = "replica_lag"
REASON_WAL_RATE = "wal_rate"
REASONS = (REASON_REPLICA_LAG, REASON_WAL_RATE)


def paced_metrics(prefix: str) -> tuple[str, ...]:
    """The counters of milliseconds paced, one per reason (sent at 0 when a run starts)."""
    return tuple(f"{prefix}_{reason}_milliseconds_total" for reason in REASONS)


class Pacer:
    """The pacing of one crew of batch loops: lane ``i`` probes on ``connections[i]``;
    ``batch_size`` is the job's own (None: batches not sized)."""

    def __init__(
        self,
        config: PacingConfig,
        telemetry: Telemetry,
        *,
        paced_metric_prefix: str,
        deadline_remaining: Callable[[], float],
        batch_size: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.telemetry, self.job_batch_size = config, telemetry, batch_size
        self.metrics = dict(zip(REASONS, paced_metrics(paced_metric_prefix), strict=True))
        self.deadline_remaining, self.clock = deadline_remaining, clock
        self.connections: list[psycopg.Connection] = []
        self._turn = threading.Lock()  # held by the loop whose batch runs, beside others
        self._on = config.paced  # and the role may read the signals
        self._lock = threading.Lock()  # everything below
        self.paced_seconds = dict.fromkeys(REASONS, 0.0)  # the crew's time paced, by reason
        self._resume_at = 0.0  # no loop starts a batch before (the crew's pause)
        self._next_probe = 0.0
        self._history: deque[Reading] = deque()
        self._shared = False
        self._row_seconds: deque[float] = deque(maxlen=RECENT_BATCHES)
        self._wal_read: tuple[float, int] | None = None  # the bucket's last WAL read
        self._wal_paid_until = 0.0
        self._wal_paced_at: float | None = None  # the last WAL-rate pause, until job_resumed

    @property
    def paced_total(self) -> float:
        """Seconds the crew spent paced (no loop starting a batch), for the run's result."""
        return sum(self.paced_seconds.values())

    def start(self) -> None:
        """Before the crew's batches: what the role may read, and whether others use the
        database."""
        if not self._on:
            return
        conn = self.connections[0]
        (self._on,) = fetch(conn, "pacing/can_read_activity")
        if not self._on:
            self.telemetry.log.warning(
                "pacing_signal_unavailable",
                signals=",".join(REASONS),
                reason="role lacks pg_read_all_stats (pg_monitor): the run is not paced",
            )
            return
        for index in range(START_READINGS):
            if index:
                time.sleep(START_SPACING_SECONDS)
            self._remember(read(conn, self._own_pids(), self.clock))
        self.telemetry.log.info("pacing_started", database_shared=self._shared)
        if self._polite():
            self._wal_debt(conn)  # opens the bucket: the first batch's WAL is paid like the rest

    def _pause(self, seconds: float, stop: StopSignal) -> float:
        """Pause the crew ``seconds`` from now and wait it out; the crew's time this added (a
        pause already under way may cover part of it)."""
        with self._lock:
            now = self.clock()
            added = max(0.0, now + seconds - max(self._resume_at, now))
            self._resume_at = max(self._resume_at, now + seconds)
        self._wait_pause(stop)
        return added

    def _wait_pause(self, stop: StopSignal) -> None:
        while not stop.is_set():
            with self._lock:
                left = self._resume_at - self.clock()
            if left <= 0:
                return
            stop.wait(left)

    def _polite(self) -> bool:  # others use the database and the WAL budget protects them
        with self._lock:
            return self._shared and bool(self.config.max_wal_mb_per_second)

    @contextlib.contextmanager
    def turn(self, stop: StopSignal) -> Iterator[int | None]:
        """Around each batch, giving its size: after the crew's pause, and beside others one
        batch at a time, sized by :func:`shared_batch_size`. On a stop, no turn."""
        self._wait_pause(stop)
        polite = self._polite()
        while polite and not self._turn.acquire(timeout=TURN_WAIT_SECONDS):
            if stop.is_set():
                polite = False
        size = self.job_batch_size
        if polite and size is not None:
            with self._lock:
                per_row = statistics.median(self._row_seconds) if self._row_seconds else None
            size = shared_batch_size(per_row, size)
        try:
            yield size
        finally:
            if polite:
                self._turn.release()

    def pace(self, lane: int, stop: StopSignal, batch_seconds: float, rows: int | None) -> None:
        """After a full batch: hold while a replica is behind, then pause until the WAL written
        so far is paid for."""
        if not self._on:
            return
        if rows:
            with self._lock:
                self._row_seconds.append(batch_seconds / rows)
        conn = self.connections[lane]
        self._probe_if_due(conn)
        if self.config.max_replica_lag_seconds:
            self._hold_for_replica(conn, stop)
        if stop.is_set() or not self.config.max_wal_mb_per_second:
            return
        debt = min(self._wal_debt(conn), WAL_PAUSE_MAX * batch_seconds, self.deadline_remaining())
        if debt > 0:
            self._account(REASON_WAL_RATE, self._pause(debt, stop))

    def _probe_if_due(self, conn: psycopg.Connection) -> None:
        with self._lock:  # the first loop past the interval probes for the crew
            now = self.clock()
            if now < self._next_probe:
                return
            self._next_probe = now + PROBE_INTERVAL_SECONDS
        self._remember(read(conn, self._own_pids(), self.clock))

    def _own_pids(self) -> list[int]:
        # behind a pooler these match nothing: the crew's idle servers count as others (safe)
        return sorted({c.info.backend_pid for c in self.connections if not c.closed})

    def _remember(self, reading: Reading) -> None:
        with self._lock:
            self._next_probe = max(self._next_probe, reading.at + PROBE_INTERVAL_SECONDS)
            self._history.append(reading)
            while reading.at - self._history[0].at > HISTORY_SECONDS:
                self._history.popleft()
            recent = itertools.takewhile(
                lambda r: reading.at - r.at <= NEIGHBOURS_WINDOW_SECONDS, reversed(self._history)
            )
            self._shared = database_shared([r.others_active for r in recent])

    def _replica_behind(self) -> float:
        """Seconds the replica is behind, or twice what it needs to replay what it has."""
        with self._lock:
            last = self._history[-1]
            return max(
                replica_lag_seconds(self._history, last), 2 * replay_seconds(self._history, last)
            )

    def _hold_for_replica(self, conn: psycopg.Connection, stop: StopSignal) -> None:
        limit, held, lag = self.config.max_replica_lag_seconds, 0.0, self._replica_behind()
        if lag <= limit:
            return
        log = self.telemetry.log
        log.info("job_paced", reason=REASON_REPLICA_LAG, value=round(lag, 3), limit=limit)
        while lag > limit and not stop.is_set() and self.deadline_remaining() > 0:
            held += self._pause(min(REPLICA_RECHECK_SECONDS, self.deadline_remaining()), stop)
            self._probe_if_due(conn)
            lag = self._replica_behind()
        self._account(REASON_REPLICA_LAG, held)
        log.info("job_resumed", reason=REASON_REPLICA_LAG, paced_ms=round(held * 1000))

    def _wal_debt(self, conn: psycopg.Connection) -> float:
        """Seconds until the WAL written so far is paid for (alone: nothing owed); logs a spell
        of debts once, ``job_paced`` at its start and ``job_resumed`` after its end."""
        with self._lock:
            shared = self._shared
        position = int(fetch(conn, "pacing/read_wal_position")[0]) if shared else 0
        now, rate = self.clock(), 0.0  # rate: bytes per second since the last read
        with self._lock:
            last, self._wal_read = self._wal_read, (now, position) if shared else None
            if shared and last is None:
                self._wal_paid_until = now  # the bucket opens: nothing owed before this read
            elif shared:
                (since, before), budget = last, self.config.max_wal_mb_per_second * MEGABYTE
                rate = max(0, position - before) / max(now - since, 1e-6)
                paid = wal_paid_until(self._wal_paid_until, since, now, position - before, budget)
                self._wal_paid_until = paid
            debt = self._wal_paid_until - now if shared else 0.0
            paced_at, paced = self._wal_paced_at, self.paced_seconds[REASON_WAL_RATE]
            resumed = debt <= 0 and paced_at is not None and now - paced_at >= WAL_RESUME_SECONDS
            if debt > 0 or resumed:
                self._wal_paced_at = now if debt > 0 else None
        log = self.telemetry.log
        if debt > 0 and paced_at is None:
            log.info(
                "job_paced",
                reason=REASON_WAL_RATE,
                value=round(rate / MEGABYTE, 1),
                limit=self.config.max_wal_mb_per_second,
            )
        if resumed:
            log.info("job_resumed", reason=REASON_WAL_RATE, paced_ms=round(paced * 1000))
        return max(debt, 0.0)

    def _account(self, reason: str, seconds: float) -> None:
        with self._lock:
            self.paced_seconds[reason] += seconds
        self.telemetry.metrics.incr(self.metrics[reason], round(seconds * 1000))
