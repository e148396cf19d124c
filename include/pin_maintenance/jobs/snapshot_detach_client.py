"""The selections detach call as the job sees it: a small protocol and a plain HTTP client.

The job (``snapshot_detach.run``) only knows :class:`DetachClient`; it never sees a URL, a
header or a credential, and it never sees a response body. :class:`HttpDetachClient` is the
``requests`` implementation used by the CLI and the tests; ``include.pin_airflow.selections``
builds the same client from Airflow's ``HttpHook`` and the ``selections_api`` connection.

The call carries the current trace context as a W3C ``traceparent`` header (nothing when no
span is active), so selections' server spans join the job's trace.

What comes back is an :class:`CallOutcome`: an HTTP status code, or the *class name* of the
transport error (``Timeout``, ``ConnectionError``), plus a parsed ``Retry-After``. Nothing else
of the exchange is kept, so nothing secret can reach ``last_error`` or a log line.
"""

from __future__ import annotations

import email.utils
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import requests
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from requests.adapters import HTTPAdapter

IDEMPOTENCY_HEADER = "Idempotency-Key"
DETACH_PATH = "/internal/snapshots/{snapshot_id}/detach"
# A Retry-After further away than this is treated as this (a bogus header must not park a row
# for a year; the operator sees the 429 in last_error anyway).
MAX_RETRY_AFTER_SECONDS = 24 * 3600.0
# W3C Trace Context only: no baggage (it could carry anything) goes to selections
_TRACE_CONTEXT = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class CallOutcome:
    """What one detach call produced: an HTTP answer or a transport error class."""

    status_code: int | None = None
    error_class: str | None = None
    retry_after_seconds: float | None = None


class DetachClient(Protocol):
    def call(
        self, snapshot_id: str, reason: str, idempotency_key: str, timeout: float
    ) -> CallOutcome:
        """POST the detach for one snapshot; never raises for HTTP or transport failures."""
        ...


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds asked for by a ``Retry-After`` header (delta-seconds or HTTP-date), or None."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
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


def basic_auth_session(login: str | None, password: str | None) -> requests.Session:
    """A session with HTTP basic auth (when ``login`` is set) and no automatic retries."""
    session = requests.Session()
    if login:
        session.auth = (login, password or "")
    return mount_single_connection_adapter(session)


def mount_single_connection_adapter(session: requests.Session) -> requests.Session:
    """One kept-alive connection per session, no transport retries (we retry via the outbox).

    ``max_retries=0`` matters: a silent transport retry of a POST would call selections twice
    for one claim and hide the failure from ``last_error``.
    """
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=1, max_retries=0)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


class HttpDetachClient:
    """``POST {base_url}/internal/snapshots/{id}/detach`` with one session per worker thread.

    ``session_factory`` makes a configured ``requests.Session`` (auth, TLS, headers). Each
    thread gets its own session, so connections are reused (keep-alive) without sharing a
    session between threads.
    """

    def __init__(self, base_url: str, session_factory: Callable[[], requests.Session]) -> None:
        self.base_url = base_url.rstrip("/")
        self._session_factory = session_factory
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._session_factory()
            self._local.session = session
            with self._lock:
                self._sessions.append(session)
        return session

    def call(
        self, snapshot_id: str, reason: str, idempotency_key: str, timeout: float
    ) -> CallOutcome:
        url = self.base_url + DETACH_PATH.format(snapshot_id=snapshot_id)
        headers = {IDEMPOTENCY_HEADER: idempotency_key}
        _TRACE_CONTEXT.inject(headers)  # the current (CLIENT) span, when there is one
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
        try:
            retry_after = None
            if response.status_code in (429, 503):
                retry_after = parse_retry_after(response.headers.get("Retry-After"))
            return CallOutcome(status_code=response.status_code, retry_after_seconds=retry_after)
        finally:
            response.close()

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.close()

    def __enter__(self) -> HttpDetachClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
