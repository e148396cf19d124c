"""A local selections service for the demo, the tests and the benchmark
(docs/design.md, "Selections API").

A real HTTP/1.1 server on loopback (keep-alive, one thread per connection) implementing
``POST /internal/snapshots/{id}/detach`` with a JSON body ``{"reason": ...}``:

- HTTP basic auth is checked on every call (401 on bad or missing credentials);
- detach is idempotent: the first successful call marks the snapshot detached, later ones
  answer 200 again with ``"already_detached": true`` (INV-SNP-005);
- configurable latency, a random failure mix (503s) and an optional capacity limit
  (``max_concurrent`` calls served at once; the rest queue), so a benchmark knows the capacity;
- an optional admission limit (``max_in_flight``): a call arriving while that many are being
  served is refused at once with ``overload_status`` (429 or 503) and, when
  ``overload_retry_after`` is set, a ``Retry-After`` header; the service counts accepted and
  refused calls and the peak in flight, so a benchmark knows what it accepted;
- an outage switch (:meth:`SelectionsService.set_outage`): every call, whatever its script,
  gets one behaviour (``error_503``, ``slow``, ``drop``, ...) until the outage is lifted; a
  refused connection is simply a stopped service;
- per-snapshot scripted behaviours, as a sequence (the last one repeats):
  ``ok``, ``already_detached``, ``error_500``, ``error_503``, ``slow`` (answers after
  ``slow_seconds``, beyond any sane timeout), ``drop`` (closes the socket without answering),
  ``not_found`` (404), ``rate_limited`` (429 with ``Retry-After``), ``unauthorized`` (401),
  ``forbidden`` (403), ``bad_request`` (400).

Every call is recorded (snapshot id, idempotency key, reason, answer, the W3C ``traceparent``
header it carried) so tests can assert that a snapshot was "called once" and which trace
called. In-process use::

    with SelectionsService(latency_ms=20) as svc:
        svc.script(snapshot_id, "error_503", "ok")
        ... svc.url ... svc.call_count(snapshot_id)

From a shell: ``python -m devtools.selections_service --port 0 --latency-ms 20`` prints
``selections service listening on http://127.0.0.1:<port>`` and serves until Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import random
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BEHAVIOURS = (
    "ok",
    "already_detached",
    "error_500",
    "error_503",
    "slow",
    "drop",
    "not_found",
    "rate_limited",
    "unauthorized",
    "forbidden",
    "bad_request",
)
_PATH = re.compile(r"^/internal/snapshots/(?P<id>[^/]+)/detach/?$")
DEFAULT_LOGIN = "pin-maintenance"
# calls whose Idempotency-Key starts with this are another caller's (the benchmark's neighbour)
NEIGHBOUR_KEY_PREFIX = "neighbour-"
DEFAULT_PASSWORD = "local-dev-secret"


@dataclass(frozen=True)
class Call:
    snapshot_id: str
    idempotency_key: str | None
    reason: str | None
    behaviour: str
    status: int | None  # the answer it gets (None = connection dropped)
    authorized: bool
    at: float
    traceparent: str | None = None  # W3C trace context the caller sent, as received
    in_flight: int = 0  # calls being served when this one arrived, itself included if admitted


class SelectionsService:
    """The fake selections internal API; start()/stop() or use as a context manager."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        login: str = DEFAULT_LOGIN,
        password: str = DEFAULT_PASSWORD,
        latency_ms: float = 0.0,
        failure_rate: float = 0.0,
        slow_seconds: float = 30.0,
        retry_after_seconds: int = 120,
        max_concurrent: int | None = None,
        max_in_flight: int | None = None,
        overload_status: int = 503,
        overload_retry_after: float | None = None,
        seed: int | None = None,
        known_snapshots: set[str] | None = None,
        latency_fn: Callable[[int], float] | None = None,
        latency_sigma: float = 0.0,
        close_connections: bool = False,
        stdlib_defaults: bool = False,
    ) -> None:
        if overload_status not in (429, 503):
            raise ValueError(f"overload_status must be 429 or 503, got {overload_status}")
        self.host = host
        self.port = port
        self.login = login
        self.password = password
        self.latency_ms = latency_ms
        # latency_fn(n) = seconds for the n-th call (0-based), overriding latency_ms; a
        # latency_sigma > 0 draws lognormal latencies with median latency_ms instead
        self.latency_fn = latency_fn
        self.latency_sigma = latency_sigma
        # one connection per call: every answer carries "Connection: close"
        self.close_connections = close_connections
        # the standard library's own server as an operator would write it: HTTP/1.0 (one
        # connection per call), a listen backlog of 5, Nagle on
        self.stdlib_defaults = stdlib_defaults
        self._served = 0
        self.failure_rate = failure_rate
        self.slow_seconds = slow_seconds
        self.retry_after_seconds = retry_after_seconds
        # None = every snapshot exists; otherwise unknown ids answer 404
        self.known_snapshots = known_snapshots
        self._capacity = threading.BoundedSemaphore(max_concurrent) if max_concurrent else None
        self.max_in_flight = max_in_flight
        self.overload_status = overload_status
        self.overload_retry_after = overload_retry_after
        self._outage: str | None = None
        self.in_flight = 0
        self.peak_in_flight = 0
        self.accepted = 0  # calls served (any answer but an overload refusal)
        self.refused = 0  # calls refused by the admission limit
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._scripts: dict[str, list[str]] = {}
        self._detached: set[str] = set()
        self.calls: list[Call] = []
        self.connections_opened = 0  # TCP connections accepted (keep-alive reuse shows here)
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- control ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("selections service is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SelectionsService:
        if self._server is not None:
            return self
        self._stopping.clear()
        if self.stdlib_defaults:
            server = _PlainServer((self.host, self.port), _PlainHandler)
        else:
            server = _Server((self.host, self.port), _Handler)
        server.service = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="selections-service",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()  # wakes "slow" handlers
        server.shutdown()
        server.server_close()
        if self._thread:
            self._thread.join(timeout=5)

    def __enter__(self) -> SelectionsService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def script(self, snapshot_id: str, *behaviours: str) -> None:
        """Answer the next calls for ``snapshot_id`` with ``behaviours`` (the last repeats)."""
        for b in behaviours:
            if b not in BEHAVIOURS:
                raise ValueError(f"unknown behaviour {b!r}; known: {', '.join(BEHAVIOURS)}")
        if not behaviours:
            raise ValueError("script() needs at least one behaviour")
        with self._lock:
            self._scripts[str(snapshot_id)] = list(behaviours)
            if "already_detached" in behaviours:
                self._detached.add(str(snapshot_id))

    def set_outage(self, behaviour: str | None) -> None:
        """Answer every call with ``behaviour`` (e.g. ``error_503``, ``slow``) until None."""
        if behaviour is not None and behaviour not in BEHAVIOURS:
            raise ValueError(f"unknown behaviour {behaviour!r}; known: {', '.join(BEHAVIOURS)}")
        with self._lock:
            self._outage = behaviour

    def mark_detached(self, snapshot_id: str) -> None:
        with self._lock:
            self._detached.add(str(snapshot_id))

    def is_detached(self, snapshot_id: str) -> bool:
        with self._lock:
            return str(snapshot_id) in self._detached

    def call_count(self, snapshot_id: str) -> int:
        with self._lock:
            return sum(1 for c in self.calls if c.snapshot_id == str(snapshot_id))

    def call_counts(self) -> Counter[str]:
        with self._lock:
            return Counter(c.snapshot_id for c in self.calls)

    def calls_for(self, snapshot_id: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.snapshot_id == str(snapshot_id)]

    def reset_calls(self) -> None:
        with self._lock:
            self.calls.clear()
            self.accepted = self.refused = self.peak_in_flight = 0

    def admission(self) -> dict[str, int]:
        """Accepted / refused calls and the peak in flight since the last reset."""
        with self._lock:
            return {
                "accepted": self.accepted,
                "refused": self.refused,
                "peak_in_flight": self.peak_in_flight,
            }

    # -- request handling (handler threads) --------------------------------------------------

    def _next_behaviour(self, snapshot_id: str) -> str:
        with self._lock:
            if self._outage is not None:
                return self._outage
            script = self._scripts.get(snapshot_id)
            if script:
                return script.pop(0) if len(script) > 1 else script[0]
        if self.known_snapshots is not None and snapshot_id not in self.known_snapshots:
            return "not_found"
        if self.failure_rate and self._rng.random() < self.failure_rate:
            return "error_503"
        return "ok"

    def _latency(self) -> float:
        with self._lock:
            n = self._served
            self._served += 1
            if self.latency_fn is not None:
                return self.latency_fn(n)
            if self.latency_sigma > 0 and self.latency_ms > 0:
                return self._rng.lognormvariate(
                    math.log(self.latency_ms / 1000), self.latency_sigma
                )
        return self.latency_ms / 1000

    def _authorized(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        try:
            decoded = base64.b64decode(header[6:], validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return False
        login, _, password = decoded.partition(":")
        return login == self.login and password == self.password

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def handle_detach(self, handler: _Handler, snapshot_id: str, body: bytes) -> None:
        key = handler.headers.get("Idempotency-Key")
        try:
            reason = json.loads(body or b"{}").get("reason")
        except (ValueError, AttributeError):
            reason = None
        authorized = self._authorized(handler.headers.get("Authorization"))
        with self._lock:
            admitted = self.max_in_flight is None or self.in_flight < self.max_in_flight
            if admitted:
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                self.accepted += 1
            else:
                self.refused += 1
            in_flight = self.in_flight
        if not admitted:
            status = self.overload_status
            self._record(
                Call(
                    snapshot_id,
                    key,
                    reason,
                    "overloaded",
                    status,
                    authorized,
                    time.time(),
                    handler.headers.get("traceparent"),
                    in_flight=in_flight,
                )
            )
            headers = {}
            if self.overload_retry_after is not None:
                headers["Retry-After"] = f"{self.overload_retry_after:g}"
            handler.send_json(self.overload_status, {"error": "overloaded"}, headers)
            return
        finished = threading.Event()

        def finish() -> None:  # the call's work is done: it no longer counts as in flight
            if not finished.is_set():
                finished.set()
                with self._lock:
                    self.in_flight -= 1

        try:
            self._serve(
                handler,
                snapshot_id,
                key,
                reason,
                authorized=authorized,
                in_flight=in_flight,
                finish=finish,
            )
        finally:
            finish()

    def _serve(
        self,
        handler: _Handler,
        snapshot_id: str,
        key: str | None,
        reason: Any,
        *,
        authorized: bool,
        in_flight: int,
        finish: Callable[[], None],
    ) -> None:
        behaviour = self._next_behaviour(snapshot_id) if authorized else "unauthorized"

        # recorded on arrival (a slow call counts as called even if the client gave up)
        intended = None if behaviour == "drop" else _STATUS.get(behaviour, 200)
        if intended == 200 and reason not in ("BlockReplaced", "PostDeleted"):
            intended = 400
        traceparent = handler.headers.get("traceparent")
        self._record(
            Call(
                snapshot_id,
                key,
                reason,
                behaviour,
                intended,
                authorized,
                time.time(),
                traceparent,
                in_flight=in_flight,
            )
        )

        with self._capacity or contextlib.nullcontext():
            delay = self._latency()
            if delay > 0:
                time.sleep(delay)
            if behaviour == "drop":
                handler.close_connection = True
                with contextlib.suppress(OSError):
                    handler.connection.shutdown(2)  # SHUT_RDWR: the client sees a reset/EOF
                return
            if behaviour == "slow" and self._stopping.wait(self.slow_seconds):
                handler.close_connection = True
                return
            status = intended or 200
            if status == 200:
                with self._lock:
                    already = snapshot_id in self._detached
                    self._detached.add(snapshot_id)
            headers = {}
            if status == 429:
                headers["Retry-After"] = str(self.retry_after_seconds)
            if status == 401:
                headers["WWW-Authenticate"] = 'Basic realm="selections"'
            finish()  # before the answer goes out: the client may call again at once
            payload: dict[str, Any] = (
                {"snapshot_id": snapshot_id, "status": "Detached", "already_detached": already}
                if status == 200
                else {"error": behaviour}
            )
            handler.send_json(status, payload, headers)


_STATUS = {
    "ok": 200,
    "already_detached": 200,
    "error_500": 500,
    "error_503": 503,
    "not_found": 404,
    "rate_limited": 429,
    "unauthorized": 401,
    "forbidden": 403,
    "bad_request": 400,
}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # kept-alive client connections must not hold up stop()
    allow_reuse_address = True
    request_queue_size = 256
    service: SelectionsService

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that gave up on its call (its timeout, a cancelled run) closed the
        connection before the answer: expected here, as in any real service, so not printed.
        Anything else is printed as the standard library does."""
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections
    # headers and body are two writes: without this every call waits ~40 ms for a delayed ACK
    disable_nagle_algorithm = True
    server_version = "pin-selections-dev/1"
    timeout = 60  # idle kept-alive connections are closed after this
    server: _Server

    def setup(self) -> None:
        super().setup()
        service = self.server.service
        with service._lock:
            service.connections_opened += 1

    def log_message(self, format: str, *args: Any) -> None:
        return  # quiet: calls are recorded on the service

    def send_json(self, status: int, payload: dict[str, Any], headers: dict[str, str]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.server.service.close_connections:
            self.send_header("Connection", "close")
            self.close_connection = True
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def do_POST(self) -> None:
        body = self._body()
        match = _PATH.match(self.path.split("?", 1)[0])
        if not match:
            self.send_json(404, {"error": "no such endpoint"}, {})
            return
        self.server.service.handle_detach(self, match.group("id"), body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_json(200, {"status": "ok"}, {})
        elif self.path == "/stats":  # for the benchmark: admission counts and a call timeline
            service = self.server.service
            with service._lock:
                timeline = [
                    [
                        c.at,
                        c.in_flight,
                        c.behaviour == "overloaded",
                        (c.idempotency_key or "").startswith(NEIGHBOUR_KEY_PREFIX),
                    ]
                    for c in service.calls
                ]
            self.send_json(200, {**service.admission(), "calls": timeline}, {})
        elif self.path == "/reset":
            self.server.service.reset_calls()
            self.send_json(200, {"status": "reset"}, {})
        else:
            self.send_json(404, {"error": "no such endpoint"}, {})


class _PlainServer(_Server):
    request_queue_size = 5  # socketserver's default listen backlog


class _PlainHandler(_Handler):
    protocol_version = "HTTP/1.0"  # BaseHTTPRequestHandler's default: close after each answer
    disable_nagle_algorithm = False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.selections_service", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = any free port")
    parser.add_argument("--login", default=DEFAULT_LOGIN)
    parser.add_argument("--password", default=DEFAULT_PASSWORD)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--failure-rate", type=float, default=0.0, help="share of 503 answers")
    parser.add_argument("--max-concurrent", type=int, default=None, help="capacity limit")
    parser.add_argument(
        "--max-in-flight", type=int, default=None, help="refuse calls beyond this many at once"
    )
    parser.add_argument("--overload-status", type=int, default=503, choices=(429, 503))
    parser.add_argument(
        "--overload-retry-after", type=float, default=None, help="Retry-After of a refusal"
    )
    parser.add_argument(
        "--latency-sigma",
        type=float,
        default=0.0,
        help="lognormal latency with median --latency-ms and this sigma (0.6: p99 ~4x median)",
    )
    parser.add_argument(
        "--close-connections",
        action="store_true",
        help="one connection per call (every answer says Connection: close)",
    )
    parser.add_argument(
        "--stdlib-defaults",
        action="store_true",
        help="the standard library's defaults: HTTP/1.0, listen backlog 5, Nagle on",
    )
    parser.add_argument("--slow-seconds", type=float, default=30.0)
    parser.add_argument("--retry-after-seconds", type=int, default=120)
    parser.add_argument(
        "--script",
        action="append",
        default=[],
        metavar="SNAPSHOT_ID=B1[,B2...]",
        help=f"scripted behaviours for a snapshot; behaviours: {', '.join(BEHAVIOURS)}",
    )
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    service = SelectionsService(
        args.host,
        args.port,
        login=args.login,
        password=args.password,
        latency_ms=args.latency_ms,
        failure_rate=args.failure_rate,
        slow_seconds=args.slow_seconds,
        retry_after_seconds=args.retry_after_seconds,
        max_concurrent=args.max_concurrent,
        max_in_flight=args.max_in_flight,
        overload_status=args.overload_status,
        overload_retry_after=args.overload_retry_after,
        seed=args.seed,
        latency_sigma=args.latency_sigma,
        close_connections=args.close_connections,
        stdlib_defaults=args.stdlib_defaults,
    )
    for item in args.script:
        snapshot_id, _, behaviours = item.partition("=")
        service.script(snapshot_id, *behaviours.split(","))
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    service.start()
    print(f"selections service listening on {service.url}", flush=True)
    try:
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
        print(f"selections service stopped after {len(service.calls)} calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
