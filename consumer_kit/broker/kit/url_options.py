"""The query options of a broker URL (``sqs://...?wait=5&heartbeat=off``), read the same way by
every adapter: the last value of a repeated option wins, an unknown option is refused, a flag is
one of ``1/true/yes/on`` or ``0/false/no/off`` (any case), a number lies within the option's
bounds (a whole number where the broker takes whole seconds). Error messages name the scheme and
the option, never the URL (it may carry user info)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, overload
from urllib.parse import parse_qs

from consumer_kit.errors import ConfigurationError

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


def url_options(query: str, known: Iterable[str], *, scheme: str) -> dict[str, str]:
    """The options of ``query`` (a URL's query string) by name, each its last value.

    Raises:
        ConfigurationError: an option not in ``known`` (names them, and the known ones).
    """
    options = {name: values[-1] for name, values in parse_qs(query).items()}
    allowed = set(known)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigurationError(
            f"unknown {scheme}:// option(s) {', '.join(unknown)}; known: {sorted(allowed)}"
        )
    return options


def flag(options: dict[str, str], name: str, default: bool, *, scheme: str) -> bool:
    """Option ``name`` as a flag (module docstring), ``default`` when it is absent.

    Raises:
        ConfigurationError: a value that is neither true nor false.
    """
    value = options.get(name)
    if value is None:
        return default
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    raise ConfigurationError(f"{scheme}:// option {name} must be true or false, not {value!r}")


@overload
def number(
    options: dict[str, str], name: str, default: int, low: int, high: int, *, scheme: str,
    whole: Literal[True], unit: str = ...,
) -> int: ...


@overload
def number(
    options: dict[str, str], name: str, default: float, low: float, high: float, *, scheme: str,
    whole: Literal[False] = ..., unit: str = ...,
) -> float: ...


def number(
    options: dict[str, str], name: str, default: float, low: float, high: float, *, scheme: str,
    whole: bool = False, unit: str = "",
) -> float:
    """Option ``name`` as a number from ``low`` to ``high``, ``default`` when it is absent;
    ``whole``: an ``int`` (a whole number); ``unit`` (``"seconds"``) names the unit in messages.

    Raises:
        ConfigurationError: not a number (not a whole one where ``whole``), or out of bounds.
    """
    value = options.get(name)
    if value is None:
        return default
    try:
        parsed: float = int(value) if whole else float(value)
    except ValueError:
        kind = (f"whole {unit}" if unit else "a whole number") if whole else "a number"
        raise ConfigurationError(f"{scheme}:// option {name} must be {kind}, not {value!r}") from None
    if not low <= parsed <= high:
        after = f" {unit}" if unit else ""
        raise ConfigurationError(
            f"{scheme}:// option {name} must be {_text(low)} to {_text(high)}{after}, not {_text(parsed)}"
        )
    return parsed


def _text(number: float) -> str:
    return f"{number:g}" if isinstance(number, float) else str(number)
