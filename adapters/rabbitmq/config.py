"""The ``amqp://`` broker URL and what the adapter takes from consumer-kit's settings.

::

    amqp[s]://[USER[:PASSWORD]@]HOST[:PORT][/VHOST][?OPTIONS]

The URL goes to aio-pika as it is (its query options, e.g. ``heartbeat``, ``connection_timeout``,
pass through); the adapter reads only the vhost from it (:func:`vhost_of`), to name it when the
broker refuses it. Logs show it with the password redacted (``consumer_kit.codec.redaction.redact_url``).

Options come from ``consumer_kit.settings.Settings`` (:meth:`RabbitMQConfig.from_settings`):
``max_deliveries`` and ``crash_limit`` (the quorum queues' delivery limit), ``retry_delays`` plus
``in_progress_delay`` (one retry queue per distinct delay), ``handler_timeout`` (checked against
RabbitMQ's ``consumer_timeout``) and ``settle_timeout`` (each settlement; a publish's confirm).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from consumer_kit.settings import Settings

SCHEMES = ("amqp", "amqps")
"""The ``consumer_kit.brokers`` entry points of this adapter."""


@dataclass(frozen=True)
class RabbitMQConfig:
    """What the adapter takes from consumer-kit's settings (module docstring).

    Attributes:
        url: the AMQP URL.
        max_deliveries: consumer-kit's attempts per message (deliveries).
        crash_limit: crashes while running alone before a message is dead-lettered (deliveries).
        retry_delays: seconds, the delay tiers: the retry delays, then the in-progress delay.
        handler_timeout: seconds a handler may run.
        settle_timeout: seconds each settlement (and each publish's confirm) may take.
    """

    url: str
    max_deliveries: int
    crash_limit: int
    retry_delays: tuple[float, ...]
    handler_timeout: float
    settle_timeout: float

    @classmethod
    def from_settings(cls, settings: Settings) -> RabbitMQConfig:
        return cls(
            url=settings.broker_url,
            max_deliveries=settings.max_deliveries,
            crash_limit=settings.crash_limit,
            retry_delays=(*settings.retry_delays, settings.in_progress_delay),
            handler_timeout=settings.handler_timeout,
            settle_timeout=settings.settle_timeout,
        )


def vhost_of(url: str) -> str:
    """The vhost an AMQP URL names: its path without the leading ``/``, unquoted; ``/`` when
    the path is empty or ``/`` (aio-pika's reading)."""
    path = urlsplit(url).path
    return "/" if path in ("", "/") else unquote(path[1:])
