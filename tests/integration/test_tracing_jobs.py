"""The jobs' trace spans on a real Postgres (and the real loopback selections service).

Each job runs with the SDK's tracer exporting to its in-memory exporter; the tests assert the
span tree (run -> batch -> detach CLIENT call), the attributes the seeds ask for, that
selections received the CLIENT span as its ``traceparent``, and that no credential, URL or
message reaches a span.
"""

from __future__ import annotations

import json

import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from devtools.retention_data import seed_sessions
from devtools.selections_service import DEFAULT_PASSWORD
from include.pin_maintenance.jobs import activity_retention, snapshot_detach
from include.pin_maintenance.jobs import slot_expiration as se
from include.pin_maintenance.jobs.slot_expiration_batch import MAX_SPAN_TENANTS
from include.pin_maintenance.stopping import StopSignal
from tests.integration import slot_expiration_fixtures as slots
from tests.integration.snapshot_detach_fixtures import (
    config,
    insert_entries,
    insert_entry,
    rows,
    run_job,
    running_service,
)
from tests.job_db import job_connect, job_telemetry

pytestmark = pytest.mark.integration


@pytest.fixture
def service():
    yield from running_service()


@pytest.fixture
def tracing():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, provider.get_tracer("pin_maintenance")
    provider.shutdown()


def _by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _dump(spans) -> str:
    return "\n".join(s.to_json() for s in spans)


