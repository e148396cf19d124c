"""Job configuration: defaults <- Airflow Variable JSON <- trigger params, validated before a job
touches the database (docs/design.md, "Configuration"). Pure functions only."""

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
BRIEF_CHARS = 40  # a refusal quotes a value this long at most: never a pasted megabyte


class ConfigError(ValueError):
    """A config key is unknown, of the wrong type or out of range."""


def brief(value: Any) -> str:
    """``value`` as a refusal quotes it: its repr when short, else what identifies it."""
    if isinstance(value, str):
        text = repr(value[:BRIEF_CHARS])
        return text if len(value) <= BRIEF_CHARS else f"{text}... ({len(value)} characters)"
    if isinstance(value, (list, tuple, Mapping)):
        # a long one is never repr'd: that is what costs the time and the memory
        if len(value) <= BRIEF_CHARS // 4 and len(text := repr(value)) <= BRIEF_CHARS:
            return text
        what = "an object of {} key" if isinstance(value, Mapping) else "a list of {} item"
        return what.format(len(value)) + ("" if len(value) == 1 else "s")
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

    def check(self, value: Any, source: str, job: str) -> Number:
        """``value`` if it is of the key's kind and in range, else a :class:`ConfigError`."""
        kinds = int if self.kind is int else (int, float)
        if (
            not isinstance(value, kinds)
            or isinstance(value, bool)
            or (isinstance(value, float) and not math.isfinite(value))
        ):
            problem = "is not valid"
        elif (
            (self.minimum is not None and value < self.minimum)
            or (self.exclusive_minimum and value == self.minimum)
            or (self.maximum is not None and value > self.maximum)
            or (self.kind is float and not _fits_float(value))
        ):
            problem = "is out of range"
        else:
            return value
        raise ConfigError(
            f"{job}: {self.name} = {brief(value)} ({source}) {problem}; allowed: {self.allowed()}"
        )


_SETTING = "pin_maintenance.setting"  # the field metadata key of a setting's range and help


def setting(
    default: Number,
    *,
    minimum: Number | None = None,
    maximum: Number | None = None,
    exclusive_minimum: bool = False,
    help: str = "",
) -> Any:
    """A config key as a field of a :class:`JobConfig`: its name and kind (``int`` or ``float``)
    are the field's; a float key's default may be written as an int."""
    bounds = dict(minimum=minimum, maximum=maximum, exclusive_minimum=exclusive_minimum, help=help)
    return field(default=default, metadata={_SETTING: bounds})


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Base of a job's resolved config: a frozen ``kw_only`` dataclass of :func:`setting` fields.
    An int given for a float key is held as a float, whoever builds the instance."""

    def __post_init__(self) -> None:
        for s in settings_of(type(self)):
            value = getattr(self, s.name)
            if s.kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, s.name, float(value))


C = TypeVar("C", bound=JobConfig)


@functools.cache
def settings_of(config_class: type[JobConfig]) -> tuple[Setting, ...]:
    """The :class:`Setting` of every field: the class's own keys first, then the inherited ones."""
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
    """A constraint between keys, checked on the resolved config: ``allowed`` renders the allowed
    range for the refusal, ``problem`` says what is wrong when "is out of range" says too little."""

    key: str
    holds: Callable[[Any], bool]
    allowed: Callable[[Any], str]
    problem: Callable[[Any], str] | None = None


@dataclass(frozen=True)
class ConfigSpec(Generic[C]):
    """One job's config (named after its DAG id): its keys, the rules between them and the
    per-run params that are not keys (``dry_run``: they pass through unvalidated)."""

    job: str
    config_class: type[C]
    rules: tuple[Rule, ...] = ()
    extra_params: frozenset[str] = field(default_factory=frozenset)

    @property
    def settings(self) -> tuple[Setting, ...]:
        return settings_of(self.config_class)

    @property
    def defaults(self) -> C:
        return self.config_class()

    def resolve(
        self,
        variable: str | Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        *,
        variable_source: str | None = None,
        rules: Sequence[Rule] = (),
    ) -> C:
        """Merge defaults, the Variable (JSON or mapping) and params (``None``: not given) and
        validate them; ``variable_source`` names a JSON not from the Variable (``--config``)."""
        where = variable_source or f"Variable {self.job}"
        by_name = {s.name: s for s in self.settings}
        given: dict[str, Any] = {s.name: s.default for s in self.settings}  # as given: quoted
        sources = dict.fromkeys(given, "default")
        trigger = {k: v for k, v in (params or {}).items() if k not in self.extra_params}
        for layer, source in (
            (self._parse_variable(variable, where), f"from {where}"),
            (trigger, "from trigger params"),
        ):
            for key, value in layer.items():
                if key not in by_name:
                    raise ConfigError(
                        f"{self.job}: unknown config key {brief(key)} = {brief(value)} ({source}); "
                        f"allowed keys: {', '.join(sorted(by_name))}"
                    )
                if value is not None or layer is not trigger:
                    given[key] = by_name[key].check(value, source, self.job)
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
        except ValueError:  # a number past 4300 digits (sys.get_int_max_str_digits)
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
