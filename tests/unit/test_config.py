"""Config layering and validation (pure; docs/design.md, "Configuration")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from include.pin_maintenance.config import (
    ConfigError,
    ConfigSpec,
    JobConfig,
    Rule,
    Setting,
    brief,
    setting,
    settings_of,
)


@dataclass(frozen=True, kw_only=True)
class DemoConfig(JobConfig):
    batch_size: int = setting(100, minimum=1, maximum=10_000)
    max_run_duration_seconds: float = setting(240, minimum=0, exclusive_minimum=True)
    lock_ttl_seconds: float = setting(360, minimum=0, exclusive_minimum=True)


SPEC = ConfigSpec(
    job="demo_job",
    config_class=DemoConfig,
    rules=(
        Rule(
            "lock_ttl_seconds",
            lambda c: c.lock_ttl_seconds > c.max_run_duration_seconds,
            lambda c: f"> max_run_duration_seconds ({c.max_run_duration_seconds:g})",
        ),
    ),
    extra_params=frozenset({"dry_run"}),
)


def test_defaults_when_nothing_is_given():
    assert dataclasses.asdict(SPEC.resolve(None, None)) == {
        "batch_size": 100,
        "max_run_duration_seconds": 240,
        "lock_ttl_seconds": 360,
    }


def test_variable_overrides_default_and_params_override_variable():
    config = SPEC.resolve('{"batch_size": 50, "lock_ttl_seconds": 400}', {"batch_size": 7})
    assert config.batch_size == 7
    assert config.lock_ttl_seconds == 400


def test_none_param_means_not_given():
    assert SPEC.resolve('{"batch_size": 50}', {"batch_size": None}).batch_size == 50


def test_extra_params_are_accepted_from_the_trigger_and_left_out_of_the_config():
    """``dry_run`` is a per-run param, not a config key: accepted, and it changes nothing."""
    assert SPEC.resolve(None, {"dry_run": True}) == SPEC.resolve(None, None) == SPEC.defaults
    config = SPEC.resolve('{"batch_size": 50}', {"dry_run": False, "lock_ttl_seconds": 400})
    assert config == DemoConfig(batch_size=50, max_run_duration_seconds=240, lock_ttl_seconds=400)
    assert not hasattr(config, "dry_run")


def test_an_extra_param_in_the_variable_is_an_unknown_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'dry_run' = True \(from Variable"):
        SPEC.resolve('{"dry_run": true}', None)


def test_int_accepted_for_float_key_and_kept_numeric():
    assert SPEC.resolve(None, {"max_run_duration_seconds": 10}).max_run_duration_seconds == 10.0


def test_the_resolved_config_is_frozen_and_typed():
    config = SPEC.resolve('{"lock_ttl_seconds": 400}', {"max_run_duration_seconds": 5})
    assert type(config) is DemoConfig
    assert type(config.batch_size) is int
    # a float key holds a float, also when given 5 (and when its default is written 240)
    assert type(config.max_run_duration_seconds) is float and config.max_run_duration_seconds == 5
    assert type(config.lock_ttl_seconds) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 1  # type: ignore[misc]


def test_the_settings_are_derived_from_the_config_class_fields():
    assert settings_of(DemoConfig) == SPEC.settings
    assert SPEC.settings == (
        Setting("batch_size", 100, minimum=1, maximum=10_000),
        Setting("max_run_duration_seconds", 240, kind=float, minimum=0, exclusive_minimum=True),
        Setting("lock_ttl_seconds", 360, kind=float, minimum=0, exclusive_minimum=True),
    )


def test_a_subclass_lists_its_own_keys_before_the_inherited_ones():
    @dataclass(frozen=True, kw_only=True)
    class Wider(DemoConfig):
        runners: int = setting(2, minimum=1)

    names = [s.name for s in settings_of(Wider)]
    assert names == ["runners", "batch_size", "max_run_duration_seconds", "lock_ttl_seconds"]


def test_a_config_class_field_that_is_not_a_setting_is_refused():
    @dataclass(frozen=True, kw_only=True)
    class Plain(JobConfig):
        batch_size: int = 10

    @dataclass(frozen=True, kw_only=True)
    class Text(JobConfig):
        name: str = setting("x")  # type: ignore[arg-type]

    for config_class in (Plain, Text):
        with pytest.raises(TypeError, match="must be declared as"):
            settings_of(config_class)


def test_a_config_class_must_be_a_frozen_dataclass():
    @dataclass
    class Loose:
        batch_size: int = setting(10)

    for config_class in (Loose, type("NotADataclass", (), {})):
        with pytest.raises(TypeError, match="must be a frozen dataclass"):
            settings_of(config_class)


def test_a_float_key_refuses_an_int_too_large_for_a_float():
    huge = r"lock_ttl_seconds = an integer of about 401 digits .*is out of range"
    with pytest.raises(ConfigError, match=huge):
        SPEC.resolve(None, {"lock_ttl_seconds": 10**400})


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


# A refusal is read by a person: at most a few hundred characters, the value cut short.
REFUSAL_CHARS = 400


@pytest.mark.parametrize(
    ("value", "quoted"),
    [
        ("abc", "'abc'"),
        ("x" * 40, repr("x" * 40)),
        ("x" * 100_000, f"{'x' * 40!r}... (100000 characters)"),
        ([1, 2], "[1, 2]"),
        (["0b5c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3"] * 100_000, "a list of 100000 items"),
        (["y" * 100_000], "a list of 1 item"),
        ({f"k{i}": i for i in range(50)}, "an object of 50 keys"),
        (1.5, "1.5"),
        (True, "True"),
        (10**5000, "an integer of about 5001 digits"),
    ],
    ids=[
        "short",
        "40-chars",
        "long-str",
        "list",
        "100k-ids",
        "huge-item",
        "dict",
        "float",
        "bool",
        "huge-int",
    ],
)
def test_brief_quotes_a_short_value_whole_and_a_long_one_by_what_identifies_it(value, quoted):
    assert brief(value) == quoted


@pytest.mark.parametrize(
    ("variable", "params", "named"),
    [
        ('{"batch_size": "' + "9" * 100_000 + '"}', None, "batch_size = '9999"),
        (None, {"batch_size": "9" * 100_000}, "batch_size = '9999"),
        (None, {"batch_size": list(range(100_000))}, "batch_size = a list of 100000 items"),
        ('{"' + "k" * 100_000 + '": 1}', None, "unknown config key 'kkkk"),
        ("[" + ",".join(["1"] * 100_000) + "]", None, "Variable demo_job = '[1,1,1,"),
        ('{"batch_size": 1' + "0" * 5000 + "}", None, "a number too long to read"),
        (None, {"batch_size": 10**5000}, "an integer of about 5001 digits"),
    ],
    ids=[
        "variable-str",
        "param-str",
        "param-list",
        "key",
        "not-an-object",
        "long-number",
        "param-int",
    ],
)
def test_a_huge_value_is_refused_in_a_short_line_naming_key_and_source(variable, params, named):
    with pytest.raises(ConfigError) as err:
        SPEC.resolve(variable, params)
    message = str(err.value)
    assert named in message
    assert len(message) <= REFUSAL_CHARS, len(message)
    assert "\n" not in message
    source = "Variable demo_job" if variable else "trigger params"
    assert source in message
