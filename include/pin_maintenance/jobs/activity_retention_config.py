"""The activity retention (seed 003) job: its id and config keys
(docs/design.md, "Configuration").

DAG files import this module at parse time, so it imports nothing heavier than the config
rules themselves (no database driver, no HTTP client).
"""

from __future__ import annotations

from include.pin_maintenance.config import ConfigSpec, Setting
from include.pin_maintenance.pacing_config import PACING_RULES, PACING_SETTINGS

JOB = "user_activity_retention"

CONFIG = ConfigSpec(
    job=JOB,
    settings=(
        Setting(
            "retention_period_days",
            365,
            minimum=1,
            help="Inactive sessions whose ended_at is older than this many days are deleted.",
        ),
        Setting(
            "batch_size",
            5000,
            minimum=1,
            maximum=50_000,
            help="Sessions per batch (one transaction per batch and table).",
        ),
        Setting(
            "runners",
            3,
            minimum=1,
            maximum=8,
            help=(
                "Independent batch loops per delete task, one connection each: each claims "
                "the next batch (FOR UPDATE SKIP LOCKED), deletes and commits it on its own; "
                "1 = one loop. A task holds up to 1 + runners server connections at once."
            ),
        ),
        Setting(
            "max_batches_per_run",
            200,
            minimum=1,
            help=(
                "Upper bound of session batches per run: each delete task claims at most this "
                "many batches of batch_size sessions' worth (a smaller batch while others use the "
                "database counts by its share), all its loops together; the rest waits for the "
                "next run."
            ),
        ),
        Setting(
            "max_run_duration_seconds",
            1800,
            kind=float,
            minimum=0,
            exclusive_minimum=True,
            help=(
                "Time budget of the whole run, split between the delete tasks (20 / 50 / 100 % "
                "of the window), checked between batches."
            ),
        ),
        *PACING_SETTINGS,
    ),
    rules=PACING_RULES,
    extra_params=frozenset({"dry_run"}),
)
