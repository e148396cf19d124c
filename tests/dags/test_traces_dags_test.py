"""``airflow dags test`` with ``[traces] otel_on`` exports the job's spans over OTLP/HTTP.

There is no worker span under ``dags test`` (the task's ``context_carrier`` is None), so the
job's run span is the root of a trace of its own; its CLIENT spans reach the loopback receiver
(the real protobuf, decoded) and selections receives their ``traceparent``. With tracing off
nothing is exported and no ``traceparent`` is sent (checked by the detach run of
test_metrics_otel.py, which has every tracing setting but ``otel_on`` in place).
"""

from __future__ import annotations

from devtools.otlp_receiver import OtlpReceiver
from devtools.selections_service import SelectionsService
from tests.integration.snapshot_detach_fixtures import insert_entries, rows

RETRY = "news_snapshot_detach_retry"
TASK = "detach_pending_snapshots"


def tracing_env(endpoint: str) -> dict[str, str]:
    return {
        "AIRFLOW__TRACES__OTEL_ON": "True",
        "OTEL_TRACES_EXPORTER": "otlp_proto_http",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": "pin-maintenance-dags-test",
    }


def _output(done) -> str:
    return f"{done.stdout}\n{done.stderr}"


def test_dags_test_exports_the_job_spans_as_their_own_trace(db, run_dag):
    entries = insert_entries(db, 3)
    with OtlpReceiver() as otlp, SelectionsService() as svc:
        done = run_dag(RETRY, db, selections_url=svc.url, extra_env=tracing_env(otlp.endpoint))
        assert done.returncode == 0, _output(done)
        spans = otlp.wait_for(
            lambda got: sum(s.name == "detach snapshot" for s in got) >= 3, timeout=30
        )
        calls = {e.snapshot_id: svc.calls_for(e.snapshot_id) for e in entries}
    assert all(rows(db)[e.snapshot_id].status == "Done" for e in entries)
    (run,) = [s for s in spans if s.name == f"{RETRY} run"]
    assert run.parent_span_id == ""  # no worker span under dags test: a root of its own
    assert run.service == "pin-maintenance-dags-test"
    assert run.attributes["airflow.dag_id"] == RETRY
    assert run.attributes["airflow.task_id"] == TASK
    assert run.attributes["airflow.task_instance.try_number"] == 1
    assert run.attributes["pin.run_id"] == run.attributes["airflow.dag_run.run_id"]
    assert run.attributes["pin.result.Succeeded"] == 3
    job_spans = [s for s in spans if s.trace_id == run.trace_id]
    clients = {s.attributes["pin.snapshot_id"]: s for s in job_spans if s.kind == "CLIENT"}
    assert set(clients) == set(calls)
    for snapshot_id, (call,) in calls.items():
        span = clients[snapshot_id]
        assert call.traceparent is not None
        assert call.traceparent.split("-")[1:3] == [run.trace_id, span.span_id]
    # the log lines of the run name its trace (logs and traces join)
    assert f"trace_id={run.trace_id}" in _output(done)
