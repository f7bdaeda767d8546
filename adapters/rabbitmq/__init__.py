"""RabbitMQ adapter (aio-pika): deliveries in, settlement, publishers out.

The aio-pika SDK (with aiormq and pamqp) is imported only inside this package. One job per module,
the same modules in the same order under the same names in every adapter (``broker-only``: this
broker alone needs it):

==================  ================================================================================
module              job (the words before the dash are the same in every adapter)
==================  ================================================================================
``config``          the broker URL and what the adapter takes from the settings —
                    :class:`RabbitMQConfig`; the vhost
``connection``      opening and closing connections — AMQP connections and channels; the backoff
                    between reconnects
``topology``        queue names; creating or reading queues — queue arguments and tolerant
                    declarations; exchanges; the broker delivery limit
``envelope``        consumer-kit's headers on this broker's messages — header names; the delivery
                    count formula (so no ``redelivery`` module)
``limits``          sizes checked before any send — ``frame_max`` and ``max_message_size``; trimming
                    a copy to fit
``errors``          what a failure means; PublishError kinds — the broker's reply codes and texts
``delivery``        one delivery: ack, retry, dead-letter, release — :class:`RabbitMQDelivery`:
                    copies, abandon
``subscription``    one queue's receive loop — a channel of its own: consume, cancel, re-create (no
                    ``renewal``: RabbitMQ holds a delivery until its channel closes)
``consumer``        the consumer: subscriptions, pause and resume, close —
                    :class:`RabbitMQConsumer`: the connection, recovery
``publisher``       the relay's confirmed publishes — :class:`RabbitMQPublisher`: publisher confirms
                    (no ``batching``: confirms are pipelined)
``confirms``        broker-only: a chunk of publishes as one write, its confirms awaited together
                    (the relay's ``publish_batch``)
``frames``          broker-only: a publish's AMQP frames encoded directly (the same bytes as pamqp;
                    the method frame once per destination)
``dead_letters``    list and redrive dead letters (``consumer-kit dlq``) —
                    :class:`RabbitMQDeadLetters`: ``<queue>.dlq``
``wire``            broker-only: what pamqp may decode — header tables nested deeper than 64
                    levels are never decoded recursively (one message must not close a connection)
==================  ================================================================================

Topology (per work queue ``<queue>``): ``<queue>`` (quorum, dead-lettering to ``<queue>.dlq``),
``<queue>.dlq`` and one ``<queue>.retry.<ms>ms`` per retry delay tier; details in
:mod:`consumer_kit.adapters.rabbitmq.topology`.

**Broker delivery limit: a loop guard only.** Quorum work queues get
``x-delivery-limit = max(50, 5 * (max_deliveries + crash_limit))``
(:func:`broker_delivery_limit`). consumer-kit counts attempts in its ledger and never lets the
broker count a graceful give-back: ``release`` republishes an uncounted copy instead of
``basic.nack(requeue=True)``, so only lost settlements and dead workers move the broker's count.

**Delivery count and suspects.** ``delivery_count`` follows :mod:`consumer_kit.adapters.rabbitmq.envelope`;
``redelivered`` is the broker's flag or ``x-consumer-kit-redelivered`` (a released suspect stays
one). Settlement details: :mod:`consumer_kit.adapters.rabbitmq.delivery`.

**One message never closes a shared connection.** Every publish (the relay's, and the retry,
release and dead-letter copies) is measured first: the encoded properties and headers against the
connection's negotiated ``frame_max``, the body against ``max_message_size`` (RabbitMQ 3.10
default 128 MiB). The relay's publisher refuses an oversized event with a permanent
``PublishError`` naming the limit and the size (the relay parks it at once). A copy that does not
fit drops, largest first, the headers that are neither consumer-kit's nor the operation's; if it
still does not fit, retry and release fall back to ``basic.nack(requeue=True)`` and a dead-letter
is ``basic.reject(requeue=False)``-ed into the work queue's own dead-letter exchange. Exchange
declarations and suspect publishes run on channels of their own (:mod:`consumer_kit.adapters.rabbitmq.publisher`).

Entry points (``consumer_kit.brokers``, schemes ``amqp``/``amqps``): :func:`consumer_from_settings`,
:func:`publisher_from_settings`, :func:`dead_letters_from_settings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from consumer_kit.errors import MissingExtra

try:
    import aio_pika  # noqa: F401 - the SDK of the rabbitmq extra
    import aiormq  # noqa: F401
except ImportError as missing:  # the extra this adapter needs (consumer_kit.broker.registry names it)
    raise MissingExtra("rabbitmq", missing) from missing

from consumer_kit.codec.envelope import MESSAGE_TYPE_HEADER
from consumer_kit.settings import BrokerSettings, Settings

from .config import SCHEMES, RabbitMQConfig
from .consumer import RabbitMQConsumer
from .dead_letters import RabbitMQDeadLetters
from .delivery import RabbitMQDelivery
from .envelope import (
    DEAD_LETTER_DETAIL_HEADER,
    DEAD_LETTER_REASON_HEADER,
    DELIVERIES_HEADER,
    ORIGINAL_QUEUE_HEADER,
    REDELIVERED_HEADER,
    TRIMMED_HEADER,
    delivery_count_of,
)
from .limits import DEFAULT_MAX_MESSAGE_SIZE
from .publisher import RabbitMQPublisher
from .tap import RabbitMQTap
from .topology import QUEUE_TYPES, broker_delivery_limit

__all__ = [
    "DEAD_LETTER_DETAIL_HEADER",
    "DEAD_LETTER_REASON_HEADER",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "DELIVERIES_HEADER",
    "MESSAGE_TYPE_HEADER",
    "ORIGINAL_QUEUE_HEADER",
    "QUEUE_TYPES",
    "SCHEMES",
    "REDELIVERED_HEADER",
    "TRIMMED_HEADER",
    "RabbitMQConfig",
    "RabbitMQConsumer",
    "RabbitMQDeadLetters",
    "RabbitMQDelivery",
    "RabbitMQPublisher",
    "RabbitMQTap",
    "broker_delivery_limit",
    "consumer_from_settings",
    "dead_letters_from_settings",
    "delivery_count_of",
    "publisher_from_settings",
    "tap_from_settings",
]


def consumer_from_settings(settings: Settings) -> RabbitMQConsumer:
    """Entry point ``consumer_kit.broker.registry: amqp``: a consumer for ``settings``
    (:class:`~consumer_kit.adapters.rabbitmq.config.RabbitMQConfig` says what it reads)."""
    config = RabbitMQConfig.from_settings(settings)
    return RabbitMQConsumer(
        config.url,
        max_deliveries=config.max_deliveries,
        crash_limit=config.crash_limit,
        retry_delays=config.retry_delays,
        handler_timeout=config.handler_timeout,
        settle_timeout=config.settle_timeout,
    )


def publisher_from_settings(settings: BrokerSettings) -> RabbitMQPublisher:
    """Entry point ``consumer_kit.broker.registry: amqp``: a publisher for ``settings.broker_url``,
    waiting at most ``settings.settle_timeout`` seconds for a confirm."""
    return RabbitMQPublisher(settings.broker_url, confirm_timeout=settings.settle_timeout)


def dead_letters_from_settings(settings: BrokerSettings) -> RabbitMQDeadLetters:
    """Entry point ``consumer_kit.broker.registry: amqp``: the dead-letter queues of ``settings.broker_url``
    (``consumer-kit dlq``), each broker operation bounded by ``settings.settle_timeout`` seconds."""
    return RabbitMQDeadLetters(settings.broker_url, timeout=settings.settle_timeout)


def tap_from_settings(settings: Settings) -> RabbitMQTap:
    """Entry point ``consumer_kit.broker.registry: amqp``: a tap on ``settings.broker_url``'s event
    exchanges (``consumer-kit watch``), connecting within ``settings.settle_timeout`` seconds."""
    return RabbitMQTap(settings.broker_url, timeout=settings.settle_timeout)


if TYPE_CHECKING:  # mypy checks this module against the core's description of an adapter module
    from consumer_kit.broker.registry import DeadLetterAdapter, TapAdapter

    from .. import rabbitmq as this_module

    _PROVIDES: DeadLetterAdapter = this_module
    _TAPS: TapAdapter = this_module
