"""include.pin_airflow.selections: the detach client built from the selections_api connection.

Outside a running task Airflow finds connections in ``AIRFLOW_CONN_*`` variables (docs/design.md,
"Connections"), which is how these tests give it one.
"""

from __future__ import annotations

import json
import uuid

import pytest

from devtools.selections_service import DEFAULT_LOGIN, DEFAULT_PASSWORD, SelectionsService
from include.pin_maintenance.jobs.snapshot_detach_answers import CallOutcome

pytestmark = pytest.mark.dags


def _conn(monkeypatch, **fields):
    monkeypatch.setenv("AIRFLOW_CONN_SELECTIONS_API", json.dumps({"conn_type": "http", **fields}))


def test_basic_auth_from_the_connection(monkeypatch):
    from include.pin_airflow.selections import selections_detach_client

    with SelectionsService() as svc:
        _conn(monkeypatch, host=svc.url, login=DEFAULT_LOGIN, password=DEFAULT_PASSWORD)
        with selections_detach_client() as client:
            sid = str(uuid.uuid4())
            assert client.call(sid, "PostDeleted", "key-1", 2) == CallOutcome(200)
            assert client.call(str(uuid.uuid4()), "PostDeleted", "key-2", 2) == CallOutcome(200)
        [call] = svc.calls_for(sid)
        assert call.authorized and call.idempotency_key == "key-1"
        assert svc.connections_opened == 1  # one thread, one kept-alive connection


def test_wrong_password_is_401(monkeypatch):
    from include.pin_airflow.selections import selections_detach_client

    with SelectionsService() as svc:
        _conn(monkeypatch, host=svc.url, login=DEFAULT_LOGIN, password="wrong")
        with selections_detach_client() as client:
            assert client.call(str(uuid.uuid4()), "PostDeleted", "k", 2) == CallOutcome(401)


def test_bearer_token_from_the_connection_extra(monkeypatch):
    from include.pin_airflow.selections import selections_detach_client

    _conn(
        monkeypatch,
        host="http://127.0.0.1:9",
        extra=json.dumps({"Authorization": "Bearer tok-123", "timeout": 3}),
    )
    client = selections_detach_client()
    session = client._session()
    assert session.auth is None
    assert session.headers["Authorization"] == "Bearer tok-123"
    assert "timeout" not in session.headers  # transport options are not sent as headers
    client.close()
