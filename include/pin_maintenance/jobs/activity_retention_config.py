"""The activity retention (seed 003) job: its id, config keys and how long each delete task
may take with them (docs/design.md, "Configuration").

DAG files import this module at parse time, so it imports nothing heavier than the config
rules themselves (no database driver, no HTTP client).
"""

from __future__ import annotations

from dataclasses import dataclass

from include.pin_maintenance.config import ConfigSpec, setting
from include.pin_maintenance.pacing_config import PacingConfig

JOB = "user_activity_retention"

# The run's budget split between the delete steps, as the point of the run's window (from
# prepare to deadline_at) where each step stops claiming. Each later step covers only the
# sessions the step before it covered, so the later steps get more of the window to finish what
# the first one cleared; the measurements behind 20 / 50 %: docs/design/retention.md. Only a
# backlog larger than the time budget meets this split.
STEP_DEADLINE_SHARE = {"action_events": 0.2, "property_object_views": 0.5, "sessions": 1.0}

# A batch's statements touch up to batch_size sessions and all their children (RI triggers
# included): more than the 30 s default, still far below the lock lease margin.
STATEMENT_TIMEOUT_SECONDS = 120
# After any exception in a batch loop: a cancel request per loop (psycopg's cancel_safe waits
# at most this long for each; they are sent one after the other), then each loop rolls back
# and closes its connection.
CANCEL_TIMEOUT_SECONDS = 5.0
# The bounded join of the loops (run_lanes' grace): past the step's deadline the batches in
# hand may still run their two statements (claim + delete, each <= statement_timeout); after a
# cancel, loops stop within one cancel round trip. A loop still running after this is reported
# (LanesDidNotStop) instead of waited for.
STOP_GRACE_SECONDS = 2 * STATEMENT_TIMEOUT_SECONDS + 2 * CANCEL_TIMEOUT_SECONDS


@dataclass(frozen=True, kw_only=True)
class RetentionConfig(PacingConfig):
    """The job's resolved config (:data:`CONFIG`); the pacing keys come after these."""

    retention_period_days: int = setting(
        365,
        minimum=1,
        help="Inactive sessions whose ended_at is older than this many days are deleted.",
    )
    batch_size: int = setting(
        5000,
        minimum=1,
        maximum=50_000,
        help="Sessions per batch (one transaction per batch and table).",
    )
    runners: int = setting(
        3,
        minimum=1,
        maximum=8,
        help=(
            "Independent batch loops per delete task, one connection each: each claims "
            "the next batch (FOR UPDATE SKIP LOCKED), deletes and commits it on its own; "
            "1 = one loop. A task holds up to 1 + runners server connections at once."
        ),
    )
    max_batches_per_run: int = setting(
        200,
        minimum=1,
        help=(
            "Upper bound of session batches per run: each delete task claims at most this "
            "many batches of batch_size sessions' worth (a smaller batch while others use the "
            "database counts by its share), all its loops together; the rest waits for the "
            "next run."
        ),
    )
    max_run_duration_seconds: float = setting(
        1800,
        minimum=0,
        exclusive_minimum=True,
        help=(
            "Time budget of the whole run, split between the delete tasks (20 / 50 / 100 % "
            "of the window), checked between batches."
        ),
    )


def worst_case_step_seconds(config: RetentionConfig, table: str) -> float:
    """How long the delete task of ``table`` may take at most with ``config``: the run's
    window starts at prepare, before the task, and the task claims batches until its share of
    it (:data:`STEP_DEADLINE_SHARE`); its loops then stop within :data:`STOP_GRACE_SECONDS`."""
    return STEP_DEADLINE_SHARE[table] * config.max_run_duration_seconds + STOP_GRACE_SECONDS


CONFIG = ConfigSpec(
    job=JOB,
    config_class=RetentionConfig,
    extra_params=frozenset({"dry_run"}),
)
