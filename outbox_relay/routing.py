"""The destination map: outbox destination name -> broker target.

Without a map, a destination names a durable RabbitMQ topic exchange of the same name and the
routing key is the row's own (``ctx.publish(..., routing_key=...)``). With a map (settings
``relay_destinations`` as JSON in ``CONSUMER_KIT_RELAY_DESTINATIONS``, or a TOML/JSON file in
``relay_destinations_file``), every destination must be in it: :meth:`Routing.check` raises at
start-up for destinations of pending rows the map does not know, and a row that arrives later with
an unknown destination is parked with ``last_error = "unknown destination ..."`` (never guessed).

File format (TOML; JSON with the same shape works too)::

    [destinations."billing.events"]
    exchange = "billing"            # RabbitMQ exchange
    routing_key = "invoice.created" # optional: fixed key instead of the row's
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import ValidationError

from consumer_kit.errors import ConfigurationError

from .errors import UnknownDestination
from .settings import RelaySettings, RouteTarget


class Routing:
    """Resolves destinations; ``targets=None`` is the default pass-through mapping."""

    def __init__(self, targets: Mapping[str, RouteTarget] | None = None) -> None:
        self.targets = dict(targets) if targets is not None else None

    @classmethod
    def from_settings(cls, settings: RelaySettings) -> Routing:
        """Build from ``relay_destinations`` and/or ``relay_destinations_file`` (the env map wins
        for a name present in both).

        Raises:
            ConfigurationError: unreadable file, bad syntax or a malformed entry.
        """
        targets: dict[str, RouteTarget] | None = None
        if settings.relay_destinations_file is not None:
            targets = load_destinations_file(settings.relay_destinations_file)
        if settings.relay_destinations is not None:
            targets = {**(targets or {}), **settings.relay_destinations}
        return cls(targets)

    def resolve(self, destination: str, routing_key: str) -> tuple[str, str]:
        """``(exchange, routing_key)`` for a row.

        Raises:
            UnknownDestination: a map is configured and does not name ``destination``.
        """
        if self.targets is None:
            return destination, routing_key
        target = self.targets.get(destination)
        if target is None:
            raise UnknownDestination(f"unknown destination {destination!r} (not in the map)")
        key = target.routing_key if target.routing_key is not None else routing_key
        return target.exchange, key

    def check(self, destinations: Iterable[str]) -> None:
        """Fail fast on destinations the map does not know.

        Raises:
            ConfigurationError: names every unknown destination and the known ones.
        """
        if self.targets is None:
            return
        unknown = sorted(set(destinations) - set(self.targets))
        if unknown:
            raise ConfigurationError(
                "pending outbox rows use destinations missing from the destination map: "
                f"{', '.join(unknown)} (known: {', '.join(sorted(self.targets)) or 'none'})"
            )


def load_destinations_file(path: Path) -> dict[str, RouteTarget]:
    """Read ``[destinations]`` from a TOML file (or a JSON object ``{"destinations": {...}}``).

    Raises:
        ConfigurationError: the file is missing, unparsable or has a malformed entry.
    """
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read destination map {path}: {exc}") from exc
    table = data.get("destinations")
    if not isinstance(table, dict):
        raise ConfigurationError(f"{path} has no [destinations] table")
    try:
        return {name: RouteTarget.model_validate(entry) for name, entry in table.items()}
    except ValidationError as exc:
        raise ConfigurationError(f"bad entry in destination map {path}: {exc}") from exc
