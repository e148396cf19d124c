"""Shared helpers for the detach retry / requeue integration tests (real Postgres, real HTTP)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from devtools.pg import Database
from devtools.selections_service import DEFAULT_LOGIN, DEFAULT_PASSWORD, SelectionsService
from include.pin_maintenance.jobs import snapshot_detach
from include.pin_maintenance.jobs.snapshot_detach_config import DetachConfig
from include.pin_maintenance.jobs.snapshot_detach_http import (
    HttpDetachClient,
    basic_auth_session,
)
from include.pin_maintenance.stopping import StopSignal
from include.pin_maintenance.telemetry import Telemetry
from tests.job_db import job_connect, job_telemetry

# fast but realistic defaults for tests: short timeout, small concurrency
TEST_CONFIG = {"detach_call_timeout_seconds": 1.0, "detach_concurrency": 4}


def running_service() -> Iterator[SelectionsService]:
    """Body of each test module's ``service`` fixture (a started service, stopped after)."""
    with SelectionsService(slow_seconds=5) as svc:
        yield svc


def make_client(svc: SelectionsService, password: str = DEFAULT_PASSWORD) -> HttpDetachClient:
    return HttpDetachClient(svc.url, lambda: basic_auth_session(DEFAULT_LOGIN, password))


def config(**overrides: Any) -> DetachConfig:
    return snapshot_detach.CONFIG.resolve(None, {**TEST_CONFIG, **overrides})


@dataclass
class Entry:
    id: str
    snapshot_id: str
    post_id: str
    reason: str


def insert_entry(
    db: Database,
    *,
    status: str = "Pending",
    attempts: int = 0,
    due_in: timedelta = timedelta(seconds=-30),
    reason: str = "BlockReplaced",
    last_error: str | None = None,
    snapshot_id: str | None = None,
    created_ago: timedelta = timedelta(minutes=5),
) -> Entry:
    entry = Entry(str(uuid.uuid4()), snapshot_id or str(uuid.uuid4()), str(uuid.uuid4()), reason)
    now = datetime.now(UTC)
    with db.connect() as conn:
        conn.execute(
            "insert into news.snapshot_detach_outbox (id, snapshot_id, post_id, reason, attempts,"
            " next_attempt_at, status, last_error, created_at, updated_at)"
            " values (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                entry.id,
                entry.snapshot_id,
                entry.post_id,
                reason,
                attempts,
                now + due_in,
                status,
                last_error,
                now - created_ago,
                now - created_ago,
            ),
        )
    return entry


def insert_entries(db: Database, count: int, **kwargs: Any) -> list[Entry]:
    return [insert_entry(db, **kwargs) for _ in range(count)]


@dataclass
class Row:
    status: str
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    updated_at: datetime


def rows(db: Database) -> dict[str, Row]:
    """Every outbox row by snapshot id (tests keep snapshot ids unique unless they say so)."""
    with db.connect() as conn:
        found = conn.execute(
            "select snapshot_id, status, attempts, next_attempt_at, last_error, updated_at"
            " from news.snapshot_detach_outbox"
        ).fetchall()
    return {str(r[0]): Row(*r[1:]) for r in found}


def run_job(
    db: Database,
    svc: SelectionsService | None,
    *,
    telemetry: Telemetry | None = None,
    stop: StopSignal | None = None,
    client: Any = None,
    password: str = DEFAULT_PASSWORD,
    **kwargs: Any,
) -> snapshot_detach.DetachResult:
    cfg = kwargs.pop("cfg", None) or config()
    telemetry = telemetry or job_telemetry(snapshot_detach.JOB)
    if client is None and svc is not None:
        client = make_client(svc, password)
    try:
        return snapshot_detach.run(
            job_connect(db, snapshot_detach.JOB),
            cfg,
            telemetry,
            stop or StopSignal(),
            client,
            **kwargs,
        )
    finally:
        if isinstance(client, HttpDetachClient):
            client.close()


def later(delta: timedelta):
    """A clock ``delta`` ahead of real time (to make backed-off rows due again)."""
    return lambda: datetime.now(UTC) + delta
