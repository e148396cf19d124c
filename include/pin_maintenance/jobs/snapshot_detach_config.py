"""The detach job's id and config keys (docs/design.md, "Configuration"); imported by the DAG
file at parse time, so nothing heavier than the config rules."""

from __future__ import annotations

from dataclasses import dataclass

from include.pin_maintenance.config import ConfigSpec, JobConfig, Rule, setting

JOB = "news_snapshot_detach_retry"
RUN_MARGIN_SECONDS = 5.0  # past the deadline: docs/design/detach.md, "Run bound and margin"


@dataclass(frozen=True, kw_only=True)
class DetachConfig(JobConfig):
    """The job's resolved config (:data:`CONFIG`)."""

    batch_size: int = setting(100, minimum=1, maximum=10_000, help="Rows claimed per batch.")
    max_run_duration_seconds: float = setting(
        240,
        minimum=0,
        exclusive_minimum=True,
        help="No new batch starts after this long; the rest waits for the next run.",
    )
    max_attempts: int = setting(
        12, minimum=1, help="A transient failure on this attempt quarantines the row."
    )
    backoff_base_seconds: float = setting(
        60, minimum=0, exclusive_minimum=True, help="Backoff after the first attempt."
    )
    backoff_factor: float = setting(2.0, minimum=1, help="Backoff growth per attempt.")
    backoff_cap_seconds: float = setting(1800, minimum=0, help="Longest backoff.")
    detach_call_timeout_seconds: float = setting(
        5, minimum=0, exclusive_minimum=True, help="Timeout of one detach call."
    )
    lock_ttl_seconds: float = setting(
        360, minimum=0, exclusive_minimum=True, help="Lease of the single-runner lock."
    )
    detach_concurrency: int = setting(
        32,
        minimum=1,
        maximum=64,
        help="Most detach calls in flight at once; the run adapts between "
        "detach_concurrency_min and this (grows on healthy answers, halves on 429/503/"
        "timeouts).",
    )
    detach_concurrency_min: int = setting(
        1,
        minimum=1,
        maximum=64,
        help="Calls in flight when a run starts (half-open) and the least it cuts to.",
    )
    breaker_failure_threshold: int = setting(
        5,
        minimum=1,
        maximum=1000,
        help="Consecutive failed calls (transport error, timeout, 5xx) that stop calling "
        "for the rest of the run; those calls and every row not called cost no attempt.",
    )
    misroute_quarantine_limit: int = setting(
        5,
        minimum=0,
        maximum=1000,
        help="404s a run quarantines before it has seen any 2xx; the next 404 without a "
        "2xx means the selections route looks wrong: calls stop for the run, the rest "
        "cost no attempt, critical alert selections_misrouted.",
    )


def worst_case_run_seconds(config: DetachConfig) -> float:
    """The run bound: max_run_duration_seconds + detach_call_timeout_seconds + the margin."""
    return config.max_run_duration_seconds + config.detach_call_timeout_seconds + RUN_MARGIN_SECONDS


CONFIG = ConfigSpec(
    job=JOB,
    config_class=DetachConfig,
    rules=(
        Rule(
            "backoff_cap_seconds",
            lambda c: c.backoff_cap_seconds >= c.backoff_base_seconds,
            lambda c: f">= backoff_base_seconds ({c.backoff_base_seconds:g})",
        ),
        Rule(
            "detach_concurrency_min",
            lambda c: c.detach_concurrency_min <= c.detach_concurrency,
            lambda c: f"<= detach_concurrency ({c.detach_concurrency})",
        ),
        Rule(
            "lock_ttl_seconds",
            lambda c: c.lock_ttl_seconds > worst_case_run_seconds(c),
            lambda c: (
                f"> the worst-case run, max_run_duration_seconds ({c.max_run_duration_seconds:g})"
                f" + detach_call_timeout_seconds ({c.detach_call_timeout_seconds:g})"
                f" + {RUN_MARGIN_SECONDS:g} s margin = {worst_case_run_seconds(c):g}"
            ),
        ),
    ),
    extra_params=frozenset({"dry_run"}),
)
