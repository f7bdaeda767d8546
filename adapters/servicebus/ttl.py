"""An entity's DefaultMessageTimeToLive, where the adapter's time-to-live guards need it.

Service Bus applies the entity's default TTL to a message whose sender set none, but does not say
so on the message: its ``expires_at_utc`` stays ``None`` (azure-sdk-for-net #21127, Azure/azure-
service-bus #432; docs/brokers/servicebus.md). So a message without its own TTL is taken as never
expiring, unless the operator states the entity's default (``default_ttls``): it then expires at
``enqueued_time_utc`` + that default, for the guards of
:mod:`consumer_kit.adapters.servicebus.delivery` (a retry never outlives it, a copy carries only
what is left of it).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping


class DefaultTtls:
    """Seconds of DefaultMessageTimeToLive per entity path (case-insensitive), as configured.

    Args:
        configured: ``{entity path: seconds}``, each > 0.

    Raises:
        ValueError: a value is not > 0 seconds.
    """

    def __init__(self, configured: Mapping[str, float] | None = None) -> None:
        values = dict(configured or {})
        if any(value <= 0 for value in values.values()):
            raise ValueError("a default time to live must be > 0 seconds")
        self._per_entity = {name.casefold(): float(value) for name, value in values.items()}

    def expires_at(
        self, entity: str, expires: dt.datetime | None, enqueued: dt.datetime | None
    ) -> dt.datetime | None:
        """A message's expiry (broker time): its own ``expires`` when set, else ``enqueued`` +
        the entity's configured default, else ``None`` (never, as far as the adapter knows)."""
        if expires is not None:
            return expires
        default = self._per_entity.get(entity.casefold())
        if default is None or enqueued is None:
            return None
        return enqueued + dt.timedelta(seconds=default)
