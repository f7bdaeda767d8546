"""NATS JetStream adapter (nats-py): deliveries in, settlement, publishers out.

nats-py is imported only inside this package. One job per module, the same modules under the same
names as the other adapters (``broker-only``: this broker alone needs it):

==================  ================================================================================
module              job
==================  ================================================================================
``config``          the broker URL and what the adapter takes from it — :class:`NATSConfig`
``connection``      opening and closing connections — one nats-py client and JetStream context
``topology``        names; creating streams and durable consumers; dead-letter streams
``envelope``        consumer-kit's headers on this broker's messages — NATS headers, ``Nats-Msg-Id``
``redelivery``      ``delivery_count`` and ``redelivered`` — from ``num_delivered`` and our give-backs
``limits``          sizes checked before any publish — ``max_payload``, the stream's ``max_msg_size``
``errors``          what a failure means; PublishError kinds
``delivery``        one delivery: ack, retry, dead-letter, release — :class:`NATSDelivery`
``renewal``         keeping held deliveries locked — ``in_progress()``
``subscription``    one queue's pull loop — ``fetch``
``consumer``        the consumer: subscriptions, pause and resume, close — :class:`NATSConsumer`
``publisher``       the relay's confirmed publishes — :class:`NATSPublisher`: a publish ack per event
``dead_letters``    list and redrive dead letters (``consumer-kit dlq``) — :class:`NATSDeadLetters`
==================  ================================================================================

Mapping of the broker contract (``consumer_kit.broker``):

===================  ===============================================================================
contract             JetStream
===================  ===============================================================================
peek-lock            a durable pull consumer with explicit ack; ``ack_wait`` is the lock
ack                  ``ack_sync`` (confirmed)
retry(delay)         ``nak(delay)``
release              an uncounted copy on the same subject, then ack (never a redelivery)
dead_letter          a copy to ``<stream>_dlq`` with reason/detail headers, then ``term()``
renew_lock           ``in_progress()`` (the heartbeat does it for every held delivery)
delivery count       ``num_delivered`` (+ earlier copies)
loop guard           ``max_deliver`` = ``max(50, 5 * (max_deliveries + crash_limit))``
message id           ``x-consumer-kit-message-id`` (copies), else ``Nats-Msg-Id``
stable publish id    ``Nats-Msg-Id`` = event ID (the stream's duplicate window), publish ack per event
size limit           ``max_payload`` (server) and ``max_msg_size`` (stream), headers plus body
ordering             one subject per partition key (``Q.k.<key>``); ``ordered=true``: one in flight
===================  ===============================================================================

Entry points (``consumer_kit.brokers``, scheme ``nats``): :func:`consumer_from_settings`,
:func:`publisher_from_settings`, :func:`dead_letters_from_settings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from consumer_kit.errors import MissingExtra

try:
    import nats  # noqa: F401 - the SDK of the nats extra
except ImportError as missing:  # the extra this adapter needs (consumer_kit.broker.registry names it)
    raise MissingExtra("nats", missing) from missing

from consumer_kit.settings import BrokerSettings, Settings

from .config import NATSConfig
from .connection import NATSConnection
from .consumer import NATSConsumer
from .dead_letters import NATSDeadLetters
from .delivery import NATSDelivery
from .envelope import DEAD_LETTER_DETAIL_HEADER, DEAD_LETTER_REASON_HEADER, MSG_ID, headers_for, headers_of
from .publisher import NATSPublisher, subject_of
from .topology import QueueInfo, recommended_max_deliver, stream_name, subject_for

__all__ = [
    "DEAD_LETTER_DETAIL_HEADER", "DEAD_LETTER_REASON_HEADER", "MSG_ID", "NATSConfig", "NATSConnection",
    "NATSConsumer", "NATSDeadLetters", "NATSDelivery", "NATSPublisher", "QueueInfo", "consumer_from_settings",
    "dead_letters_from_settings", "headers_for", "headers_of", "publisher_from_settings",
    "recommended_max_deliver", "stream_name", "subject_for", "subject_of",
]


def consumer_from_settings(settings: Settings) -> NATSConsumer:
    """Entry point ``consumer_kit.broker.registry: nats``: a consumer for ``settings`` (``broker_url``,
    ``max_deliveries``, ``crash_limit``, ``settle_timeout``, ``handler_timeout``).

    Raises:
        ConfigurationError: the ``nats://`` URL is invalid.
    """
    return NATSConsumer(
        NATSConfig.from_url(settings.broker_url), max_deliveries=settings.max_deliveries,
        crash_limit=settings.crash_limit, settle_timeout=settings.settle_timeout,
        handler_timeout=settings.handler_timeout,
    )


def publisher_from_settings(settings: BrokerSettings) -> NATSPublisher:
    """Entry point ``consumer_kit.broker.registry: nats``: a publisher (raises ConfigurationError for a bad URL)."""
    return NATSPublisher(NATSConfig.from_url(settings.broker_url))


def dead_letters_from_settings(settings: BrokerSettings) -> NATSDeadLetters:
    """Entry point ``consumer_kit.broker.registry: nats``: the dead-letter streams (``consumer-kit dlq``)."""
    return NATSDeadLetters(NATSConfig.from_url(settings.broker_url))


if TYPE_CHECKING:  # mypy checks this module against the core's description of an adapter module
    from consumer_kit.broker.registry import DeadLetterAdapter

    from .. import nats as this_module

    _PROVIDES: DeadLetterAdapter = this_module
