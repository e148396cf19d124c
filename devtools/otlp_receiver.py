"""A local OTLP/HTTP receiver for traces and metrics: decodes the real protobuf and keeps what
it got.

For the trace and metrics tests and for a quick look without a collector. It accepts
``POST /v1/traces`` and ``POST /v1/metrics`` with ``Content-Type: application/x-protobuf``
(optionally gzip-encoded), parses them as ``ExportTraceServiceRequest`` /
``ExportMetricsServiceRequest`` (``opentelemetry-proto``, installed with Airflow) and answers
the empty response of each; JSON-encoded OTLP is refused (415), as the exporters Airflow uses
send protobuf. Listens on loopback only, on a free port by default.

In-process::

    with OtlpReceiver() as otlp:
        env = {"OTEL_TRACES_EXPORTER": "otlp_proto_http",
               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp.endpoint,
               "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": otlp.metrics_endpoint}
        ... otlp.spans() ... otlp.metrics() ...

From a shell: ``python -m devtools.otlp_receiver`` prints the endpoints, one line per span
(service, trace id, span id, parent id, kind, name) and one per metric data point (service,
name, kind, value, attributes) until Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import signal
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

TRACES_PATH = "/v1/traces"
METRICS_PATH = "/v1/metrics"
_KINDS = {v: k.removeprefix("SPAN_KIND_") for k, v in PbSpan.SpanKind.items()}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived, ids as lowercase hex (W3C spelling)."""

    service: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: str  # INTERNAL, SERVER, CLIENT, ...
    attributes: dict[str, Any] = field(default_factory=dict)
    status_code: str = "UNSET"  # UNSET, OK, ERROR
    status_message: str = ""
    events: tuple[tuple[str, dict[str, Any]], ...] = ()
    start_unix_nano: int = 0


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest`` (raises ``DecodeError`` on bad input)."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service=service,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=_KINDS.get(s.kind, str(s.kind)),
                        attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        status_code=_status(s.status.code),
                        status_message=s.status.message,
                        events=tuple(
                            (e.name, {kv.key: _value(kv.value) for kv in e.attributes})
                            for e in s.events
                        ),
                        start_unix_nano=s.start_time_unix_nano,
                    )
                )
    return spans


def _status(code: int) -> str:
    return {0: "UNSET", 1: "OK", 2: "ERROR"}.get(code, str(code))


@dataclass(frozen=True)
class ReceivedPoint:
    """One metric data point as it arrived.

    ``value`` is the number a dashboard reads: a sum's or gauge's value, a histogram's sum of
    observations (``count`` holds how many; 1 for sums and gauges). ``temporality`` is
    CUMULATIVE or DELTA for sums and histograms, "" for gauges.
    """

    service: str
    name: str
    kind: str  # sum, gauge, histogram, exponential_histogram, summary
    value: float
    count: int = 1
    unit: str = ""
    monotonic: bool = False
    temporality: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    time_unix_nano: int = 0


_TEMPORALITY = {
    v: k.removeprefix("AGGREGATION_TEMPORALITY_") for k, v in AggregationTemporality.items()
}


