"""Each job's resolved config is one frozen dataclass with typed fields (docs/design.md,
"Configuration"); the refusals stay those of the one validator (include/pin_maintenance/config.py).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from include.pin_maintenance.config import ConfigError, ConfigSpec, JobConfig
from include.pin_maintenance.jobs import activity_retention_config as retention
from include.pin_maintenance.jobs import slot_expiration_config as slots
from include.pin_maintenance.jobs import snapshot_detach_config as detach
from include.pin_maintenance.jobs import snapshot_requeue as requeue
from include.pin_maintenance.pacing_config import PacingConfig

# (spec, its config class, an int key, a float key whose default is written as an int)
JOBS = [
    (slots.CONFIG, slots.SlotConfig, "batch_size", "max_run_duration_seconds"),
    (detach.CONFIG, detach.DetachConfig, "max_attempts", "backoff_base_seconds"),
    (retention.CONFIG, retention.RetentionConfig, "retention_period_days", "max_wal_mb_per_second"),
]
IDS = [spec.job for spec, *_ in JOBS]


@pytest.mark.parametrize(("spec", "config_class", "int_key", "float_key"), JOBS, ids=IDS)
def test_resolving_returns_the_jobs_frozen_typed_config(spec, config_class, int_key, float_key):
    config = spec.resolve(None, {int_key: 5, float_key: 5})
    assert type(config) is config_class
    assert type(getattr(config, int_key)) is int and getattr(config, int_key) == 5
    assert type(getattr(config, float_key)) is float and getattr(config, float_key) == 5.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, int_key, 6)
    # every field holds its kind, the defaults too
    for setting in spec.settings:
        assert type(getattr(config, setting.name)) is setting.kind, setting.name
        assert type(getattr(spec.defaults, setting.name)) is setting.kind, setting.name


@pytest.mark.parametrize(("spec", "config_class", "int_key", "float_key"), JOBS, ids=IDS)
def test_the_config_class_is_the_one_list_of_keys(spec, config_class, int_key, float_key):
    names = [f.name for f in dataclasses.fields(config_class)]
    assert sorted(names) == sorted(s.name for s in spec.settings)
    assert dataclasses.asdict(spec.defaults) == {s.name: s.default for s in spec.settings}


def test_the_pacing_keys_are_shared_by_the_paced_jobs():
    pacing = {f.name for f in dataclasses.fields(PacingConfig)}
    assert issubclass(slots.SlotConfig, PacingConfig)
    assert issubclass(retention.RetentionConfig, PacingConfig)
    assert not issubclass(detach.DetachConfig, PacingConfig)
    for spec in (slots.CONFIG, retention.CONFIG):
        # after the job's own keys (the trigger form's order)
        assert [s.name for s in spec.settings][-len(pacing) :] == [
            f.name for f in dataclasses.fields(PacingConfig)
        ]


def test_the_requeue_action_has_a_config_without_keys():
    spec: ConfigSpec = requeue.SPEC.config
    assert spec.settings == ()
    config = spec.resolve(None, None)
    assert isinstance(config, JobConfig) and dataclasses.asdict(config) == {}
    with pytest.raises(ConfigError, match=r"unknown config key 'batch_size' = 5 \(from --config\)"):
        spec.resolve('{"batch_size": 5}', None, variable_source="--config")


@pytest.mark.parametrize(("spec", "config_class", "int_key", "float_key"), JOBS, ids=IDS)
def test_an_unknown_key_and_a_bad_value_are_refused_as_before(
    spec, config_class, int_key, float_key
):
    with pytest.raises(ConfigError) as unknown:
        spec.resolve('{"bogus": 1}', None)
    assert str(unknown.value).startswith(
        f"{spec.job}: unknown config key 'bogus' = 1 (from Variable {spec.job}); allowed keys: "
    )
    with pytest.raises(ConfigError, match=re.escape(f"{int_key} = 1.5 (from trigger params)")):
        spec.resolve(None, {int_key: 1.5})
    with pytest.raises(ConfigError, match=re.escape(f"{float_key} = '5' (from trigger params)")):
        spec.resolve(None, {float_key: "5"})
    with pytest.raises(ConfigError, match=re.escape(f"{float_key} = -1 (from trigger params)")):
        spec.resolve(None, {float_key: -1})


def test_contradictory_settings_are_refused_naming_both_values():
    with pytest.raises(ConfigError) as err:
        detach.CONFIG.resolve('{"backoff_base_seconds": 120}', {"backoff_cap_seconds": 90})
    assert str(err.value) == (
        "news_snapshot_detach_retry: backoff_cap_seconds = 90 (from trigger params) is out of "
        "range; allowed: >= backoff_base_seconds (120)"
    )
    with pytest.raises(ConfigError) as err:
        detach.CONFIG.resolve(None, {"max_run_duration_seconds": 400.5})
    assert str(err.value) == (
        "news_snapshot_detach_retry: lock_ttl_seconds = 360 (default) is out of range; "
        "allowed: > the worst-case run, max_run_duration_seconds (400.5) + "
        "detach_call_timeout_seconds (5) + 5 s margin = 410.5"
    )
