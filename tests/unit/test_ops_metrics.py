"""ops/metrics.yml (the metric contract) and ops/statsd/mapping.yml (StatsD -> Prometheus)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CATALOG = yaml.safe_load((REPO / "ops" / "metrics.yml").read_text())
MAPPING = yaml.safe_load((REPO / "ops" / "statsd" / "mapping.yml").read_text())

# The BRIEF's metric names (the contract the job DAGs emit), by type.
BRIEF = {
    "gauge": {
        "news_snapshot_detach_pending",
        "news_snapshot_detach_oldest_age_seconds",
        "news_snapshot_detach_last_success_timestamp_seconds",
        "news_snapshot_detach_concurrency_limit",
        "calendar_slot_expiration_backlog",
        "calendar_slot_expiration_last_success_timestamp_seconds",
        "activity_retention_eligible_backlog",
        "activity_retention_last_success_timestamp_seconds",
    },
    "counter": {
        "news_snapshot_detach_retried_total",
        "news_snapshot_detach_succeeded_total",
        "news_snapshot_detach_failed_total",
        "news_snapshot_detach_quarantined_total",
        "news_snapshot_detach_lock_contention_total",
        "news_snapshot_detach_breaker_open_total",
        "calendar_slot_expiration_items_total",
        "calendar_slot_expiration_skip_locked_total",
        "calendar_slot_expiration_errors_total",
        "activity_retention_deleted_sessions",
        "activity_retention_deleted_property_object_views",
        "activity_retention_deleted_action_events",
        "activity_retention_batches_processed",
        "activity_retention_lock_contention_total",
        # pacing (docs/design.md, "Pacing"): milliseconds paced, one counter per reason
        "calendar_slot_expiration_paced_replica_lag_milliseconds_total",
        "calendar_slot_expiration_paced_wal_rate_milliseconds_total",
        "activity_retention_paced_replica_lag_milliseconds_total",
        "activity_retention_paced_wal_rate_milliseconds_total",
    },
    "timing": {
        "news_snapshot_detach_lag_seconds",
        "news_snapshot_detach_run_duration_seconds",
        "calendar_slot_expiration_cycle_duration_seconds",
        "activity_retention_run_duration_seconds",
    },
}


def test_catalog_is_the_brief_list() -> None:
    by_type: dict[str, set[str]] = {}
    for name, spec in CATALOG["metrics"].items():
        by_type.setdefault(spec["type"], set()).add(name)
    assert by_type == BRIEF


def test_catalog_names_pass_airflow_stat_name_rules() -> None:
    """Airflow's default handler: <= 250 chars of [A-Za-z0-9_.-/] (prefix included)."""
    from airflow.sdk._shared.observability.metrics.validators import stat_name_default_handler

    for name in CATALOG["metrics"]:
        assert stat_name_default_handler(f"airflow.{name}") == f"airflow.{name}"


def test_catalog_names_are_not_airflow_registry_names() -> None:
    """A registry name with a legacy name would be emitted twice under two names."""
    from airflow.sdk._shared.observability.metrics.metrics_registry import MetricsRegistry

    registry = MetricsRegistry()
    assert [n for n in CATALOG["metrics"] if registry.get(name=n)] == []


def mappings_by_match() -> dict[str, dict]:
    return {m["match"]: m for m in MAPPING["mappings"]}


def test_every_metric_is_mapped_to_its_own_name() -> None:
    mappings = mappings_by_match()
    for name, spec in CATALOG["metrics"].items():
        mapping = mappings.pop(f"airflow.{name}")
        assert mapping["name"] == name
        if spec["type"] == "timing":
            assert mapping["observer_type"] == "histogram"
            buckets = mapping["histogram_options"]["buckets"]
            assert buckets == sorted(buckets) and len(set(buckets)) == len(buckets)
        else:
            assert "observer_type" not in mapping  # counters and gauges keep their type
    # the only other mapping: Airflow's dagrun durations
    assert list(mappings) == ["airflow.dagrun.duration.*.*"]
    assert mappings["airflow.dagrun.duration.*.*"]["name"] in CATALOG["airflow_metrics"]


def test_histogram_buckets_cover_each_jobs_budget() -> None:
    """Buckets at the limits the rules and SLOs use (docs/design.md, "Metrics"; seeds' SLOs)."""
    buckets = {
        m["name"]: m["histogram_options"]["buckets"]
        for m in MAPPING["mappings"]
        if "histogram_options" in m
    }
    assert 600 in buckets["news_snapshot_detach_lag_seconds"]  # SLO p99 <= 600 s
    assert 240 in buckets["news_snapshot_detach_run_duration_seconds"]  # max_run_duration
    assert 30 in buckets["calendar_slot_expiration_cycle_duration_seconds"]  # target < 30 s
    assert {1620, 1800} <= set(buckets["activity_retention_run_duration_seconds"])  # near max


def test_mapping_names_are_valid_prometheus_names() -> None:
    for mapping in MAPPING["mappings"]:
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", mapping["name"]), mapping


def test_every_mapping_carries_the_catalog_help() -> None:
    """statsd_exporter's HELP line otherwise reads "Metric autogenerated by statsd_exporter"."""
    helps = {
        name: spec["help"]
        for section in ("metrics", "airflow_metrics")
        for name, spec in CATALOG[section].items()
    }
    for mapping in MAPPING["mappings"]:
        assert mapping.get("help") == helps[mapping["name"]], mapping["name"]
