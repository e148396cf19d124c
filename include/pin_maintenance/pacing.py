"""Pacing by the database's health: a batch job slows down or pauses between batches while the
database's other users would feel it, and speeds up again when they would not (docs/design.md,
"Pacing").

Two signals, read between batches on the loop's own connection (at most every
:data:`PROBE_INTERVAL_SECONDS` for the whole crew of loops):

- **Replica lag.** How far the slowest streaming replica's replay is behind, in seconds: the
  larger of ``pg_stat_replication.replay_lag`` and the age of the oldest WAL position this job
  saw written that the replica has not replayed (the job samples ``pg_current_wal_lsn()`` at each
  probe; ``replay_lag`` alone stays at its last value while replay is stuck). Above
  ``max_replica_lag_seconds`` every loop holds between batches until the replica is back under
  it (gh-ost's ``max-lag-millis``, pt-archiver's ``--max-lag``).
- **Neighbour latency.** A canary: one empty transaction that commits with
  ``synchronous_commit = on``, which waits like the services' own commits for the CPU and for
  the WAL flush. Its mean over the last probes (a mean, not a median: the services feel the
  tail), against its median before the first batch, says how much slower the database answers
  everyone because of the job. While other sessions are active and the canary is slower than
  ``max_neighbour_slowdown`` times its baseline, each
  loop sleeps a multiple of its own batch time after each batch (gh-ost's ``nice-ratio``,
  pt-archiver's ``--sleep-coef``); the multiple doubles while the canary stays slow and decays
  once it is back, so the drain takes what the database can spare.

While other sessions are busy the loops also take turns, one batch at a time, so the job never
takes more than one core and one stream of WAL from them; a run that finds them busy when it
reads its baseline starts at half speed and earns the rest while the canary stays healthy.
Nobody else there (other sessions active in fewer than one probe in ten of the last 5 s): no
canary pacing, the loops run side by side at full speed. Reading the other sessions and the
replicas needs ``pg_read_all_stats`` (in ``pg_monitor``); a role without it cannot tell its
own load from its neighbours', so its run is not paced, and says so in one warning.
Every pause takes its timeout from the run's deadline and ends on a stop.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from include.pin_maintenance import sql
from include.pin_maintenance.parallel import Lane
from include.pin_maintenance.runloop import StopSignal
from include.pin_maintenance.telemetry import Telemetry

PROBE_INTERVAL_SECONDS = 0.25  # the crew reads the signals at most this often
REPLICA_RECHECK_SECONDS = 0.5  # a loop held by replica lag looks again this often
BASELINE_CANARIES = 7  # canaries before the first batch: their median is the baseline
RECENT_CANARIES = 5  # canaries whose mean is compared with it
# Commit times differ by fractions of a millisecond from one probe to the next on an idle
# server; nobody feels that, so the canary may exceed its limit by this much before it counts.
CANARY_SLACK_SECONDS = 0.0005
# The database is shared when other sessions were running a statement in at least this share of
# the probes of the last NEIGHBOURS_WINDOW_SECONDS. Services' short transactions are caught by
# some probes only (300 tx/s of 1 ms: about one probe in four); a monitor's heartbeat of one
# short commit a second, by almost none.
NEIGHBOURS_WINDOW_SECONDS = 5.0
NEIGHBOURS_SHARE = 0.1
NICE_START = 0.5  # the first sleep, as a multiple of the batch's own time
# A run that finds other sessions busy starts at this multiple (half speed, one loop at a time)
# and earns the rest while the canary stays healthy: its first seconds are not a burst.
NICE_SHARED_START = 1.0
TURN_WAIT_SECONDS = 0.2  # a loop waiting for its turn looks at its stop signal this often
# A batch that holds the turn longer than this (or 3x the recent batches' median, if longer) is
# stuck, e.g. on a lock: the other loops go on without a turn rather than stall behind it.
TURN_PATIENCE_SECONDS = 1.0
RECENT_BATCHES = 8  # batch times whose median sets the patience
NICE_MAX = 20.0  # at most this multiple: the drain keeps at least 1/21 of its pace
NICE_DECAY = 0.75  # each healthy probe shortens the sleep by this factor
NICE_FLOOR = 0.05  # below this, no sleep at all
HISTORY_SECONDS = 3600.0  # WAL positions kept for the lag estimate (one every probe)

REASON_REPLICA_LAG = "replica_lag"
REASON_NEIGHBOUR_LATENCY = "neighbour_latency"
REASONS = (REASON_REPLICA_LAG, REASON_NEIGHBOUR_LATENCY)


@dataclass(frozen=True)
class PacingLimits:
    """The two config keys; 0 turns a signal off."""

    max_replica_lag_seconds: float
    max_neighbour_slowdown: float

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PacingLimits:
        return cls(
            float(config.get("max_replica_lag_seconds", 0)),
            float(config.get("max_neighbour_slowdown", 0)),
        )

    @property
    def off(self) -> bool:
        return not self.max_replica_lag_seconds and not self.max_neighbour_slowdown


@dataclass(frozen=True)
class Reading:
    """One probe of the database, at ``at`` on the monotonic clock."""

    at: float
    wal_bytes: int  # pg_current_wal_lsn() as a byte position
    replay_bytes: int | None  # the slowest streaming replica's replay position (None: none seen)
    replay_lag_seconds: float | None  # its replay_lag as the server measured it
    others_active: int | None  # other client sessions running a statement (None: unreadable)
    canary_seconds: float | None  # the canary commit's time (None: canary off)


def paced_metric(prefix: str, reason: str) -> str:
    """The counter of milliseconds paced for ``reason``: ``<prefix>_replica_lag_milliseconds_total``
    etc. A counter, sent at 0 when a run starts like the jobs' others, so that a series exists
    before the first pause (a timer's would appear only then)."""
    return f"{prefix}_{reason}_milliseconds_total"


def paced_metrics(prefix: str) -> tuple[str, ...]:
    """Every pacing counter of a job, for its ``JobMetrics.counters``."""
    return tuple(paced_metric(prefix, reason) for reason in REASONS)


def replica_lag_seconds(history: Sequence[tuple[float, int]], reading: Reading) -> float:
    """The slowest replica's replay lag in seconds (0 without a replica).

    ``history`` holds (time, WAL byte position) samples of earlier probes, oldest first. The
    oldest WAL not yet replayed was written after the last sample at or before the replay
    position, so the age of the first sample past it is a lower bound of the lag; the server's
    own ``replay_lag`` is another, and the larger one counts. A replica that has replayed all
    the WAL of the reading is not behind, whatever ``replay_lag`` still shows: it keeps its
    last measurement for a while after a replica caught up.
    """
    if reading.replay_bytes is None or reading.replay_bytes >= reading.wal_bytes:
        return 0.0
    lag = max(reading.replay_lag_seconds or 0.0, 0.0)
    for at, position in history:
        if position > reading.replay_bytes:
            return max(lag, reading.at - at)
    return lag


def next_nice(nice: float, *, slow: bool) -> float:
    """The sleep multiple after a probe: doubled (from :data:`NICE_START`) while the canary is
    slow, decayed towards none once it is back (AIMD the other way round: the neighbours' side
    is protected quickly, the drain's pace comes back gradually)."""
    if slow:
        return min(NICE_MAX, max(NICE_START, nice * 2))
    nice *= NICE_DECAY
    return nice if nice >= NICE_FLOOR else 0.0


def database_shared(others_active: Sequence[bool]) -> bool:
    """Whether other sessions ran statements in enough of the recent probes."""
    if not others_active:
        return False
    return sum(others_active) / len(others_active) >= NEIGHBOURS_SHARE


def canary_slow(recent: Sequence[float], baseline: float, limit: float) -> bool:
    """Whether the recent canaries' mean exceeds ``limit`` times the baseline (+ slack)."""
    if not recent or limit <= 0:
        return False
    return statistics.fmean(recent) > limit * baseline + CANARY_SLACK_SECONDS


@dataclass
class PaceTotals:
    """Time the loops spent paced, by reason (summed over loops), for the run's result."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REASONS, 0.0))

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def main_reason(self) -> str:
        reason, seconds = max(self.seconds.items(), key=lambda item: item[1])
        return reason if seconds > 0 else "none"


class Pacer:
    """The pacing of one crew of batch loops (one run or one retention step).

    :meth:`start` reads the baseline before the first batch; :meth:`after_batch` is what
    :func:`parallel.run_batch_loops` calls on a loop's thread after each full batch.
    ``connections`` maps a loop's lane index to its connection, on which that loop probes
    (idle between batches, so pacing needs no server connection of its own).
    """

    def __init__(
        self,
        limits: PacingLimits,
        telemetry: Telemetry,
        *,
        paced_metric_prefix: str,
        deadline_remaining: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.telemetry = telemetry
        self.paced_metric_prefix = paced_metric_prefix
        self.deadline_remaining = deadline_remaining
        self.clock = clock
        self.totals = PaceTotals()
        self.connections: dict[int, psycopg.Connection] = {}
        self._lock = threading.Lock()  # the readings and the sleep multiple
        self._probing = threading.Lock()  # one probe at a time for the crew
        self._history: deque[tuple[float, int]] = deque()
        self._canaries: deque[float] = deque(maxlen=RECENT_CANARIES)
        self._baseline = 0.0
        self._last: Reading | None = None
        self._others: deque[tuple[float, bool]] = deque()  # (probe time, others active)
        self._stats_readable = True
        self._nice = 0.0
        self._shared = False  # other sessions busy in enough recent probes
        self._turn = threading.Lock()  # held by the loop whose batch runs, while taking turns
        self._turn_since = 0.0  # when the turn was last taken
        self._batch_seconds: deque[float] = deque(maxlen=RECENT_BATCHES)

    # -- set-up ----------------------------------------------------------------------------

    def start(self, conn: psycopg.Connection) -> None:
        """Check what the role may read and measure the canary's baseline (before the loops'
        batches; the slot drain's first batch, which decides whether there are any, comes first)."""
        if self.limits.off:
            return
        row = conn.execute(sql.load("pacing/can_read_activity")).fetchone()
        if not conn.autocommit:
            conn.rollback()
        self._stats_readable = bool(row and row[0])
        if not self._stats_readable:
            self.telemetry.log.warning(
                "pacing_signal_unavailable",
                signals="replica_lag,neighbour_latency",
                reason="role lacks pg_read_all_stats (pg_monitor): the run is not paced",
            )
            return
        if not self.limits.max_neighbour_slowdown:
            self._remember(self._read(conn))
            return
        readings = [self._read(conn) for _ in range(BASELINE_CANARIES)]
        self._baseline = statistics.median(r.canary_seconds or 0.0 for r in readings)
        with self._lock:
            for reading in readings:
                self._note(reading)
            self._shared = database_shared([active for _, active in self._others])
            if self._shared:
                self._nice = NICE_SHARED_START
        self.telemetry.log.info(
            "pacing_baseline",
            canary_ms=round(self._baseline * 1000, 3),
            database_shared=self._shared,
        )
        if self._shared:
            self.telemetry.log.info(
                "job_paced",
                reason=REASON_NEIGHBOUR_LATENCY,
                value=round(self._baseline * 1000, 3),
                limit=round(self.limits.max_neighbour_slowdown * self._baseline * 1000, 3),
            )

    # -- between batches -------------------------------------------------------------------

    @contextlib.contextmanager
    def turn(self, lane: Lane) -> Iterator[None]:
        """:class:`parallel.BatchPacing`'s turn: while other sessions are busy and the canary
        is on, the loops take turns, one batch at a time, so the job never takes more than one
        core and one stream of WAL from the services beside it. A batch stuck in its turn past
        :meth:`_turn_patience` does not hold the others back."""
        with self._lock:
            taking_turns = self._shared and bool(self.limits.max_neighbour_slowdown)
        if not taking_turns:
            yield
            return
        acquired = self._turn.acquire(blocking=False)
        while not acquired:
            with self._lock:
                stuck = self.clock() - self._turn_since > self._turn_patience()
            if stuck or lane.stop.is_set():
                yield  # without a turn: the loop sees the stop, or goes past a stuck batch
                return
            acquired = self._turn.acquire(timeout=TURN_WAIT_SECONDS)
        with self._lock:
            self._turn_since = self.clock()
        try:
            yield
        finally:
            self._turn.release()

    def _turn_patience(self) -> float:
        recent = statistics.median(self._batch_seconds) if self._batch_seconds else 0.0
        return max(TURN_PATIENCE_SECONDS, 3 * recent)

    def pace(self, lane: Lane, batch_seconds: float) -> None:
        """:class:`parallel.BatchPacing`'s pace: :meth:`after_batch` for the lane."""
        self.after_batch(lane.index, lane.stop, batch_seconds)

    def after_batch(self, lane_index: int, stop: StopSignal, batch_seconds: float) -> None:
        """Hold while a replica is behind; then sleep the current multiple of the batch time."""
        if self.limits.off or not self._stats_readable:
            return
        with self._lock:
            self._batch_seconds.append(batch_seconds)
        conn = self.connections.get(lane_index)
        if conn is None:
            return
        self._probe_if_due(conn)
        if self.limits.max_replica_lag_seconds:
            self._hold_for_replica(conn, stop)
        with self._lock:
            nice = self._nice
        if nice and not stop.is_set():
            pause = min(nice * batch_seconds, self.deadline_remaining())
            if pause > 0:
                stop.wait(pause)
                self._account(REASON_NEIGHBOUR_LATENCY, pause)

    def _hold_for_replica(self, conn: psycopg.Connection, stop: StopSignal) -> None:
        limit = self.limits.max_replica_lag_seconds
        held = 0.0
        while not stop.is_set():
            with self._lock:
                lag = self._lag()
            if lag <= limit:
                break
            left = self.deadline_remaining()
            if left <= 0:
                break
            if not held:
                self.telemetry.log.info(
                    "job_paced",
                    reason=REASON_REPLICA_LAG,
                    value=round(lag, 3),
                    limit=limit,
                )
            wait = min(REPLICA_RECHECK_SECONDS, left)
            stop.wait(wait)
            held += wait
            self._probe_if_due(conn)
        if held:
            self._account(REASON_REPLICA_LAG, held)
            self.telemetry.log.info(
                "job_resumed", reason=REASON_REPLICA_LAG, paced_ms=round(held * 1000)
            )

    # -- probes ----------------------------------------------------------------------------

    def _probe_if_due(self, conn: psycopg.Connection) -> None:
        with self._lock:
            due = self._last is None or self.clock() - self._last.at >= PROBE_INTERVAL_SECONDS
        if not due or not self._probing.acquire(blocking=False):
            return  # another loop is probing: this one uses the latest reading
        try:
            self._remember(self._read(conn))
        finally:
            self._probing.release()

    def _read(self, conn: psycopg.Connection) -> Reading:
        canary = self._canary(conn) if self.limits.max_neighbour_slowdown else None
        row = conn.execute(sql.load("pacing/read_database_health")).fetchone()
        if not conn.autocommit:
            conn.rollback()
        wal, replay, replay_lag, others = row
        return Reading(
            at=self.clock(),
            wal_bytes=int(wal),
            replay_bytes=int(replay) if replay is not None else None,
            replay_lag_seconds=float(replay_lag) if replay_lag is not None else None,
            others_active=int(others) if self._stats_readable else None,
            canary_seconds=canary,
        )

    def _canary(self, conn: psycopg.Connection) -> float:
        started = self.clock()
        with conn.transaction():
            conn.execute(sql.load("pacing/commit_canary"))
        return self.clock() - started

    def _note(self, reading: Reading) -> None:
        """Keep a reading's WAL position and neighbours (under ``_lock``)."""
        self._last = reading
        self._history.append((reading.at, reading.wal_bytes))
        while self._history and reading.at - self._history[0][0] > HISTORY_SECONDS:
            self._history.popleft()
        self._others.append((reading.at, reading.others_active != 0))
        while reading.at - self._others[0][0] > NEIGHBOURS_WINDOW_SECONDS:
            self._others.popleft()

    def _remember(self, reading: Reading) -> None:
        """Fold a reading into the state: history, neighbours, and the sleep multiple."""
        with self._lock:
            self._note(reading)
            if reading.canary_seconds is None:
                return
            self._canaries.append(reading.canary_seconds)
            self._shared = database_shared([active for _, active in self._others])
            slow = self._shared and canary_slow(
                self._canaries, self._baseline, self.limits.max_neighbour_slowdown
            )
            before, self._nice = self._nice, next_nice(self._nice, slow=slow)
            canary_ms = statistics.fmean(self._canaries) * 1000
            paced = self.totals.seconds[REASON_NEIGHBOUR_LATENCY]
        if not before and self._nice:
            self.telemetry.log.info(
                "job_paced",
                reason=REASON_NEIGHBOUR_LATENCY,
                value=round(canary_ms, 3),
                limit=round(self.limits.max_neighbour_slowdown * self._baseline * 1000, 3),
            )
        elif before and not self._nice:
            self.telemetry.log.info(
                "job_resumed", reason=REASON_NEIGHBOUR_LATENCY, paced_ms=round(paced * 1000)
            )

    def _lag(self) -> float:
        if self._last is None:
            return 0.0
        return replica_lag_seconds(self._history, self._last)

    def _account(self, reason: str, seconds: float) -> None:
        with self._lock:
            self.totals.seconds[reason] += seconds
        self.telemetry.metrics.incr(
            paced_metric(self.paced_metric_prefix, reason), round(seconds * 1000)
        )
