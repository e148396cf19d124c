"""The answer table: what one detach call's answer means for its row, the outage breaker, the
concurrency limit and the misroute breaker, decided once (docs/design/detach.md)."""

from __future__ import annotations

import re
from collections.abc import Container
from dataclasses import dataclass, field, replace
from enum import StrEnum

LAST_ERROR_MAX = 512


@dataclass(frozen=True)
class CallOutcome:
    """What one detach call produced: an HTTP answer or a transport error class."""

    status_code: int | None = None
    error_class: str | None = None
    retry_after_seconds: float | None = None


class Verdict(StrEnum):
    DONE = "Done"
    RETRY = "Retry"  # stays Pending, backoff as set at claim (or Retry-After)
    QUARANTINE = "Quarantined"
    AUTH_FAILED = "AuthFailed"  # attempt given back, circuit breaker opens
    NOT_CALLED = "NotCalled"  # attempt given back (cancelled / breaker open)
    OUTAGE = "Outage"  # called, failed as part of an outage: attempt given back, error kept
    MISROUTED = "Misrouted"  # a 404 after the misroute breaker opened: attempt given back


class Streak(StrEnum):
    """What an answer does to the outage breaker's count of failures in a row."""

    FAILURE = "failure"  # one more failure in a row
    RESET = "reset"  # the service answered: the count starts again
    NONE = "none"  # says nothing about the service (our client's error, 1xx/3xx)


class Load(StrEnum):
    """What an answer tells the concurrency limit."""

    LATENCY = "latency"  # the service did the work: its latency joins the limit's window
    CONGESTION = "congestion"  # too many calls in flight: cut the limit
    NONE = "none"


class Route(StrEnum):
    """What an answer says about the selections route (the misrouting breaker)."""

    WORKS = "works"  # a 2xx
    NOT_FOUND = "not_found"  # a 404: an unknown snapshot, or a wrong route
    NONE = "none"


@dataclass(frozen=True)
class Answer:
    """One row of :data:`ANSWERS` or, made by :func:`answer_of`, one call's answer."""

    kind: str  # names the row; the outcomes it holds are not compared (kind says it)
    codes: Container[int] | None = field(compare=False)  # status codes; None: every other
    verdict: Verdict  # before max_attempts and an outage count (see decide())
    streak: Streak
    load: Load
    name: str = field(default="", compare=False)  # last_error's class, unless in CODE_NAMES
    errors: Container[str] | None = field(default=(), compare=False)  # None: every other class
    throttles: bool = False  # counted as throttled; its Retry-After pauses calls, delays the row
    stops_calls: bool = False  # our credentials are refused: no more calls this run
    lost_in_transport: bool = False  # made once more if the service answered later calls
    route: Route = Route.NONE
    # the call's own, filled in by answer_of()
    error: str | None = None  # last_error text (class + code), None for a 2xx
    retry_after_seconds: float | None = None  # only where the row throttles
    status_code: int | None = None  # the span's http.response.status_code
    error_type: str | None = None  # the span's error.type and the logs' error (None for 2xx)


