"""The activity retention (seed 003) job's id, config keys and bounds (docs/design.md,
"Configuration"). DAG files import it at parse time: no database driver, no HTTP client.
"""

from __future__ import annotations

from dataclasses import dataclass

from include.pin_maintenance.config import ConfigSpec, setting
from include.pin_maintenance.pacing_config import PacingConfig

JOB = "user_activity_retention"

# Where in the run's window each delete step stops claiming (docs/design/retention.md).
STEP_DEADLINE_SHARE = {"action_events": 0.2, "property_object_views": 0.5, "sessions": 1.0}

# A batch's statements touch up to batch_size sessions and all their children (RI triggers
# included): more than the 30 s default, still far below the lock lease margin.
STATEMENT_TIMEOUT_SECONDS = 120
CANCEL_TIMEOUT_SECONDS = 5.0  # each loop's cancel_safe after an exception (psycopg: 30 s)
# the loops' bounded join: a batch in hand (claim + delete) and a cancel round trip
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
    """How long the delete task of ``table`` may take at most: its share of the run's window
    (which starts at prepare), then :data:`STOP_GRACE_SECONDS` for its loops to stop."""
    return STEP_DEADLINE_SHARE[table] * config.max_run_duration_seconds + STOP_GRACE_SECONDS


CONFIG = ConfigSpec(
    job=JOB,
    config_class=RetentionConfig,
    extra_params=frozenset({"dry_run"}),
)
