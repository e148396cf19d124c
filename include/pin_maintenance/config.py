"""Job configuration: defaults <- Airflow Variable JSON <- trigger params, validated up front.

Pure functions only. A job declares its keys once, as the fields of a frozen dataclass derived
from :class:`JobConfig` (each field a :func:`setting`: its default, allowed range and help; its
annotation, ``int`` or ``float``, is the key's kind), and a :class:`ConfigSpec` that names the
job and adds the rules that relate two keys. :meth:`ConfigSpec.resolve` merges the three layers,
validates them (:class:`Setting`, :class:`Rule`: the one validator) and returns an instance of
that dataclass, or raises :class:`ConfigError` naming the key, the value, where it came from and
what is allowed. Validation happens before a job touches the database, so a bad value never
half-runs a job.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Number = int | float


class ConfigError(ValueError):
    """A config key is unknown, of the wrong type or out of range."""


# A refusal quotes a value so that a person recognizes it, never in full: a pasted 100,000-id
# list or a megabyte string would make one unreadable line of megabytes.
BRIEF_CHARS = 40


def brief(value: Any) -> str:
    """``value`` as a refusal quotes it: its repr when short, else what identifies it.

    A long string is cut to its first :data:`BRIEF_CHARS` characters plus its length; a long
    list or object is given by its size, a huge integer by its digits.
    """
    if isinstance(value, str):
        text = repr(value[:BRIEF_CHARS])
        return text if len(value) <= BRIEF_CHARS else f"{text}... ({len(value)} characters)"
    if isinstance(value, (list, tuple, Mapping)):
        # many items are never repr'd at all: that is what costs the time and the memory
        if len(value) <= BRIEF_CHARS // 4 and len(text := repr(value)) <= BRIEF_CHARS:
            return text
        n = len(value)
        if isinstance(value, Mapping):
            return f"an object of {n} key{'' if n == 1 else 's'}"
        return f"a list of {n} item{'' if n == 1 else 's'}"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        # repr of an int past 4300 digits raises (sys.get_int_max_str_digits)
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= BRIEF_CHARS else f"{text[:BRIEF_CHARS]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Setting:
    """One config key: its default and allowed range (bounds are inclusive unless noted)."""

    name: str
    default: Number
    kind: type = int  # int or float
    minimum: Number | None = None
    maximum: Number | None = None
    exclusive_minimum: bool = False
    help: str = ""

    def allowed(self) -> str:
        kind = "integer" if self.kind is int else "number"
        if self.minimum is not None and self.maximum is not None:
            return f"{kind} {_fmt(self.minimum)}..{_fmt(self.maximum)}"
        if self.minimum is not None:
            op = ">" if self.exclusive_minimum else ">="
            return f"{kind} {op} {_fmt(self.minimum)}"
        return kind

    def check(self, value: Any, source: str) -> Number:
        ok_type = (
            isinstance(value, int) and not isinstance(value, bool)
            if self.kind is int
            else isinstance(value, (int, float)) and not isinstance(value, bool)
        )
        if not ok_type or (isinstance(value, float) and not math.isfinite(value)):
            raise ConfigError(
                f"{self.name} = {brief(value)} ({source}) is not valid; allowed: {self.allowed()}"
            )
        too_low = self.minimum is not None and (
            value <= self.minimum if self.exclusive_minimum else value < self.minimum
        )
        too_high = (self.maximum is not None and value > self.maximum) or (
            self.kind is float and not _fits_float(value)
        )
        if too_low or too_high:
            raise ConfigError(
                f"{self.name} = {brief(value)} ({source}) is out of range; "
                f"allowed: {self.allowed()}"
            )
        return value


# The metadata key under which a config field carries its Setting's range and help.
_SETTING = "pin_maintenance.setting"


def setting(
    default: Number,
    *,
    minimum: Number | None = None,
    maximum: Number | None = None,
    exclusive_minimum: bool = False,
    help: str = "",
) -> Any:
    """A config key, as a field of a :class:`JobConfig` dataclass: its default, range and help.

    The key's name is the field's name, its kind (int or float) the field's annotation. A
    float key's default may be written as an int (``2``: what the README's table shows); the
    config holds it as a float.
    """
    bounds = {
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "help": help,
    }
    return field(default=default, metadata={_SETTING: bounds})


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Base of a job's resolved config: a frozen dataclass whose fields are its keys.

    A subclass (``@dataclass(frozen=True, kw_only=True)``) declares each key once with
    :func:`setting`; :func:`settings_of` derives the :class:`Setting` each key is validated by.
    An int given for a float key is held as a float, whoever builds the instance.
    """

    def __post_init__(self) -> None:
        for s in settings_of(type(self)):
            value = getattr(self, s.name)
            if s.kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, s.name, float(value))


C = TypeVar("C", bound=JobConfig)


