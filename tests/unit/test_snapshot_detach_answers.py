"""The detach job's answer table: every outcome of a call, and everything it means.

One row per status class or transport error (``ANSWERS``), each checked for every column the
job reads (the verdict and ``last_error``, the outage breaker's streak, the concurrency limit,
the Retry-After pause, refused credentials, the misroute, a second call, the span's fields),
then what the row itself adds (``decide``: max_attempts, an outage).
"""

from __future__ import annotations

import pytest

from include.pin_maintenance.jobs.snapshot_detach_answers import (
    ANSWERS,
    LAST_ERROR_MAX,
    CallOutcome,
    Load,
    Route,
    Streak,
    Verdict,
    answer_of,
    clean_error,
    decide,
)

MAX = 12
R, F, N = Streak.RESET, Streak.FAILURE, Streak.NONE
LAT, CUT, NO = Load.LATENCY, Load.CONGESTION, Load.NONE
THROTTLES, STOPS, LOST = "throttles", "stops_calls", "lost_in_transport"

# outcome, row, verdict, last_error, streak, load, flags, route, Retry-After kept
TABLE = [
    (CallOutcome(200), "2xx", Verdict.DONE, None, R, LAT, (), Route.WORKS, None),
    (CallOutcome(204), "2xx", Verdict.DONE, None, R, LAT, (), Route.WORKS, None),
    (
        CallOutcome(404),
        "404",
        Verdict.QUARANTINE,
        "HttpNotFound 404",
        R,
        LAT,
        (),
        Route.NOT_FOUND,
        None,
    ),
    (
        CallOutcome(400),
        "400/410/422",
        Verdict.QUARANTINE,
        "HttpBadRequest 400",
        R,
        LAT,
        (),
        None,
        None,
    ),
    (CallOutcome(410), "400/410/422", Verdict.QUARANTINE, "HttpGone 410", R, LAT, (), None, None),
    (
        CallOutcome(422),
        "400/410/422",
        Verdict.QUARANTINE,
        "HttpUnprocessable 422",
        R,
        LAT,
        (),
        None,
        None,
    ),
    (
        CallOutcome(401),
        "401/403",
        Verdict.AUTH_FAILED,
        "HttpUnauthorized 401",
        R,
        LAT,
        (STOPS,),
        None,
        None,
    ),
    (
        CallOutcome(403),
        "401/403",
        Verdict.AUTH_FAILED,
        "HttpForbidden 403",
        R,
        LAT,
        (STOPS,),
        None,
        None,
    ),
    (
        CallOutcome(408),
        "408/409/423/425",
        Verdict.RETRY,
        "HttpRequestTimeout 408",
        R,
        LAT,
        (),
        None,
        None,
    ),
    (
        CallOutcome(409),
        "408/409/423/425",
        Verdict.RETRY,
        "HttpConflict 409",
        R,
        LAT,
        (),
        None,
        None,
    ),
    (CallOutcome(423), "408/409/423/425", Verdict.RETRY, "HttpLocked 423", R, LAT, (), None, None),
    (
        CallOutcome(425),
        "408/409/423/425",
        Verdict.RETRY,
        "HttpTooEarly 425",
        R,
        LAT,
        (),
        None,
        None,
    ),
    (
        CallOutcome(429, retry_after_seconds=120),
        "429",
        Verdict.RETRY,
        "HttpTooManyRequests 429 retry_after=120s",
        R,
        CUT,
        (THROTTLES,),
        None,
        120,
    ),
    (
        CallOutcome(429),
        "429",
        Verdict.RETRY,
        "HttpTooManyRequests 429",
        R,
        CUT,
        (THROTTLES,),
        None,
        None,
    ),
    (CallOutcome(405), "other 4xx", Verdict.RETRY, "HttpClientError 405", R, LAT, (), None, None),
    (CallOutcome(418), "other 4xx", Verdict.RETRY, "HttpClientError 418", R, LAT, (), None, None),
    (
        CallOutcome(503, retry_after_seconds=30),
        "503",
        Verdict.RETRY,
        "HttpServerError 503 retry_after=30s",
        F,
        CUT,
        (THROTTLES,),
        None,
        30,
    ),
    (
        CallOutcome(503),
        "503",
        Verdict.RETRY,
        "HttpServerError 503",
        F,
        CUT,
        (THROTTLES,),
        None,
        None,
    ),
    (CallOutcome(502), "502/504", Verdict.RETRY, "HttpServerError 502", F, CUT, (), None, None),
    (CallOutcome(504), "502/504", Verdict.RETRY, "HttpServerError 504", F, CUT, (), None, None),
    # a Retry-After on an answer that does not throttle is not read
    (
        CallOutcome(500, retry_after_seconds=90),
        "other 5xx",
        Verdict.RETRY,
        "HttpServerError 500",
        F,
        NO,
        (),
        None,
        None,
    ),
    (CallOutcome(599), "other 5xx", Verdict.RETRY, "HttpServerError 599", F, NO, (), None, None),
    (
        CallOutcome(302),
        "unexpected status",
        Verdict.RETRY,
        "HttpUnexpectedStatus 302",
        N,
        NO,
        (),
        None,
        None,
    ),
    (
        CallOutcome(101),
        "unexpected status",
        Verdict.RETRY,
        "HttpUnexpectedStatus 101",
        N,
        NO,
        (),
        None,
        None,
    ),
    (
        CallOutcome(error_class="Timeout"),
        "timeout",
        Verdict.RETRY,
        "Timeout",
        F,
        CUT,
        (LOST,),
        None,
        None,
    ),
    (
        CallOutcome(error_class="ConnectionError"),
        "connection error",
        Verdict.RETRY,
        "ConnectionError",
        F,
        CUT,
        (LOST,),
        None,
        None,
    ),
    (
        CallOutcome(error_class="ClientError:RuntimeError"),
        "client exception",
        Verdict.RETRY,
        "ClientError:RuntimeError",
        N,
        NO,
        (),
        None,
        None,
    ),
    (
        CallOutcome(error_class="ChunkedEncodingError"),
        "other transport error",
        Verdict.RETRY,
        "ChunkedEncodingError",
        F,
        NO,
        (),
        None,
        None,
    ),
    (CallOutcome(), "other transport error", Verdict.RETRY, "UnknownError", F, NO, (), None, None),
]


