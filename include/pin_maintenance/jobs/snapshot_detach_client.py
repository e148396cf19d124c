"""The selections detach call as the job sees it: a small protocol and a plain HTTP client.

The job (``snapshot_detach.run``) only knows :class:`DetachClient`; it never sees a URL, a
header or a credential, and it never sees a response body. :class:`HttpDetachClient` is the
``requests`` implementation used by the CLI and the tests; ``include.pin_airflow.selections``
builds the same client from Airflow's ``HttpHook`` and the ``selections_api`` connection.

The call carries the current trace context as a W3C ``traceparent`` header (nothing when no
span is active), so selections' server spans join the job's trace.

What comes back is a :class:`CallOutcome` (``snapshot_detach_answers``): an HTTP status code,
or the *class name* of the transport error (``Timeout``, ``ConnectionError``), plus a parsed
``Retry-After`` where the answer table reads one. Nothing else
of the exchange is kept, so nothing secret can reach ``last_error`` or a log line.

**Transport**: a call through ``requests`` costs about 1.3 ms of client CPU, one
through ``urllib3`` (which ``requests`` is built on) about 0.4 ms, and at 16-32 calls in flight
the job is CPU-bound on a shared machine long before the service is. The client therefore
reads the session's settings once (auth, headers, ``verify``, ``cert``) and sends the calls
with one shared ``urllib3.PoolManager`` (kept-alive connections, no transport retries, no
redirects). A session this cannot reproduce exactly (an auth object other than basic auth,
proxies, or a CA bundle taken from the environment) keeps the ``requests`` path.
"""

from __future__ import annotations

import base64
import email.utils
import json
import math
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

import requests
import urllib3
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from requests.adapters import HTTPAdapter
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from include.pin_maintenance.jobs.snapshot_detach_answers import CallOutcome, reads_retry_after

IDEMPOTENCY_HEADER = "Idempotency-Key"
DETACH_PATH = "/internal/snapshots/{snapshot_id}/detach"
# A Retry-After further away than this is treated as this (a bogus header must not park a row
# for a year; the operator sees the 429 in last_error anyway).
MAX_RETRY_AFTER_SECONDS = 24 * 3600.0
# W3C Trace Context only: no baggage (it could carry anything) goes to selections
_TRACE_CONTEXT = TraceContextTextMapPropagator()


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


def _outcome(status: int, retry_after: str | None) -> CallOutcome:
    """An HTTP answer; its ``Retry-After`` only where the answer table reads it."""
    seconds = parse_retry_after(retry_after) if reads_retry_after(status) else None
    return CallOutcome(status_code=status, retry_after_seconds=seconds)


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


POOL_SIZE = 64  # connections kept alive per host (detach_concurrency is at most 64)
_CA_BUNDLE_ENV = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


class _PooledTransport:
    """The calls on one ``urllib3.PoolManager``, with the settings of a ``requests`` session."""

    def __init__(self, headers: dict[str, str], pool: urllib3.PoolManager) -> None:
        self.headers = headers
        self.pool = pool

    @classmethod
    def from_session(cls, session: requests.Session, base_url: str) -> _PooledTransport | None:
        """The same request as ``session`` would send, or None when that cannot be promised."""
        headers = {str(k): str(v) for k, v in session.headers.items()}
        auth = session.auth
        if isinstance(auth, requests.auth.HTTPBasicAuth):
            auth = (auth.username, auth.password)
        if isinstance(auth, tuple) and len(auth) == 2:
            token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode("latin-1")).decode()
            headers["Authorization"] = f"Basic {token}"
        elif auth is not None:
            return None  # a custom auth object: only requests knows what it does
        if session.proxies or (session.trust_env and requests.utils.get_environ_proxies(base_url)):
            return None
        pool_kw: dict[str, Any] = {}
        if base_url.startswith("https://"):
            if session.trust_env and any(os.environ.get(v) for v in _CA_BUNDLE_ENV):
                return None
            verify = session.verify
            if verify is False:
                pool_kw["cert_reqs"] = "CERT_NONE"
            else:
                pool_kw["cert_reqs"] = "CERT_REQUIRED"
                if isinstance(verify, str):
                    pool_kw["ca_cert_dir" if os.path.isdir(verify) else "ca_certs"] = verify
                else:
                    pool_kw["ca_certs"] = requests.utils.DEFAULT_CA_BUNDLE_PATH
            cert = session.cert
            if isinstance(cert, str):
                pool_kw["cert_file"] = cert
            elif isinstance(cert, tuple):
                pool_kw["cert_file"], pool_kw["key_file"] = cert
        pool = urllib3.PoolManager(
            num_pools=4, maxsize=POOL_SIZE, block=False, retries=False, **pool_kw
        )
        return cls(headers, pool)

    def call(self, url: str, reason: str, key: str, timeout: float) -> CallOutcome:
        headers = {**self.headers, "Content-Type": "application/json", IDEMPOTENCY_HEADER: key}
        _TRACE_CONTEXT.inject(headers)  # the current (CLIENT) span, when there is one
        try:
            response = self.pool.request(
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

    def close(self) -> None:
        self.pool.clear()


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
        self._transport: _PooledTransport | None = None
        self._transport_checked = False

    def _pooled(self) -> _PooledTransport | None:
        with self._lock:
            if not self._transport_checked:
                self._transport_checked = True
                session = self._session_factory()
                try:
                    self._transport = _PooledTransport.from_session(session, self.base_url)
                finally:
                    session.close()
            return self._transport

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
        transport = self._pooled()
        if transport is not None:
            return transport.call(url, reason, idempotency_key, timeout)
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
            return _outcome(response.status_code, response.headers.get("Retry-After"))
        finally:
            response.close()

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
            transport = self._transport
        for session in sessions:
            session.close()
        if transport is not None:
            transport.close()

    def __enter__(self) -> HttpDetachClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
