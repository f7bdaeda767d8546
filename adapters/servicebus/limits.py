"""Size checks made before every send, so one message never fails a batch or a link for others.

Service Bus limits a message to the entity's maximum message size (256 KB on the standard tier,
1 MB and up to 100 MB on premium), which the link reports when it opens, and a batch to the
link's batch size (256 KB standard, 1 MB premium). The SDK measures each message's encoded size as
it is added to a ``ServiceBusMessageBatch``, but copies the first message's id, session id and
partition key onto the batch envelope *after* measuring (up to three 128-character strings more
on the wire than it counted), so:

* a batch of several messages (:func:`batch_for`) is bounded by the smaller limit minus
  :data:`ENVELOPE_MARGIN` bytes;
* a message that does not fit such a batch goes alone (no envelope): :func:`check_fits_alone`
  measures it against the smaller limit and raises :class:`TooLarge` (never sent) when it does not
  fit, except where the link allows larger messages than batches (premium large-message entities):
  then Service Bus decides.
"""
from __future__ import annotations

from azure.servicebus import ServiceBusMessage, ServiceBusMessageBatch
from azure.servicebus.aio import ServiceBusSender
from azure.servicebus.exceptions import MessageSizeExceededError

from .errors import TooLarge


def link_message_limit(sender: ServiceBusSender) -> int:
    """Bytes: the largest message the open link accepts (0 when not known yet). The SDK keeps the
    link's negotiated ``max-message-size`` without a public accessor."""
    return int(getattr(sender, "_max_message_size_on_link", 0) or 0)


ENVELOPE_MARGIN = 512
"""Bytes kept free in a batch of several messages for what the SDK adds to its envelope unmeasured."""


async def empty_batch(sender: ServiceBusSender, *, margin: int = 0) -> ServiceBusMessageBatch:
    """An empty batch bounded by the link's batch and message limits less ``margin`` bytes (opens
    the link if needed).

    Raises:
        azure.servicebus.exceptions.ServiceBusError: the link could not be opened.
    """
    batch = await sender.create_message_batch()
    limit = batch.max_size_in_bytes
    message_limit = link_message_limit(sender)
    if 0 < message_limit < limit:
        limit = message_limit
    if limit - margin != batch.max_size_in_bytes:
        batch = await sender.create_message_batch(max_size_in_bytes=max(1, limit - margin))
    return batch


async def batch_for(sender: ServiceBusSender) -> ServiceBusMessageBatch:
    """An empty batch for several messages (see the module docstring)."""
    return await empty_batch(sender, margin=ENVELOPE_MARGIN)


def add_or_refuse(batch: ServiceBusMessageBatch, message: ServiceBusMessage) -> bool:
    """Add ``message`` to ``batch``; ``False`` when it does not fit (the batch is unchanged)."""
    try:
        batch.add_message(message)
    except MessageSizeExceededError:
        return False
    return True


async def check_fits_alone(sender: ServiceBusSender, message: ServiceBusMessage, *, body_size: int, what: str) -> None:
    """Raise :class:`TooLarge` unless ``message`` can be sent by itself (see the module docstring).

    Raises:
        TooLarge: larger than the batch limit where the link allows no more than that.
    """
    batch = await empty_batch(sender)
    if add_or_refuse(batch, message):
        return
    limit = batch.max_size_in_bytes
    if link_message_limit(sender) > limit:
        return  # a premium large-message entity: Service Bus decides
    raise TooLarge(
        f"{what} (body {body_size} bytes) does not fit the {limit}-byte message limit of "
        f"{sender.entity_name!r}",
        limit=limit,
    )


async def encoded_size(sender: ServiceBusSender, message: ServiceBusMessage) -> int:
    """Bytes ``message`` takes on the wire, as the SDK measures it (within a batch: a few bytes
    more than alone, so the estimate errs on the large side).

    Raises:
        TooLarge: larger than any batch the link takes (its size is then not measured).
    """
    batch = await empty_batch(sender)
    before = batch.size_in_bytes
    if not add_or_refuse(batch, message):
        raise TooLarge(f"larger than the {batch.max_size_in_bytes}-byte limit", limit=batch.max_size_in_bytes)
    return batch.size_in_bytes - before
