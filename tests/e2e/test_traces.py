"""Traces under the real scheduler: one trace from ``dag_run.<dag_id>`` to the detach calls.

The manual-runs Airflow that the alert chain uses too (``chain_airflow``: LocalExecutor,
manual runs only) has ``[traces] otel_on`` and exports OTLP/HTTP
(``OTEL_TRACES_EXPORTER=otlp_proto_http``) to a loopback receiver that decodes the real
protobuf. One detach run is triggered through the REST API; the test asserts the chain

    dag_run.<dag_id> (scheduler) -> task_run.<task_id> (API server) -> worker.<task_id>
    (task process) -> <dag_id> run -> <dag_id> batch -> detach snapshot (CLIENT)

in one trace, and that the selections service received each CLIENT span as its
``traceparent``. The spans are picked by the run id, so other runs of the stack do not matter.
"""

from __future__ import annotations

import pytest

from devtools.otlp_receiver import OtlpReceiver, ReceivedSpan
from devtools.outbox_data import generate_outbox
from devtools.selections_service import SelectionsService
from tests.e2e.chain_fixtures import OTEL_SERVICE as SERVICE
from tests.e2e.stack_fixtures import E2EAirflow

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DAG_ID = "news_snapshot_detach_retry"
TASK = "detach_pending_snapshots"


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.name, s.trace_id) for s in spans])
    return found[0]


def test_one_trace_from_the_dag_run_to_the_detach_calls(
    chain_airflow: E2EAirflow, otlp: OtlpReceiver, e2e_selections: SelectionsService
) -> None:
    e2e, selections = chain_airflow, e2e_selections
    with e2e.job_conn() as conn:
        conn.execute("delete from news.snapshot_detach_outbox")
        conn.commit()
        snapshots = generate_outbox(conn, 5)
    e2e.wait_dag(DAG_ID)
    e2e.set_paused(DAG_ID, False)
    run_id = e2e.new_run_id("traced")
    r = e2e.trigger_api(DAG_ID, {"batch_size": 2, "detach_concurrency": 2}, run_id)
    assert r.status_code == 200, r.text
    run = e2e.wait_run(DAG_ID, run_id)
    assert run["state"] == "success", e2e.run_logs(DAG_ID, run_id)

    def complete(spans: list[ReceivedSpan]) -> bool:
        runs = [
            s
            for s in spans
            if s.name == f"dag_run.{DAG_ID}"
            and s.attributes.get("airflow.dag_run.run_id") == run_id
        ]
        if not runs:
            return False
        in_trace = [s for s in spans if s.trace_id == runs[0].trace_id]
        return sum(s.name == "detach snapshot" for s in in_trace) >= 5 and any(
            s.name == f"task_run.{TASK}" for s in in_trace
        )

    spans = otlp.wait_for(complete, timeout=120)
    dag_run = next(
        s
        for s in spans
        if s.name == f"dag_run.{DAG_ID}" and s.attributes.get("airflow.dag_run.run_id") == run_id
    )
    trace = [s for s in spans if s.trace_id == dag_run.trace_id]
    by_id = {s.span_id: s for s in trace}

    assert dag_run.parent_span_id == ""
    task_run = _one(trace, f"task_run.{TASK}")
    worker = _one(trace, f"worker.{TASK}")
    job_run = _one(trace, f"{DAG_ID} run")
    assert task_run.parent_span_id == dag_run.span_id
    assert worker.parent_span_id == task_run.span_id
    assert job_run.parent_span_id == worker.span_id
    assert job_run.service == SERVICE
    assert job_run.attributes["airflow.dag_run.run_id"] == run_id
    assert job_run.attributes["airflow.task_id"] == TASK
    assert job_run.attributes["airflow.task_instance.try_number"] == 1
    assert job_run.attributes["pin.result.Succeeded"] == 5

    batches = [s for s in trace if s.name == f"{DAG_ID} batch"]
    assert batches and all(b.parent_span_id == job_run.span_id for b in batches)
    assert sum(b.attributes["pin.batch.rows"] for b in batches) == 5
    clients = {s.attributes["pin.snapshot_id"]: s for s in trace if s.name == "detach snapshot"}
    assert set(clients) == set(snapshots)
    for snapshot_id, span in clients.items():
        assert span.kind == "CLIENT"
        assert by_id[span.parent_span_id].name == f"{DAG_ID} batch"
        assert span.attributes["http.response.status_code"] == 200
        (call,) = selections.calls_for(snapshot_id)
        assert call.traceparent is not None
        assert call.traceparent.split("-")[1:3] == [dag_run.trace_id, span.span_id]

    log = e2e.task_log(DAG_ID, run_id, TASK)
    assert f"trace_id={dag_run.trace_id}" in log
