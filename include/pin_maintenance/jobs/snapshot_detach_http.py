"""The detach call: the HTTP client (a :class:`CallOutcome` out, nothing secret in it) and the
run's calls on the call pool through its gate."""

from __future__ import annotations

import base64
import email.utils
import json
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

import requests
import urllib3
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from requests.adapters import HTTPAdapter
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from include.pin_maintenance.jobs.snapshot_detach_answers import (
    Answer,
    CallOutcome,
    answer_of,
    decide,
)
from include.pin_maintenance.jobs.snapshot_detach_config import DetachConfig
from include.pin_maintenance.jobs.snapshot_detach_gate import CallGate
from include.pin_maintenance.telemetry import Telemetry, record_error

if TYPE_CHECKING:
    from include.pin_maintenance.jobs.snapshot_detach import ClaimedRow

IDEMPOTENCY_HEADER = "Idempotency-Key"
DETACH_PATH = "/internal/snapshots/{snapshot_id}/detach"
MAX_RETRY_AFTER_SECONDS = 24 * 3600.0  # a bogus Retry-After must not park a row for a year
POOL_SIZE = 64  # connections kept alive per host (detach_concurrency is at most 64)
_CA_BUNDLE_ENV = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
_TRACE_CONTEXT = TraceContextTextMapPropagator()  # W3C Trace Context only, no baggage


