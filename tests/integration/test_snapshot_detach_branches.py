"""Detach retry branches the main suite does not reach, on a real Postgres and real HTTP.

* the detach client itself raises on one row: that row is a transient failure
  (``ClientError:<class>``), the others are unaffected;
* the batch outcome write fails (a row the database rejects): every other row's outcome is
  still written, each in its own transaction, and the rejected row stays as its claim left it;
* the backlog measurement at the end of a run fails: the run still ends as a success, without
  the gauges.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import psycopg
import pytest

from devtools.selections_service import SelectionsService
from include.pin_maintenance.jobs import snapshot_detach
from include.pin_maintenance.jobs.snapshot_detach import Metric
from include.pin_maintenance.jobs.snapshot_detach_answers import CallOutcome
from include.pin_maintenance.stopping import StopSignal
from tests.integration.snapshot_detach_fixtures import (
    config,
    insert_entries,
    insert_entry,
    make_client,
    rows,
    run_job,
)
from tests.job_db import job_connect, job_telemetry

pytestmark = pytest.mark.integration

LOGGER = f"pin_maintenance.{snapshot_detach.JOB}"


@pytest.fixture
def service() -> Iterator[SelectionsService]:
    with SelectionsService(slow_seconds=5) as svc:
        yield svc


class RaisesFor:
    """The real HTTP client, except that it raises for one snapshot (a client-side bug)."""

    def __init__(self, inner, snapshot_id: str) -> None:
        self.inner, self.snapshot_id = inner, snapshot_id

    def call(self, snapshot_id: str, reason: str, key: str, timeout: float) -> CallOutcome:
        if snapshot_id == self.snapshot_id:
            raise RuntimeError("client bug")
        return self.inner.call(snapshot_id, reason, key, timeout)


def test_a_client_that_raises_costs_only_that_row_an_attempt(
    db, service, caplog: pytest.LogCaptureFixture
) -> None:
    entries = insert_entries(db, 4, attempts=1)
    bad = entries[2].snapshot_id
    telemetry = job_telemetry(snapshot_detach.JOB)
    with make_client(service) as http, caplog.at_level(logging.ERROR, logger=LOGGER):
        result = run_job(db, service, client=RaisesFor(http, bad), telemetry=telemetry)

    state = rows(db)
    assert state[bad].status == "Pending"
    assert state[bad].attempts == 2  # the claim's attempt stays: it is a failed call
    assert state[bad].last_error == "ClientError:RuntimeError"
    assert all(state[e.snapshot_id].status == "Done" for e in entries if e.snapshot_id != bad)
    assert (result.succeeded, result.retried) == (3, 1)
    assert any(
        "event=entry_call_failed" in r.getMessage() and f"snapshot_id={bad}" in r.getMessage()
        for r in caplog.records
    )
    assert service.call_count(bad) == 0  # it never reached selections


REJECT_DONE = """
create function public.reject_outcome() returns trigger language plpgsql as $$
begin
  if new.snapshot_id = '{snapshot_id}' and new.status = 'Done' then
    raise exception 'outbox row % rejected', new.id using errcode = '23514';
  end if;
  return new;
end $$;
create trigger reject_outcome before update on news.snapshot_detach_outbox
  for each row execute function public.reject_outcome();
"""


def test_a_failing_batch_outcome_write_falls_back_to_one_row_at_a_time(
    db, service, caplog: pytest.LogCaptureFixture
) -> None:
    entries = insert_entries(db, 5, attempts=3)
    bad = entries[1].snapshot_id
    with db.connect() as conn:
        conn.execute(REJECT_DONE.replace("{snapshot_id}", bad))
    before = rows(db)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = run_job(db, service)

    state = rows(db)
    good = [e.snapshot_id for e in entries if e.snapshot_id != bad]
    assert all(state[s].status == "Done" and state[s].last_error is None for s in good)
    # the rejected row is as its claim left it: Pending, the attempt counted, backed off
    assert state[bad].status == "Pending"
    assert state[bad].attempts == 4
    assert state[bad].next_attempt_at > before[bad].next_attempt_at
    assert result.succeeded == 4 and result.superseded == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("event=batch_outcome_failed" in m and "rows=5" in m for m in messages)
    assert any("event=entry_outcome_failed" in m and f"snapshot_id={bad}" in m for m in messages)


def _unreachable() -> psycopg.Connection:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return psycopg.connect(f"postgresql://nobody@127.0.0.1:{port}/x", connect_timeout=5)


def test_a_failing_backlog_measurement_still_ends_the_run_as_a_success(
    db, caplog: pytest.LogCaptureFixture
) -> None:
    """Dry run: the privilege check and the count work, then the database is unreachable for
    the measurement."""
    insert_entries(db, 3)
    insert_entry(db, status="Quarantined")
    real = job_connect(db, snapshot_detach.JOB)
    opened: list[str] = []

    def connect() -> psycopg.Connection:
        opened.append("real" if len(opened) < 2 else "unreachable")
        return real() if opened[-1] == "real" else _unreachable()

    telemetry = job_telemetry(snapshot_detach.JOB)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = snapshot_detach.run(connect, config(), telemetry, StopSignal(), None, dry_run=True)

    assert opened == ["real", "real", "unreachable"]
    assert result.due == 3
    assert result.pending == 0  # not measured
    gauges = telemetry.metrics.gauges
    assert Metric.PENDING not in gauges and Metric.OLDEST_AGE not in gauges
    assert Metric.LAST_SUCCESS in gauges  # the run itself succeeded
    assert any(
        "event=backlog_measure_failed" in r.getMessage() and "OperationalError" in r.getMessage()
        for r in caplog.records
    )
