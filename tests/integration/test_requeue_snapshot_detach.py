"""news_snapshot_detach_requeue on a real Postgres: ids, all, dry run, refusals."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from devtools.selections_service import SelectionsService
from include.pin_maintenance.jobs import snapshot_requeue
from include.pin_maintenance.jobs.snapshot_requeue import RequeueRequestError, parse_choice
from tests.integration.snapshot_detach_fixtures import (
    insert_entry,
    rows,
    run_job,
)
from tests.job_db import job_connect, job_telemetry

pytestmark = pytest.mark.integration


def _requeue(db, ids=None, all_quarantined=False, dry_run=False):
    return snapshot_requeue.requeue(
        job_connect(db, snapshot_requeue.JOB),
        job_telemetry(snapshot_requeue.JOB, "requeue_run"),
        parse_choice(ids, all_quarantined),
        dry_run=dry_run,
    )


@pytest.fixture
def outbox(db):
    return {
        "q1": insert_entry(db, status="Quarantined", attempts=12, last_error="HttpNotFound 404"),
        "q2": insert_entry(db, status="Quarantined", attempts=3, last_error="HttpClientError 400"),
        "q3": insert_entry(db, status="Quarantined", attempts=12),
        "pending": insert_entry(db, attempts=4, last_error="Timeout"),
        "done": insert_entry(db, status="Done", attempts=1),
    }


def test_requeue_by_ids_moves_only_the_chosen_quarantined_rows(db, outbox):
    before = rows(db)
    started = datetime.now(UTC)
    missing = str(uuid.uuid4())
    chosen = [outbox["q1"].snapshot_id, outbox["q2"].snapshot_id]

    result = _requeue(db, [*chosen, outbox["pending"].snapshot_id, missing])

    state = rows(db)
    for sid, old_error in zip(chosen, ["HttpNotFound 404", "HttpClientError 400"], strict=True):
        row = state[sid]
        assert (row.status, row.attempts) == ("Pending", 0)
        assert row.next_attempt_at >= started.replace(microsecond=0)
        assert row.next_attempt_at <= datetime.now(UTC)
        assert row.last_error == f"requeued: {old_error}"
    for key in ("q3", "pending", "done"):
        assert state[outbox[key].snapshot_id] == before[outbox[key].snapshot_id]
    assert result.count == 2
    assert result.snapshot_ids == sorted(chosen)
    assert result.skipped == {
        outbox["pending"].snapshot_id: "Pending (only Quarantined rows are requeued)",
        missing: "not found",
    }


def test_requeue_all_quarantined(db, outbox):
    result = _requeue(db, all_quarantined=True)
    state = rows(db)
    assert result.count == 3
    assert sorted(result.snapshot_ids) == sorted(outbox[k].snapshot_id for k in ("q1", "q2", "q3"))
    assert all(state[outbox[k].snapshot_id].status == "Pending" for k in ("q1", "q2", "q3"))
    assert state[outbox["q3"].snapshot_id].last_error == "requeued: no error recorded"
    assert state[outbox["done"].snapshot_id].status == "Done"
    # rerun: nothing left to do
    assert _requeue(db, all_quarantined=True).count == 0


def test_requeue_dry_run_reports_and_changes_nothing(db, outbox):
    before = rows(db)
    result = _requeue(db, all_quarantined=True, dry_run=True)
    assert result.dry_run and result.count == 3
    assert rows(db) == before
    report = result.as_dict()
    assert (report["RequeuedCount"], report["WouldRequeueCount"]) == (0, 3)


def test_requeue_report_is_bounded(db, monkeypatch):
    monkeypatch.setattr(snapshot_requeue, "REPORT_LIMIT", 2)
    for _ in range(5):
        insert_entry(db, status="Quarantined", attempts=12)
    result = _requeue(db, all_quarantined=True)
    assert result.count == 5
    assert len(result.snapshot_ids) == 2 and result.truncated
    assert result.as_dict()["RequeuedCount"] == 5
    assert result.as_dict()["WouldRequeueCount"] == 0


@pytest.mark.parametrize(
    ("ids", "all_q"), [(None, False), ([], False), (["0b5c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3"], True)]
)
def test_refused_choices_change_nothing(db, outbox, ids, all_q):
    before = rows(db)
    with pytest.raises(RequeueRequestError):
        _requeue(db, ids, all_q)
    assert rows(db) == before


def test_requeued_row_is_picked_up_by_the_next_detach_run(db, outbox):
    _requeue(db, [outbox["q1"].snapshot_id])
    with SelectionsService() as svc:
        result = run_job(db, svc)
        assert svc.call_count(outbox["q1"].snapshot_id) == 1
    assert result.succeeded == 2  # q1 and the row that was Pending anyway
    row = rows(db)[outbox["q1"].snapshot_id]
    assert (row.status, row.attempts, row.last_error) == ("Done", 1, None)