class DetachClient(Protocol):
    def call(
        self, snapshot_id: str, reason: str, idempotency_key: str, timeout: float
    ) -> CallOutcome:
        """POST the detach for one snapshot; never raises for HTTP or transport failures."""
        ...


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds asked for by a ``Retry-After`` header (delta-seconds or HTTP-date), or None."""
    text = (value or "").strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def _outcome(status: int, retry_after: str | None) -> CallOutcome:
    seconds = parse_retry_after(retry_after) if retry_after else None  # answer_of keeps it or not
    return CallOutcome(status_code=status, retry_after_seconds=seconds)


def basic_auth_session(login: str | None, password: str | None) -> requests.Session:
    """A session with HTTP basic auth (when ``login`` is set) and no automatic retries."""
    session = requests.Session()
    if login:
        session.auth = (login, password or "")
    return mount_single_connection_adapter(session)


def mount_single_connection_adapter(session: requests.Session) -> requests.Session:
    """One kept-alive connection per session and no transport retries (the outbox retries)."""
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=1, max_retries=0)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _pool_for(
    session: requests.Session, base_url: str, headers: dict[str, str]
) -> urllib3.PoolManager | None:
    """A ``urllib3`` pool sending what ``session`` would send with ``headers`` (basic auth
    added to them; a third of the CPU per call: docs/design/detach.md), or None when that
    cannot be promised (an auth object other than basic auth, proxies, a CA bundle from the
    environment)."""
    auth = session.auth
    if isinstance(auth, requests.auth.HTTPBasicAuth):
        auth = (auth.username, auth.password)
    if isinstance(auth, tuple) and len(auth) == 2:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode("latin-1")).decode()
        headers["Authorization"] = f"Basic {token}"
    elif auth is not None:
        return None
    if session.proxies or (session.trust_env and requests.utils.get_environ_proxies(base_url)):
        return None
    tls: dict[str, Any] = {}
    if base_url.startswith("https://"):
        if session.trust_env and any(os.environ.get(v) for v in _CA_BUNDLE_ENV):
            return None
        verify, cert = session.verify, session.cert
        tls["cert_reqs"] = "CERT_NONE" if verify is False else "CERT_REQUIRED"
        if isinstance(verify, str):
            tls["ca_cert_dir" if os.path.isdir(verify) else "ca_certs"] = verify
        elif verify is not False:
            tls["ca_certs"] = requests.utils.DEFAULT_CA_BUNDLE_PATH
        if isinstance(cert, str):
            tls["cert_file"] = cert
        elif isinstance(cert, tuple):
            tls["cert_file"], tls["key_file"] = cert
    return urllib3.PoolManager(num_pools=4, maxsize=POOL_SIZE, block=False, retries=False, **tls)


class HttpDetachClient:
    """Calls through one ``urllib3`` pool configured like the session ``session_factory``
    makes, or, where the pool cannot stand in for it, through one such session per thread."""

    def __init__(self, base_url: str, session_factory: Callable[[], requests.Session]) -> None:
        self.base_url = base_url.rstrip("/")
        self._session_factory = session_factory
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()
        with session_factory() as session:
            self._headers = {str(k): str(v) for k, v in session.headers.items()}
            self._pool = _pool_for(session, self.base_url, self._headers)

    def call(
        self, snapshot_id: str, reason: str, idempotency_key: str, timeout: float
    ) -> CallOutcome:
        url = self.base_url + DETACH_PATH.format(snapshot_id=snapshot_id)
        if self._pool is None:
            return self._session_call(url, reason, idempotency_key, timeout)
        headers = {**self._headers, "Content-Type": "application/json"}
        headers[IDEMPOTENCY_HEADER] = idempotency_key
        _TRACE_CONTEXT.inject(headers)  # the current (CLIENT) span, when there is one
        try:
            response = self._pool.request(
                "POST",
                url,
                body=json.dumps({"reason": reason}).encode(),
                headers=headers,
                timeout=urllib3.Timeout(connect=timeout, read=timeout),
                retries=False,
                redirect=False,  # never follow a redirect with our credentials
                preload_content=True,
            )
        except NewConnectionError:  # before the timeout: in urllib3 2 it is also one
            return CallOutcome(error_class="ConnectionError")
        except Urllib3Timeout:
            return CallOutcome(error_class="Timeout")
        except Urllib3Error:  # reset, refused, TLS, protocol: as requests' ConnectionError
            return CallOutcome(error_class="ConnectionError")
        return _outcome(response.status, response.headers.get("Retry-After"))

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = self._session_factory()
            with self._lock:
                self._sessions.append(session)
        return session

    def _session_call(self, url: str, reason: str, key: str, timeout: float) -> CallOutcome:
        headers = {IDEMPOTENCY_HEADER: key}
        _TRACE_CONTEXT.inject(headers)
        try:
            response = self._session().post(
                url,
                json={"reason": reason},
                headers=headers,
                timeout=timeout,
                allow_redirects=False,  # never follow a redirect with our credentials
            )
        except requests.Timeout:  # before ConnectionError: ConnectTimeout is both
            return CallOutcome(error_class="Timeout")
        except requests.ConnectionError:
            return CallOutcome(error_class="ConnectionError")
        except requests.RequestException as exc:
            return CallOutcome(error_class=type(exc).__name__)
        with response:
            return _outcome(response.status_code, response.headers.get("Retry-After"))

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.close()
        if self._pool is not None:
            self._pool.clear()

    def __enter__(self) -> HttpDetachClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CallWorkers:
    """The run's calls on ``pool``, each through ``gate``: a future per row, whose result is
    the call's :class:`Answer`, or None when no call was made."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        gate: CallGate,
        client: DetachClient,
        config: DetachConfig,
        telemetry: Telemetry,
    ) -> None:
        self.pool, self.gate, self.client = pool, gate, client
        self.max_attempts = config.max_attempts
        self.telemetry, self.log = telemetry, telemetry.log
        self._count_lock = threading.Lock()
        self._submitted = 0  # calls queued on the pool
        self._taken = 0  # of them, picked up by a worker

    def submit(self, rows: list[ClaimedRow], parent: Context) -> dict[str, Future]:
        """Queue the call of each row; row id -> its future."""
        with self._count_lock:
            self._submitted += len(rows)
        return {r.id: self.pool.submit(self._call, r, parent) for r in rows}

    def queued(self) -> int:
        """Calls queued and not yet picked up by a worker."""
        with self._count_lock:
            return self._submitted - self._taken

    def abandon(self, calls: dict[str, Future]) -> None:
        """Past the deadline: record the calls still running as timed out (their threads end
        on their own) and those never started as not called."""
        for row_id, call in list(calls.items()):
            if call.done():
                continue
            replacement: Future = Future()
            if call.cancel():  # never started: not called, its attempt is given back
                replacement.set_result(None)
            else:
                replacement.set_result(answer_of(CallOutcome(error_class="Timeout")))
                self.log.warning("entry_call_abandoned", outbox_id=row_id)
            calls[row_id] = replacement

    def _call(self, row: ClaimedRow, parent: Context) -> Answer | None:
        """On a worker thread: the call, made once more when the gate says so."""
        with self._count_lock:
            self._taken += 1
        answer = None
        for attempt in range(2):
            ticket = self.gate.acquire()  # waits for a slot (adaptive limit, Retry-After pause)
            if ticket is None:  # calls stopped, the run stopped, or the deadline reached
                return answer
            answer = self._traced_call(row, parent)
            if not self.gate.release(ticket, row.id, answer) or attempt:
                return answer
            self.log.info("entry_call_retried", outbox_id=row.id, error=answer.error_type)
        return answer

    def _traced_call(self, row: ClaimedRow, parent: Context) -> Answer:
        """The call as a CLIENT span under its batch's span."""
        attributes = {
            "http.request.method": "POST",
            "url.template": DETACH_PATH,
            "pin.snapshot_id": row.snapshot_id,
            "pin.post_id": row.post_id,
            "pin.attempts": row.attempts,
        }
        with self.telemetry.span(
            "detach snapshot", attributes, kind=SpanKind.CLIENT, context=parent
        ) as span:
            answer = answer_of(self._detach(row))  # the one place a call's outcome is read
            if span.is_recording():
                decision = decide(answer, row.attempts, self.max_attempts)
                span.set_attribute("pin.outcome", decision.verdict.value)
                if answer.status_code is not None:
                    span.set_attribute("http.response.status_code", answer.status_code)
                if answer.error_type is not None:
                    record_error(span, answer.error_type)
        return answer

    def _detach(self, row: ClaimedRow) -> CallOutcome:
        try:
            return self.client.call(row.snapshot_id, row.reason, row.id, self.gate.call_timeout())
        except Exception as exc:  # a client bug or infrastructure failure: this row only
            self.log.error(
                "entry_call_failed", snapshot_id=row.snapshot_id, error=type(exc).__name__
            )
            return CallOutcome(error_class=f"ClientError:{type(exc).__name__}")
