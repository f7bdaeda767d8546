"""The ``broker`` group: which broker, and how long one exchange with it may take.

Read by every command that talks to a broker (the worker, the relay, ``declare``, ``dlq``); each
adapter's ``publisher_from_settings`` and ``dead_letters_from_settings`` take this group only.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import field_validator

from .database import DatabaseSettings
from .fields import example, seconds

DEFAULT_BROKER_URL = "memory://"


class BrokerSettings(DatabaseSettings):
    """The broker URL and the settlement bound, on top of :class:`DatabaseSettings`.

    Raises (on construction):
        pydantic.ValidationError: a value out of range; a broker URL whose host and port cannot be
            read (a password with an unescaped ``/``, ``?`` or ``#``), named without its text.
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

    @field_validator("broker_url")
    @classmethod
    def _parsable(cls, value: str) -> str:
        """A URL the adapters can parse: an unescaped ``/`` in a base64 password ends the host
        there, and the drivers then fail with a traceback quoting the rest (the password's)."""
        try:
            urlsplit(value).port  # noqa: B018 - raises ValueError for a malformed host or port
        except ValueError:
            raise ValueError(
                "cannot read the host and port of this URL: percent-encode '/', '?', '#', '@' and ':' in "
                "the user name and password (e.g. '/' as %2F, python: urllib.parse.quote(password, safe=''))"
            ) from None
        return value
