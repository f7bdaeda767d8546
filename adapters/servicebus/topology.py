"""Entity names: what a subscribed queue name means on Service Bus, and its receivers and senders.

An app subscribes names (``app.subscribe("invoices.commands", ...)``). On Service Bus a name is

* a **queue** (``invoices.commands``), or
* a **topic subscription**, written as Service Bus writes its path:
  ``<topic>/Subscriptions/<subscription>`` (``billing.events/Subscriptions/ledger``).

The dead-letter sub-queue of either is ``<path>/$DeadLetterQueue``. Entities listed in
``CONSUMER_KIT_SERVICEBUS_SESSION_ENTITIES`` require sessions (see :mod:`consumer_kit.adapters.servicebus.sessions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from azure.servicebus import NEXT_AVAILABLE_SESSION, ServiceBusReceiveMode, ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver, ServiceBusSender

from consumer_kit.errors import ConfigurationError

SUBSCRIPTIONS = "subscriptions"
DEAD_LETTER_SUFFIX = "/$DeadLetterQueue"


@dataclass(frozen=True)
class Entity:
    """A queue or a topic subscription that deliveries come from.

    Attributes:
        path: the name as subscribed (``queue`` or ``topic/Subscriptions/subscription``).
        topic: the topic of a subscription, else ``None``.
        subscription: the subscription name, else ``None``.
        requires_session: whether its messages are locked by session.
    """

    path: str
    topic: str | None = None
    subscription: str | None = None
    requires_session: bool = False

    @classmethod
    def parse(cls, path: str, *, session_entities: frozenset[str] = frozenset()) -> Entity:
        """The entity ``path`` names.

        Raises:
            ValueError: empty, or a path with slashes that is not ``topic/Subscriptions/name``.
        """
        if not path or path != path.strip():
            raise ValueError(f"not a Service Bus entity name: {path!r}")
        sessions = path.casefold() in session_entities
        parts = path.split("/")
        if len(parts) == 1:
            return cls(path, requires_session=sessions)
        if len(parts) == 3 and parts[1].casefold() == SUBSCRIPTIONS and parts[0] and parts[2]:
            return cls(path, parts[0], parts[2], requires_session=sessions)
        raise ValueError(
            f"not a Service Bus entity name: {path!r} (a queue name, or topic/Subscriptions/subscription)"
        )

    @property
    def is_queue(self) -> bool:
        """Queues take scheduled copies; a subscription cannot be sent to (its topic can)."""
        return self.topic is None

    @property
    def dead_letter_path(self) -> str:
        return self.path + DEAD_LETTER_SUFFIX

    def receiver(self, client: ServiceBusClient, *, session_wait: float | None = None) -> ServiceBusReceiver:
        """A peek-lock receiver without prefetch: messages are locked only when a receive call asks
        for them, so none waits, locked and unrenewed, in the SDK's buffer. A session entity gets
        a receiver for the next available session, waiting up to ``session_wait`` seconds."""
        options: dict[str, Any] = {"receive_mode": ServiceBusReceiveMode.PEEK_LOCK, "prefetch_count": 0}
        if self.requires_session:
            options.update(session_id=NEXT_AVAILABLE_SESSION, max_wait_time=session_wait)
        if self.topic is not None:
            assert self.subscription is not None
            return client.get_subscription_receiver(self.topic, self.subscription, **options)
        return client.get_queue_receiver(self.path, **options)


    def dead_letter_receiver(self, client: ServiceBusClient) -> ServiceBusReceiver:
        """A peek-lock receiver of ``<path>/$DeadLetterQueue``, without prefetch (nothing is locked
        until a receive call asks). Never a session receiver: a dead-letter queue does not lock by
        session, even under a session entity."""
        options: dict[str, Any] = {
            "receive_mode": ServiceBusReceiveMode.PEEK_LOCK, "prefetch_count": 0,
            "sub_queue": ServiceBusSubQueue.DEAD_LETTER,
        }
        if self.topic is not None:
            assert self.subscription is not None
            return client.get_subscription_receiver(self.topic, self.subscription, **options)
        return client.get_queue_receiver(self.path, **options)


def not_created_here(what: str) -> ConfigurationError:
    """The answer to ``consumer-kit declare``: consumer-kit does not create Service Bus entities
    (that takes the management plane: Bicep, Terraform, ``az servicebus``, the emulator's config)."""
    return ConfigurationError(
        f"consumer-kit does not create Service Bus entities: create {what} yourself (Bicep, Terraform, "
        "`az servicebus queue|topic create`, or the emulator's Config.json); its dead-letter queue "
        "comes with it"
    )


def sender_for(client: ServiceBusClient, name: str) -> ServiceBusSender:
    """A sender to the queue or topic ``name`` (both are addressed alike on the wire)."""
    return client.get_queue_sender(name)
