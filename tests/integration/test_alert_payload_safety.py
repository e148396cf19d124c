"""Alert payloads carry an error class and code, never an exception's text.

Real failures on the suite's real Postgres, delivered by the real notifier
(``pin_maintenance_plugin.notify.Notifier``) to a loopback webhook and a loopback Alertmanager
endpoint (``POST /api/v2/alerts``), with the log line it writes captured:

- a trigger that ``RAISE``s with a recognisable secret and a row value (an action event's id,
  which is in no alert's details), under retention (``retention_batch_failed``, then the
  task's ``task_failed``) and under slot expiration (``slot_expiration_poison_row``);
- connection failures that name a host and a user (``task_failed`` of the task they fail).

Neither string reaches the webhook, Alertmanager or the ``PIN_ALERT`` log line, while the
details an operator needs (batch ids, slot id, SQLSTATE) do. A real Alertmanager receiving the
same alerts: tests/e2e/test_alert_chain.py.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from devtools.retention_data import insert_event, insert_session
from include.pin_airflow.alerts import on_task_failed
from include.pin_maintenance.jobs import activity_retention, slot_expiration
from include.pin_maintenance.jobs.activity_retention_walk import BatchFailed
from include.pin_maintenance.stopping import StopSignal
from include.pin_maintenance.telemetry import Telemetry
from pin_maintenance_plugin.notify import Notifier
from tests.e2e.loopback import RecordingWebhook
from tests.integration.slot_expiration_fixtures import insert_slot
from tests.job_db import job_connect, job_telemetry

pytestmark = pytest.mark.integration

SECRET = "raise-secret-9b7a31"
LEAKY_USER = "leaky_user_5e2c"
LEAKY_HOST = "leaky-host-7f3d.invalid"


class Sinks:
    """The webhook, the Alertmanager endpoint and the notifier's log lines of one test."""

    def __init__(self, hook: RecordingWebhook, manager: RecordingWebhook) -> None:
        self.hook, self.manager = hook, manager
        self.lines: list[str] = []

    def text(self) -> str:
        return json.dumps([self.hook.received, self.manager.received]) + "\n".join(self.lines)

    def alert_lines(self) -> list[str]:
        return [line for line in self.lines if "PIN_ALERT" in line]


class _Capture(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


@pytest.fixture
def sinks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sinks]:
    with RecordingWebhook() as hook, RecordingWebhook() as manager:
        monkeypatch.setenv(
            "AIRFLOW_CONN_ALERTS_WEBHOOK", json.dumps({"conn_type": "http", "host": hook.url})
        )
        monkeypatch.setenv(
            "AIRFLOW_CONN_ALERTMANAGER",
            json.dumps({"conn_type": "http", "host": manager.url.removesuffix("/alerts")}),
        )
        found = Sinks(hook, manager)
        handler = _Capture(found.lines)
        logger = logging.getLogger("pin_maintenance.alerts")
        logger.addHandler(handler)
        try:
            yield found
        finally:
            logger.removeHandler(handler)


def telemetry(job: str, run_id: str) -> Telemetry:
    """The job's telemetry with the real notifier (the one Airflow's glue gives it)."""
    return job_telemetry(job, run_id, alerts=Notifier(job, run_id))


def failed_context(dag_id: str, task_id: str, exc: BaseException) -> dict:
    ti = SimpleNamespace(
        dag_id=dag_id, run_id="scheduled__x", task_id=task_id, try_number=2, max_tries=1
    )
    return {"ti": ti, "run_id": ti.run_id, "exception": exc}


def _raise_trigger(conn: psycopg.Connection, table: str, row_value: str) -> None:
    conn.execute(
        f"""
        create function public.leak_on_write() returns trigger language plpgsql as $$
        begin raise exception 'refused row % with password={SECRET}', old.{row_value}; end $$;
        create trigger leak_on_write before update or delete on {table}
          for each row execute function public.leak_on_write();
        """
    )


