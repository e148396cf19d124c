"""The detach job against services a real one resembles, with the job's default limits.

A plain threaded server with the standard library's defaults (HTTP/1.0: one connection per
call; a listen backlog of 5) drops connection attempts once more of them arrive at once than
its accept loop takes in; TCP retries a dropped attempt a second later, and a call may time
out. The job must find that knee, not push past it: every row Done in one run, each called
once, none left Pending by an error the job's own overload caused. Speed is `make bench`'s.
"""

from __future__ import annotations

import threading

import pytest

from devtools.selections_service import SelectionsService
from include.pin_maintenance.jobs import snapshot_detach
from tests.integration.snapshot_detach_fixtures import config, insert_entries, rows, run_job

DEFAULTS = snapshot_detach.CONFIG.defaults
# the DAG's own limits (the module's test config pins them low)
JOB_LIMITS = {
    "detach_concurrency": DEFAULTS.detach_concurrency,
    "detach_call_timeout_seconds": DEFAULTS.detach_call_timeout_seconds,
}


@pytest.mark.parametrize(
    "latency_sigma",
    [pytest.param(0.0, id="20ms"), pytest.param(0.6, id="lognormal-p99-80ms")],
)
def test_a_plain_threaded_server_gets_every_row_done_in_one_run(db, latency_sigma):
    entries = insert_entries(db, 300)
    with SelectionsService(
        stdlib_defaults=True, latency_ms=20, latency_sigma=latency_sigma, seed=11
    ) as svc:
        result = run_job(db, svc, cfg=config(**JOB_LIMITS))
        calls = svc.call_counts()
    after = rows(db)
    not_done = {e.snapshot_id: after[e.snapshot_id].last_error for e in entries}
    not_done = {k: v for k, v in not_done.items() if after[k].status != "Done"}
    assert not_done == {}  # no Timeout, no ConnectionError: the job did not overload it
    assert result.succeeded == 300 and result.failed == 0
    # each row called once, or twice when its first connection was lost
    assert result.calls == 300 + result.call_retries
    # a call lost before it reached the service is not in its log
    assert 300 <= sum(calls.values()) <= result.calls and max(calls.values()) <= 2
    assert result.concurrency_peak <= DEFAULTS.detach_concurrency


def test_two_runs_started_together_on_a_small_queue_lose_no_row(db):
    # one run takes the lock and drains 80 rows in batches of 10, the other skips; the
    # winner's ramp-up must not overrun the server's accept queue (tried three times)
    with SelectionsService(stdlib_defaults=True, latency_ms=20) as svc:
        for attempt in range(3):
            entries = insert_entries(db, 80)
            results: list = []

            def run(results=results) -> None:
                results.append(run_job(db, svc, cfg=config(batch_size=10, **JOB_LIMITS)))

            threads = [threading.Thread(target=run) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            after = rows(db)
            left = {after[e.snapshot_id].last_error for e in entries}
            assert [after[e.snapshot_id].status for e in entries] == ["Done"] * 80, (attempt, left)
            assert any(r.lock_acquired for r in results)  # the other skipped, or found none due
            assert sum(r.calls - r.call_retries for r in results) == 80
