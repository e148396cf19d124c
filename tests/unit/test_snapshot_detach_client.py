"""The detach HTTP client against the local selections service (real loopback HTTP, no DB)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import requests

from devtools.selections_service import DEFAULT_LOGIN, DEFAULT_PASSWORD, SelectionsService
from include.pin_maintenance.jobs.snapshot_detach_answers import CallOutcome
from include.pin_maintenance.jobs.snapshot_detach_http import HttpDetachClient, basic_auth_session

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def svc():
    with SelectionsService(slow_seconds=3, retry_after_seconds=42) as s:
        yield s


def _client(svc, password=DEFAULT_PASSWORD):
    return HttpDetachClient(svc.url, lambda: basic_auth_session(DEFAULT_LOGIN, password))


def _sid() -> str:
    return str(uuid.uuid4())


@pytest.mark.parametrize(
    ("behaviour", "expected"),
    [
        ("ok", CallOutcome(200)),
        ("already_detached", CallOutcome(200)),
        ("error_500", CallOutcome(500)),
        ("error_503", CallOutcome(503)),
        ("not_found", CallOutcome(404)),
        ("rate_limited", CallOutcome(429, retry_after_seconds=42)),
        ("unauthorized", CallOutcome(401)),
        ("forbidden", CallOutcome(403)),
        ("bad_request", CallOutcome(400)),
        ("slow", CallOutcome(error_class="Timeout")),
        ("drop", CallOutcome(error_class="ConnectionError")),
    ],
)
def test_each_scripted_behaviour_maps_to_an_outcome(svc, behaviour, expected):
    sid = _sid()
    svc.script(sid, behaviour)
    with _client(svc) as client:
        assert client.call(sid, "BlockReplaced", "key-1", timeout=0.3) == expected
    assert svc.call_count(sid) == 1


def test_call_sends_reason_and_idempotency_key_and_is_recorded(svc):
    sid = _sid()
    with _client(svc) as client:
        client.call(sid, "PostDeleted", "outbox-id-1", timeout=2)
    [call] = svc.calls_for(sid)
    assert (call.reason, call.idempotency_key, call.status, call.authorized) == (
        "PostDeleted",
        "outbox-id-1",
        200,
        True,
    )
    assert svc.is_detached(sid)


def test_detach_is_idempotent_on_the_service(svc):
    sid = _sid()
    with _client(svc) as client:
        assert client.call(sid, "BlockReplaced", "k", timeout=2).status_code == 200
        assert client.call(sid, "BlockReplaced", "k", timeout=2).status_code == 200
    assert [c.status for c in svc.calls_for(sid)] == [200, 200]


def test_bad_credentials_get_401(svc):
    sid = _sid()
    with _client(svc, password="nope") as client:
        assert client.call(sid, "BlockReplaced", "k", timeout=2) == CallOutcome(401)
    assert not svc.calls_for(sid)[0].authorized
    assert not svc.is_detached(sid)


def test_scripts_run_in_order_and_the_last_repeats(svc):
    sid = _sid()
    svc.script(sid, "error_503", "rate_limited", "ok")
    with _client(svc) as client:
        codes = [client.call(sid, "BlockReplaced", "k", timeout=2).status_code for _ in range(4)]
    assert codes == [503, 429, 200, 200]


def test_connections_are_reused_across_calls(svc):
    with _client(svc) as client:
        for _ in range(20):
            assert client.call(_sid(), "BlockReplaced", "k", timeout=2).status_code == 200
    assert svc.connections_opened == 1


def test_unknown_reason_gets_400_from_the_service(svc):
    with _client(svc) as client:
        assert client.call(_sid(), "Mystery", "k", timeout=2).status_code == 400


def test_refused_connection_is_a_connection_error():
    svc = SelectionsService().start()
    url = svc.url
    svc.stop()
    client = HttpDetachClient(url, lambda: basic_auth_session("a", "b"))
    assert client.call(_sid(), "BlockReplaced", "k", timeout=1) == CallOutcome(
        error_class="ConnectionError"
    )
    client.close()


def test_failure_rate_and_known_snapshots():
    known = _sid()
    with (
        SelectionsService(failure_rate=1.0, known_snapshots={known}) as s,
        _client(s) as client,
    ):
        assert client.call(_sid(), "BlockReplaced", "k", timeout=2).status_code == 404
        assert client.call(known, "BlockReplaced", "k", timeout=2).status_code == 503


def test_unknown_behaviour_is_refused(svc):
    with pytest.raises(ValueError, match="unknown behaviour"):
        svc.script(_sid(), "explode")


def test_runs_as_a_module_and_prints_its_url():
    proc = subprocess.Popen(
        [sys.executable, "-m", "devtools.selections_service", "--port", "0", "--latency-ms", "1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("selections service listening on http://127.0.0.1:")
        url = line.split()[-1]
        answer = requests.post(
            f"{url}/internal/snapshots/{_sid()}/detach",
            json={"reason": "BlockReplaced"},
            auth=(DEFAULT_LOGIN, DEFAULT_PASSWORD),
            timeout=5,
        )
        assert answer.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
    assert proc.returncode == 0


class _BasicAuthObject(requests.auth.AuthBase):
    """An auth object the urllib3 pool cannot copy: the session's own requests path sends."""

    def __call__(self, request):
        return requests.auth.HTTPBasicAuth(DEFAULT_LOGIN, DEFAULT_PASSWORD)(request)


def test_a_session_the_pool_cannot_copy_sends_through_requests(svc):
    def session():
        s = basic_auth_session(None, None)
        s.auth = _BasicAuthObject()
        return s

    sid = _sid()
    svc.script(sid, "rate_limited")
    with HttpDetachClient(svc.url, session) as client:
        assert client._pool is None
        assert client.call(sid, "BlockReplaced", "k", timeout=2) == CallOutcome(
            429, retry_after_seconds=42
        )
        assert client.call(_sid(), "BlockReplaced", "k", timeout=2) == CallOutcome(200)
    assert svc.calls_for(sid)[0].authorized
