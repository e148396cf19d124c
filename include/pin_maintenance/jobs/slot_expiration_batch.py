"""One batch of a slot-expiration cycle: the expire statement, and poison isolation (bisection
under savepoints) when a row fails it; any other error rolls the batch back and is raised.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from include.pin_maintenance import sql
from include.pin_maintenance.db import is_row_error
from include.pin_maintenance.jobs.slot_expiration_config import JOB
from include.pin_maintenance.lifecycle import CappedAlerts, describe_error
from include.pin_maintenance.telemetry import Alert, Telemetry, error_code

M_ERRORS = "calendar_slot_expiration_errors_total"
POISON_ALERT = "slot_expiration_poison_row"
# Counts (backlog, skipped, dry run) stop here: a bounded index range read (the alert: 5000).
COUNT_CAP = 1_000_000
MAX_SPAN_TENANTS = 20


@dataclass(frozen=True)
class PoisonSlot:
    slot_id: str
    error: str  # class, SQLSTATE and the server's message: for the log line
    code: str = ""  # class and SQLSTATE only: for the alert (telemetry.error_code)


@dataclass
class CycleState:
    """What the batches (and threads) of one cycle share."""

    as_of: datetime
    batch_size: int
    expired: int = 0
    batches: int = 0
    poison: list[PoisonSlot] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def excluded_ids(self) -> list[str]:
        with self._lock:
            return [p.slot_id for p in self.poison]

    def params(self) -> dict[str, Any]:
        return {
            "as_of": self.as_of,
            "batch_size": self.batch_size,
            "excluded_ids": self.excluded_ids,
            "count_cap": COUNT_CAP,
        }

    def batch_done(
        self, expired: int, poison: Sequence[PoisonSlot]
    ) -> tuple[int, list[PoisonSlot]]:
        """Count one batch; its number in the cycle (1-based) and the poison slots new to the
        cycle (two loops can both meet one before either has excluded it)."""
        with self._lock:
            self.expired += expired
            known = {p.slot_id for p in self.poison}
            new = [p for p in poison if p.slot_id not in known]
            self.poison.extend(new)
            self.batches += 1
            return self.batches, new


@dataclass
class KeysetPosition:
    """One loop's place in the index: the largest ``start_at`` it has locked so far."""

    runner: int
    after: datetime | None = None


@dataclass
class _Outcome:
    """What one batch did."""

    selected: int
    expired: int
    last_start_at: datetime | None
    poison: list[tuple[uuid.UUID, psycopg.Error]] = field(default_factory=list)
    tenants: list[uuid.UUID] | None = None  # None: isolated (reads no tenants)
    tenant_count: int = 0


def run_batch(
    conn: psycopg.Connection,
    cycle: CycleState,
    position: KeysetPosition,
    telemetry: Telemetry,
    alerts: CappedAlerts,
    *,
    size: int | None = None,
) -> bool:
    """One batch of ``size`` slots at most (None: ``batch_size``) in one transaction; True when
    it was full (more may be due)."""
    size = size or cycle.batch_size
    with telemetry.span(f"{JOB} batch", {"pin.runner": position.runner}) as span:
        tracing = span.is_recording()
        params = cycle.params() | {
            "batch_size": size,
            "after": position.after,
            "with_tenants": tracing,
            "max_tenants": MAX_SPAN_TENANTS,
        }
        try:
            outcome = _expire(conn, cycle, params)
        except psycopg.Error as exc:
            if not is_row_error(exc.sqlstate) or conn.closed:
                raise
            telemetry.log.warning(
                "batch_isolating",
                runner=position.runner,
                batch_size=size,
                error=describe_error(exc),
            )
            outcome = _expire_isolating(conn, cycle, params)
        if outcome.last_start_at is not None:
            position.after = outcome.last_start_at
        found = [
            PoisonSlot(str(slot_id), describe_error(error), error_code(error))
            for slot_id, error in outcome.poison
        ]
        number, found = cycle.batch_done(outcome.expired, found)
        for slot in found:
            telemetry.log.error("item_failed", slot_id=slot.slot_id, error=slot.error)
            telemetry.metrics.incr(M_ERRORS)
            summary = f"slot {slot.slot_id} cannot be expired; left Available for the next cycle"
            details = {"slot_id": slot.slot_id, "error": slot.code or "unknown"}
            alerts.send(Alert(POISON_ALERT, "warning", summary, details))
            if tracing:  # the exception's class only
                error_type = slot.error.split(":", 1)[0]
                span.add_event(
                    "item_failed", {"pin.slot_id": slot.slot_id, "error.type": error_type}
                )
        if tracing:
            span.set_attributes(
                {
                    "pin.batch.index": number,
                    "pin.batch.rows": outcome.selected,
                    "pin.batch.expired": outcome.expired,
                    "pin.batch.poison": len(outcome.poison),
                    "pin.batch.outcome": "isolated" if outcome.tenants is None else "committed",
                }
            )
            if outcome.tenants is not None:
                span.set_attribute("pin.tenant_ids", sorted(str(t) for t in outcome.tenants))
                span.set_attribute("pin.tenant_count", outcome.tenant_count)
        telemetry.log.info(
            "batch_selected",
            batch_index=number,
            runner=position.runner,
            count=outcome.selected,
            expired=outcome.expired,
        )
        return outcome.selected >= size


def _expire(conn: psycopg.Connection, cycle: CycleState, params: dict[str, Any]) -> _Outcome:
    """The batch as one statement in one transaction."""
    with conn.transaction():
        row = conn.execute(sql.load("slots/expire_due_slots"), params).fetchone()
        selected, expired, last_start_at, missed, tenants, tenant_count = row
        if missed:  # see expire_due_slots.sql: updated concurrently before our lock
            expired += conn.execute(
                sql.load("slots/expire_slots_by_id"), {"ids": missed, "as_of": cycle.as_of}
            ).rowcount
    return _Outcome(selected, expired, last_start_at, tenants=tenants, tenant_count=tenant_count)


def _expire_isolating(
    conn: psycopg.Connection, cycle: CycleState, params: dict[str, Any]
) -> _Outcome:
    """Lock the batch's selection again and expire it by halves under savepoints, until the
    failing rows stand alone (about 2·k·log2(n) statements for k poison rows in n)."""
    query = sql.load("slots/expire_slots_by_id")
    with conn.transaction():
        rows = conn.execute(sql.load("slots/lock_due_slots"), params).fetchall()
        outcome = _Outcome(len(rows), 0, max((start for _, start in rows), default=None))
        stack = [[slot_id for slot_id, _ in rows]]
        while stack:
            part = stack.pop()
            if not part:
                continue
            try:
                with conn.transaction():  # a savepoint inside the batch transaction
                    outcome.expired += conn.execute(
                        query, {"ids": part, "as_of": cycle.as_of}
                    ).rowcount
            except psycopg.Error as exc:
                if not is_row_error(exc.sqlstate) or conn.closed:
                    raise
                if len(part) == 1:
                    outcome.poison.append((part[0], exc))
                else:
                    mid = len(part) // 2
                    stack += [part[mid:], part[:mid]]
    return outcome
