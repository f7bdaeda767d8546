"""AWS SQS adapter (boto3): deliveries in, settlement, publishers out.

boto3 and botocore are imported only inside this package, and called only from worker threads
(:mod:`consumer_kit.adapters.sqs.connection`). One job per module, the same modules in the same order under the
same names in every adapter (``broker-only``: this broker alone needs it):

==================  ================================================================================
module              job (the words before the dash are the same in every adapter)
==================  ================================================================================
``config``          the broker URL and what the adapter takes from the settings —
                    :class:`SQSConfig`: the ``sqs://`` URL (endpoint, region, long-poll wait,
                    visibility, options)
``connection``      opening and closing connections — one thread-safe boto3 client per adapter
                    object, called from its own threads
``topology``        queue names; creating or reading queues — URLs and ARNs; attributes read from
                    the queue; dead-letter queues
``envelope``        consumer-kit's headers on this broker's messages — headers as message attributes
                    (at most 10); consumer-kit's attribute names
``redelivery``      ``delivery_count`` and ``redelivered`` — from ``ApproximateReceiveCount`` and
                    our own give-backs
``limits``          sizes checked before any send — the queue's ``MaximumMessageSize`` and the batch
                    size; trimming a copy to fit
``errors``          what a failure means; PublishError kinds — SQS error codes; stale receipt
                    handles
``delivery``        one delivery: ack, retry, dead-letter, release — :class:`SQSDelivery`: the
                    lock's deadline
``renewal``         keeping held deliveries locked — extending the visibility of held deliveries;
                    the 12-hour maximum
``subscription``    one queue's receive loop — the long-poll loop; broker duplicates
``consumer``        the consumer: subscriptions, pause and resume, close — :class:`SQSConsumer`
``publisher``       the relay's confirmed publishes — :class:`SQSPublisher`: ``SendMessageBatch``
``batching``        calls sent in batches — up to 10 entries per batch call, per queue
``dead_letters``    list and redrive dead letters (``consumer-kit dlq``) — :class:`SQSDeadLetters`:
                    a work queue's DLQ
``settlement``      broker-only: batched deletes, visibility changes, copies; stale receipt handles
``fifo``            broker-only: FIFO message groups, one message of a group at a time, groups in
                    parallel
==================  ================================================================================

Mapping of the broker contract (``consumer_kit.broker``):

===================  ===============================================================================
contract             SQS
===================  ===============================================================================
peek-lock            the visibility timeout (the queue's, or ``visibility=`` in the URL), kept by
                     the heartbeat until settlement, at most 12 hours from the receive; a delivery
                     handed back unsettled (a crash point) is left to lapse, as after a crash
ack                  ``DeleteMessage``, batched as ``DeleteMessageBatch``
retry(delay)         standard: a copy with ``DelaySeconds`` (<= 900 s) and the deliveries so far, then
                     delete; FIFO (or longer delays): ``ChangeMessageVisibility(delay)``
release              standard: an uncounted copy, then delete; FIFO: ``ChangeMessageVisibility(0)``
dead_letter          a copy to the DLQ (the redrive policy's target, else ``<queue>-dlq``) with
                     ``x-dead-letter-reason``/``-detail`` attributes, then delete
renew_lock           ``ChangeMessageVisibility`` (the heartbeat does it on its own as well)
delivery count       ``ApproximateReceiveCount`` (+ earlier copies, - uncounted releases)
redelivered          a receive count this adapter's own give-backs do not explain
                     (:mod:`consumer_kit.adapters.sqs.redelivery`: why copies on standard queues)
message id           ``x-consumer-kit-message-id`` (the outbox event ID), else SQS's ``MessageId``
ordering             FIFO ``MessageGroupId`` = the partition key, per-group lanes
stable publish id    FIFO ``MessageDeduplicationId`` = the event ID, plus the message-id attribute
size limit           the queue's ``MaximumMessageSize``, body plus attributes, checked before sending
===================  ===============================================================================

**The 5-minute FIFO deduplication window protects sends only**: SQS drops a second send with the
same ``MessageDeduplicationId`` within 5 minutes (a relay that publishes an event again after a
crash), nothing more. It does not stop a redelivery (a lapsed lock, a failed delete) nor a re-send
after 5 minutes; the ledger answers those as duplicates.

Entry points (``consumer_kit.brokers``, scheme ``sqs``): :func:`consumer_from_settings`,
:func:`publisher_from_settings`, :func:`dead_letters_from_settings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from consumer_kit.errors import MissingExtra

try:
    import boto3  # noqa: F401 - the SDK of the sqs extra
    import botocore  # noqa: F401
except ImportError as missing:  # the extra this adapter needs (consumer_kit.broker.registry names it)
    raise MissingExtra("sqs", missing) from missing

from consumer_kit.settings import BrokerSettings, Settings

from .config import SQSConfig
from .connection import SQSClient
from .consumer import SQSConsumer
from .dead_letters import SQSDeadLetters
from .delivery import SQSDelivery
from .envelope import (
    DEAD_LETTER_DETAIL_ATTRIBUTE,
    DEAD_LETTER_REASON_ATTRIBUTE,
    DELIVERIES_ATTRIBUTE,
    MESSAGE_ID_ATTRIBUTE,
    ORIGINAL_QUEUE_ATTRIBUTE,
    REDELIVERED_ATTRIBUTE,
    attributes_for,
    headers_of,
)
from .publisher import SQSPublisher
from .topology import QueueInfo, dead_letter_name, recommended_max_receive_count, sqs_queue_name

__all__ = [
    "DEAD_LETTER_DETAIL_ATTRIBUTE",
    "DEAD_LETTER_REASON_ATTRIBUTE",
    "DELIVERIES_ATTRIBUTE",
    "MESSAGE_ID_ATTRIBUTE",
    "ORIGINAL_QUEUE_ATTRIBUTE",
    "REDELIVERED_ATTRIBUTE",
    "QueueInfo",
    "SQSClient",
    "SQSConfig",
    "SQSConsumer",
    "SQSDeadLetters",
    "SQSDelivery",
    "SQSPublisher",
    "attributes_for",
    "consumer_from_settings",
    "dead_letter_name",
    "dead_letters_from_settings",
    "headers_of",
    "publisher_from_settings",
    "recommended_max_receive_count",
    "sqs_queue_name",
]


def consumer_from_settings(settings: Settings) -> SQSConsumer:
    """Entry point ``consumer_kit.broker.registry: sqs``: a consumer for ``settings`` (``broker_url``,
    ``max_deliveries``, ``crash_limit``, ``settle_timeout``, ``concurrency``, ``handler_timeout``).

    Raises:
        ConfigurationError: the ``sqs://`` URL is invalid.
    """
    return SQSConsumer(
        SQSConfig.from_url(settings.broker_url),
        max_deliveries=settings.max_deliveries,
        crash_limit=settings.crash_limit,
        settle_timeout=settings.settle_timeout,
        concurrency=settings.concurrency,
        handler_timeout=settings.handler_timeout,
    )


def publisher_from_settings(settings: BrokerSettings) -> SQSPublisher:
    """Entry point ``consumer_kit.broker.registry: sqs``: a publisher for ``settings.broker_url``.

    Raises:
        ConfigurationError: the ``sqs://`` URL is invalid.
    """
    return SQSPublisher(SQSConfig.from_url(settings.broker_url))


def dead_letters_from_settings(settings: BrokerSettings) -> SQSDeadLetters:
    """Entry point ``consumer_kit.broker.registry: sqs``: the dead-letter queues of the work queues at
    ``settings.broker_url`` (``consumer-kit dlq``; :mod:`consumer_kit.adapters.sqs.dead_letters`).

    Raises:
        ConfigurationError: the ``sqs://`` URL is invalid.
    """
    return SQSDeadLetters(SQSConfig.from_url(settings.broker_url))


if TYPE_CHECKING:  # mypy checks this module against the core's description of an adapter module
    from consumer_kit.broker.registry import DeadLetterAdapter

    from .. import sqs as this_module

    _PROVIDES: DeadLetterAdapter = this_module
