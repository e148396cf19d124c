"""Pacing by the database's health: a batch job slows down or pauses between batches while the
database's other users would feel it, and speeds up again when they would not (docs/design.md,
"Pacing").

Three signals, read between batches on the loop's own connection (the first two at most every
:data:`PROBE_INTERVAL_SECONDS` for the whole crew of loops, the WAL position after each batch):

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
  ``max_neighbour_slowdown`` times its baseline, the crew pauses after each batch for a
  multiple of that batch's time (gh-ost's ``nice-ratio``, pt-archiver's ``--sleep-coef``); the
  multiple doubles while the canary stays slow and decays once it is back, so the drain takes
  what the database can spare.
- **WAL rate.** The services' commits wait for the WAL flush, and a drain's WAL queues ahead of
  theirs (the job commits without waiting, so the WAL writer flushes it in large writes). While
  other sessions are active, the database's WAL (everyone's, read as
  ``pg_current_wal_insert_lsn()`` after each batch) is held to ``max_wal_mb_per_second`` by a
  leaky bucket: after a batch the crew pauses until the WAL written so far is paid for at that
  rate (GitLab's batched migrations' WAL-rate indicator, vacuum's cost delay).

A pause is the crew's: no loop starts a batch until it is over, so the database sees the
job's batches with the gaps the rule asks for, however many loops there are. While others use
the database and the canary or the WAL budget is on, a crew given its job's ``batch_size`` also
sizes each batch to take about :data:`SHARED_BATCH_SECONDS` (:meth:`Pacer.batch_limit`).

While other sessions are busy the loops also take turns, one batch at a time, so the job never
takes more than one core and one stream of WAL from them; a run that finds them busy when it
reads its baseline starts at half speed and earns the rest while the canary stays healthy.
Nobody else there (other sessions running a statement, or done with one in the last 50 ms, in
fewer than half the probes of the last 5 s): no pacing but the replica's, the loops run side by
side at full speed. Reading the other sessions and the
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
from include.pin_maintenance.stopping import StopSignal
from include.pin_maintenance.telemetry import Telemetry

PROBE_INTERVAL_SECONDS = 0.25  # the crew reads the signals at most this often
REPLICA_RECHECK_SECONDS = 0.5  # a loop held by replica lag looks again this often
BASELINE_CANARIES = 7  # canaries before the first batch: their median is the baseline
BASELINE_SPACING_SECONDS = 0.025  # between them: the 7 span 150 ms, three of a 50 ms recency
RECENT_CANARIES = 5  # canaries whose mean is compared with it
# Commit times differ by fractions of a millisecond from one probe to the next on an idle
# server; nobody feels that, so the canary may exceed its limit by this much before it counts.
CANARY_SLACK_SECONDS = 0.0005
# The database is shared when other sessions were running a statement, or had finished one in the
# last 50 ms (pacing/read_database_health.sql), in at least this share of the probes of the last
# NEIGHBOURS_WINDOW_SECONDS. Services' short transactions are caught so by nearly every probe
# (300 tx/s: a statement every few ms); a monitor polling a few times a second, by one in five;
# a heartbeat of one commit a second, by one in twenty. Running statements alone are caught by
# one probe in four: too few for a paced crew's sparse probes, which would take the services for
# gone and let the loops burst.
NEIGHBOURS_WINDOW_SECONDS = 5.0
NEIGHBOURS_SHARE = 0.5
NICE_START = 0.5  # the first sleep, as a multiple of the batch's own time
# A run that finds other sessions busy starts at this multiple (half speed, one loop at a time)
# and earns the rest while the canary stays healthy: its first seconds are not a burst.
NICE_SHARED_START = 1.0
TURN_WAIT_SECONDS = 0.2  # a loop waiting for its turn looks at its stop signal this often
# A batch that holds the turn longer than this (or 3x the recent batches' median, if longer) is
# stuck, e.g. on a lock: the other loops go on without a turn rather than stall behind it.
TURN_PATIENCE_SECONDS = 1.0
RECENT_BATCHES = 8  # batch times whose median sets the patience
NICE_MAX = 20.0  # at most this multiple (of a WAL-rate sleep too): 1/21 of the pace stays
NICE_DECAY = 0.75  # each healthy probe shortens the sleep by this factor
NICE_FLOOR = 0.05  # below this, no sleep at all
# While others use the database, a batch is sized to take about this long (pt-archiver's
# --chunk-time, GitLab's batch sizing): a service transaction that meets a batch waits less
# behind a short one, and its commit flushes less of the job's WAL. At the 4 MB/s WAL budget,
# a slot drain's p99 was 2.5x its baseline with 5 ms batches (180-490 rows) against 3.1x with
# 10 ms ones (400-1100 rows), at the same drain rate (docs/benchmarks.md, notes).
SHARED_BATCH_SECONDS = 0.005
SHARED_BATCH_MIN = 50  # rows (sessions) a sized batch takes at least
HISTORY_SECONDS = 3600.0  # WAL positions kept for the lag estimate (one every probe)
WAL_DEBT_MAX_SECONDS = 2.0  # the WAL-rate bucket's depth, in seconds of the budget
WAL_RATE_WINDOW_SECONDS = 2.0  # the WAL rate a log line reports is over this window
# A crew that found no WAL debt after a batch this long after its last WAL-rate sleep is back
# at its own pace (one job_resumed line, not one per batch around the budget).
WAL_RESUME_SECONDS = 1.0
MEGABYTE = 1_000_000

REASON_REPLICA_LAG = "replica_lag"
REASON_NEIGHBOUR_LATENCY = "neighbour_latency"
REASON_WAL_RATE = "wal_rate"
REASONS = (REASON_REPLICA_LAG, REASON_NEIGHBOUR_LATENCY, REASON_WAL_RATE)


@dataclass(frozen=True)
class PacingLimits:
    """The pacing config keys; 0 turns a signal off."""

    max_replica_lag_seconds: float
    max_neighbour_slowdown: float
    max_wal_mb_per_second: float = 0.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PacingLimits:
        return cls(
            float(config.get("max_replica_lag_seconds", 0)),
            float(config.get("max_neighbour_slowdown", 0)),
            float(config.get("max_wal_mb_per_second", 0)),
        )

    @property
    def off(self) -> bool:
        return not (
            self.max_replica_lag_seconds
            or self.max_neighbour_slowdown
            or self.max_wal_mb_per_second
        )


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


def wal_paid_until(
    paid_until: float, since: float, now: float, new_bytes: int, bytes_per_second: float
) -> float:
    """The WAL-rate leaky bucket: the time at which all WAL written so far is paid for.

    ``new_bytes`` were written between the last read of the position, at ``since``, and
    ``now``; at the budget they take ``new_bytes / bytes_per_second`` to pay, from ``since`` or
    from when the earlier WAL was paid, whichever is later. Time spent under the budget is not
    saved up (an idle minute buys no burst), and the debt is at most
    :data:`WAL_DEBT_MAX_SECONDS` (a burst of the services' own WAL is not the drain's to repay
    long after it ended).
    """
    paid = max(paid_until, since) + max(0, new_bytes) / bytes_per_second
    return min(paid, now + WAL_DEBT_MAX_SECONDS)


def next_nice(nice: float, *, slow: bool) -> float:
    """The sleep multiple after a probe: doubled (from :data:`NICE_START`) while the canary is
    slow, decayed towards none once it is back (AIMD the other way round: the neighbours' side
    is protected quickly, the drain's pace comes back gradually)."""
    if slow:
        return min(NICE_MAX, max(NICE_START, nice * 2))
    nice *= NICE_DECAY
    return nice if nice >= NICE_FLOOR else 0.0


def shared_batch_size(seconds_per_row: float | None, batch_size: int) -> int:
    """A batch's size while others use the database: what takes about
    :data:`SHARED_BATCH_SECONDS` at the recent batches' pace (at least
    :data:`SHARED_BATCH_MIN`, at most ``batch_size``); the minimum before any batch was timed."""
    floor = min(batch_size, SHARED_BATCH_MIN)
    if not seconds_per_row or seconds_per_row <= 0:
        return floor
    return max(floor, min(batch_size, round(SHARED_BATCH_SECONDS / seconds_per_row)))


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
    """Time the crew spent paced (no loop starting a batch), by reason, for the run's result."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REASONS, 0.0))

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


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
        batch_size: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.batch_size = batch_size  # the job's own; None: batches are not sized
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
        self._turn_lane: int | None = None  # the lane holding it
        self._turn_since = 0.0  # when its batch started (inf while it is pacing, not stuck)
        self._resume_at = 0.0  # the crew's pause: no loop starts a batch before this
        self._batch_seconds: deque[float] = deque(maxlen=RECENT_BATCHES)
        self._row_seconds: deque[float] = deque(maxlen=RECENT_BATCHES)  # a batch's time per row
        # the WAL-rate bucket: the last WAL position read while shared, when all WAL read so
        # far is paid for, recent positions for the rate a log line reports, and the end of
        # the last WAL-rate sleep while the crew is paced by it
        self._wal_read: tuple[float, int] | None = None
        self._wal_paid_until = 0.0
        self._wal_recent: deque[tuple[float, int]] = deque()
        self._wal_paced_at: float | None = None

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
                signals=",".join(REASONS),
                reason="role lacks pg_read_all_stats (pg_monitor): the run is not paced",
            )
            return
        if self.limits.max_neighbour_slowdown:
            self._read_baseline(conn)
        elif self.limits.max_wal_mb_per_second:
            for reading in self._spaced_readings(conn):
                self._remember(reading)
        else:
            self._remember(self._read(conn))
        with self._lock:
            shared = self._shared
        if self.limits.max_wal_mb_per_second and shared:
            # the bucket opens before the first batch, so that batch's WAL is paid after it
            # like every other's: at each step's start the loops would otherwise run two or
            # three batches back to back before the first debt shows
            self._charge_wal(*self._read_wal(conn))

    def _read_baseline(self, conn: psycopg.Connection) -> None:
        """The canary's baseline and whether the database is shared, before the first batch."""
        readings = self._spaced_readings(conn)
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

    def _spaced_readings(self, conn: psycopg.Connection) -> list[Reading]:
        """:data:`BASELINE_CANARIES` readings :data:`BASELINE_SPACING_SECONDS` apart, so that
        they see more than one moment: back to back, a monitor polling a few times a second,
        caught just after a poll, would make a run on an idle database start as if shared."""
        readings = []
        for index in range(BASELINE_CANARIES):
            if index:
                time.sleep(BASELINE_SPACING_SECONDS)
            readings.append(self._read(conn))
        return readings

    # -- between batches -------------------------------------------------------------------

    @contextlib.contextmanager
    def turn(self, lane: Lane) -> Iterator[None]:
        """:class:`parallel.BatchPacing`'s turn: no loop starts a batch during the crew's pause;
        while other sessions are busy and the canary is on, the loops also take turns, one batch
        at a time, so the job never takes more than one core and one stream of WAL from the
        services beside it. A batch stuck in its turn past :meth:`_turn_patience` does not hold
        the others back."""
        self._wait_for_resume(lane.stop)
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
            self._turn_lane, self._turn_since = lane.index, self.clock()
        try:
            yield
        finally:
            with self._lock:
                self._turn_lane = None
            self._turn.release()

    def batch_limit(self, lane: Lane) -> int | None:
        """:class:`parallel.BatchPacing`'s batch size: the job's own ``batch_size`` alone,
        :func:`shared_batch_size` while others use the database and a signal that protects them
        (the canary or the WAL budget) is on."""
        if self.batch_size is None:
            return None
        with self._lock:
            polite = (
                self._stats_readable
                and self._shared
                and bool(self.limits.max_neighbour_slowdown or self.limits.max_wal_mb_per_second)
            )
            per_row = statistics.median(self._row_seconds) if self._row_seconds else None
        return shared_batch_size(per_row, self.batch_size) if polite else self.batch_size

    def _turn_patience(self) -> float:
        recent = statistics.median(self._batch_seconds) if self._batch_seconds else 0.0
        return max(TURN_PATIENCE_SECONDS, 3 * recent)

    def pace(self, lane: Lane, batch_seconds: float) -> None:
        """:class:`parallel.BatchPacing`'s pace: :meth:`after_batch` for the lane's batch."""
        self.after_batch(lane.index, lane.stop, batch_seconds, rows=lane.batch_limit)

    def after_batch(
        self, lane_index: int, stop: StopSignal, batch_seconds: float, rows: int | None = None
    ) -> None:
        """Hold while a replica is behind; then pause the crew for the current multiple of the
        batch time, or until its WAL is paid for. The pause is the crew's, not the loop's: no
        loop starts a batch before it ends (one loop's sleep alone would let the others' batches
        follow back to back, and a crew of three at 1x would pace nothing at all). ``rows``: the
        batch's size (None: not known, the batch's time teaches nothing about sizing)."""
        if self.limits.off or not self._stats_readable:
            return
        with self._lock:
            self._batch_seconds.append(batch_seconds)
            if rows:  # a full batch: it took this long for its rows
                self._row_seconds.append(batch_seconds / rows)
            if self._turn_lane == lane_index:
                self._turn_since = float("inf")  # pacing in its turn: not a stuck batch
        conn = self.connections.get(lane_index)
        if conn is None:
            return
        self._probe_if_due(conn)
        if self.limits.max_replica_lag_seconds:
            self._hold_for_replica(conn, stop)
        if stop.is_set():
            return
        with self._lock:
            nice_pause = self._nice * batch_seconds
        wal_pause = self._wal_debt(conn, batch_seconds) if self.limits.max_wal_mb_per_second else 0
        reason = REASON_WAL_RATE if wal_pause > nice_pause else REASON_NEIGHBOUR_LATENCY
        pause = min(max(nice_pause, wal_pause), self.deadline_remaining())
        if pause > 0:
            self._account(reason, self._pause_crew(pause, stop))
            if reason == REASON_WAL_RATE:
                with self._lock:
                    self._wal_paced_at = self.clock()

    def _pause_crew(self, seconds: float, stop: StopSignal) -> float:
        """Pause the crew for ``seconds`` from now (a pause under way may already cover part
        of it) and wait it out; the crew's time this added, counted once however many loops
        paused it."""
        with self._lock:
            now = self.clock()
            added = max(0.0, now + seconds - max(self._resume_at, now))
            self._resume_at = max(self._resume_at, now + seconds)
        self._wait_for_resume(stop)
        return added

    def _wait_for_resume(self, stop: StopSignal) -> None:
        """Wait until the crew's pause is over (or a stop)."""
        while not stop.is_set():
            with self._lock:
                left = self._resume_at - self.clock()
            if left <= 0:
                return
            stop.wait(left)

    def _wal_debt(self, conn: psycopg.Connection, batch_seconds: float) -> float:
        """Charge the WAL written since the last read to the bucket; the seconds until it is
        paid, at most :data:`NICE_MAX` times the batch's time (the services' own WAL alone may
        exceed the budget: the drain slows to its floor then, it does not stop). Only while
        other sessions are active: alone, the job pays nothing and reads nothing."""
        with self._lock:
            shared = self._shared
            if not shared:
                self._wal_read = None
                self._wal_recent.clear()
        if not shared:
            self._wal_resumed()
            return 0.0
        now, position = self._read_wal(conn)
        debt, first_pause = self._charge_wal(now, position)
        if debt <= 0:
            self._wal_resumed()
            return 0.0
        if first_pause:
            self.telemetry.log.info(
                "job_paced",
                reason=REASON_WAL_RATE,
                value=round(self._wal_rate() / MEGABYTE, 1),
                limit=self.limits.max_wal_mb_per_second,
            )
        return min(debt, NICE_MAX * batch_seconds)

    def _charge_wal(self, now: float, position: int) -> tuple[float, bool]:
        """Fold a WAL position read at ``now`` into the bucket (the first read opens it); the
        seconds of debt, and whether this is the first debt since the crew was last at its own
        pace."""
        budget = self.limits.max_wal_mb_per_second * MEGABYTE
        with self._lock:
            if self._wal_read is None:
                self._wal_read, self._wal_paid_until = (now, position), now
            elif position > self._wal_read[1]:
                since, before = self._wal_read
                self._wal_paid_until = wal_paid_until(
                    self._wal_paid_until, since, now, position - before, budget
                )
                self._wal_read = (now, position)
            self._wal_recent.append((now, position))
            while (
                len(self._wal_recent) > 2 and now - self._wal_recent[0][0] > WAL_RATE_WINDOW_SECONDS
            ):
                self._wal_recent.popleft()
            debt = self._wal_paid_until - now
            first_pause = debt > 0 and self._wal_paced_at is None
            if first_pause:
                self._wal_paced_at = now
        return debt, first_pause

    def _read_wal(self, conn: psycopg.Connection) -> tuple[float, int]:
        """(now, the server's WAL insert position in bytes)."""
        row = conn.execute(sql.load("pacing/read_wal_position")).fetchone()
        if not conn.autocommit:
            conn.rollback()
        return self.clock(), int(row[0])

    def _wal_rate(self) -> float:
        """The database's WAL rate over the recent reads (the last two at least), bytes per
        second."""
        with self._lock:
            (first_at, first), (last_at, last) = self._wal_recent[0], self._wal_recent[-1]
        return (last - first) / (last_at - first_at) if last_at > first_at else 0.0

    def _wal_resumed(self) -> None:
        """One ``job_resumed`` line once the crew has run :data:`WAL_RESUME_SECONDS` without a
        WAL-rate sleep."""
        with self._lock:
            paced_at = self._wal_paced_at
            if paced_at is None or self.clock() - paced_at < WAL_RESUME_SECONDS:
                return
            self._wal_paced_at = None
            paced = self.totals.seconds[REASON_WAL_RATE]
        self.telemetry.log.info("job_resumed", reason=REASON_WAL_RATE, paced_ms=round(paced * 1000))

    def _hold_for_replica(self, conn: psycopg.Connection, stop: StopSignal) -> None:
        limit = self.limits.max_replica_lag_seconds
        held, holding = 0.0, False
        while not stop.is_set():
            with self._lock:
                lag = self._lag()
            if lag <= limit:
                break
            left = self.deadline_remaining()
            if left <= 0:
                break
            if not holding:
                holding = True
                self.telemetry.log.info(
                    "job_paced",
                    reason=REASON_REPLICA_LAG,
                    value=round(lag, 3),
                    limit=limit,
                )
            held += self._pause_crew(min(REPLICA_RECHECK_SECONDS, left), stop)
            self._probe_if_due(conn)
        if holding:
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
        row = conn.execute(
            sql.load("pacing/read_database_health"), {"own_pids": self._own_pids(conn)}
        ).fetchone()
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

    def _own_pids(self, conn: psycopg.Connection) -> list[int]:
        """The server processes of the crew's connections: between batches a loop's session is
        idle under no application_name, and must not count as a neighbour that just finished a
        statement. (Behind a pooler these are the pooler's own numbers and match nothing: the
        loops' idle server connections may then count, which paces more, not less.)"""
        conns = [conn, *self.connections.values()]
        return sorted({c.info.backend_pid for c in conns if not c.closed})

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
            self._shared = database_shared([active for _, active in self._others])
            if reading.canary_seconds is None:
                return
            self._canaries.append(reading.canary_seconds)
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
