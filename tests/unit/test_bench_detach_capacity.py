"""The capacity bench's reading of the selections service's call log (pure)."""

from __future__ import annotations

import math

import pytest

from devtools.bench_detach_capacity import settle_and_ratio


def _log(pattern):
    """``pattern``: one (accepted, refused) pair per 25-call chunk, 10 ms between calls."""
    calls, t = [], 0.0
    for accepted, refused in pattern:
        for i in range(accepted + refused):
            calls.append([t, 4, i >= accepted])
            t += 0.01
    return calls


def test_never_over_the_limit_is_settled_at_once():
    settled, after, total = settle_and_ratio(_log([(22, 3), (24, 1), (25, 0)]))
    assert settled == 0.0
    assert after == total == pytest.approx(75 / 71)


def test_settles_after_the_last_chunk_with_too_many_refusals():
    settled, after, total = settle_and_ratio(_log([(10, 15), (20, 5), (23, 2), (25, 0)]))
    assert settled == pytest.approx(0.5)  # the second chunk still refused 5 for 20 accepted
    assert after == pytest.approx(50 / 48)
    assert total == pytest.approx(100 / 78)


def test_a_short_last_chunk_is_judged_with_the_one_before():
    log = [*_log([(25, 0), (24, 1)]), [9.0, 4, True]]  # one refused call at the very end
    settled, _after, total = settle_and_ratio(log)
    assert settled == 0.0 and total == pytest.approx(51 / 49)


def test_still_over_the_limit_at_the_end_never_settled():
    settled, after, _total = settle_and_ratio(_log([(25, 0), (10, 15)]))
    assert settled == math.inf and math.isnan(after)


def test_empty_log_is_not_a_number():
    assert all(math.isnan(v) for v in settle_and_ratio([]))


def test_job_duration_comes_from_the_last_job_completed_line():
    from devtools.bench_detach_airflow import job_duration_seconds

    out = (
        "event=job_completed job=x run_id=a succeeded=1 duration_ms=900\n"
        "noise duration_ms=5\n"
        "event=job_completed job=x run_id=b succeeded=9 stop_reason=drained duration_ms=12345\n"
    )
    assert job_duration_seconds(out) == 12.345
    with pytest.raises(ValueError, match="job_completed"):
        job_duration_seconds("nothing here")
