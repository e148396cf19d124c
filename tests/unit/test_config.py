"""Config layering and validation (pure; docs/design.md, "Configuration")."""

from __future__ import annotations

import pytest

from include.pin_maintenance.config import ConfigError, ConfigSpec, Rule, Setting

SPEC = ConfigSpec(
    job="demo_job",
    settings=(
        Setting("batch_size", 100, minimum=1, maximum=10_000),
        Setting("max_run_duration_seconds", 240, kind=float, minimum=0, exclusive_minimum=True),
        Setting("lock_ttl_seconds", 360, kind=float, minimum=0, exclusive_minimum=True),
    ),
    rules=(
        Rule(
            "lock_ttl_seconds",
            lambda v: v["lock_ttl_seconds"] > v["max_run_duration_seconds"],
            lambda v: f"> max_run_duration_seconds ({v['max_run_duration_seconds']})",
        ),
    ),
    extra_params=frozenset({"dry_run"}),
)


def test_defaults_when_nothing_is_given():
    assert SPEC.resolve(None, None) == {
        "batch_size": 100,
        "max_run_duration_seconds": 240,
        "lock_ttl_seconds": 360,
    }


def test_variable_overrides_default_and_params_override_variable():
    values = SPEC.resolve('{"batch_size": 50, "lock_ttl_seconds": 400}', {"batch_size": 7})
    assert values["batch_size"] == 7
    assert values["lock_ttl_seconds"] == 400


def test_none_param_means_not_given():
    assert SPEC.resolve('{"batch_size": 50}', {"batch_size": None})["batch_size"] == 50


def test_extra_params_are_accepted_from_the_trigger_and_left_out_of_the_config():
    """``dry_run`` is a per-run param, not a config key: accepted, and it changes nothing."""
    assert SPEC.resolve(None, {"dry_run": True}) == SPEC.resolve(None, None) == SPEC.defaults
    values = SPEC.resolve('{"batch_size": 50}', {"dry_run": False, "lock_ttl_seconds": 400})
    assert values == {"batch_size": 50, "max_run_duration_seconds": 240, "lock_ttl_seconds": 400}


def test_an_extra_param_in_the_variable_is_an_unknown_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'dry_run' = True \(from Variable"):
        SPEC.resolve('{"dry_run": true}', None)


def test_int_accepted_for_float_key_and_kept_numeric():
    assert SPEC.resolve(None, {"max_run_duration_seconds": 10})["max_run_duration_seconds"] == 10.0


@pytest.mark.parametrize(
    ("variable", "params", "expected"),
    [
        (
            None,
            {"batch_size": 0},
            r"batch_size = 0 \(from trigger params\) is out of range; "
            r"allowed: integer 1\.\.10000",
        ),
        ('{"batch_size": 10001}', None, r"batch_size = 10001 \(from Variable demo_job\)"),
        (None, {"batch_size": "100"}, r"batch_size = '100' .* is not valid; allowed: integer"),
        (None, {"batch_size": True}, r"batch_size = True"),
        (None, {"batch_size": 1.5}, r"batch_size = 1\.5"),
        (
            None,
            {"max_run_duration_seconds": 0},
            r"max_run_duration_seconds = 0 .*allowed: number > 0",
        ),
        ('{"bogus": 1}', None, r"unknown config key 'bogus' = 1 \(from Variable demo_job\)"),
        (None, {"bogus": 1}, r"unknown config key 'bogus'"),
        (
            '{"lock_ttl_seconds": 100}',
            None,
            r"lock_ttl_seconds = 100 \(from Variable demo_job\) is out of range; "
            r"allowed: > max_run_duration_seconds \(240",
        ),
        ("not json", None, r"Variable demo_job is not valid JSON"),
        ("[1, 2]", None, r"must be a JSON object"),
    ],
)
def test_invalid_config_names_key_value_and_range(variable, params, expected):
    with pytest.raises(ConfigError, match=expected):
        SPEC.resolve(variable, params)


def test_error_message_starts_with_job_name():
    with pytest.raises(ConfigError, match=r"^demo_job: "):
        SPEC.resolve(None, {"batch_size": -1})
