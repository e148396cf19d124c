"""Deadline alerts (Airflow 3's SLA): a run that is not finished in time raises ``deadline_missed``.

Usage (the bundle's ``include.pin_airflow.deadlines`` adds each DAG's default)::

    from pin_maintenance_plugin.deadlines import deadline_alert

    @dag(..., deadline=deadline_alert("news_snapshot_detach_retry", default_seconds=600))

The deadline is ``DagRun.queued_at + interval``. The interval is the Airflow Variable
``<dag_id>_deadline_seconds`` (whole seconds) when it exists and is a positive number, else the
default below (docs/design.md, "Deadlines"). Nothing is read when the DAG file is parsed.

Why not ``DeadlineAlert(interval=VariableInterval(...))`` (read from Airflow 3.3.2's source,
``airflow/serialization/definitions/dag.py`` ``_process_dagrun_deadline_alerts`` and
``airflow/serialization/definitions/deadline.py`` ``SerializedVariableInterval.resolve``):
the Variable is resolved when the DagRun is created and a missing one raises ``ValueError``.
The scheduler then creates no deadline at all (silently) and ``airflow dags test`` fails the
run. ``VariableInterval`` has no default, and the decoder accepts only ``timedelta`` or
``VariableInterval`` as interval (``decode_deadline_alert``), so a custom *interval* type is
impossible. The supported extension point is a custom *deadline reference*: a
``BaseDeadlineReference`` subclass, serialized with its fields plus ``__class_path``, decoded
by the scheduler only if an ``AirflowPlugin`` lists it in ``deadline_references``
(``find_registered_custom_deadline_reference``). :class:`QueuedAtPlusTunableInterval` is such
a reference: it returns ``queued_at + (Variable or default)`` and the alert's own interval is
zero. :mod:`pin_maintenance_plugin.plugin` registers it through this distribution's
``airflow.plugins`` entry point, so the distribution must be installed wherever the scheduler,
dag-processor, API server and triggerer run (the image), not only shipped in the bundle.

The interval is evaluated once, when the run is created; changing the Variable affects the
next runs. Custom references are always created at DagRun creation (``TYPES.DAGRUN`` holds
``SerializedCustomReference``); for a scheduled run that is the moment it is queued.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseDeadlineReference, DeadlineAlert, SyncCallback

from pin_maintenance_plugin.notify import Alert, Notifier, Severity

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

# A late run is slowness, not loss: the liveness rules ("no successful run for N") and the
# task_failed alert carry the critical pages.
DEADLINE_MISSED_SEVERITY: Severity = "warning"


def deadline_variable(dag_id: str) -> str:
    """The Variable that tunes ``dag_id``'s deadline (docs/design.md, "Deadlines")."""
    return f"{dag_id}_deadline_seconds"


def parse_interval_seconds(raw: object, default_seconds: int) -> tuple[int, str]:
    """The interval to use for a Variable value (None = missing), and where it came from.

    A missing, non-numeric or non-positive value falls back to the default (logged by the
    caller): a bad Variable must never mean "no deadline".
    """
    if raw is None:
        return default_seconds, "default"
    try:
        seconds = int(float(str(raw).strip()))
    except (TypeError, ValueError):
        return default_seconds, "default (invalid variable)"
    if seconds <= 0:
        return default_seconds, "default (invalid variable)"
    return seconds, "variable"


@dataclass(eq=False)
class QueuedAtPlusTunableInterval(BaseDeadlineReference):
    """Deadline reference: the run's ``queued_at`` plus the Variable's seconds or the default.

    Evaluated by the scheduler when the DagRun is created (never at parse time). The
    ``BaseDeadlineReference`` equality/hash (on the serialized form) is kept: ``eq=False``.
    Fields have defaults because Airflow requires custom references to be constructible
    without arguments.
    """

    variable: str = ""
    default_seconds: int = 0
    required_kwargs: ClassVar[set[str]] = {"dag_id", "run_id"}

    def serialize_reference(self) -> dict[str, Any]:
        data = super().serialize_reference()
        data.update(variable=self.variable, default_seconds=self.default_seconds)
        return data

    @classmethod
    def deserialize_reference(cls, reference_data: dict[str, Any]) -> QueuedAtPlusTunableInterval:
        return cls(
            variable=str(reference_data["variable"]),
            default_seconds=int(reference_data["default_seconds"]),
        )

    def interval_seconds(self, session: Session | None = None) -> int:
        """Read the Variable now (scheduler side) and fall back to the default."""
        raw = read_variable(self.variable, session)
        seconds, source = parse_interval_seconds(raw, self.default_seconds)
        if source != "variable" and raw is not None:
            log.warning(
                "deadline variable %s=%r is not a positive number of seconds; using default %s",
                self.variable,
                raw,
                self.default_seconds,
            )
        return seconds

    def _evaluate_with(self, *, session: Session, **kwargs: Any) -> datetime | None:
        from airflow.models import DagRun
        from sqlalchemy import select

        queued_at = session.scalar(
            select(DagRun.queued_at).where(
                DagRun.dag_id == kwargs["dag_id"], DagRun.run_id == kwargs["run_id"]
            )
        )
        if queued_at is None:  # same as the builtin DAGRUN_QUEUED_AT: no deadline without it
            return None
        return queued_at + timedelta(seconds=self.interval_seconds(session))


