"""What one activity retention run acts on and reports: its tables and queries, its metric
names, the plan every task of the run shares, and the results the tasks hand on (XComs).

The run itself is in :mod:`include.pin_maintenance.jobs.activity_retention`, the keyset walk of
one delete step in :mod:`include.pin_maintenance.jobs.activity_retention_walk`.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

from include.pin_maintenance.db import SessionSettings
from include.pin_maintenance.jobs.activity_retention_config import (
    CONFIG,
    STATEMENT_TIMEOUT_SECONDS,
    RetentionConfig,
)
from include.pin_maintenance.stopping import StopReason

LOCK_NAME = "job:scheduled:activity-retention"
LOCK_TTL_MARGIN_SECONDS = 300

SESSION_SETTINGS = SessionSettings(
    statement_timeout_ms=STATEMENT_TIMEOUT_SECONDS * 1000,
    lock_timeout_ms=5_000,
    application_name="pin-activity-retention",
)

# Child tables first: the RESTRICT foreign keys on sessions(id) demand it (seed, step 4).
TABLES: tuple[str, ...] = ("action_events", "property_object_views", "sessions")

_DELETE_SQL = {
    "action_events": "retention/delete_action_events",
    "property_object_views": "retention/delete_property_object_views",
    "sessions": "retention/delete_childless_sessions",
}
_COUNT_SQL = {
    "action_events": "retention/count_action_events",
    "property_object_views": "retention/count_property_object_views",
    "sessions": "retention/count_sessions",
}

M_BATCHES = "activity_retention_batches_processed"
M_LOCK_CONTENTION = "activity_retention_lock_contention_total"
M_RUN_DURATION = "activity_retention_run_duration_seconds"
M_ELIGIBLE_BACKLOG = "activity_retention_eligible_backlog"
# time the loops spent paced, one counter per reason (pacing.paced_metric)
M_PACED_PREFIX = "activity_retention_paced"
DELETED_METRIC = {
    "action_events": "activity_retention_deleted_action_events",
    "property_object_views": "activity_retention_deleted_property_object_views",
    "sessions": "activity_retention_deleted_sessions",
}

# Keyset start and end: before / after every possible (ended_at, id).
_KEY_START = (datetime(1, 1, 1, tzinfo=UTC), uuid.UUID(int=0))
_KEY_END = (datetime(9999, 12, 31, tzinfo=UTC), uuid.UUID(int=(1 << 128) - 1))


@dataclass(frozen=True)
class RunPlan:
    """What every task of one run acts on: the same cutoff, deadline and config (an XCom)."""

    cutoff: datetime
    deadline_at: datetime
    started_at_unix: float
    eligible_backlog: int
    config: RetentionConfig  # as prepare resolved it: every task of the run uses the same
    dry_run: bool = False

    def to_xcom(self) -> dict[str, Any]:
        """One flat JSON object: the config keys beside the plan's own."""
        data = {**asdict(self.config), **asdict(self)}
        del data["config"]
        data["cutoff"] = self.cutoff.isoformat()
        data["deadline_at"] = self.deadline_at.isoformat()
        return data

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> RunPlan:
        """The plan :meth:`to_xcom` wrote. A config key missing from it (a plan from before
        the key existed) gets its default, except ``runners``: there one loop was the run."""
        keys = {s.name for s in CONFIG.settings}
        config = {key: data[key] for key in keys & data.keys()}
        # a plan written by another version of the code may hold keys this one no longer has
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        config.setdefault("runners", 1)
        values["cutoff"] = datetime.fromisoformat(values["cutoff"])
        values["deadline_at"] = datetime.fromisoformat(values["deadline_at"])
        return cls(config=RetentionConfig(**config), **values)


@dataclass(frozen=True)
class StepResult:
    """One delete task: rows of its table deleted (or counted, in a dry run) and how it ended."""

    table: str
    rows: int = 0
    batches: int = 0
    stop_reason: str = StopReason.DRAINED.value
    lock_skipped: bool = False
    dry_run: bool = False
    # the keyset position the step reached (the last claimed session): the later steps of the
    # run cover no session past it; None = no batch claimed
    last_ended_at: str | None = None
    last_id: str | None = None
    paced_ms: int = 0  # time its loops spent paced (no loop running a batch)

    def covered(self) -> tuple[datetime, uuid.UUID] | None:
        """The last (ended_at, id) this step covered, or None when it covered everything."""
        if self.lock_skipped:
            return _KEY_START  # it covered nothing
        if self.stop_reason == StopReason.DRAINED.value:
            return None
        if self.last_ended_at is None or self.last_id is None:
            return _KEY_START
        return datetime.fromisoformat(self.last_ended_at), uuid.UUID(self.last_id)

    @property
    def has_more(self) -> bool:
        """A bound or a busy lock, not an exhausted eligible set, ended the step."""
        return self.lock_skipped or self.stop_reason != StopReason.DRAINED.value

    def to_xcom(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> StepResult:
        return cls(**data)


@dataclass(frozen=True)
class RetentionResult:
    """The seed's result (step 8). ``batches_processed`` counts session batches as the seed
    defines them (one batch = up to ``batch_size`` sessions with their children): the batches
    the sessions step committed, the same as the activity_retention_batches_processed counter.
    ``batches_by_table`` has each delete step's committed batches beside it.
    """

    deleted_sessions: int = 0
    deleted_property_object_views: int = 0
    deleted_action_events: int = 0
    batches_processed: int = 0
    has_more: bool = False
    dry_run: bool = False
    paced_ms: int = 0
    batches_by_table: dict[str, int] = field(default_factory=dict, compare=False)
    steps: tuple[StepResult, ...] = field(default=(), compare=False)

    @classmethod
    def of_steps(cls, steps: tuple[StepResult, ...], *, dry_run: bool) -> RetentionResult:
        """The run's result: each table's rows from its step, session batches as the seed's."""
        by_table = {s.table: s for s in steps}

        def step(table: str) -> StepResult:
            return by_table.get(table, StepResult(table))

        return cls(
            deleted_sessions=step("sessions").rows,
            deleted_property_object_views=step("property_object_views").rows,
            deleted_action_events=step("action_events").rows,
            batches_processed=step("sessions").batches,
            batches_by_table={s.table: s.batches for s in steps},
            has_more=any(s.has_more for s in steps),
            dry_run=dry_run,
            paced_ms=sum(s.paced_ms for s in steps),
            steps=steps,
        )

    def as_dict(self) -> dict[str, Any]:
        counts = {
            "Sessions": self.deleted_sessions,
            "PropertyObjectViews": self.deleted_property_object_views,
            "ActionEvents": self.deleted_action_events,
        }
        # A dry run deletes nothing: its counts are WouldDelete*, the Deleted* keys stay 0
        # (as the slot job's ExpiredCount / WouldExpireCount)
        out: dict[str, Any] = {f"Deleted{k}": 0 if self.dry_run else n for k, n in counts.items()}
        out.update(
            {
                "BatchesProcessed": self.batches_processed,
                "ActionEventBatches": self.batches_by_table.get("action_events", 0),
                "PropertyObjectViewBatches": self.batches_by_table.get("property_object_views", 0),
                "SessionBatches": self.batches_by_table.get("sessions", 0),
                "HasMore": self.has_more,
                "DryRun": self.dry_run,
                "PacedMs": self.paced_ms,
            }
        )
        if self.dry_run:
            out.update({f"WouldDelete{k}": n for k, n in counts.items()})
        return out