@functools.cache
def settings_of(config_class: type[JobConfig]) -> tuple[Setting, ...]:
    """The :class:`Setting` of every field of ``config_class``: the keys the class declares
    itself first, in the order written, then the ones it inherits (the shared pacing keys)."""
    if not dataclasses.is_dataclass(config_class) or not config_class.__dataclass_params__.frozen:
        raise TypeError(f"{config_class.__name__} must be a frozen dataclass")
    kinds = typing.get_type_hints(config_class)
    by_name = {f.name: f for f in dataclasses.fields(config_class)}
    names: dict[str, None] = {}
    for klass in config_class.__mro__:
        names.update(dict.fromkeys(n for n in inspect.get_annotations(klass) if n in by_name))
    settings = []
    for name in names:
        f, kind = by_name[name], kinds[name]
        if _SETTING not in f.metadata or kind not in (int, float):
            raise TypeError(
                f"{config_class.__name__}.{name} must be declared as "
                f"`{name}: int = setting(...)` or `{name}: float = setting(...)`"
            )
        settings.append(Setting(name, f.default, kind=kind, **f.metadata[_SETTING]))
    return tuple(settings)


@dataclass(frozen=True)
class Rule:
    """A constraint between keys, e.g. ``lock_ttl_seconds > max_run_duration_seconds``.

    Each callable gets the resolved config (a :class:`JobConfig`, fields typed). ``allowed``
    renders the allowed range from it, for the error message; ``problem`` says what is wrong
    with the value when "is out of range" says too little.
    """

    key: str
    holds: Callable[[Any], bool]
    allowed: Callable[[Any], str]
    problem: Callable[[Any], str] | None = None


@dataclass(frozen=True)
class ConfigSpec(Generic[C]):
    """The config of one job (named after its DAG id): its typed keys, the rules between them
    and the per-run extras it accepts."""

    job: str
    config_class: type[C]
    rules: tuple[Rule, ...] = ()
    # Per-run params that are not config keys (e.g. dry_run); they pass through unvalidated here.
    extra_params: frozenset[str] = field(default_factory=frozenset)

    @property
    def settings(self) -> tuple[Setting, ...]:
        return settings_of(self.config_class)

    @property
    def defaults(self) -> C:
        """The config when nothing overrides a default."""
        return self.config_class()

    def resolve(
        self,
        variable: str | Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        *,
        variable_source: str | None = None,
        rules: Sequence[Rule] = (),
    ) -> C:
        """Merge defaults, the Variable (JSON text or mapping) and params; validate everything.

        A param whose value is ``None`` means "not given" (the DAG declares its params with a
        ``None`` default so that the Variable can still override the code default).
        ``variable_source`` names where the JSON came from when it is not the Airflow Variable
        (a CLI's ``--config``), so that an error points at what the user typed. ``rules`` are
        checked after the spec's own, for a limit the caller knows (a task's timeout).
        """
        where = variable_source or f"Variable {self.job}"
        by_name = {s.name: s for s in self.settings}
        # the values as given (a refusal quotes them so), then typed in the config class
        given: dict[str, Any] = {s.name: s.default for s in self.settings}
        sources = {name: "default" for name in given}

        for layer, source in (
            (self._parse_variable(variable, where), f"from {where}"),
            (params or {}, "from trigger params"),
        ):
            for key, value in layer.items():
                if key in self.extra_params and source == "from trigger params":
                    continue
                if key not in by_name:
                    raise ConfigError(
                        f"{self.job}: unknown config key {brief(key)} = {brief(value)} ({source}); "
                        f"allowed keys: {', '.join(sorted(by_name))}"
                    )
                if value is None and source == "from trigger params":
                    continue
                try:
                    given[key] = by_name[key].check(value, source)
                except ConfigError as exc:
                    raise ConfigError(f"{self.job}: {exc}") from None
                sources[key] = source

        config = self.config_class(**given)
        for rule in (*self.rules, *rules):
            if not rule.holds(config):
                problem = rule.problem(config) if rule.problem else "is out of range"
                raise ConfigError(
                    f"{self.job}: {rule.key} = {brief(given[rule.key])} ({sources[rule.key]}) "
                    f"{problem}; allowed: {rule.allowed(config)}"
                )
        return config

    def _parse_variable(
        self, variable: str | Mapping[str, Any] | None, where: str
    ) -> Mapping[str, Any]:
        if variable is None or variable == "":
            return {}
        if isinstance(variable, Mapping):
            return variable
        try:
            parsed = json.loads(variable)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{self.job}: {where} is not valid JSON ({exc.msg} at position "
                f'{exc.pos}); expected a JSON object such as {{"batch_size": 100}}'
            ) from exc
        except ValueError:  # a number of more than 4300 digits (sys.get_int_max_str_digits)
            raise ConfigError(
                f"{self.job}: {where} holds a number too long to read "
                f"({len(variable)} characters in all); expected numbers such as 100"
            ) from None
        if not isinstance(parsed, dict):
            raise ConfigError(
                f"{self.job}: {where} = {brief(variable)} must be a JSON object of "
                f"config keys, got {type(parsed).__name__}"
            )
        return parsed


def _fits_float(value: Number) -> bool:
    try:
        float(value)
    except OverflowError:  # an int past 1.8e308
        return False
    return True


def _fmt(value: Number) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
