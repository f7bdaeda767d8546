"""What every settings group shares: field helpers that carry a unit, a range and an example, and
the base class that reads a group from the environment and refuses a bad value in one line.

A refusal names the variable (or the option), the value, the unit, the range and an example::

    CONSUMER_KIT_LOCK_TIMEOUT=0.0004: seconds, must be between 0.001 and 3600 (e.g. 5)
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, Self

from pydantic import Field, SecretStr, ValidationError
from pydantic.config import JsonDict
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from consumer_kit.codec.redaction import redact_url
from consumer_kit.errors import ConfigurationError

ENV_PREFIX = "CONSUMER_KIT_"
"""Prefix of every environment variable consumer-kit reads."""


def number(value: float) -> str:
    """``5``, ``0.001``, ``31622400``: a range bound as a user types it (no exponent)."""
    return f"{value:.0f}" if value == int(value) else f"{value:g}"


def seconds(
    default: float | None, *, minimum: float, maximum: float, example: float | str, description: str
) -> Any:
    """A duration field in seconds: finite, ``minimum <= value <= maximum``; the range and an
    example are appended to ``description`` and kept for error messages and the reference page."""
    return Field(
        default=default, ge=minimum, le=maximum, allow_inf_nan=False,
        description=f"{description} Seconds, {number(minimum)} to {number(maximum)} (e.g. {example}).",
        json_schema_extra={"unit": "seconds", "minimum": minimum, "maximum": maximum, "example": str(example)},
    )


def count(
    default: int | None, *, unit: str, minimum: int, maximum: int, example: int | str, description: str
) -> Any:
    """An integer field of ``unit`` (deliveries, rows, ...) within ``minimum..maximum``."""
    return Field(
        default=default, ge=minimum, le=maximum,
        description=f"{description} {unit[:1].upper()}{unit[1:]}, {minimum} to {maximum} (e.g. {example}).",
        json_schema_extra={"unit": unit, "minimum": minimum, "maximum": maximum, "example": str(example)},
    )


def example(value: str, description: str, default: Any = None, *, rule: str | None = None) -> Any:
    """A field without a numeric range, with an ``example`` (and the ``rule`` to state instead of
    pydantic's own message) for error messages."""
    extra: JsonDict = {"example": value} if rule is None else {"example": value, "rule": rule}
    return Field(default=default, description=description, json_schema_extra=extra)


def env_name(field: str) -> str:
    """``lock_timeout`` -> ``CONSUMER_KIT_LOCK_TIMEOUT`` (groups with the plain prefix)."""
    return ENV_PREFIX + field.upper()


class GroupSettings(BaseSettings):
    """One group of the settings tree, read from ``CONSUMER_KIT_*`` environment variables
    (a group may narrow the prefix, e.g. ``CONSUMER_KIT_SERVICEBUS_``).

    Raises (on construction):
        pydantic.ValidationError: a value out of range (:meth:`from_environment` says it in
            one line per setting instead).
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=None, extra="ignore")

    @classmethod
    def env_name_of(cls, field: str) -> str:
        """The environment variable of ``field``: ``CONSUMER_KIT_SERVICEBUS_RECEIVE_WAIT``."""
        return str(cls.model_config.get("env_prefix", "")) + field.upper()

    @classmethod
    def env_names(cls) -> set[str]:
        """Every environment variable this group reads (upper case)."""
        return {cls.env_name_of(name) for name in cls.model_fields}

    @classmethod
    def from_environment(cls, *, options: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Read the environment; ``overrides`` (``None`` values skipped) win over it.

        Args:
            options: field -> command-line option that set it (``{"relay_claim_timeout":
                "--claim-timeout"}``), so an error names what the user typed.

        Raises:
            ConfigurationError: one line per refused setting: the variable (or option), its
                value, the unit, the allowed range and an example.
        """
        given = {name: value for name, value in overrides.items() if value is not None}
        try:
            return cls(**given)
        except ValidationError as exc:
            lines = [cls._describe(error, given, options or {}) for error in exc.errors()]
        except SettingsError as exc:  # a value pydantic-settings could not even parse
            lines = [str(exc)]
        raise ConfigurationError("\n".join(dict.fromkeys(lines)))

    @classmethod
    def _describe(
        cls, error: Mapping[str, Any], given: Mapping[str, Any], options: Mapping[str, str]
    ) -> str:
        """One line for one pydantic error (see :meth:`from_environment`)."""
        if not error["loc"]:  # a rule across settings: its message names the variables
            return str(error["msg"]).removeprefix("Value error, ")
        name = str(error["loc"][0])
        field = cls.model_fields.get(name)
        if name in given:
            source, value = options.get(name, name), given[name]
        else:
            source, value = cls.env_name_of(name), _environ(cls.env_name_of(name), error.get("input"))
        if name.endswith("_url"):  # never a password in an error
            value = redact_url(value) if isinstance(value, str) else "***"
        if field is not None and SecretStr in _types_of(field.annotation):  # nor a key
            value = "***"
        extra = field.json_schema_extra if field is not None else None
        info: Mapping[str, Any] = extra if isinstance(extra, Mapping) else {}
        shown = value if isinstance(value, str) else json.dumps(value, default=str)
        if "minimum" in info:
            rule = (
                f"{info['unit']}, must be between {number(info['minimum'])} and {number(info['maximum'])}"
                f" (e.g. {info['example']})"
            )
            return f"{source}={shown}: {rule}"
        reason = info.get("rule") or str(error["msg"]).removeprefix("Value error, ")
        hint = f" (e.g. {info['example']})" if "example" in info else ""
        return f"{source}={shown}: {reason}{hint}"


def _types_of(annotation: Any) -> tuple[Any, ...]:
    """``SecretStr | None`` -> ``(SecretStr, NoneType)``; a plain type -> ``(type,)``."""
    return tuple(getattr(annotation, "__args__", ())) or (annotation,)


def _environ(name: str, fallback: Any) -> Any:
    """The raw environment value of ``name`` (matched without case, as pydantic-settings does)."""
    for key, value in os.environ.items():
        if key.upper() == name:
            return value
    return fallback


def unknown_variables(
    known: set[str], environ: Mapping[str, str] | None = None, *, everywhere: Iterable[str] = ()
) -> list[str]:
    """``CONSUMER_KIT_*`` variables that look like a misspelt setting, each as
    ``"CONSUMER_KIT_LOCK_TIMOUT (did you mean CONSUMER_KIT_LOCK_TIMEOUT?)"``.

    Args:
        known: field names of the plain-prefix groups a command reads (``lock_timeout``), or
            full variable names (``CONSUMER_KIT_SERVICEBUS_RECEIVE_WAIT``).
        everywhere: variables of other groups: set on purpose for another command, never
            reported (a shared environment serves the worker and the relay).

    Variables with no close match are left alone (tests and tools use the prefix for their own
    variables)."""
    names = {key if key.upper().startswith(ENV_PREFIX) else env_name(key) for key in known}
    skip = names | {name.upper() for name in everywhere}
    found = []
    for key in sorted(environ if environ is not None else os.environ):
        upper = key.upper()
        if not upper.startswith(ENV_PREFIX) or upper in skip:
            continue
        match = difflib.get_close_matches(upper, names, n=1, cutoff=0.95)
        if match:
            found.append(f"{key} (did you mean {match[0]}?)")
    return found
