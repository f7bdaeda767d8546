"""The ``servicebus`` group: the Azure Service Bus adapter's own ``CONSUMER_KIT_SERVICEBUS_*``
settings (the namespace itself comes from the broker URL and, for keys, the connection string).
The adapter re-exports :class:`ServiceBusSettings` from ``consumer_kit.adapters.servicebus.config``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from .fields import ENV_PREFIX, GroupSettings, count, seconds


class ServiceBusSettings(GroupSettings):
    """The adapter's settings, read from the environment with prefix ``CONSUMER_KIT_SERVICEBUS_``.

    Durations are in seconds.
    """

    model_config = SettingsConfigDict(env_prefix=f"{ENV_PREFIX}SERVICEBUS_", env_file=None, extra="ignore")

    connection_string: SecretStr | None = Field(
        default=None,
        description="Endpoint=sb://...;SharedAccessKeyName=...;SharedAccessKey=... (with the broker URL"
        " servicebus://). Unset: Microsoft Entra ID sign-in to the URL's namespace.",
    )
    session_entities: list[str] = Field(
        default=[],
        description="Queues (or topic/Subscriptions/name paths) that require sessions, as a JSON list:"
        " consumed one session at a time per receiver, in order; the session id is the partition key"
        " (the publisher refuses events without one to the queues listed).",
        json_schema_extra={"example": '["orders"]'},
    )
    lock_durations: dict[str, Annotated[float, Field(ge=5, le=300, allow_inf_nan=False)]] = Field(
        default={},
        description="LockDuration per entity (queue or topic/Subscriptions/name path), as a JSON object:"
        " an override of what each lock's grant tells the adapter (only needed where the host's clock"
        " may run behind the broker's). Seconds, 5 to 300 (Service Bus's range) (e.g. {\"orders\": 60}).",
        json_schema_extra={"unit": "seconds", "range": "each 5 to 300", "example": '{"orders": 60}'},
    )
    default_ttls: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default={},
        description="DefaultMessageTimeToLive per entity, as a JSON object: Service Bus applies it to a"
        " message whose sender set no TTL without showing it on the message, so the retry guards (a"
        " retry never outlives the message, a copy keeps only what is left) need it stated here."
        " Seconds, each above 0 (e.g. {\"orders\": 86400}).",
        json_schema_extra={"unit": "seconds", "range": "each above 0", "example": '{"orders": 86400}'},
    )
    receive_wait: float = seconds(
        1.0, minimum=0.01, maximum=60, example=1,
        description="Longest wait of one receive call for a first message (bounds how long pause and"
        " shutdown wait for a receive in progress).",
    )
    publish_batch_max_messages: int = count(
        100, unit="messages", minimum=1, maximum=4500, example=100,
        description="Most events per ServiceBusMessageBatch. Set 1 for partitioned entities with"
        " duplicate detection, which refuse batches of distinct message ids.",
    )
