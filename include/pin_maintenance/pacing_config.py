"""The pacing config keys the batch jobs share (docs/design.md, "Pacing").

DAG files import this at parse time through the jobs' config modules: config rules only.
"""

from __future__ import annotations

from dataclasses import dataclass

from include.pin_maintenance.config import JobConfig, setting


@dataclass(frozen=True, kw_only=True)
class PacingConfig(JobConfig):
    """The pacing keys, inherited by the config of each job that paces its batches."""

    max_replica_lag_seconds: float = setting(
        2,
        minimum=0,
        maximum=3600,
        help=(
            "Hold between batches while the slowest streaming replica replays more than this "
            "many seconds behind; 0 = do not watch replicas. Reading the replicas needs the "
            "job role in pg_monitor; without it the job runs without this signal (one warning)."
        ),
    )
    max_wal_mb_per_second: float = setting(
        4,
        minimum=0,
        maximum=10000,
        help=(
            "While other sessions use the database, hold its WAL rate (everyone's, in MB/s) to "
            "this by sleeping between batches: the services' commits wait behind the WAL the "
            "drain writes; 0 = off."
        ),
    )

    @property
    def paced(self) -> bool:
        """Whether any signal is on: with both off a run goes at its own speed, reading none."""
        return bool(self.max_replica_lag_seconds or self.max_wal_mb_per_second)


# every signal off, as config overrides: a run at its own speed (a test of a bound, a bench case)
PACING_OFF = {"max_replica_lag_seconds": 0, "max_wal_mb_per_second": 0}
