"""The cost of tracing: the detach and slots jobs with spans exported vs the no-op tracer.

Plugged into ``devtools.bench`` as the ``tracing`` section (``--only tracing``). Each timed run
is the job function in a fresh subprocess (as every bench job run is), on a fresh clone of the
same dataset, alternately with tracing off (``Telemetry``'s default no-op tracer, what a task
gets without ``[traces] otel_on``) and on: an SDK ``TracerProvider`` with the
``BatchSpanProcessor`` and the OTLP/HTTP protobuf exporter Airflow configures, exporting to
a loopback receiver (:mod:`devtools.otlp_receiver`) in the bench process. The "on" time
includes the final ``force_flush`` (the task runner flushes at the end of every task), so it
is the whole price: span creation, attributes, the tenant-id read of the slot batches,
protobuf encoding and the POSTs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from devtools.bench_core import SectionSpec

if TYPE_CHECKING:  # the bench imports this module; keep the import graph one-way at runtime
    from devtools.bench_core import Bench

MODES = ("off", "on")


def child_tracer(spec: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
    """In the job subprocess: (tracer or None, flush) for ``spec["otlp_endpoint"]``."""
    endpoint = spec.get("otlp_endpoint")
    if not endpoint:
        return None, lambda: None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource({"service.name": "pin-maintenance-bench"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))

    def flush() -> None:
        if not provider.force_flush(30_000):
            raise RuntimeError("spans not flushed within 30 s")

    return provider.get_tracer("pin_maintenance"), flush


def bench_tracing(bench: Bench, out: list[str]) -> None:
    from devtools import bench_core as b
    from devtools.otlp_receiver import OtlpReceiver

    detach_due = bench.plan.detach_rows
    slots_total, slots_due = bench.plan.slots[0]
    rows = []
    with OtlpReceiver() as otlp:
        cases = [
            ("detach", f"{detach_due:,} due outbox rows", bench.outbox_template(detach_due)),
            (
                "slots",
                f"{slots_total:,} slots, {slots_due:,} due",
                bench.slots_template(slots_total, slots_due),
            ),
        ]
        for job, label, template in cases:
            series = {mode: b.Series() for mode in MODES}
            cpu = {mode: b.Series() for mode in MODES}
            spans_per_run = b.Series()
            for i in range(bench.runs):
                for mode in MODES if i % 2 == 0 else MODES[::-1]:
                    before = len(otlp.spans())
                    run = _timed_run(bench, job, template, mode, otlp.endpoint)
                    series[mode].add(run.seconds)
                    cpu[mode].add(run.cpu)
                    exported = len(otlp.spans()) - before
                    if mode == "off" and exported:
                        raise b.BenchError(f"{job}: {exported} spans exported with tracing off")
                    if mode == "on":
                        if not exported:
                            raise b.BenchError(f"{job}: no span exported with tracing on")
                        spans_per_run.add(exported)
            off, on = series["off"], series["on"]
            overhead = on.median / off.median - 1 if off.median else float("nan")
            rows.append(
                [
                    job,
                    label,
                    off.fmt(),
                    on.fmt(),
                    f"{100 * overhead:+.1f}%",
                    b._secs(cpu["off"].median),
                    b._secs(cpu["on"].median),
                    f"{spans_per_run.median:,.0f}",
                    b._verdict(overhead <= 0.10),
                ]
            )
        otlp.clear()
    out.append(
        "Tracing off: the no-op tracer (no `[traces] otel_on`). On: an SDK TracerProvider with "
        "the BatchSpanProcessor and the OTLP/HTTP exporter, exporting to a loopback receiver "
        "that decodes every request; the time includes the final flush. Off and on alternate "
        "on fresh clones of the same dataset (detach: the selections service of the detach "
        "section, default concurrency and batch size; slots: default batch size and runners)."
    )
    out.append("")
    out.append(
        b.md_table(
            [
                "job",
                "data",
                "tracing off",
                "tracing on",
                "on/off - 1",
                "CPU off",
                "CPU on",
                "spans per run",
                "goal <= +10%",
            ],
            rows,
        )
    )


def _timed_run(bench: Bench, job: str, template: Any, mode: str, endpoint: str):
    from devtools import bench_core as b
    from devtools import bench_data as bd

    config: dict[str, Any] = {"max_run_duration_seconds": 3000}
    extra: dict[str, Any] = {}
    if job == "slots":
        config["max_batches_per_cycle"] = 100_000  # drain mode: one cycle, the whole backlog
    if job == "detach":
        config["lock_ttl_seconds"] = 3600
        extra["selections_url"] = bench.selections().url
    if mode == "on":
        extra["otlp_endpoint"] = endpoint
    db = bench.clone(template, f"trace_{job}")
    try:
        run = bench.run_job(job, db, config, **extra)
        if job == "detach":
            state = bd.outbox_state(db.url)
            if state["due"] != 0:
                raise b.BenchError(f"detach ({mode}) left {state}, result {run.result}")
        elif bd.slots_state(db.url)["due"] != 0:
            raise b.BenchError(f"slots ({mode}) left due slots, result {run.result}")
        return run
    finally:
        bench.drop(db)


SECTION = SectionSpec(
    key="tracing", title="Tracing overhead (OpenTelemetry spans on / off)", run=bench_tracing
)