def test_detach_run_batch_and_client_spans_form_one_trace_with_selections(db, service, tracing):
    exporter, tracer = tracing
    ok = insert_entries(db, 3)
    failing = insert_entry(db)
    service.script(failing.snapshot_id, "error_503")
    unknown = insert_entry(db, reason="Mystery")
    result = run_job(
        db,
        service,
        telemetry=job_telemetry(snapshot_detach.JOB, "trace_run", tracer=tracer),
        cfg=config(batch_size=2),
    )
    assert (result.succeeded, result.retried, result.quarantined) == (3, 1, 1)
    spans = exporter.get_finished_spans()

    (run,) = _by_name(spans, f"{snapshot_detach.JOB} run")
    assert run.parent is None
    assert run.attributes["pin.run_id"] == "trace_run"
    assert run.attributes["pin.result.Succeeded"] == 3
    assert run.attributes["pin.result.Retried"] == 1
    assert run.attributes["pin.result.Quarantined"] == 1
    trace_id = run.context.trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}

    batches = _by_name(spans, f"{snapshot_detach.JOB} batch")
    assert all(b.parent.span_id == run.context.span_id for b in batches)
    assert sum(b.attributes["pin.batch.rows"] for b in batches) == 5
    assert sum(b.attributes.get("pin.batch.outcome.Done", 0) for b in batches) == 3
    assert sum(b.attributes.get("pin.batch.outcome.Quarantined", 0) for b in batches) == 1
    batch_ids = {b.context.span_id for b in batches}

    calls = _by_name(spans, "detach snapshot")
    assert len(calls) == 4  # the unknown reason is not called
    by_snapshot = {c.attributes["pin.snapshot_id"]: c for c in calls}
    assert set(by_snapshot) == {e.snapshot_id for e in [*ok, failing]}
    assert unknown.snapshot_id not in by_snapshot
    for entry in [*ok, failing]:
        span = by_snapshot[entry.snapshot_id]
        assert span.kind is SpanKind.CLIENT
        assert span.parent.span_id in batch_ids
        assert span.attributes["pin.post_id"] == entry.post_id
        assert span.attributes["pin.attempts"] == 1
        assert span.attributes["http.request.method"] == "POST"
        (received,) = service.calls_for(entry.snapshot_id)
        ctx = span.context
        assert (
            received.traceparent == f"00-{trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        )
    for entry in ok:
        span = by_snapshot[entry.snapshot_id]
        assert span.attributes["http.response.status_code"] == 200
        assert span.attributes["pin.outcome"] == "Done"
        assert span.status.status_code is not StatusCode.ERROR
    bad = by_snapshot[failing.snapshot_id]
    assert bad.attributes["http.response.status_code"] == 503
    assert bad.attributes["pin.outcome"] == "Retry"
    assert bad.status.status_code is StatusCode.ERROR
    assert bad.attributes["error.type"] == "503"
    assert rows(db)[failing.snapshot_id].status == "Pending"


def test_detach_auth_failure_spans_carry_no_credential_or_url(db, service, tracing):
    exporter, tracer = tracing
    insert_entries(db, 2)
    wrong = "wrong-" + DEFAULT_PASSWORD
    result = run_job(
        db,
        service,
        telemetry=job_telemetry(snapshot_detach.JOB, "trace_run", tracer=tracer),
        password=wrong,
        cfg=config(detach_concurrency=1),
    )
    assert result.auth_failed
    spans = exporter.get_finished_spans()
    calls = _by_name(spans, "detach snapshot")
    assert calls and all(c.attributes["pin.outcome"] == "AuthFailed" for c in calls)
    assert all(c.attributes["error.type"] == "401" for c in calls)
    (run,) = _by_name(spans, f"{snapshot_detach.JOB} run")
    assert run.attributes["pin.result.AuthFailed"] is True
    text = _dump(spans)
    for secret in (wrong, DEFAULT_PASSWORD, service.url, "Authorization", "Basic "):
        assert secret not in text


def test_detach_with_the_default_tracer_sends_no_traceparent(db, service):
    entries = insert_entries(db, 2)
    run_job(db, service)
    assert all(service.calls_for(e.snapshot_id)[0].traceparent is None for e in entries)


def test_slot_batches_name_their_tenants_under_one_run_span_across_runners(db, tracing):
    exporter, tracer = tracing
    due = slots.insert_due(db, 9)
    with db.connect() as conn:
        tenants = {
            str(t)
            for (t,) in conn.execute(
                "select tenant_id from calendar.availability_slots where id = any(%s)", (due,)
            )
        }
    run = slots.Run(job_telemetry(se.JOB, "trace_run", tracer=tracer), None, None)  # type: ignore[arg-type]
    result = slots.run_job(db, {**slots.DRAIN, "batch_size": 2, "runners": 2}, run=run)
    assert result.expired_count == 9
    spans = exporter.get_finished_spans()
    (root,) = _by_name(spans, f"{se.JOB} run")
    assert root.attributes["pin.result.ExpiredCount"] == 9
    batches = _by_name(spans, f"{se.JOB} batch")
    assert {b.parent.span_id for b in batches} == {root.context.span_id}
    assert {b.attributes["pin.runner"] for b in batches} == set(range(1, result.runners + 1))
    assert sum(b.attributes["pin.batch.expired"] for b in batches) == 9
    named = [t for b in batches for t in b.attributes.get("pin.tenant_ids", ())]
    assert sorted(named) == sorted(tenants)  # one tenant per slot here, each named once
    assert all(
        b.attributes["pin.tenant_count"] == len(b.attributes.get("pin.tenant_ids", ()))
        for b in batches
    )


def test_slot_batch_names_at_most_max_span_tenants(db, tracing):
    exporter, tracer = tracing
    slots.insert_due(db, MAX_SPAN_TENANTS + 5)
    run = slots.Run(job_telemetry(se.JOB, "trace_run", tracer=tracer), None, None)  # type: ignore[arg-type]
    slots.run_job(db, {"batch_size": 500, "runners": 1}, run=run)
    (batch, *_) = _by_name(exporter.get_finished_spans(), f"{se.JOB} batch")
    assert len(batch.attributes["pin.tenant_ids"]) == MAX_SPAN_TENANTS
    assert batch.attributes["pin.tenant_count"] == MAX_SPAN_TENANTS + 5


def test_retention_steps_and_batches_are_spans_of_the_run(db, tracing):
    exporter, tracer = tracing
    with psycopg.connect(db.url) as conn:
        seed_sessions(conn, 5, 2, 1, tag="trace")
    connect = job_connect(db, activity_retention.JOB)
    cfg = activity_retention.CONFIG.resolve(None, {"batch_size": 2})
    telemetry = job_telemetry(activity_retention.JOB, "trace_run", tracer=tracer)
    result = activity_retention.run(connect, cfg, telemetry, StopSignal())
    assert result.deleted_sessions == 5
    spans = exporter.get_finished_spans()
    job = activity_retention.JOB
    (root,) = _by_name(spans, f"{job} run")
    steps = [f"{job} prepare", *(f"{job} delete {t}" for t in activity_retention.TABLES)]
    for name in [*steps, f"{job} report"]:
        (span,) = _by_name(spans, name)
        assert span.parent.span_id == root.context.span_id, name
    (prepare,) = _by_name(spans, f"{job} prepare")
    (check,) = _by_name(spans, f"{job} privileges")  # the role's, before any delete
    assert check.parent.span_id == prepare.context.span_id
    assert check.status.status_code is not StatusCode.ERROR
    (sessions_step,) = _by_name(spans, f"{job} delete sessions")
    assert sessions_step.attributes["pin.result.rows"] == 5
    (report,) = _by_name(spans, f"{job} report")
    assert report.attributes["pin.result.DeletedSessions"] == 5
    batches = [
        s for s in _by_name(spans, f"{job} batch") if s.attributes["pin.table"] == "sessions"
    ]
    assert batches and all(b.parent.span_id == sessions_step.context.span_id for b in batches)
    assert sum(b.attributes.get("pin.batch.rows", 0) for b in batches) == 5
    assert json.loads(root.to_json())["context"]["trace_id"]