def test_a_trigger_raise_reaches_no_alert_of_retention(db, sinks: Sinks) -> None:
    with db.connect() as conn:
        old = datetime.now(UTC) - timedelta(days=800)
        sid = insert_session(conn, ended_at=old)
        event_id = insert_event(conn, sid, occurred_at=old)
        _raise_trigger(conn, "user_activity.action_events", "id")
    connect = job_connect(db, activity_retention.JOB)
    config = activity_retention.CONFIG.resolve(None, None)
    tel = telemetry(activity_retention.JOB, "scheduled__x")
    with pytest.raises(BatchFailed) as failed:
        activity_retention.run(connect, config, tel, StopSignal())
    assert SECRET in str(failed.value.__cause__)  # the real error does carry both strings
    assert str(event_id) in str(failed.value.__cause__)
    on_task_failed(failed_context("user_activity_retention", "delete_action_events", failed.value))

    assert [a["alert"] for a in sinks.hook.received] == ["retention_batch_failed", "task_failed"]
    assert [a[0]["labels"]["alertname"] for a in sinks.manager.received] == [
        "retention_batch_failed",
        "task_failed",
    ]
    assert len(sinks.alert_lines()) == 2
    batch, task = sinks.hook.received
    assert batch["details"]["error"] == "RaiseException P0001"
    assert batch["details"]["batch_ids"]["first"] == str(sid)  # the details stay
    assert task["details"]["error"] == "BatchFailed P0001"
    assert task["details"]["event"] == "retention_batch_failed"  # inhibited by the batch alert
    assert SECRET not in sinks.text()
    assert str(event_id) not in sinks.text()


def test_a_trigger_raise_reaches_no_poison_slot_alert(db, sinks: Sinks) -> None:
    with db.connect() as conn:
        poison = insert_slot(conn, start_at=datetime.now(UTC) - timedelta(hours=2))
        tenant = conn.execute(
            "select tenant_id from calendar.availability_slots where id = %s", (poison,)
        ).fetchone()[0]
        _raise_trigger(conn, "calendar.availability_slots", "tenant_id")
    connect = job_connect(db, slot_expiration.JOB)
    config = slot_expiration.CONFIG.resolve(None)
    result = slot_expiration.run(
        connect, config, telemetry(slot_expiration.JOB, "scheduled__x"), StopSignal()
    )
    assert [p.slot_id for p in result.poison] == [str(poison)]
    assert SECRET in result.poison[0].error  # the log line keeps the server's message

    [alert] = sinks.hook.received
    assert alert["alert"] == "slot_expiration_poison_row"
    assert alert["details"] == {"slot_id": str(poison), "error": "RaiseException P0001"}
    assert len(sinks.manager.received) == 1 and len(sinks.alert_lines()) == 1
    assert SECRET not in sinks.text()
    assert str(tenant) not in sinks.text()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connection_error(conninfo: str) -> psycopg.OperationalError:
    with pytest.raises(psycopg.OperationalError) as failed:
        psycopg.connect(conninfo, connect_timeout=5)
    return failed.value


def test_a_connection_failure_naming_host_and_user_reaches_no_alert(db, sinks: Sinks) -> None:
    # the suite's real server refuses a role it does not know: the message names the user
    params = conninfo_to_dict(db.url)
    params["user"] = LEAKY_USER
    no_role = _connection_error(make_conninfo(**params))
    # a host name that cannot resolve (.invalid, RFC 2606): the message names the host
    no_server = _connection_error(
        f"host={LEAKY_HOST} port={_closed_port()} user={LEAKY_USER} dbname=x"
    )
    assert LEAKY_USER in str(no_role)
    assert LEAKY_HOST in str(no_server)
    for exc, task_id in ((no_role, "expire_slots"), (no_server, "detach")):
        on_task_failed(failed_context("calendar_slot_expiration", task_id, exc))

    assert [a["details"]["error"] for a in sinks.hook.received] == [
        f"OperationalError {no_role.sqlstate}" if no_role.sqlstate else "OperationalError",
        "OperationalError",
    ]
    assert len(sinks.manager.received) == 2 and len(sinks.alert_lines()) == 2
    assert LEAKY_USER not in sinks.text()
    assert LEAKY_HOST not in sinks.text()
