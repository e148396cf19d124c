"""Runbook action for the detach outbox: move chosen ``Quarantined`` rows back to ``Pending``.

``quarantined_total > 0`` -> read ``last_error``; once the cause is fixed, requeue: the chosen
rows get ``status = 'Pending'``, ``attempts = 0``, ``next_attempt_at = now`` and
``last_error = 'requeued: ' || <previous error>``. Only rows that are ``Quarantined`` move;
nothing else is touched. The choice is either a list of snapshot ids or ``all_quarantined``,
never both and never neither. ``dry_run`` reports the same and changes nothing.

No lock is needed against the retry job: it never selects Quarantined rows and its outcome
update applies only to the Pending claim it made, so a requeue is never overwritten.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from include.pin_maintenance import privileges, sql
from include.pin_maintenance.config import ConfigError, ConfigSpec, JobConfig, brief
from include.pin_maintenance.db import Connect
from include.pin_maintenance.lifecycle import JobMetrics, JobSpec, job_run
from include.pin_maintenance.telemetry import Telemetry

JOB = "news_snapshot_detach_requeue"
REPORT_LIMIT = 100  # ids listed in the report; the count is always exact
MAX_SNAPSHOT_IDS = 10_000


@dataclass(frozen=True, kw_only=True)
class RequeueConfig(JobConfig):
    """A runbook action has no config keys: its params are the choice (:class:`RequeueChoice`).

    It has no metrics of its own either (:data:`SPEC`)."""


SPEC = JobSpec(
    job=JOB,
    config=ConfigSpec(job=JOB, config_class=RequeueConfig),
    metrics=JobMetrics(counters=(), duration=None, last_success=None),
)


class RequeueRequestError(ConfigError):
    """The requeue params do not name a valid choice; nothing was changed (bad input, like a
    bad config value: the run fails at once and is not paged as critical)."""


@dataclass(frozen=True)
class RequeueChoice:
    snapshot_ids: tuple[str, ...] = ()
    all_quarantined: bool = False

    def describe(self) -> str:
        if self.all_quarantined:
            return "all_quarantined"
        return f"{len(self.snapshot_ids)} snapshot id(s)"


def parse_choice(
    snapshot_ids: Any, all_quarantined: Any, *, source: str = "trigger params"
) -> RequeueChoice:
    """Validate the params: a list of uuid strings XOR ``all_quarantined: true``.

    ``snapshot_ids`` may also be one string with ids separated by commas or whitespace (what a
    person pastes into a form field). Raises :class:`RequeueRequestError` naming the problem,
    the value (cut short, :func:`brief`), the limit and ``source`` (where the values came from).
    """
    if all_quarantined not in (None, True, False):
        raise RequeueRequestError(
            f"all_quarantined = {brief(all_quarantined)} (from {source}) is not valid; "
            "allowed: true or false"
        )
    ids = _as_id_list(snapshot_ids, source)
    if ids and all_quarantined:
        raise RequeueRequestError(
            "give either snapshot_ids or all_quarantined: true, not both "
            f"(got {len(ids)} snapshot id(s) and all_quarantined = true from {source}); "
            "nothing was changed"
        )
    if not ids and not all_quarantined:
        raise RequeueRequestError(
            f"nothing chosen (from {source}): give snapshot_ids (a list of snapshot uuids) or "
            "all_quarantined: true; nothing was changed"
        )
    if all_quarantined:
        return RequeueChoice(all_quarantined=True)
    # checked here, not in the param's JSON schema: Airflow's schema error quotes the whole list
    if len(ids) > MAX_SNAPSHOT_IDS:
        raise RequeueRequestError(
            f"snapshot_ids has {len(ids)} ids (from {source}); allowed at most "
            f"{MAX_SNAPSHOT_IDS} per run; nothing was changed"
        )
    normalized = []
    for n, value in enumerate(ids, start=1):
        try:
            normalized.append(str(uuid.UUID(str(value).strip())))
        except (ValueError, AttributeError, TypeError):
            raise RequeueRequestError(
                f"snapshot_ids: {brief(value)} (id {n} of {len(ids)}, from {source}) is not "
                "a valid uuid; nothing was changed"
            ) from None
    return RequeueChoice(snapshot_ids=tuple(dict.fromkeys(normalized)))


def _as_id_list(value: Any, source: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part for part in value.replace(",", " ").split() if part]
    if isinstance(value, Iterable) and not isinstance(value, (bytes, dict)):
        return list(value)
    raise RequeueRequestError(
        f"snapshot_ids = {brief(value)} (from {source}) is not valid; "
        "allowed: a list of snapshot uuid strings"
    )


@dataclass
class RequeueResult:
    dry_run: bool
    choice: str
    count: int = 0
    snapshot_ids: list[str] = field(default_factory=list)  # first REPORT_LIMIT, sorted
    truncated: bool = False
    # requested ids that did not move, with why (their status, or "not found")
    skipped: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        # a dry run moves nothing: its count is WouldRequeueCount, as the log line says
        # (requeued_count=0 would_requeue_count=N); the slot job reports ExpiredCount /
        # WouldExpireCount alike
        return {
            "DryRun": self.dry_run,
            "Choice": self.choice,
            "RequeuedCount": 0 if self.dry_run else self.count,
            "WouldRequeueCount": self.count if self.dry_run else 0,
            "SnapshotIds": self.snapshot_ids,
            "Truncated": self.truncated,
            "Skipped": self.skipped,
        }


def requeue(
    connect: Connect, telemetry: Telemetry, choice: RequeueChoice, *, dry_run: bool = False
) -> RequeueResult:
    """Requeue (or, with ``dry_run``, list) the chosen Quarantined rows in one transaction."""
    with job_run(SPEC, telemetry) as run:
        started = time.monotonic()
        run.started(choice=choice.describe(), dry_run=dry_run)
        privileges.require(connect, JOB, telemetry)  # before any write
        result = RequeueResult(dry_run=dry_run, choice=choice.describe())
        moved = _requeue_or_select(connect, choice, result, dry_run=dry_run)
        result.count = len(moved)
        result.snapshot_ids = moved[:REPORT_LIMIT]
        result.truncated = len(moved) > REPORT_LIMIT
        run.completed(
            result.as_dict(),
            duration_seconds=time.monotonic() - started,
            dry_run=dry_run,
            requeued_count=0 if dry_run else result.count,
            would_requeue_count=result.count if dry_run else 0,
            skipped=len(result.skipped),
            snapshot_ids=",".join(result.snapshot_ids) or "-",
            truncated=result.truncated,
        )
    return result


def _requeue_or_select(
    connect: Connect, choice: RequeueChoice, result: RequeueResult, *, dry_run: bool
) -> list[str]:
    """The snapshot ids moved (or, dry run, that would move), sorted; a requested id that did
    not move goes into ``result.skipped`` with why."""
    params = {
        "now": datetime.now(UTC),
        "all_quarantined": choice.all_quarantined,
        "snapshot_ids": list(choice.snapshot_ids),
    }
    # dry run: a read-only select of the same rows the update would move
    query = "news/select_quarantined_entries" if dry_run else "news/requeue_quarantined_entries"
    statuses: dict[str, set[str]] = {}
    with connect() as conn, conn.transaction():
        moved = sorted(str(r[1]) for r in conn.execute(sql.load(query), params).fetchall())
        if choice.snapshot_ids:
            for sid, status in conn.execute(sql.load("news/select_entry_statuses"), params):
                statuses.setdefault(str(sid), set()).add(status)
    moved_set = set(moved)
    for sid in choice.snapshot_ids:
        if sid not in moved_set:
            found = statuses.get(sid)
            result.skipped[sid] = (
                f"{','.join(sorted(found))} (only Quarantined rows are requeued)"
                if found
                else "not found"
            )
    return moved
