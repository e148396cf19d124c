"""The activity retention (seed 003) job: its id and config keys
(docs/design.md, "Configuration").

DAG files import this module at parse time, so it imports nothing heavier than the config
rules themselves (no database driver, no HTTP client).
"""

from __future__ import annotations

from include.pin_maintenance.config import ConfigSpec, Setting

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
                "Batch loops per delete task, one connection each. They take the task's batches "
                "in keyset order one after the other (the same batches one loop would take), "
                "delete them side by side and commit them in batch order; 1 = one loop. Three: "
                "while one loop waits for its turn to commit, two others delete."
            ),
        ),
        Setting(
            "max_batches_per_run",
            200,
            minimum=1,
            help="Upper bound of batches per delete task; the rest waits for the next run.",
        ),
        Setting(
            "max_run_duration_seconds",
            1800,
            kind=float,
            minimum=0,
            exclusive_minimum=True,
            help="Time budget of the whole run, checked between batches.",
        ),
    ),
    extra_params=frozenset({"dry_run"}),
)
