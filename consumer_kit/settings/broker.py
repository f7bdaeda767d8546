"""The ``broker`` group: which broker, and how long one exchange with it may take.

Read by every command that talks to a broker (the worker, the relay, ``declare``, ``dlq``); each
adapter's ``publisher_from_settings`` and ``dead_letters_from_settings`` take this group only.
"""

from __future__ import annotations

from pydantic import field_validator

from .database import DatabaseSettings
from .fields import example, seconds

DEFAULT_BROKER_URL = "memory://"


class BrokerSettings(DatabaseSettings):
    """The broker URL and the settlement bound, on top of :class:`DatabaseSettings`.

    Raises (on construction):
        pydantic.ValidationError: a value out of range.
    """

    broker_url: str = example(
        "amqp://guest:guest@127.0.0.1:5672/",
        "Broker URL: amqp[s]://..., sqs://..., servicebus://..., or memory:// (one process only).",
        default=DEFAULT_BROKER_URL,
    )
    settle_timeout: float = seconds(
        10.0, minimum=0.1, maximum=300, example=10,
        description="Longest wait on a settlement (ack, retry, dead-letter) and on a publish confirm.",
    )

    @field_validator("broker_url", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        """Blank (``CONSUMER_KIT_BROKER_URL=``) is unset: the in-process default, which the worker,
        the relay and ``declare`` refuse with "set CONSUMER_KIT_BROKER_URL"."""
        return DEFAULT_BROKER_URL if isinstance(value, str) and not value.strip() else value
