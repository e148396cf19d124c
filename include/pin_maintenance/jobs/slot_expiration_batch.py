"""One batch of a slot-expiration cycle: the expire statement, and poison isolation when a row
fails it (the cycle around it: :mod:`include.pin_maintenance.jobs.slot_expiration`).

A batch locks the oldest due slots after its loop's keyset position under ``FOR UPDATE SKIP
LOCKED`` and expires them in one statement and one transaction. When a row error fails that
statement (:func:`db.is_row_error`), the batch is retried in a fresh transaction that locks the
same selection and expires it by halves under savepoints; each row that fails alone is a poison
slot: logged, counted, alerted (capped per cycle) and excluded for the rest of the cycle. Any
other error (the database, not a row) rolls the batch back and is raised as it is.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from opentelemetry import trace

from include.pin_maintenance import sql
from include.pin_maintenance.db import is_row_error
from include.pin_maintenance.jobs.slot_expiration_config import JOB
from include.pin_maintenance.lifecycle import CappedAlerts, describe_error
from include.pin_maintenance.telemetry import Alert, Telemetry, error_code

M_ERRORS = "calendar_slot_expiration_errors_total"
POISON_ALERT = "slot_expiration_poison_row"
# Counts (backlog, skipped, dry run) stop here so a huge backlog costs a bounded index range
# read; the backlog alert fires at 5000, far below.
COUNT_CAP = 1_000_000
# A batch span names at most this many of the tenants it touched (plus their count).
MAX_SPAN_TENANTS = 20


@dataclass(frozen=True)
class PoisonSlot:
    slot_id: str
    error: str  # class, SQLSTATE and the server's message: for the log line
    code: str = ""  # class and SQLSTATE only: for the alert (telemetry.error_code)


@dataclass
class CycleState:
    """What the batches of one cycle share (each loop runs in its own thread)."""

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
        """Count one batch; return its number in the cycle (1-based) and the poison slots new
        to the cycle (two loops can both meet a slot before either has excluded it)."""
        with self._lock:
            self.expired += expired
            known = {p.slot_id for p in self.poison}
            new = [p for p in poison if p.slot_id not in known]
            self.poison.extend(new)
            self.batches += 1
            return self.batches, new


@dataclass
class KeysetPosition:
    """Where one batch loop of a cycle stands in the index: the largest ``start_at`` it has
    locked so far (its next batch starts there). ``runner`` numbers the loop in log lines."""

    runner: int
    after: datetime | None = None


@dataclass
class _Outcome:
    """What one batch did, for the cycle's tally, its span and its log line."""

    selected: int
    expired: int
    last_start_at: datetime | None
    poison: list[tuple[uuid.UUID, psycopg.Error]] = field(default_factory=list)
    tenants: list[uuid.UUID] | None = None  # None: the isolating path reads no tenants
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
    """One batch of ``size`` slots at most (None: the cycle's ``batch_size``) in one
    transaction (a span); True when it was full (more may be due)."""
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
            # Nothing of this batch was written (the whole transaction rolled back).
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
            _report_poison(slot, telemetry, alerts)
            if tracing:  # seed 002: item failed (SlotId, exception), here its class only
                error_type = slot.error.split(":", 1)[0]
                span.add_event(
                    "item_failed", {"pin.slot_id": slot.slot_id, "error.type": error_type}
                )
        if tracing:
            _annotate(span, number, outcome)
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
    """Lock the batch's selection again and expire it by halves under savepoints.

    A group that fails is split until the failing rows stand alone; with k poison rows in a
    batch of n this costs about 2·k·log2(n) statements instead of n.
    """
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
                    stack.append(part[mid:])
                    stack.append(part[:mid])
    return outcome


def _annotate(span: trace.Span, number: int, outcome: _Outcome) -> None:
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


def _report_poison(slot: PoisonSlot, telemetry: Telemetry, alerts: CappedAlerts) -> None:
    telemetry.log.error("item_failed", slot_id=slot.slot_id, error=slot.error)
    telemetry.metrics.incr(M_ERRORS)
    alerts.send(
        Alert(
            POISON_ALERT,
            "warning",
            f"slot {slot.slot_id} cannot be expired; left Available for the next cycle",
            {"slot_id": slot.slot_id, "error": slot.code or "unknown"},
        )
    )
