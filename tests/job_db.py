"""How a test runs a job: through the job's own connection role, with the job's telemetry.

Every test that runs a job in-process connects through :func:`job_connect` (the role the grant
script ``include/sql/schema/job_roles.sql`` made for the job's connection, with the job's
per-transaction session guards) and reports through :func:`job_telemetry`; CLIs and Airflow
runs take :func:`job_cli` / ``Database.job_urls()``. Set-up and assertions use ``db.url`` (the
owner). So a job that needs a privilege the script does not grant fails its tests.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg
from opentelemetry.trace import Tracer

from devtools.pg import Database
from include.pin_maintenance.db import Connect, SessionSettings, configured
from include.pin_maintenance.telemetry import (
    AlertSink,
    JobLog,
    LogOnlyAlerts,
    MetricsSink,
    RecordingMetrics,
    Telemetry,
)

# Each job's Airflow connection (the DAG files' conn ids), so its role.
JOB_CONN_IDS = {
    "news_snapshot_detach_retry": "news_db",
    "news_snapshot_detach_requeue": "news_db",
    "calendar_slot_expiration": "calendar_db",
    "user_activity_retention": "user_activity_db",
}


def conn_id_of(job: str) -> str:
    try:
        return JOB_CONN_IDS[job]
    except KeyError:
        raise LookupError(f"no job {job!r}; expected one of {sorted(JOB_CONN_IDS)}") from None


def session_settings(job: str) -> SessionSettings:
    """The guards the job's DAG opens its connections with."""
    from include.pin_maintenance.jobs import activity_retention, slot_expiration

    if job == activity_retention.JOB:
        return activity_retention.SESSION_SETTINGS
    if job == slot_expiration.JOB:
        return slot_expiration.SESSION
    conn_id_of(job)
    return SessionSettings(application_name=job)


def job_url(db: Database, job: str) -> str:
    """``db`` as ``job``'s connection role logs in to it."""
    return db.job_url(conn_id_of(job))


def job_connect(
    db: Database,
    job: str,
    settings: SessionSettings | None = None,
    *,
    url: str | None = None,
    connect: Callable[[], psycopg.Connection] | None = None,
) -> Connect:
    """The job's connection factory, as its DAG builds it: ``job``'s role on ``db`` (or
    ``url``, e.g. the same role through a pooler; or a raw ``connect`` of the test's own) with
    the job's session guards (or ``settings``)."""
    target = url or job_url(db, job)
    raw = connect or (lambda: psycopg.connect(target))
    return configured(raw, settings or session_settings(job))


def job_cli(db: Database, job: str) -> tuple[str, dict[str, str]]:
    """A job CLI's ``--db-url`` as ``job``'s role (no password in it) and the environment that
    gives the password (``PGPASSWORD``)."""
    return db.job_cli(conn_id_of(job))


def job_telemetry(
    job: str,
    run_id: str = "test",
    *,
    metrics: MetricsSink | None = None,
    alerts: AlertSink | None = None,
    tracer: Tracer | None = None,
) -> Telemetry:
    """The job's telemetry outside Airflow: its log, metrics kept in memory (or ``metrics``),
    alerts as log lines kept for inspection (or ``alerts``), spans to ``tracer``."""
    log = JobLog(job, run_id)
    telemetry = Telemetry.local(log, metrics or RecordingMetrics(), tracer)
    if alerts is not None:
        telemetry.alerts = alerts
    return telemetry


def sent_alerts(telemetry: Telemetry) -> list:
    """The alerts a :func:`job_telemetry` kept (its default sink)."""
    assert isinstance(telemetry.alerts, LogOnlyAlerts), type(telemetry.alerts)
    return telemetry.alerts.sent