def decode_metrics(body: bytes) -> list[ReceivedPoint]:
    """The data points of one ``ExportMetricsServiceRequest`` (raises ``DecodeError``)."""
    request = ExportMetricsServiceRequest()
    request.ParseFromString(body)
    points = []
    for resource_metrics in request.resource_metrics:
        resource = {kv.key: _value(kv.value) for kv in resource_metrics.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_metrics in resource_metrics.scope_metrics:
            for m in scope_metrics.metrics:
                kind = m.WhichOneof("data") or ""
                data = getattr(m, kind) if kind else None
                temporality = _TEMPORALITY.get(getattr(data, "aggregation_temporality", 0), "")
                for p in getattr(data, "data_points", ()):
                    if kind in ("sum", "gauge"):
                        value, count = getattr(p, p.WhichOneof("value") or "as_double"), 1
                    else:  # histogram, exponential_histogram, summary
                        value, count = p.sum, p.count
                    points.append(
                        ReceivedPoint(
                            service=service,
                            name=m.name,
                            kind=kind,
                            value=float(value),
                            count=int(count),
                            unit=m.unit,
                            monotonic=bool(getattr(data, "is_monotonic", False)),
                            temporality="" if kind == "gauge" else temporality,
                            attributes={kv.key: _value(kv.value) for kv in p.attributes},
                            time_unix_nano=p.time_unix_nano,
                        )
                    )
    return points


_DECODERS = {
    TRACES_PATH: (decode, ExportTraceServiceResponse),
    METRICS_PATH: (decode_metrics, ExportMetricsServiceResponse),
}


class OtlpReceiver:
    """The receiver; ``start()``/``stop()`` or a context manager. Thread-safe reads.

    ``requests`` counts the accepted exports of both kinds, ``metric_requests`` those of
    metrics alone.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, echo: bool = False) -> None:
        self._spans: list[ReceivedSpan] = []
        self._points: list[ReceivedPoint] = []
        self.metric_requests = 0
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self.requests = 0
        self.rejected = 0
        self.echo = echo
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                path = self.path.split("?", 1)[0]
                if path not in _DECODERS:
                    return self._answer(404, b"")
                if self.headers.get("Content-Type", "") != "application/x-protobuf":
                    return receiver._reject(self, 415)
                decoder, response = _DECODERS[path]
                try:
                    if self.headers.get("Content-Encoding", "") == "gzip":
                        body = gzip.decompress(body)
                    items = decoder(body)
                except Exception:  # a malformed export: the exporter sees 400
                    return receiver._reject(self, 400)
                if path == TRACES_PATH:
                    receiver._add(items)
                else:
                    receiver._add_points(items)
                self._answer(200, response().SerializeToString())

            def _answer(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )

    @property
    def endpoint(self) -> str:
        """The value for ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}{TRACES_PATH}"

    @property
    def metrics_endpoint(self) -> str:
        """The value for ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}{METRICS_PATH}"

    @property
    def address(self) -> tuple[str, int]:
        """(host, port): for ``[metrics] otel_host`` / ``otel_port``, which add ``/v1/metrics``."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._arrived:
            self.requests += 1
            self._spans.extend(spans)
            self._arrived.notify_all()
        if self.echo:
            for s in spans:
                print(
                    f"{s.service} trace={s.trace_id} span={s.span_id} "
                    f"parent={s.parent_span_id or '-'} {s.kind} {s.name}",
                    flush=True,
                )

    def _add_points(self, points: list[ReceivedPoint]) -> None:
        with self._arrived:
            self.requests += 1
            self.metric_requests += 1
            self._points.extend(points)
            self._arrived.notify_all()
        if self.echo:
            for p in points:
                shown = p.value if p.count == 1 else f"sum={p.value:g} count={p.count}"
                print(f"{p.service} {p.name} {p.kind} {shown} {p.attributes or ''}", flush=True)

    def metrics(self) -> list[ReceivedPoint]:
        """Every data point received, in arrival order (a periodic reader repeats cumulative
        points at each export: the last one of a series is its final value)."""
        with self._lock:
            return list(self._points)

    def wait_for_metrics(self, predicate, timeout: float) -> list[ReceivedPoint]:
        """Wait until ``predicate(points)`` is true; return the points (raises on timeout)."""
        with self._arrived:
            if self._arrived.wait_for(lambda: predicate(self._points), timeout=timeout):
                return list(self._points)
            names = sorted({p.name for p in self._points})
        raise TimeoutError(f"metrics not received within {timeout:g}s; got names {names}")

    def _reject(self, handler: BaseHTTPRequestHandler, status: int) -> None:
        with self._lock:
            self.rejected += 1
        handler.send_response(status)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate, timeout: float) -> list[ReceivedSpan]:
        """Wait until ``predicate(spans)`` is true; return the spans (raises on timeout)."""
        with self._arrived:
            if self._arrived.wait_for(lambda: predicate(self._spans), timeout=timeout):
                return list(self._spans)
            names = sorted({s.name for s in self._spans})
        raise TimeoutError(f"spans not received within {timeout:g}s; got names {names}")

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._points.clear()

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.otlp_receiver", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = any free port")
    args = parser.parse_args(argv)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    with OtlpReceiver(args.host, args.port, echo=True) as receiver:
        print(
            f"OTLP/HTTP receiver listening on {receiver.endpoint} and {receiver.metrics_endpoint}",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            stopped.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
