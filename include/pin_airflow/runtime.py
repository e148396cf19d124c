"""Task-time adapters: build a job's connection factory, config and telemetry from the context."""

from __future__ import annotations

import gc
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

from airflow.sdk.exceptions import AirflowFailException
from opentelemetry import trace
from opentelemetry.trace import Tracer

from include.pin_maintenance import privileges, server_version
from include.pin_maintenance.config import C, ConfigError, ConfigSpec, JobConfig, Rule
from include.pin_maintenance.db import Connect, SessionSettings, configured
from include.pin_maintenance.telemetry import JobLog, Telemetry

log = logging.getLogger(__name__)


def postgres_connect(conn_id: str, settings: SessionSettings) -> Connect:
    """Connections from ``PostgresHook`` (psycopg 3), each with the job's session guards."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    hook = PostgresHook(postgres_conn_id=conn_id)
    return configured(hook.get_conn, settings)


def read_variable_json(key: str) -> str | None:
    """The raw text of Variable ``key`` or None when it does not exist."""
    from airflow.sdk import Variable

    return Variable.get(key, default=None)


class InvalidConfig(ConfigError, AirflowFailException):
    """A bad config value fails the task at once: an Airflow retry cannot fix it (while
    infrastructure failures keep their retry). Still a ConfigError for callers and tests."""


# A job's worst-case run length with a resolved config, in seconds (e.g.
# slot_expiration_config.worst_case_run_seconds).
RunSeconds = Callable[[Any], float]
# The key that sets how long a run goes on, in every job.
RUN_KEY = "max_run_duration_seconds"


def resolve_config(
    spec: ConfigSpec[C],
    context: Mapping[str, Any],
    run_seconds: RunSeconds | Mapping[str, RunSeconds] | None = None,
) -> C:
    """Defaults <- Variable named after the DAG id <- the run's params
    (docs/design.md, "Configuration"), as the job's typed config.

    ``run_seconds`` is the job's worst-case rule for the running task, or one per task id of
    its DAG when the config is resolved for tasks that run later (retention's prepare). A
    ``max_run_duration_seconds`` that needs longer than the task's ``execution_timeout`` is
    refused here: Airflow would kill the run mid-way and retry it into the same wall.

    Raises :class:`InvalidConfig` naming the key, its value and the allowed range.
    """
    params = context.get("params")
    try:
        return spec.resolve(
            read_variable_json(spec.job),
            params_for_spec(spec, params),
            rules=timeout_rules(context, run_seconds),
        )
    except ConfigError as exc:
        raise refuse(exc) from None


def timeout_rules(
    context: Mapping[str, Any], run_seconds: RunSeconds | Mapping[str, RunSeconds] | None
) -> tuple[Rule, ...]:
    """One :func:`timeout_rule` per task that has an ``execution_timeout``."""
    if run_seconds is None:
        return ()
    ti = context["ti"]
    by_task = run_seconds if isinstance(run_seconds, Mapping) else {ti.task_id: run_seconds}
    rules = []
    for task_id, seconds in by_task.items():
        task = ti.task if task_id == ti.task_id else ti.task.dag.get_task(task_id)
        if task.execution_timeout is not None:
            timeout = task.execution_timeout.total_seconds()
            rules.append(timeout_rule(task_id, timeout, seconds))
    return tuple(rules)


def timeout_rule(task_id: str, timeout: float, seconds: RunSeconds) -> Rule:
    """``max_run_duration_seconds`` such that ``seconds`` (the job's worst case) fits in
    ``timeout``; the message names both and the largest value that fits."""
    return Rule(
        RUN_KEY,
        lambda v: seconds(v) <= timeout,
        lambda v: _largest_fitting(v, timeout, seconds),
        problem=lambda v: (
            f"needs up to {seconds(v):g} s in task {task_id}, "
            f"more than its execution_timeout of {timeout:g} s"
        ),
    )


def _largest_fitting(config: JobConfig, timeout: float, seconds: RunSeconds) -> str:
    # The rules grow linearly with the key: its share of it plus what the rest of the run needs.
    rest = seconds(replace(config, **{RUN_KEY: 0.0}))
    share = (seconds(config) - rest) / getattr(config, RUN_KEY)
    largest = (timeout - rest) / share if share > 0 else 0.0
    if largest <= 0:
        return f"none until the execution_timeout exceeds {rest:g} s"
    return f"<= {math.floor(largest * 1000) / 1000:g}"


def refuse(exc: ConfigError) -> InvalidConfig:
    """Bad input: one ERROR line that names it, then the exception that fails the task at once.

    Raise the result ``from None``: nothing was written yet, so there is nothing to retry.
    """
    log.error("refused bad input: %s", exc)
    return InvalidConfig(str(exc))


def params_for_spec(spec: ConfigSpec, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The params that belong to config (declared extras such as dry_run are handled apart)."""
    return {k: v for k, v in (params or {}).items() if k not in spec.extra_params}


class MissingPrivileges(privileges.MissingPrivileges, AirflowFailException):
    """A role without a privilege the job needs fails the task at once: a retry 30 s later
    would only fail again and alert again. Still the job package's MissingPrivileges."""


class UnsupportedServer(server_version.UnsupportedServer, AirflowFailException):
    """A PostgreSQL older than the jobs support fails the task at once, like a missing grant."""


def refuse_run(exc: Exception) -> BaseException:
    """``Telemetry.refuse``: a run refused for its configuration fails without a retry."""
    if isinstance(exc, privileges.MissingPrivileges):
        return MissingPrivileges(exc.job, exc.role, exc.missing)
    if isinstance(exc, server_version.UnsupportedServer):
        return UnsupportedServer(exc.job, exc.server_version)
    return exc


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Around a task's job run: the objects alive when it starts stay out of the garbage
    collector's scans until it ends (:class:`_HeapFreeze`)."""
    with _heap_freeze.held():
        yield


class _HeapFreeze:
    """``gc.freeze`` of the heap a run starts with, until the last run in the process ends (as
    Airflow does around a fork).

    In a task process that heap is Airflow's (about 700k objects): each full collection
    walked it with the GIL held, 0.5-1 s in which no thread of the run could move. A heap the
    process had frozen already stays frozen.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs = 0
        self._thaw = False

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._runs == 0:
                self._thaw = gc.get_freeze_count() == 0
                gc.freeze()
            self._runs += 1
        try:
            yield
        finally:
            with self._lock:
                self._runs -= 1
                if self._runs == 0 and self._thaw:
                    gc.unfreeze()


_heap_freeze = _HeapFreeze()


class StatsMetrics:
    """Metrics through Airflow's stats client: StatsD or OpenTelemetry per ``[metrics]``."""

    def __init__(self) -> None:
        from airflow.sdk.observability import stats

        self._stats = stats

    def incr(self, name: str, count: int = 1) -> None:
        self._stats.incr(name, count)

    def gauge(self, name: str, value: float) -> None:
        self._stats.gauge(name, value)

    def timing(self, name: str, value: timedelta) -> None:
        self._stats.timing(name, value)


def telemetry_for(job: str, context: Mapping[str, Any]) -> Telemetry:
    """Telemetry for one task run, correlated by the DAG run id.

    Alerts go through the installed distribution's notifier, the same delivery the deadline
    callback uses on the scheduler side.
    """
    from include.pin_airflow.scheduler_side import notify

    run_id = str(context.get("run_id") or "manual")
    return Telemetry(
        log=JobLog(job, run_id),
        metrics=StatsMetrics(),
        alerts=notify.Notifier(job, run_id),
        tracer=job_tracer(),
        run_attributes=airflow_span_attributes(context),
        refuse=refuse_run,
    )


TRACER_NAME = "pin_maintenance"


def job_tracer() -> Tracer:
    """The tracer of the provider Airflow configured (``[traces] otel_on``), else a no-op one.

    Airflow sets the global provider when it starts (``airflow.settings`` -> configure_otel);
    this module never configures one. With tracing off the API's proxy provider hands out
    non-recording spans, so nothing is exported.
    """
    return trace.get_tracer(TRACER_NAME)


def airflow_span_attributes(context: Mapping[str, Any]) -> dict[str, str | int]:
    """The run span's Airflow ids, under the names Airflow's own ``worker.<task_id>`` uses."""
    ti = context.get("ti")
    attributes: dict[str, str | int] = {}
    for key, value in (
        ("airflow.dag_id", getattr(ti, "dag_id", None)),
        ("airflow.dag_run.run_id", context.get("run_id")),
        ("airflow.task_id", getattr(ti, "task_id", None)),
        ("airflow.task_instance.try_number", getattr(ti, "try_number", None)),
    ):
        if isinstance(value, str | int) and not isinstance(value, bool):
            attributes[key] = value
    return attributes