def read_variable(key: str, session: Session | None = None) -> str | None:
    """The Variable's raw value from the secrets backends (env, custom, metadata DB), or None.

    Not ``airflow.models.Variable.get``: that opens a ``provide_session`` session, which is the
    *same* thread-scoped session the scheduler / ``airflow dags trigger`` is creating the DagRun
    in, and closes it on the way out. The run object is then detached and run creation fails
    with ``DetachedInstanceError`` (seen here with ``airflow dags trigger``). The metadata-DB
    backend is therefore asked through the caller's session. A failing backend is skipped, like
    Airflow does; the answer is never cached.
    """
    from airflow.configuration import ensure_secrets_loaded
    from airflow.secrets.metastore import MetastoreBackend

    for backend in ensure_secrets_loaded():
        try:
            if isinstance(backend, MetastoreBackend):
                if session is None:
                    continue
                value = backend.get_variable(key, session=session)
            else:
                value = backend.get_variable(key)
        except Exception:  # a broken backend must not cost us the deadline
            log.warning("deadline variable %s: %s failed", key, type(backend).__name__)
            continue
        if value is not None:
            return value
    return None


def deadline_alert(dag_id: str, default_seconds: int) -> DeadlineAlert:
    """The DAG's deadline: queued_at + Variable ``<dag_id>_deadline_seconds`` or the default.

    No I/O: safe at parse time.
    """
    if default_seconds <= 0:
        raise ValueError(f"default_seconds must be > 0, got {default_seconds}")
    variable = deadline_variable(dag_id)
    return DeadlineAlert(
        reference=QueuedAtPlusTunableInterval(variable=variable, default_seconds=default_seconds),
        interval=timedelta(0),
        callback=SyncCallback(
            on_deadline_missed,
            kwargs={"variable": variable, "default_seconds": default_seconds},
        ),
        name=f"{dag_id} not finished in time",
    )


def deadline_missed_alert(
    context: dict[str, Any], *, variable: str, default_seconds: int
) -> tuple[str, str, Alert]:
    """(dag_id, run_id, alert) for the context Airflow passes to a deadline callback.

    The context is ``{"dag_run": DAGRunResponse as JSON, "deadline": {"id", "deadline_time"}}``
    (``airflow/models/deadline.py`` ``Deadline.handle_miss``).
    """
    dag_run = dict(context.get("dag_run") or {})
    deadline = dict(context.get("deadline") or {})
    dag_id = str(dag_run.get("dag_id") or "unknown")
    run_id = str(dag_run.get("dag_run_id") or dag_run.get("run_id") or "unknown")
    details = {
        "deadline_id": str(deadline.get("id")),
        "deadline_time": str(deadline.get("deadline_time")),
        "queued_at": dag_run.get("queued_at"),
        "start_date": dag_run.get("start_date"),
        "state": dag_run.get("state"),
        "run_type": dag_run.get("run_type"),
        "tune_with_variable": variable,
        "default_seconds": default_seconds,
        "runbook": "docs/runbooks/deadline-missed.md",
    }
    summary = (
        f"{dag_id} run {run_id} is not finished by its deadline {details['deadline_time']} "
        f"(state {details['state']})"
    )
    return dag_id, run_id, Alert("deadline_missed", DEADLINE_MISSED_SEVERITY, summary, details)


# DagRun states that end a run (airflow.utils.state.DagRunState)
FINISHED_STATES = ("success", "failed")


def finished_before_deadline(context: dict[str, Any]) -> bool:
    """Whether the run had already ended when its deadline passed.

    Airflow 3.3.2 prunes a run's deadlines when it succeeds, not when it fails
    (``DagRun.update_state``), so the scheduler still handles a failed run's deadline as missed
    and runs this callback afterwards (apache/airflow#60927; seen here under the scheduler:
    ``task_failed``, then ``deadline_missed``). The context's ``dag_run`` is read when the miss
    is handled, so its state and end date say whether the run was late or had already ended.
    A run that ended after its deadline was late, whatever its outcome, and still alerts.
    """
    dag_run = dict(context.get("dag_run") or {})
    deadline = dict(context.get("deadline") or {})
    if str(dag_run.get("state")) not in FINISHED_STATES:
        return False
    ended = _as_datetime(dag_run.get("end_date"))
    due = _as_datetime(deadline.get("deadline_time"))
    return ended is not None and due is not None and ended <= due


def _as_datetime(value: object) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def on_deadline_missed(
    context: dict[str, Any], variable: str = "", default_seconds: int = 0, **_: Any
) -> None:
    """The deadline callback (a ``SyncCallback``, run by the executor's callback supervisor).

    Silent for a run that had already ended before its deadline: a failed run paged once, as
    ``task_failed``; one event, one page.
    """
    dag_id, run_id, alert = deadline_missed_alert(
        context, variable=variable, default_seconds=default_seconds
    )
    if finished_before_deadline(context):
        log.info(
            "PIN_ALERT_SUPPRESSED alert=deadline_missed dag_id=%s run_id=%s state=%s "
            "reason=run_ended_before_its_deadline",
            dag_id,
            run_id,
            alert.details.get("state"),
        )
        return
    Notifier(dag_id, run_id).send(alert)
