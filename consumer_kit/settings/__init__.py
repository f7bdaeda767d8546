"""consumer-kit's settings: one tree, a group per command, read from ``CONSUMER_KIT_*``
environment variables (pydantic-settings).

=============  ===========================================  =====================================
group          class                                        read by
=============  ===========================================  =====================================
database       :class:`DatabaseSettings`                    every command that touches PostgreSQL
broker         :class:`BrokerSettings` (+ database)         every command that talks to a broker
worker         :class:`WorkerSettings` (+ broker)           ``consumer-kit worker``, ``declare``,
                                                            the HTTP front door
relay          :class:`RelaySettings` (+ broker)            ``outbox-relay`` (its maintenance
                                                            commands: :class:`OutboxSettings`)
logging        :class:`LoggingSettings`                     every command: logs, progress bars
telemetry      :class:`TelemetrySettings`                   the worker and the relay: metrics, traces
console        :class:`OperatorConsoleSettings`             ``consumer-kit console`` (web console)
servicebus     :class:`ServiceBusSettings`                  the Service Bus adapter
sqs            :class:`SQSURLOptions` (URL options)         the SQS adapter
=============  ===========================================  =====================================

A command reads its group and the groups it builds on, nothing else: a bad worker setting cannot
break ``migrate`` or the relay. Every number has a unit and an enforced range (finite, a floor that
keeps the system sane, a ceiling); :meth:`GroupSettings.from_environment` turns a refusal into one
line per setting that names the variable, the unit, the range and an example::

    CONSUMER_KIT_LOCK_TIMEOUT=0.0004: seconds, must be between 0.001 and 3600 (e.g. 5)

:data:`SETTINGS_GROUPS` lists the tree for tools (``consumer_kit.settings.reference`` renders it).
"""

from __future__ import annotations

from pydantic import BaseModel

from .broker import BrokerSettings
from .database import EMBEDDED, DatabaseSettings
from .fields import ENV_PREFIX, GroupSettings, count, env_name, example, number, seconds, unknown_variables
from .operator_console import OperatorConsoleSettings
from .output import LEVELS, LOG_FORMATS, LoggingSettings, TelemetrySettings
from .relay import OutboxSettings, RelaySettings, RouteTarget, default_relay_id
from .servicebus import ServiceBusSettings
from .sqs import SQSURLOptions
from .worker import Settings, WorkerSettings

SETTINGS_GROUPS: dict[str, type[BaseModel]] = {
    "database": DatabaseSettings,
    "broker": BrokerSettings,
    "worker": WorkerSettings,
    "relay": RelaySettings,
    "logging": LoggingSettings,
    "telemetry": TelemetrySettings,
    "console": OperatorConsoleSettings,
    "servicebus": ServiceBusSettings,
    "sqs": SQSURLOptions,
}
"""Group name -> the pydantic model of its settings, in reading order. A group's own settings are
its model's fields minus those of the groups it builds on (:func:`own_fields`)."""

GROUP_READERS: dict[str, str] = {
    "database": "Every command that touches PostgreSQL: migrate, ledger, stats, prune, the worker,"
    " the relay, the HTTP front door.",
    "broker": "Every command that talks to a broker: the worker, the relay, declare, dlq; each"
    " adapter's publisher and dead-letter tools. RabbitMQ and NATS have no group of"
    " their own: their options are those of the amqp:// URL (aio-pika's) and the nats:// URL, plus"
    " the worker's retry settings.",
    "worker": "consumer-kit worker and declare; the HTTP front door (its timeouts and pool).",
    "relay": "outbox-relay; its maintenance commands (status, requeue, cleanup) read only the"
    " database group and the RELAY_MAX_ATTEMPTS, RELAY_RETENTION and RELAY_CLEANUP_BATCH settings.",
    "logging": "Every command-line program (consumer-kit, outbox-relay): logs and progress bars;"
    " an option such as --log-level wins over the variable.",
    "telemetry": "consumer-kit worker and outbox-relay: metrics and traces; an option such as"
    " --metrics-port wins over the variable.",
    "console": "consumer-kit console (the operator's web console), on top of the worker group.",
    "servicebus": "The Service Bus adapter (broker URL servicebus://).",
    "sqs": "The SQS adapter: options of the sqs:// broker URL, not environment variables.",
}
"""Group name -> one sentence: who reads it."""


def own_fields(group: str) -> list[str]:
    """The field names ``group`` adds to the groups its model builds on (declaration order).

    Raises:
        KeyError: no such group.
    """
    model = SETTINGS_GROUPS[group]
    inherited: set[str] = set()
    for other in SETTINGS_GROUPS.values():
        if other is not model and issubclass(model, other):
            inherited |= set(other.model_fields)
    return [name for name in model.model_fields if name not in inherited]


def all_env_names() -> set[str]:
    """Every environment variable of the tree (upper case)."""
    names: set[str] = set()
    for model in SETTINGS_GROUPS.values():
        if issubclass(model, GroupSettings):
            names |= model.env_names()
    return names


__all__ = [
    "EMBEDDED",
    "ENV_PREFIX",
    "GROUP_READERS",
    "LEVELS",
    "LOG_FORMATS",
    "SETTINGS_GROUPS",
    "BrokerSettings",
    "LoggingSettings",
    "DatabaseSettings",
    "GroupSettings",
    "OperatorConsoleSettings",
    "OutboxSettings",
    "RelaySettings",
    "RouteTarget",
    "SQSURLOptions",
    "TelemetrySettings",
    "ServiceBusSettings",
    "Settings",
    "WorkerSettings",
    "all_env_names",
    "count",
    "default_relay_id",
    "env_name",
    "example",
    "number",
    "own_fields",
    "seconds",
    "unknown_variables",
]