@pytest.mark.parametrize(
    "case", TABLE, ids=[f"{row[1]}:{row[0].status_code or row[0].error_class}" for row in TABLE]
)
def test_answer_table(case):
    outcome, kind, verdict, error, streak, load, flags, route, retry_after = case
    answer = answer_of(outcome)
    assert answer.kind == kind
    assert answer.verdict is verdict
    assert answer.error == error
    assert answer.streak is streak
    assert answer.load is load
    assert {f for f in (THROTTLES, STOPS, LOST) if getattr(answer, f)} == set(flags)
    assert answer.route is (route or Route.NONE)
    assert answer.retry_after_seconds == retry_after
    # the span's fields: the status code, and an error type for every answer but a 2xx
    assert answer.status_code == outcome.status_code
    if verdict is Verdict.DONE:
        assert answer.error_type is None
    else:
        assert answer.error_type == str(outcome.status_code or outcome.error_class)


def test_the_table_test_covers_every_row():
    assert {row[1] for row in TABLE} == {a.kind for a in ANSWERS}
    assert len({a.kind for a in ANSWERS}) == len(ANSWERS)


@pytest.mark.parametrize("code", range(100, 600))
def test_every_status_code_has_one_row_and_only_429_and_503_keep_retry_after(code):
    answer = answer_of(CallOutcome(code, retry_after_seconds=5))
    assert answer.kind in {a.kind for a in ANSWERS}
    assert answer.throttles is (code in (429, 503))
    assert answer.retry_after_seconds == (5 if code in (429, 503) else None)


PERMANENT_4XX = {400, 404, 410, 422}
AUTH_4XX = {401, 403}


@pytest.mark.parametrize("code", range(400, 500))
def test_every_4xx_is_permanent_auth_or_transient_by_the_table(code):
    verdict = decide(answer_of(CallOutcome(code)), 1, MAX).verdict
    if code in PERMANENT_4XX:
        assert verdict is Verdict.QUARANTINE
    elif code in AUTH_4XX:
        assert verdict is Verdict.AUTH_FAILED
    else:
        assert verdict is Verdict.RETRY


