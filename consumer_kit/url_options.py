"""The query options of a broker URL (``sqs://...?wait=5&heartbeat=off``), read the same way by
every adapter: the last value of a repeated option wins, an unknown option is refused, a flag is
one of ``1/true/yes/on`` or ``0/false/no/off`` (any case). Error messages name the scheme and the
option, never the URL (it may carry user info)."""

from __future__ import annotations

from collections.abc import Iterable
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
