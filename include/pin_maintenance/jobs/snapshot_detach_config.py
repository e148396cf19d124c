"""The detach retry (seed 000) job: its id and config keys
(docs/design.md, "Configuration").

DAG files import this module at parse time, so it imports nothing heavier than the config
rules themselves (no database driver, no HTTP client).
"""

from __future__ import annotations

from include.pin_maintenance.config import ConfigSpec, Rule, Setting

JOB = "news_snapshot_detach_retry"
# What a run may take past max_run_duration_seconds + detach_call_timeout_seconds:
# the last batch's outcome transaction, the backlog gauges and the alert flush (bounded to
# ALERT_FLUSH_SECONDS of it) on a healthy database. docs/design/detach.md, "Run bound".
RUN_MARGIN_SECONDS = 5.0


def worst_case_run_seconds(values: dict) -> float:
    """The run bound: max_run_duration_seconds + detach_call_timeout_seconds + the margin."""
    return (
        float(values["max_run_duration_seconds"])
        + float(values["detach_call_timeout_seconds"])
        + RUN_MARGIN_SECONDS
    )


CONFIG = ConfigSpec(
    job=JOB,
    settings=(
        Setting("batch_size", 100, minimum=1, maximum=10_000, help="Rows claimed per batch."),
        Setting(
            "max_run_duration_seconds",
            240,
            kind=float,
            minimum=0,
            exclusive_minimum=True,
            help="No new batch starts after this long; the rest waits for the next run.",
        ),
        Setting(
            "max_attempts",
            12,
            minimum=1,
            help="A transient failure on this attempt quarantines the row.",
        ),
        Setting(
            "backoff_base_seconds",
            60,
            kind=float,
            minimum=0,
            exclusive_minimum=True,
            help="Backoff after the first attempt.",
        ),
        Setting("backoff_factor", 2.0, kind=float, minimum=1, help="Backoff growth per attempt."),
        Setting("backoff_cap_seconds", 1800, kind=float, minimum=0, help="Longest backoff."),
        Setting(
            "detach_call_timeout_seconds",
            5,
            kind=float,
            minimum=0,
            exclusive_minimum=True,
            help="Timeout of one detach call.",
        ),
        Setting(
            "lock_ttl_seconds",
            360,
            kind=float,
            minimum=0,
            exclusive_minimum=True,
            help="Lease of the single-runner lock.",
        ),
        Setting(
            "detach_concurrency",
            32,
            minimum=1,
            maximum=64,
            help="Most detach calls in flight at once; the run adapts between "
            "detach_concurrency_min and this (grows on healthy answers, halves on 429/503/"
            "timeouts).",
        ),
        Setting(
            "detach_concurrency_min",
            1,
            minimum=1,
            maximum=64,
            help="Calls in flight when a run starts (half-open) and the least it cuts to.",
        ),
        Setting(
            "breaker_failure_threshold",
            5,
            minimum=1,
            maximum=1000,
            help="Consecutive failed calls (transport error, timeout, 5xx) that stop calling "
            "for the rest of the run; those calls and every row not called cost no attempt.",
        ),
        Setting(
            "misroute_quarantine_limit",
            5,
            minimum=0,
            maximum=1000,
            help="404s a run quarantines before it has seen any 2xx; the next 404 without a "
            "2xx means the selections route looks wrong: calls stop for the run, the rest "
            "cost no attempt, critical alert selections_misrouted.",
        ),
    ),
    rules=(
        Rule(
            "backoff_cap_seconds",
            lambda v: v["backoff_cap_seconds"] >= v["backoff_base_seconds"],
            lambda v: f">= backoff_base_seconds ({v['backoff_base_seconds']})",
        ),
        Rule(
            "detach_concurrency_min",
            lambda v: v["detach_concurrency_min"] <= v["detach_concurrency"],
            lambda v: f"<= detach_concurrency ({v['detach_concurrency']})",
        ),
        Rule(
            "lock_ttl_seconds",
            lambda v: v["lock_ttl_seconds"] > worst_case_run_seconds(v),
            lambda v: (
                f"> the worst-case run, max_run_duration_seconds ({v['max_run_duration_seconds']})"
                f" + detach_call_timeout_seconds ({v['detach_call_timeout_seconds']})"
                f" + {RUN_MARGIN_SECONDS:g} s margin = {worst_case_run_seconds(v):g}"
            ),
        ),
    ),
    extra_params=frozenset({"dry_run"}),
)