@pytest.mark.parametrize(
    ("outcome", "attempts", "verdict", "error"),
    [
        (CallOutcome(200), 1, Verdict.DONE, None),
        (CallOutcome(204), 12, Verdict.DONE, None),
        (CallOutcome(500), 1, Verdict.RETRY, "HttpServerError 500"),
        (CallOutcome(502), 11, Verdict.RETRY, "HttpServerError 502"),
        (
            CallOutcome(503, retry_after_seconds=30),
            2,
            Verdict.RETRY,
            "HttpServerError 503 retry_after=30s",
        ),
        (CallOutcome(error_class="Timeout"), 3, Verdict.RETRY, "Timeout"),
        (CallOutcome(error_class="ConnectionError"), 3, Verdict.RETRY, "ConnectionError"),
        (
            CallOutcome(429, retry_after_seconds=120),
            1,
            Verdict.RETRY,
            "HttpTooManyRequests 429 retry_after=120s",
        ),
        (CallOutcome(429), 1, Verdict.RETRY, "HttpTooManyRequests 429"),
        (CallOutcome(408), 1, Verdict.RETRY, "HttpRequestTimeout 408"),
        (CallOutcome(302), 1, Verdict.RETRY, "HttpUnexpectedStatus 302"),
        (CallOutcome(500), 12, Verdict.QUARANTINE, "HttpServerError 500; max_attempts 12 reached"),
        (
            CallOutcome(error_class="Timeout"),
            13,
            Verdict.QUARANTINE,
            "Timeout; max_attempts 12 reached",
        ),
        (
            CallOutcome(429),
            12,
            Verdict.QUARANTINE,
            "HttpTooManyRequests 429; max_attempts 12 reached",
        ),
        (CallOutcome(404), 1, Verdict.QUARANTINE, "HttpNotFound 404"),
        (CallOutcome(410), 1, Verdict.QUARANTINE, "HttpGone 410"),
        # which 4xx are permanent (quarantine at once), which are transient
        (CallOutcome(400), 1, Verdict.QUARANTINE, "HttpBadRequest 400"),
        (CallOutcome(422), 1, Verdict.QUARANTINE, "HttpUnprocessable 422"),
        (CallOutcome(409), 1, Verdict.RETRY, "HttpConflict 409"),
        (CallOutcome(423), 1, Verdict.RETRY, "HttpLocked 423"),
        (CallOutcome(425), 1, Verdict.RETRY, "HttpTooEarly 425"),
        (CallOutcome(405), 1, Verdict.RETRY, "HttpClientError 405"),
        (CallOutcome(418), 1, Verdict.RETRY, "HttpClientError 418"),
        (CallOutcome(409), 12, Verdict.QUARANTINE, "HttpConflict 409; max_attempts 12 reached"),
        (CallOutcome(401), 1, Verdict.AUTH_FAILED, "HttpUnauthorized 401"),
        (CallOutcome(403), 12, Verdict.AUTH_FAILED, "HttpForbidden 403"),
        (None, 5, Verdict.NOT_CALLED, None),
    ],
)
def test_decide(outcome, attempts, verdict, error):
    decision = decide(outcome and answer_of(outcome), attempts, MAX)
    assert decision.verdict is verdict
    assert decision.error == error


def test_retry_after_is_carried_for_429_and_503_only():
    def carried(outcome):
        return decide(answer_of(outcome), 1, MAX).retry_after_seconds

    assert carried(CallOutcome(429, retry_after_seconds=90)) == 90
    assert carried(CallOutcome(503, retry_after_seconds=90)) == 90
    assert carried(CallOutcome(500, retry_after_seconds=90)) is None


def test_outage_decision_gives_the_attempt_back_even_at_max_attempts():
    decision = decide(answer_of(CallOutcome(503, retry_after_seconds=30)), 12, 12, outage=True)
    assert decision.verdict is Verdict.OUTAGE
    assert decision.error == "HttpServerError 503 retry_after=30s"
    assert decision.retry_after_seconds == 30
    assert decision.is_failed_call
    # an outage does not change final answers
    assert decide(answer_of(CallOutcome(200)), 3, 12, outage=True).verdict is Verdict.DONE
    assert decide(answer_of(CallOutcome(404)), 3, 12, outage=True).verdict is Verdict.QUARANTINE


def test_a_404_of_a_suspect_route_gives_the_attempt_back_even_at_max_attempts():
    decision = decide(answer_of(CallOutcome(404)), 12, 12, misrouted=True)
    assert decision.verdict is Verdict.MISROUTED
    assert decision.error == "HttpNotFound 404; route suspect"
    assert decision.is_failed_call


def test_clean_error_bounds_length_and_alphabet():
    assert len(clean_error("x" * 2000)) == LAST_ERROR_MAX
    assert clean_error('Err "user:pw@host"') == "Err ?user:pw?host?"
