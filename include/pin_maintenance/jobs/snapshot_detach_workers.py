"""The detach calls of one run: on worker threads, through the run's :class:`CallGate`.

:class:`CallWorkers` queues each claimed row's call on a thread pool (one future per row),
makes the call under the gate's limit and breakers, takes its answer from the answer table once
(``snapshot_detach_answers``), gives each row its verdict once its call is in
(:meth:`CallWorkers.decide`), and after the last batch reports what the gate saw: the call
counts, why calls stopped, and that run's alerts (:meth:`CallWorkers.report`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from include.pin_maintenance.jobs.snapshot_detach_answers import (
    Answer,
    CallOutcome,
    Decision,
    answer_of,
    decide,
)
from include.pin_maintenance.jobs.snapshot_detach_client import DETACH_PATH, DetachClient
from include.pin_maintenance.jobs.snapshot_detach_config import DetachConfig
from include.pin_maintenance.jobs.snapshot_detach_gate import Breaker, CallGate
from include.pin_maintenance.jobs.snapshot_detach_outcomes import (
    KNOWN_REASONS,
    ClaimedRow,
    DetachResult,
    Metric,
    OutcomeRecorder,
)
from include.pin_maintenance.parallel import Deadline
from include.pin_maintenance.stopping import StopReason
from include.pin_maintenance.telemetry import Alert, AlertSink, Telemetry, record_error

MISROUTE_ALERT = "selections_misrouted"
OUTAGE_ALERT = "selections_unavailable"


class CallWorkers:
    """The calls of one run; :meth:`close` when the run's pipeline ends, however it ends."""

    def __init__(
        self,
        config: DetachConfig,
        *,
        client: DetachClient | None,
        deadline: Deadline,
        stopped: Callable[[], bool],
        telemetry: Telemetry,
        alerts: AlertSink,
        result: DetachResult,
        outcomes: OutcomeRecorder,
    ) -> None:
        self.config = config
        self.client = client
        self.deadline = deadline
        self.telemetry = telemetry
        self.log = telemetry.log
        self.metrics = telemetry.metrics
        self.alerts = alerts
        self.result = result
        self.outcomes = outcomes
        self.call_seconds = config.detach_call_timeout_seconds
        self._aborted = False  # the run's main thread failed: no new call starts
        self.gate = CallGate(
            config.detach_concurrency_min,
            config.detach_concurrency,
            config.breaker_failure_threshold,
            deadline=deadline,
            call_seconds=self.call_seconds,
            stopped=lambda: stopped() or self._aborted,
            on_open=self._log_outage_breaker_open,
            misroute_limit=config.misroute_quarantine_limit,
        )
        self._pool = ThreadPoolExecutor(
            max_workers=config.detach_concurrency, thread_name_prefix="detach"
        )
        self._count_lock = threading.Lock()
        self._submitted = 0  # calls queued on the workers
        self._taken = 0  # of them, picked up by a worker

    # -- on the run's main thread ----------------------------------------------------------

    def submit(self, rows: list[ClaimedRow], parent: Context) -> dict[str, Future]:
        """Queue the call of each row with a known reason; row id -> its future."""
        calls = [r for r in rows if r.reason in KNOWN_REASONS]
        with self._count_lock:
            self._submitted += len(calls)
        return {r.id: self._pool.submit(self._call, r, parent) for r in calls}

    @property
    def calls_stopped(self) -> bool:
        """No call starts for the rest of the run (``report`` names why)."""
        return self.gate.calls_stopped

    @property
    def deadline_reached(self) -> bool:
        return self.gate.deadline_reached

    @property
    def slots(self) -> int:
        """Calls the gate lets into flight now."""
        return self.gate.slots

    def queued(self) -> int:
        """Calls queued and not yet picked up by a worker."""
        with self._count_lock:
            return self._submitted - self._taken

    def abandon(self, calls: dict[str, Future]) -> None:
        """Past the deadline with calls still running (a client that ignored its timeout):
        record them as timed out; the worker thread is left to finish on its own."""
        for row_id, call in list(calls.items()):
            if call.done():
                continue
            replacement: Future = Future()
            if call.cancel():  # never started: not called, its attempt is given back
                replacement.set_result(None)
            else:
                replacement.set_result(answer_of(CallOutcome(error_class="Timeout")))
                self.log.warning("entry_call_abandoned", outbox_id=row_id)
            calls[row_id] = replacement

    def decide(self, row: ClaimedRow, calls: dict[str, Future]) -> Decision:
        """The verdict of a row that was queued, with what the gate learnt about the run
        (outage, misroute)."""
        answer = calls[row.id].result()
        return decide(
            answer,
            row.attempts,
            self.config.max_attempts,
            outage=answer is not None and self.gate.outage_row(row.id),
            misrouted=answer is not None and self.gate.misroute_row(row.id),
        )

    def abort(self) -> None:
        """The run failed: no new call starts (claimed rows keep their claim)."""
        self._aborted = True

    def close(self) -> None:
        """Wake every waiting worker and drop the calls not started; never waits for one."""
        self.gate.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- one call, on a worker thread ------------------------------------------------------

    def _call(self, row: ClaimedRow, parent: Context | None = None) -> Answer | None:
        """One detach call, or None when no call may start any more.

        The call is a CLIENT span under ``parent`` (its batch's span); the client sends it to
        selections as the W3C ``traceparent``.
        """
        with self._count_lock:
            self._taken += 1
        answer = None
        for attempt in range(2):
            ticket = self.gate.acquire()  # waits for a slot (adaptive limit, Retry-After pause)
            if ticket is None:  # calls stopped, the run stopped, or the deadline reached
                return answer
            answer = self._traced_call(row, parent)
            if not self.gate.release(ticket, row.id, answer) or attempt:
                return answer
            # the connection failed while the service answered others: the job's own overload
            # (a dropped connection attempt) or the connection, not the row; call once more
            self.log.info("entry_call_retried", outbox_id=row.id, error=answer.error_type)
        return answer

    def _traced_call(self, row: ClaimedRow, parent: Context | None) -> Answer:
        attributes = {
            "http.request.method": "POST",
            "url.template": DETACH_PATH,
            "pin.snapshot_id": row.snapshot_id,
            "pin.post_id": row.post_id,
            "pin.attempts": row.attempts,
        }
        with self.telemetry.span(
            "detach snapshot", attributes, kind=SpanKind.CLIENT, context=parent
        ) as span:
            answer = answer_of(self._detach(row))  # the one place a call's outcome is read
            if span.is_recording():
                decision = decide(answer, row.attempts, self.config.max_attempts)
                span.set_attribute("pin.outcome", decision.verdict.value)
                if answer.status_code is not None:
                    span.set_attribute("http.response.status_code", answer.status_code)
                if answer.error_type is not None:
                    record_error(span, answer.error_type)
        return answer

    def _detach(self, row: ClaimedRow) -> CallOutcome:
        assert self.client is not None  # checked in snapshot_detach.run()
        try:
            return self.client.call(
                row.snapshot_id,
                row.reason,
                row.id,
                # a whole call fitted when it started; never wait past the run's deadline
                max(self.deadline.timeout(self.call_seconds), 0.001),
            )
        except Exception as exc:  # a client bug or infrastructure failure: this row only
            self.log.error(
                "entry_call_failed", snapshot_id=row.snapshot_id, error=type(exc).__name__
            )
            return CallOutcome(error_class=f"ClientError:{type(exc).__name__}")

    def _log_outage_breaker_open(self, breaker: Breaker, answer: Answer) -> None:
        """On the worker thread whose call opened the outage breaker (once)."""
        self.log.warning(
            "breaker_open", consecutive_failures=breaker.failures_at_open, error_code=answer.error
        )

    # -- after the last batch --------------------------------------------------------------

    def report(self, pipeline_reason: StopReason | str | None) -> None:
        """After the last batch is recorded: the gate's counts into the result, the run's
        stop reason, and the run's summary alerts."""
        self._take_call_stats()
        self.result.stop_reason = self._stop_reason_of_run(pipeline_reason)
        self._announce_stopped_calls()

    def _take_call_stats(self) -> None:
        """What the gate saw into the result, and the concurrency gauge."""
        gate, stats, r = self.gate, self.gate.stats, self.result
        r.calls = stats.calls
        r.throttled = stats.throttled
        r.retry_after_paused_seconds = stats.paused_seconds
        r.concurrency_limit = gate.slots
        r.concurrency_peak = stats.peak_in_flight
        r.call_stalls = stats.stalls
        r.call_retries = stats.retried
        r.misrouted = gate.is_misrouted
        r.breaker_open = gate.is_open
        if gate.is_open:
            r.breaker_failures = gate.failures_at_open
        self.metrics.gauge(Metric.CONCURRENCY, r.concurrency_limit)

    def _stop_reason_of_run(self, pipeline_reason: StopReason | str | None) -> str:
        """Why calls stopped, if they did (refused credentials first), else why the pipeline
        stopped claiming."""
        gate = self.gate
        if gate.auth_rejected:
            return "auth_failed"
        if gate.is_open:
            return "selections_unavailable"
        if gate.is_misrouted:
            return "selections_misrouted"
        if gate.stopped_by_retry_after:
            return "retry_after"
        return str(pipeline_reason or StopReason.DRAINED)

    def _announce_stopped_calls(self) -> None:
        """The run's summary alerts: the quarantine summary and, once each, why calls stopped
        (a long Retry-After, a misrouting, an outage). Refused credentials alerted already."""
        gate, r = self.gate, self.result
        if gate.stopped_by_retry_after and not gate.is_open:
            self.log.warning("calls_paused_past_run_bound", throttled=r.throttled)
        self.outcomes.summarize_quarantines()
        if gate.is_misrouted:
            self._alert_misrouted()
        if gate.is_open:
            self.metrics.incr(Metric.BREAKER_OPEN)
            self.alerts.send(
                Alert(
                    OUTAGE_ALERT,
                    "warning",
                    f"selections failed {r.breaker_failures} detach calls in a row; calls "
                    f"stopped for this run after {r.calls} call(s), {r.outage_calls} of them "
                    "and every row not called cost no attempt. The next run probes again.",
                    {
                        "consecutive_failures": r.breaker_failures,
                        "calls": r.calls,
                        "outage_calls": r.outage_calls,
                        "given_back": r.given_back,
                    },
                )
            )

    def _alert_misrouted(self) -> None:
        r = self.result
        limit = self.config.misroute_quarantine_limit
        quarantined_404 = self.gate.quarantined_404s
        self.log.error(
            MISROUTE_ALERT,
            quarantined_404=quarantined_404,
            misroute_calls=r.misroute_calls,
            given_back=r.given_back,
        )
        self.alerts.send(
            Alert(
                MISROUTE_ALERT,
                "critical",
                f"selections answered 404 to {quarantined_404 + 1}+ detach calls and 2xx to "
                "none: the selections route looks wrong (base URL, path, ingress). At most "
                f"{limit} row(s) were quarantined; calls stopped for this run and every other "
                "row cost no attempt. Check the selections_api connection.",
                {
                    "quarantined_404": quarantined_404,
                    "misroute_calls": r.misroute_calls,
                    "given_back": r.given_back,
                    "limit": limit,
                },
            )
        )
