"""Which delivery tags of a channel are still unacked, so that one multiple ``basic.ack`` can
settle a batch (:func:`consumer_kit.broker.ack_all`).

A ``basic.ack`` with ``multiple`` set acks *every* unacked tag of its channel up to and including
its own (AMQP 0-9-1, basic.ack). It is safe only when each of those tags is one the caller means
to ack: never one still running, waiting for its copy's confirm (retry, dead letter, release) or
an unmappable message being rejected. So every message handed to the subscription is held here
from its arrival until the frame that settles it (ack, nack or reject) is written; the registry is
per aiormq channel (tags restart on a new channel) and dies with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

# aiormq channel -> its unacked tags, in arrival (= tag) order
_UNACKED: weakref.WeakKeyDictionary[Any, dict[int, None]] = weakref.WeakKeyDictionary()


def hold(message: AbstractIncomingMessage) -> None:
    """``message`` arrived on its channel and is not settled yet."""
    if message.delivery_tag is not None:
        _UNACKED.setdefault(message.channel, {})[message.delivery_tag] = None


def settled(message: AbstractIncomingMessage) -> None:
    """The frame settling ``message`` (ack, nack, reject) was written, or its channel is gone."""
    tags = _UNACKED.get(message.channel)
    if tags is not None and message.delivery_tag is not None:
        tags.pop(message.delivery_tag, None)


def settled_all(messages: Sequence[AbstractIncomingMessage]) -> None:
    """:func:`settled` of ``messages``, all of one channel (a multiple ack)."""
    tags = _UNACKED.get(messages[0].channel) if messages else None
    if tags is not None:
        for message in messages:
            tags.pop(message.delivery_tag or 0, None)


def multiple_ack_prefix(messages: Sequence[AbstractIncomingMessage]) -> int:
    """How many of ``messages`` (one channel's, unacked, ascending tags) one multiple ack of the
    last of them may settle: the longest prefix that is exactly the channel's lowest unacked tags
    (0 or 1: no gain over single acks)."""
    tags = _UNACKED.get(messages[0].channel) if messages else None
    if not tags:
        return 0
    n = 0
    for unacked, message in zip(tags, messages, strict=False):
        if unacked != message.delivery_tag:
            break
        n += 1
    return n
