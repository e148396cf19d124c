"""Trace spans of the job package: the Telemetry helpers and the detach client's traceparent.

The tracer is the SDK's own, exporting to its in-memory exporter (no global provider is set:
the job package must work with whatever tracer it is handed). The client test calls the real
loopback selections service.
"""

from __future__ import annotations

import logging
import re
import uuid

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from devtools.selections_service import DEFAULT_LOGIN, DEFAULT_PASSWORD, SelectionsService
from include.pin_maintenance.jobs.snapshot_detach_http import (
    HttpDetachClient,
    basic_auth_session,
)
from include.pin_maintenance.telemetry import JobLog, Telemetry, resumed, set_result


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, provider.get_tracer("test")
    provider.shutdown()


def _telemetry(tracer, **attrs) -> Telemetry:
    telemetry = Telemetry.local(JobLog("job_x", "run_1"), tracer=tracer)
    telemetry.run_attributes = attrs
    return telemetry


def test_default_tracer_records_nothing_and_logs_carry_no_trace_ids(caplog):
    caplog.set_level(logging.INFO)
    telemetry = Telemetry.local(JobLog("job_x", "run_1"))
    with telemetry.run_span("job_x run") as span:
        assert not span.is_recording()
        telemetry.log.info("job_started")
    assert "trace_id=" not in caplog.text


def test_run_span_carries_correlation_and_airflow_ids_and_nests_children(spans):
    exporter, tracer = spans
    telemetry = _telemetry(
        tracer, **{"airflow.task_id": "t1", "airflow.task_instance.try_number": 2}
    )
    with telemetry.run_span("job_x run") as run:
        set_result(run, {"Claimed": 3, "HasMore": False, "StopReason": "drained", "Due": None})
        with telemetry.span("job_x batch", {"pin.batch.rows": 3, "skipped": None}):
            pass
    batch, run_span = exporter.get_finished_spans()
    assert run_span.name == "job_x run" and batch.name == "job_x batch"
    assert batch.parent.span_id == run_span.context.span_id
    assert batch.context.trace_id == run_span.context.trace_id
    assert dict(run_span.attributes) == {
        "pin.job": "job_x",
        "pin.run_id": "run_1",
        "airflow.task_id": "t1",
        "airflow.task_instance.try_number": 2,
        "pin.result.Claimed": 3,
        "pin.result.HasMore": False,
        "pin.result.StopReason": "drained",
    }
    assert dict(batch.attributes) == {"pin.batch.rows": 3}  # None dropped


def test_an_escaping_error_is_recorded_by_class_only(spans):
    exporter, tracer = spans
    secret = "postgresql://pin:s3cr3t@db.internal/news"
    with pytest.raises(RuntimeError), _telemetry(tracer).run_span("job_x run"):
        raise RuntimeError(f"could not connect to {secret}")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "RuntimeError"
    assert span.attributes["error.type"] == "RuntimeError"
    assert span.events == ()  # no exception event: its message would carry the URL
    assert "s3cr3t" not in repr(span.to_json())


def test_resumed_makes_a_started_span_current_and_ends_it(spans, caplog):
    caplog.set_level(logging.INFO)
    exporter, tracer = spans
    telemetry = _telemetry(tracer)
    started = tracer.start_span("job_x batch")
    assert not exporter.get_finished_spans()
    with pytest.raises(ValueError), resumed(started):
        telemetry.log.info("batch_outcome")
        raise ValueError("bad row 42")
    (span,) = exporter.get_finished_spans()
    assert span.status.description == "ValueError"
    ids = f"trace_id={span.context.trace_id:032x} span_id={span.context.span_id:016x}"
    assert caplog.records[-1].getMessage().endswith(ids)


def test_log_lines_name_the_current_span(spans, caplog):
    caplog.set_level(logging.INFO)
    exporter, tracer = spans
    telemetry = _telemetry(tracer)
    with telemetry.run_span("job_x run"):
        telemetry.log.info("job_started", batch_size=5)
    (span,) = exporter.get_finished_spans()
    line = caplog.records[-1].getMessage()
    assert re.fullmatch(
        r"event=job_started job=job_x run_id=run_1 batch_size=5 "
        r"trace_id=[0-9a-f]{32} span_id=[0-9a-f]{16}",
        line,
    )
    assert f"trace_id={span.context.trace_id:032x}" in line
    assert f"span_id={span.context.span_id:016x}" in line


def test_detach_client_sends_the_current_span_as_traceparent(spans):
    _, tracer = spans
    snapshot_id = str(uuid.uuid4())
    with SelectionsService() as svc:
        client = HttpDetachClient(
            svc.url, lambda: basic_auth_session(DEFAULT_LOGIN, DEFAULT_PASSWORD)
        )
        with client:
            with tracer.start_as_current_span("detach snapshot", kind=SpanKind.CLIENT) as span:
                assert client.call(snapshot_id, "BlockReplaced", "key-1", 2.0).status_code == 200
            untraced = str(uuid.uuid4())
            assert client.call(untraced, "BlockReplaced", "key-2", 2.0).status_code == 200
        (call,) = svc.calls_for(snapshot_id)
        (plain,) = svc.calls_for(untraced)
    ctx = span.get_span_context()
    assert call.traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    assert ctx.trace_flags.sampled
    assert plain.traceparent is None  # no active span: no header
    assert trace.get_current_span() is trace.INVALID_SPAN