CODE_NAMES = {
    400: "HttpBadRequest",
    401: "HttpUnauthorized",
    403: "HttpForbidden",
    408: "HttpRequestTimeout",
    409: "HttpConflict",
    410: "HttpGone",
    422: "HttpUnprocessable",
    423: "HttpLocked",
    425: "HttpTooEarly",
}
V, S, L = Verdict, Streak, Load
# The first row holding an outcome is its answer (why each 4xx is where it is:
# docs/design/detach.md); redirects are not followed, so a 1xx/3xx is an unexpected status.
ANSWERS: tuple[Answer, ...] = (
    Answer("2xx", range(200, 300), V.DONE, S.RESET, L.LATENCY, route=Route.WORKS),
    Answer("404", {404}, V.QUARANTINE, S.RESET, L.LATENCY, "HttpNotFound", route=Route.NOT_FOUND),
    Answer("400/410/422", {400, 410, 422}, V.QUARANTINE, S.RESET, L.LATENCY),
    Answer("401/403", {401, 403}, V.AUTH_FAILED, S.RESET, L.LATENCY, stops_calls=True),
    Answer("408/409/423/425", {408, 409, 423, 425}, V.RETRY, S.RESET, L.LATENCY),
    Answer("429", {429}, V.RETRY, S.RESET, L.CONGESTION, "HttpTooManyRequests", throttles=True),
    Answer("other 4xx", range(400, 500), V.RETRY, S.RESET, L.LATENCY, "HttpClientError"),
    Answer("503", {503}, V.RETRY, S.FAILURE, L.CONGESTION, "HttpServerError", throttles=True),
    Answer("502/504", {502, 504}, V.RETRY, S.FAILURE, L.CONGESTION, "HttpServerError"),
    Answer("other 5xx", range(500, 600), V.RETRY, S.FAILURE, L.NONE, "HttpServerError"),
    Answer("unexpected status", None, V.RETRY, S.NONE, L.NONE, "HttpUnexpectedStatus"),
    Answer(
        "timeout", (), V.RETRY, S.FAILURE, L.CONGESTION, errors={"Timeout"}, lost_in_transport=True
    ),
    Answer(
        "connection error",
        (),
        V.RETRY,
        S.FAILURE,
        L.CONGESTION,
        errors={"ConnectionError"},
        lost_in_transport=True,
    ),
    Answer("client exception", (), V.RETRY, S.NONE, L.NONE, errors={"ClientError"}),
    Answer("other transport error", (), V.RETRY, S.FAILURE, L.NONE, errors=None),
)
del V, S, L


def row_of(outcome: CallOutcome) -> Answer:
    """The row of :data:`ANSWERS` that holds ``outcome``."""
    code = outcome.status_code
    if code is not None:
        return next(a for a in ANSWERS if a.codes is None or code in a.codes)
    error = outcome.error_class or ""
    if error.startswith("ClientError:"):
        error = "ClientError"  # our client raised; the exception's class follows the colon
    return next(a for a in ANSWERS if a.errors is None or error in a.errors)


def answer_of(outcome: CallOutcome) -> Answer:
    """The answer of one call: its row, with the call's own fields (pure, table-tested)."""
    row = row_of(outcome)
    code = outcome.status_code
    if row.verdict is Verdict.DONE:
        return replace(row, status_code=code)
    retry_after = outcome.retry_after_seconds if row.throttles else None
    if code is None:
        error = clean_error(outcome.error_class or "UnknownError")
    else:
        name = CODE_NAMES.get(code, row.name)
        suffix = f" retry_after={retry_after:g}s" if retry_after is not None else ""
        error = f"{name} {code}{suffix}"
    return replace(
        row,
        error=error,
        retry_after_seconds=retry_after,
        status_code=code,
        error_type=str(code or outcome.error_class),
    )


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    error: str | None = None  # last_error text (class + code), None for Done / not called
    retry_after_seconds: float | None = None

    @property
    def is_failed_call(self) -> bool:
        """A call was made and did not succeed (news_snapshot_detach_failed_total)."""
        called = self.verdict not in (Verdict.DONE, Verdict.NOT_CALLED)
        return called and self.error != "UnknownReason"


def decide(
    answer: Answer | None,
    attempts: int,
    max_attempts: int,
    *,
    outage: bool = False,
    misrouted: bool = False,
) -> Decision:
    """What to do with a row after its call (``None``: not called). ``outage`` / ``misrouted``:
    the gate counted the call as the outage's or the misroute's evidence."""
    if answer is None:
        return Decision(Verdict.NOT_CALLED)
    if misrouted:
        return Decision(Verdict.MISROUTED, f"{answer.error}; route suspect")
    if answer.verdict is not Verdict.RETRY:
        return Decision(answer.verdict, answer.error)
    if outage:
        return Decision(Verdict.OUTAGE, answer.error, answer.retry_after_seconds)
    if attempts >= max_attempts:
        return Decision(Verdict.QUARANTINE, f"{answer.error}; max_attempts {max_attempts} reached")
    return Decision(Verdict.RETRY, answer.error, answer.retry_after_seconds)


_UNSAFE = re.compile(r"[^A-Za-z0-9 _.:;=()/-]")


def clean_error(text: str) -> str:
    """Bound ``last_error`` to the column and to a harmless alphabet (no quotes, no '@')."""
    return _UNSAFE.sub("?", text)[:LAST_ERROR_MAX]
