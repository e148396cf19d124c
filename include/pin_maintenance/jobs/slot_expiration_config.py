"""The slot expiration (seed 002) job's id, config keys and bounds (docs/design.md,
"Configuration"). DAG files import it at parse time: no database driver, no HTTP client.
"""

from __future__ import annotations

from dataclasses import dataclass

from include.pin_maintenance.config import ConfigSpec, setting
from include.pin_maintenance.pacing_config import PacingConfig

JOB = "calendar_slot_expiration"
CONN_ID = "calendar_db"

# One statement never runs longer than this; a slow batch is an infrastructure failure.
STATEMENT_TIMEOUT_SECONDS = 30
# a loop in a statement at a cancel: interrupted at once, this if the server does not answer
STOP_GRACE_SECONDS = STATEMENT_TIMEOUT_SECONDS + 5


@dataclass(frozen=True, kw_only=True)
class SlotConfig(PacingConfig):
    """The job's resolved config (:data:`CONFIG`); the pacing keys come after these."""

    batch_size: int = setting(
        500,
        minimum=1,
        maximum=10_000,
        help="Slots expired per batch (one statement, one transaction).",
    )
    runners: int = setting(
        2,
        minimum=1,
        maximum=8,
        help=(
            "Batch loops side by side, one connection each, kept apart by SKIP LOCKED like "
            "parallel instances; the extra ones start only when max_batches_per_cycle is "
            "above 1 and the first batch comes back full."
        ),
    )
    max_batches_per_cycle: int = setting(
        1,
        minimum=1,
        maximum=100_000,
        help=(
            "Batches one cycle may take (seed 002: batch_size is the bound of rows per "
            "cycle, so 1 by default). Raise it to drain a backlog: up to this many batches "
            "of batch_size rows per cycle, and the side runners start only when it is above 1."
        ),
    )
    max_run_duration_seconds: float = setting(
        30,
        minimum=0,
        exclusive_minimum=True,
        help="No new batch starts after this many seconds; the rest waits for the next cycle.",
    )


def worst_case_run_seconds(config: SlotConfig) -> float:
    """How long a cycle may take at most: its duration bound, then the loops' stop grace."""
    return config.max_run_duration_seconds + STOP_GRACE_SECONDS


CONFIG = ConfigSpec(
    job=JOB,
    config_class=SlotConfig,
    extra_params=frozenset({"dry_run"}),
)
