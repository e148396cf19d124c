"""ActivityRetentionJob pure parts: config contract, XCom round trips, the report (no DB)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import UTC, datetime

import pytest

from include.pin_maintenance import sql
from include.pin_maintenance.config import ConfigError
from include.pin_maintenance.jobs import activity_retention as job
from include.pin_maintenance.jobs.activity_retention_config import STOP_GRACE_SECONDS
from include.pin_maintenance.jobs.activity_retention_walk import _SQL, KEY_START, _sample_ids
from include.pin_maintenance.stopping import StopReason
from tests.job_db import job_telemetry


def test_config_keys_and_defaults_are_the_design_contract():
    assert job.CONFIG.job == "user_activity_retention"
    assert dataclasses.asdict(job.CONFIG.resolve(None, None)) == {
        "retention_period_days": 365,
        "batch_size": 5000,
        "runners": 3,
        "max_batches_per_run": 200,
        "max_run_duration_seconds": 1800,
        "max_replica_lag_seconds": 2,
        "max_wal_mb_per_second": 4,
    }
    assert job.CONFIG.extra_params == frozenset({"dry_run"})


@pytest.mark.parametrize(
    ("variable", "params", "key", "allowed"),
    [
        ({"retention_period_days": 0}, None, "retention_period_days", ">= 1"),
        ({"retention_period_days": 1.5}, None, "retention_period_days", ">= 1"),
        (None, {"batch_size": 0}, "batch_size", "1..50000"),
        (None, {"batch_size": 50_001}, "batch_size", "1..50000"),
        ({"batch_size": True}, None, "batch_size", "1..50000"),
        (None, {"max_batches_per_run": 0}, "max_batches_per_run", ">= 1"),
        (None, {"runners": 0}, "runners", "1..8"),
        ({"runners": 9}, None, "runners", "1..8"),
        ({"max_run_duration_seconds": 0}, None, "max_run_duration_seconds", "> 0"),
        (None, {"max_run_duration_seconds": -5}, "max_run_duration_seconds", "> 0"),
        ({"max_run_duration_seconds": "30m"}, None, "max_run_duration_seconds", "> 0"),
        ({"retention_period": 30}, None, "retention_period", "allowed keys"),
    ],
)
def test_invalid_config_names_key_value_and_range(variable, params, key, allowed):
    with pytest.raises(ConfigError) as caught:
        job.CONFIG.resolve(json.dumps(variable) if variable else None, params)
    message = str(caught.value)
    assert key in message
    assert allowed in message


def test_edges_of_the_ranges_are_valid():
    config = job.CONFIG.resolve(
        {"retention_period_days": 1, "batch_size": 50_000},
        {"max_batches_per_run": 1, "max_run_duration_seconds": 0.5, "dry_run": True},
    )
    assert config.batch_size == 50_000
    assert config.max_run_duration_seconds == 0.5


def test_every_query_file_exists():
    for name in [name for pair in _SQL.values() for name in pair]:
        assert sql.load(name)
    for name in ("plan_run", "count_eligible_sessions", "seconds_until"):
        assert sql.load(f"retention/{name}")
    assert "skip locked" in sql.load("retention/claim_session_batch")
    assert "for update" not in sql.load("retention/peek_session_batch")


PLAN = job.RunPlan(
    cutoff=datetime(2025, 11, 30, 0, 0, tzinfo=UTC),
    deadline_at=datetime(2026, 11, 30, 0, 30, tzinfo=UTC),
    started_at_unix=1_000.0,
    eligible_backlog=42,
    config=job.CONFIG.resolve(None, {"runners": 1}),  # else the defaults
)


def test_plan_and_step_survive_a_json_xcom_round_trip():
    assert job.RunPlan.from_xcom(json.loads(json.dumps(PLAN.to_xcom()))) == PLAN
    wide = dataclasses.replace(
        PLAN, config=job.CONFIG.resolve(None, {"max_wal_mb_per_second": 0.5})
    )
    again = job.RunPlan.from_xcom(json.loads(json.dumps(wide.to_xcom())))
    assert again == wide and type(again.config.max_replica_lag_seconds) is float


def test_the_plan_xcom_is_one_flat_object_of_the_config_keys_and_the_plan():
    data = PLAN.to_xcom()
    assert data == {
        **dataclasses.asdict(PLAN.config),
        "cutoff": "2025-11-30T00:00:00+00:00",
        "deadline_at": "2026-11-30T00:30:00+00:00",
        "started_at_unix": 1_000.0,
        "eligible_backlog": 42,
        "dry_run": False,
    }


def test_a_plan_from_before_the_pacing_keys_gets_their_defaults():
    keys = ("max_replica_lag_seconds", "max_wal_mb_per_second")
    unpaced = dataclasses.replace(PLAN.config, **dict.fromkeys(keys, 0))
    old = dataclasses.replace(PLAN, config=unpaced).to_xcom()
    for key in keys:
        del old[key]
    assert job.RunPlan.from_xcom(old) == PLAN  # PLAN's config has the pacing defaults
    # a plan written with a key this version no longer has (the canary's) still loads
    assert job.RunPlan.from_xcom(PLAN.to_xcom() | {"max_neighbour_slowdown": 2}) == PLAN
    step = job.StepResult("sessions", rows=3, batches=1, stop_reason="max_batches")
    assert job.StepResult.from_xcom(json.loads(json.dumps(step.to_xcom()))) == step


@pytest.mark.parametrize(
    ("stop_reason", "lock_skipped", "has_more"),
    [
        (StopReason.DRAINED, False, False),
        (StopReason.MAX_BATCHES, False, True),
        (StopReason.MAX_DURATION, False, True),
        (StopReason.DRAINED, True, True),
    ],
)
def test_step_has_more_when_a_bound_or_the_lock_ended_it(stop_reason, lock_skipped, has_more):
    step = job.StepResult("action_events", stop_reason=stop_reason.value, lock_skipped=lock_skipped)
    assert step.has_more is has_more


def test_report_sums_the_steps_into_the_seed_result_and_emits_run_metrics():
    tel = job_telemetry(job.JOB, "unit")
    steps = [
        job.StepResult("action_events", rows=60, batches=3),
        job.StepResult("property_object_views", rows=50, batches=3),
        job.StepResult("sessions", rows=30, batches=3, stop_reason="max_batches"),
    ]

    result = job.report(PLAN, steps, tel, wall_clock=lambda: 1_012.5)

    assert result.as_dict() == {
        "DeletedSessions": 30,
        "DeletedPropertyObjectViews": 50,
        "DeletedActionEvents": 60,
        "BatchesProcessed": 3,  # session batches (the seed's batch: sessions + children)
        "ActionEventBatches": 3,
        "PropertyObjectViewBatches": 3,
        "SessionBatches": 3,
        "HasMore": True,
        "DryRun": False,
        "PacedMs": 0,
    }
    assert tel.metrics.timings["activity_retention_run_duration_seconds"] == [12.5]
    assert tel.metrics.gauges["activity_retention_last_success_timestamp_seconds"] == 1_012.5


def test_delete_step_refuses_an_unknown_table():
    with pytest.raises(ValueError, match="unknown table"):
        job.delete_step(
            lambda: None, PLAN, "property_object_view_stats", job_telemetry(job.JOB, "unit"), None
        )


def test_lock_lease_outlives_a_run_plus_one_batch():
    worst_batch = 2 * job.SESSION_SETTINGS.statement_timeout_ms / 1000
    assert worst_batch < job.LOCK_TTL_MARGIN_SECONDS


@pytest.mark.parametrize(
    ("plan", "loops"),
    [
        ({"runners": 2, "eligible_backlog": 100_000}, 2),
        # three batches: a fourth loop would find nothing
        ({"runners": 4, "eligible_backlog": 12_000}, 3),
        ({"runners": 2, "eligible_backlog": 5000}, 1),  # one full batch
        ({"runners": 2, "eligible_backlog": 0}, 1),  # empty: the one loop finds that out
        # never more loops than batches allowed
        ({"runners": 8, "eligible_backlog": 100_000, "max_batches_per_run": 2}, 2),
        # a dry run only counts: one reader
        ({"runners": 2, "eligible_backlog": 100_000, "dry_run": True}, 1),
        ({"runners": 1, "eligible_backlog": 100_000}, 1),
    ],
)
def test_runner_count_follows_config_backlog_and_bounds(plan, loops):
    assert PLAN.config.batch_size == 5000
    keys = {s.name for s in job.CONFIG.settings}
    config = dataclasses.replace(PLAN.config, **{k: v for k, v in plan.items() if k in keys})
    rest = {k: v for k, v in plan.items() if k not in keys}
    assert job._runner_count(dataclasses.replace(PLAN, config=config, **rest)) == loops


def test_a_plan_from_before_the_runners_key_means_one_loop():
    old = {k: v for k, v in PLAN.to_xcom().items() if k != "runners"}
    assert job.RunPlan.from_xcom(old).config.runners == 1


def test_each_step_stops_at_its_share_of_the_run_and_the_last_at_the_run_deadline():
    deadlines = [job.step_deadline(PLAN, t) for t in job.TABLES]
    assert deadlines == sorted(deadlines)  # children first, each later step after
    assert deadlines[-1] == PLAN.deadline_at
    start = PLAN.deadline_at - job.timedelta(seconds=PLAN.config.max_run_duration_seconds)
    assert deadlines[0] == start + job.timedelta(seconds=360)  # a fifth of 1800 s
    # the views step may take 1.5x what the first step had, the sessions step at least 2.5x
    first = (deadlines[0] - start).total_seconds()
    assert (deadlines[1] - deadlines[0]).total_seconds() == pytest.approx(1.5 * first)
    assert (deadlines[2] - deadlines[1]).total_seconds() == pytest.approx(2.5 * first)


@pytest.mark.parametrize(
    ("step", "covered"),
    [
        # drained: the later steps are not bounded
        (job.StepResult("action_events", stop_reason="drained", last_id=None), None),
        # bounded: the later steps stop at the last key it reached
        (
            job.StepResult(
                "action_events",
                stop_reason="max_duration",
                last_ended_at="2025-01-01T00:00:00+00:00",
                last_id="00000000-0000-0000-0000-000000000007",
            ),
            (datetime(2025, 1, 1, tzinfo=UTC), uuid.UUID(int=7)),
        ),
        # a busy lock: it covered nothing, nor do the later steps
        (job.StepResult("action_events", lock_skipped=True), KEY_START),
    ],
)
def test_a_later_step_covers_what_the_step_before_it_covered(step, covered):
    assert step.covered() == covered


def test_lock_alert_threshold_is_the_lease_not_the_run_budget():
    """A step of a live run holds the lock up to its lease; only a holder past it alerts."""
    assert job.lock_lease_seconds(PLAN) == 1800 + job.LOCK_TTL_MARGIN_SECONDS
    worst_step = PLAN.config.max_run_duration_seconds + STOP_GRACE_SECONDS
    assert worst_step < job.lock_lease_seconds(PLAN)


def test_a_failed_batch_logs_at_most_20_of_its_ids():
    literal = "{" + ",".join(str(uuid.UUID(int=i)) for i in range(5000)) + "}"
    assert _sample_ids(literal) == [str(uuid.UUID(int=i)) for i in range(20)]
    assert _sample_ids("{}") == []
