"""Azure Service Bus adapter (azure-servicebus, asyncio API): deliveries in, settlement, publishers out.

The azure-servicebus SDK (and azure-identity, when used) is imported only inside this package. One
job per module, the same modules in the same order under the same names in every adapter
(``broker-only``: this broker alone needs it):

==================  ================================================================================
module              job (the words before the dash are the same in every adapter)
==================  ================================================================================
``config``          the broker URL and what the adapter takes from the settings — the namespace and
                    connection string; the ``CONSUMER_KIT_SERVICEBUS_*`` settings
``connection``      opening and closing connections — clients (shared access key or Microsoft Entra
                    ID)
``topology``        queue names; creating or reading queues — queue and ``topic/Subscriptions/name``
                    names; receivers and senders for them
``envelope``        consumer-kit's headers on this broker's messages — fields read and written;
                    copies; dead-letter texts; relay events
``redelivery``      ``delivery_count`` and ``redelivered`` — telling a crash from our own abandon
``limits``          sizes checked before any send — entity and batch limits; measuring a message
``errors``          what a failure means; PublishError kinds — lock loss; the dead-letter command's
                    errors
``delivery``        one delivery: ack, retry, dead-letter, release — :class:`ServiceBusDelivery`:
                    complete, abandon, copies, held retry
``renewal``         keeping held deliveries locked — every held lock renewed at half its remaining
                    time
``subscription``    one queue's receive loop — receive exactly as many messages as there are slots
``consumer``        the consumer: subscriptions, pause and resume, close —
                    :class:`ServiceBusConsumer`: pumps, shutdown
``publisher``       the relay's confirmed publishes — :class:`ServiceBusPublisher`
``batching``        calls sent in batches — one entity's publishes as ``ServiceBusMessageBatch``-es
``dead_letters``    list and redrive dead letters (``consumer-kit dlq``) —
                    :class:`ServiceBusDeadLetters`: ``<entity>/$DeadLetterQueue``
``sessions``        broker-only: a session entity, sessions in parallel, each one's messages in
                    order
``route``           broker-only: a delivery's receiver and session lock
``copies``          broker-only: the sender of retry and release copies (and the queue's size limit)
``counters``        broker-only: the names the consumer counts
                    (:class:`consumer_kit.broker.kit.counters.Counters`)
``throttling``      broker-only: ``ServiceBusServerBusyError`` waited out with backoff (settlements,
                    sends, peeks, receives)
==================  ================================================================================

Mapping (details in each module):

==============  ===================================================================================
contract        Service Bus
==============  ===================================================================================
peek-lock       ``ServiceBusReceiveMode.PEEK_LOCK``, SDK prefetch off; each receive asks for as many
                messages as the worker has free slots (``prefetch``), so every locked message is in
                the worker's hands and renewed
ack             ``complete_message``
retry(0)        ``abandon_message``
retry(delay)    queue: a copy scheduled ``delay`` seconds ahead, then ``complete_message``; session
                entity or subscription: the lock held (renewed) for ``delay``, then abandoned
dead_letter     ``dead_letter_message(reason, error_description)`` into ``<entity>/$DeadLetterQueue``,
                the description cut to the room the entity's size limit leaves
release         queue: an uncounted copy, then ``complete_message`` (restarts and outages leave no
                count and no suspect behind); session entity or subscription: ``abandon_message``,
                remembered as our own give-back
renew_lock      ``renew_message_lock`` (``session.renew_lock`` for a session message); the lock
                keeper renews every unsettled delivery (and each held session) at half its time left
delivery count  ``x-consumer-kit-deliveries + delivery_count + 1``
partition key   session id (``session_id`` on publish; session entities listed in
                ``CONSUMER_KIT_SERVICEBUS_SESSION_ENTITIES``)
publish         ``message_id`` = event id, ``session_id`` = partition key, ``subject`` = routing key,
                application properties = headers (message type, causing operation, trace context),
                sent in size-checked batches
==============  ===================================================================================

**redelivered.** Service Bus raises ``delivery_count`` on abandon and on lock expiry alike. A
redelivery counts as our own give-back only when this process abandoned that very message (entity,
sequence number) and the count is exactly the next one; anything else is a suspect
(:mod:`consumer_kit.adapters.servicebus.redelivery`). A real crash is never missed; a message abandoned by
another process, or by this one before a restart (a release on a session entity or a
subscription, a ``retry(0)``), is a false suspect, which costs only running alone once. Releases
on plain queues are copies and never make a suspect.

**Broker delivery limit.** Service Bus also counts our own abandons (``retry(0)``, held retries,
releases on session entities and subscriptions): set the entities' ``MaxDeliveryCount`` well above
consumer-kit's own bounds, at least ``max(50, 5 * (max_deliveries + crash_limit))`` plus the
give-backs you expect (Service Bus allows up to 2000; the emulator caps it at 10). It is a loop
guard only: consumer-kit counts attempts in its ledger.

**Lock loss.** ``MessageLockLostError`` / ``SessionLockLostError`` (from a renewal or a settlement)
mean the delivery is no longer ours: it is never acked afterwards, ``lost`` is set and the broker
redelivers it (counted as ``locks_lost``).

Entry points (``consumer_kit.brokers``, schemes ``servicebus`` and ``sb``):
:func:`consumer_from_settings`, :func:`publisher_from_settings`, :func:`dead_letters_from_settings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from consumer_kit.errors import MissingExtra

try:
    import azure.servicebus  # noqa: F401 - the SDK of the servicebus extra
except ImportError as missing:  # the extra this adapter needs (consumer_kit.broker.registry names it)
    raise MissingExtra("servicebus", missing) from missing

from consumer_kit.settings import BrokerSettings, Settings

from .config import SCHEMES, Namespace, ServiceBusConfig, ServiceBusSettings
from .consumer import ServiceBusConsumer
from .counters import ConsumerCounters
from .dead_letters import ServiceBusDeadLetters
from .delivery import ServiceBusDelivery
from .envelope import DELIVERIES_PROPERTY, ORIGINAL_MESSAGE_ID_PROPERTY
from .publisher import ServiceBusPublisher
from .redelivery import GiveBacks
from .topology import Entity

__all__ = [
    "DELIVERIES_PROPERTY",
    "ORIGINAL_MESSAGE_ID_PROPERTY",
    "SCHEMES",
    "ConsumerCounters",
    "Entity",
    "GiveBacks",
    "Namespace",
    "ServiceBusConfig",
    "ServiceBusConsumer",
    "ServiceBusDeadLetters",
    "ServiceBusDelivery",
    "ServiceBusPublisher",
    "ServiceBusSettings",
    "consumer_from_settings",
    "dead_letters_from_settings",
    "publisher_from_settings",
]


def consumer_from_settings(settings: Settings) -> ServiceBusConsumer:
    """Entry point ``consumer_kit.broker.registry: servicebus``: a consumer for ``settings.broker_url``
    (``settle_timeout`` bounds settlements) and the ``CONSUMER_KIT_SERVICEBUS_*`` settings
    (:class:`~consumer_kit.adapters.servicebus.config.ServiceBusConfig`).

    Raises:
        ConfigurationError: the URL and the connection string do not name a namespace.
    """
    config = ServiceBusConfig.from_settings(settings)
    return ServiceBusConsumer(
        config.namespace,
        session_entities=config.adapter.session_entities,
        settle_timeout=settings.settle_timeout,
        receive_wait=config.adapter.receive_wait,
        lock_duration=config.adapter.lock_durations or None,
        default_ttls=config.adapter.default_ttls,
    )


def publisher_from_settings(settings: BrokerSettings) -> ServiceBusPublisher:
    """Entry point ``consumer_kit.broker.registry: servicebus``: a publisher for ``settings.broker_url``,
    waiting at most ``settings.settle_timeout`` seconds for a confirmation.

    Raises:
        ConfigurationError: the URL and the connection string do not name a namespace.
    """
    config = ServiceBusConfig.from_settings(settings)
    return ServiceBusPublisher(
        config.namespace,
        confirm_timeout=settings.settle_timeout,
        batch_max_messages=config.adapter.publish_batch_max_messages,
        session_entities=config.adapter.session_entities,
    )


def dead_letters_from_settings(settings: BrokerSettings) -> ServiceBusDeadLetters:
    """Entry point ``consumer_kit.broker.registry: servicebus``: the dead-letter sub-queues of the queues and
    subscriptions of ``settings.broker_url``'s namespace (``consumer-kit dlq``;
    :mod:`consumer_kit.adapters.servicebus.dead_letters`); a redrive's receive waits
    ``CONSUMER_KIT_SERVICEBUS_RECEIVE_WAIT`` seconds.

    Raises:
        ConfigurationError: the URL and the connection string do not name a namespace.
    """
    config = ServiceBusConfig.from_settings(settings)
    return ServiceBusDeadLetters(config.namespace, receive_wait=config.adapter.receive_wait)


if TYPE_CHECKING:  # mypy checks this module against the core's description of an adapter module
    from consumer_kit.broker.registry import DeadLetterAdapter

    from .. import servicebus as this_module

    _PROVIDES: DeadLetterAdapter = this_module
