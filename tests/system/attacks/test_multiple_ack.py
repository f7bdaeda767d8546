"""Attacks on RabbitMQ's multiple ack for batches (adapters/rabbitmq/acks.py, ``ack_all``): a
multiple ``basic.ack`` must never cover a delivery that is not settled yet.

Real broker: batches finishing out of order on one channel, a delivery of a batch going to retry
or dead-letter whose copy the broker does not take (so the original is nacked back and comes
again with a higher tag), and that redelivered tag sitting between the tags of a later batch. If a
multiple ack covered one of them, the later ``basic.nack`` of that tag would be an unknown delivery
tag (the broker closes the channel: every delivery of it ``lost``), or a message would vanish from
the queue although nobody settled it; both are asserted against.
"""

from __future__ import annotations

import asyncio

import pytest

from consumer_kit.adapters.rabbitmq.delivery import RabbitMQDelivery
from consumer_kit.broker import Settlement, ack_all
from tests.adapters.rabbitmq.test_adapter import (
    Inbox,
    ack_what_comes_back,
    cleanup,
    consuming,
    queue_state,
    raw_channel,
    send,
)

__all__ = ["cleanup"]  # the fixture, imported for the tests below

pytestmark = [pytest.mark.rabbitmq]


async def test_out_of_order_batches_with_refused_retry_and_dead_letter_copies_ack_nothing_unsettled(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox, prefetch=10) as consumer:
        # the copies of a retry (0.5 s tier) and of a dead letter have nowhere to go: returned, so the
        # originals fall back to nack-requeue and come again with new, higher tags
        async with raw_channel(rabbitmq_url) as channel:
            for name in (f"{unique_name}.retry.500ms", f"{unique_name}.dlq"):
                await channel.queue_delete(name)
        ids = [await send(rabbitmq_url, unique_name, message_id=f"m{n}") for n in range(1, 9)]
        held = [await inbox.next() for _ in ids]
        assert [d.message_id for d in held] == ids  # tag order
        d1, d2, d3, d4, d5, d6, d7, d8 = held
        batch_b = [d5, d6, d7]  # batch A: d1..d4; d8: still being processed, alone

        # batch B finishes first, while all of batch A is unsettled below it: no group at all
        assert RabbitMQDelivery._ack_groups(list(batch_b))[0] == []
        # meanwhile, in batch A, d2 goes to retry and d3 to dead-letter, concurrently with B's acks
        await asyncio.gather(ack_all(batch_b), d2.retry(0.5), d3.dead_letter("attack", "refused copy"))
        assert [d.settlement for d in held] == [
            None, Settlement.RETRY, Settlement.DEAD_LETTER, None, Settlement.ACK, Settlement.ACK, Settlement.ACK, None,
        ]
        assert d2.lost and d3.lost  # fell back to nack-requeue: they come again
        assert not any(d.lost for d in batch_b)
        again = sorted([await inbox.next(), await inbox.next()], key=lambda d: d.message_id or "")
        assert [d.message_id for d in again] == ["m2", "m3"] and all(d.redelivered for d in again)
        d2b, d3b = again

        # batch A's rest (d1, d4) are the channel's lowest unacked tags (d2, d3 were nacked): one
        # multiple ack of d4; it must not cover d8 nor the redelivered d2b/d3b above it
        groups, alone = RabbitMQDelivery._ack_groups([d1, d4])
        assert [list(g.members) for g in groups] == [[d1, d4]] and alone == []
        # a later batch that holds a redelivery and d8, with d2b unsettled between: not a prefix
        groups, alone = RabbitMQDelivery._ack_groups([d3b])
        assert groups == []
        await ack_all([d1, d4])
        await ack_all([d3b])  # above d8 and d2b, which stay unsettled: acked alone
        assert not any(d.lost for d in (d1, d4, d3b))
        assert consumer.ready  # no unknown-tag channel error: nothing was acked twice
        assert d8.settlement is None and d2b.settlement is None

    # closed: d8 and d2b, never settled, must go back to the queue
    await ack_what_comes_back(rabbitmq_url, unique_name, ["m2", "m8"])


async def test_a_multiple_ack_racing_a_running_release_never_covers_the_released_tag(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    """d2 is given back (release: copy to the queue, confirm, then ack) while the batch around it
    (d1, d3) is acked: d1..d3 are never all three one multiple ack's, whatever the interleaving,
    and the released copy arrives exactly once."""
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox, prefetch=10) as consumer:
        ids = [await send(rabbitmq_url, unique_name, message_id=f"r{n}") for n in range(1, 4)]
        d1, d2, d3 = [await inbox.next() for _ in ids]
        release = asyncio.ensure_future(d2.release())
        await ack_all([d1, d3])
        await release
        assert not any(d.lost for d in (d1, d2, d3))
        copy = await inbox.next()
        assert copy.message_id == "r2" and not copy.redelivered
        await copy.ack()
        assert not copy.lost and consumer.ready
    assert await queue_state(rabbitmq_url, unique_name) == (0, 0)
