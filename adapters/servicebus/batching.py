"""Batch sends for one entity: the relay's concurrent publishes leave as ``ServiceBusMessageBatch``-es.

The relay publishes the rows of a pass concurrently, one ``publish()`` each. Every publish to the
same queue or topic joins that entity's :class:`EntityBatcher`; its flush task starts on the first
one and, after letting the others of the same pass join (one turn of the event loop), packs what
waits into batches (at most ``max_messages`` each, bounded by the link's limits, see
:mod:`consumer_kit.adapters.servicebus.limits`) and sends them one after the other. Each publish learns its own
outcome:

* sent: every message of the batch is confirmed;
* too large to send even alone: permanent ``PublishError`` naming the limit, never sent; the rest
  of the batch goes on;
* the batch refused (a refusal Service Bus cannot pin on one message): each of its messages is
  sent alone, so a refusal is that message's own (permanent) and the others go through;
* the link or the connection failed: transient (the sender is re-opened on the next send).

Messages of one batch may carry different session ids (one per partition key: the relay's ordered
mode never claims two rows of one key together). A partitioned entity stores a batch in one
partition and refuses one whose messages carry different keys (Service Bus engineer on
Azure/azure-service-bus#103: a batch is a transaction and "cannot span across partitions"); the
adapter cannot tell a partitioned entity from a plain one without the management API, so it
learns it from that refusal: the refused batch's events are sent each alone (above) and from then
on that entity's batches are grouped by key (the session id, which is the event's partition key,
else the message's partition key; events without either form one group), each group packed on
its own. Plain entities keep mixed batches (the ordered relay's keyed events stay batched).
Partitioned entities with duplicate detection also refuse batches of distinct message ids (every
batch of events): such a batch is refused whole and each of its events sent alone; set
``CONSUMER_KIT_SERVICEBUS_PUBLISH_BATCH_MAX_MESSAGES=1`` for them to skip the refused attempt.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from azure.servicebus import ServiceBusMessage, ServiceBusMessageBatch
from azure.servicebus.aio import ServiceBusClient, ServiceBusSender

from consumer_kit.errors import PublishError

from .connection import close_quietly
from .errors import TooLarge, describe, is_refusal, publish_error
from .limits import add_or_refuse, batch_for, check_fits_alone
from .throttling import while_throttled
from .topology import sender_for

logger = logging.getLogger(__name__)


@dataclass
class Pending:
    """One publish waiting for its batch: the SDK message, the event id, the body size (bytes)."""

    message: ServiceBusMessage
    message_id: str
    body_size: int
    outcome: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def __post_init__(self) -> None:
        # A publisher that gave up waiting never reads the outcome: mark it read, so asyncio does
        # not report an exception "never retrieved".
        self.outcome.add_done_callback(lambda done: done.cancelled() or done.exception())

    def succeed(self) -> None:
        if not self.outcome.done():
            self.outcome.set_result(None)

    def fail(self, error: PublishError) -> None:
        if not self.outcome.done():
            self.outcome.set_exception(error)


class EntityBatcher:
    """Sends the publishes to one queue or topic in batches (see the module docstring).

    Args:
        client: the publisher's client.
        entity: the queue or topic name.
        max_messages: most messages per batch.
        send_timeout: seconds one batch send (or opening the sender) may take.

    Attributes:
        batches_sent: batches Service Bus confirmed.
        keys_apart: a batch mixing keys was refused (a partitioned entity): batches keep to one key.
    """

    def __init__(self, client: ServiceBusClient, entity: str, *, max_messages: int, send_timeout: float) -> None:
        self._client = client
        self.entity = entity
        self._max_messages = max_messages
        self._send_timeout = send_timeout
        self._sender: ServiceBusSender | None = None
        self._waiting: list[Pending] = []
        self._flusher: asyncio.Task[None] | None = None
        self.batches_sent = 0
        self.keys_apart = False

    def submit(self, pending: Pending) -> None:
        """Queue ``pending`` for the next batch; its ``outcome`` resolves once it is sent or refused."""
        self._waiting.append(pending)
        if self._flusher is None or self._flusher.done():
            # one-shot: one flush at a time, awaited (bounded) then cancelled by close()
            self._flusher = asyncio.create_task(self._flush(), name=f"consumer-kit servicebus batch {self.entity}")

    def withdraw(self, pending: Pending) -> None:
        """Take ``pending`` out if it has not left yet (its publisher gave up waiting)."""
        if pending in self._waiting:
            self._waiting.remove(pending)

    async def close(self, timeout: float) -> None:
        """Let the batch in flight finish (at most ``timeout`` seconds), then close the sender."""
        if self._flusher is not None and not self._flusher.done():
            await asyncio.wait({self._flusher}, timeout=timeout)
            self._flusher.cancel()
        await self._reset()

    # -- the flush ----------------------------------------------------------------------------

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the other publishes of this pass are queued by now
        while self._waiting:
            taken, self._waiting = self._waiting, []
            try:
                await self._send_all(taken)
            except BaseException as exc:
                for pending in taken:  # cancelled (closing) or a bug: nobody waits forever
                    pending.fail(PublishError(f"publish of message_id={pending.message_id} aborted: {describe(exc)}"))
                raise

    async def _send_all(self, taken: list[Pending]) -> None:
        try:
            async with asyncio.timeout(self._send_timeout):
                sender = await self._ready_sender()
                packed, alone = await self._pack(sender, taken)
        except Exception as exc:  # noqa: BLE001 - the link did not open: every publish fails alike
            await self._reset()
            for pending in taken:
                pending.fail(publish_error(exc, pending.message_id, self.entity, alone=False))
            return
        for batch, members in packed:
            # One message goes as itself: no batch envelope around it.
            await self._send(sender, members[0].message if len(members) == 1 else batch, members)
        for pending in alone:
            await self._send(sender, pending.message, [pending])

    async def _pack(
        self, sender: ServiceBusSender, taken: list[Pending]
    ) -> tuple[list[tuple[ServiceBusMessageBatch, list[Pending]]], list[Pending]]:
        """Batches of what fits, and what must go alone. Publishes too large to be sent even alone
        are failed here, permanently, never sent."""
        packed: list[tuple[ServiceBusMessageBatch, list[Pending]]] = []
        alone: list[Pending] = []
        for group in _by_key(taken) if self.keys_apart else [taken]:
            await self._pack_group(sender, group, packed, alone)
        return packed, alone

    async def _pack_group(
        self, sender: ServiceBusSender, group: list[Pending],
        packed: list[tuple[ServiceBusMessageBatch, list[Pending]]], alone: list[Pending],
    ) -> None:
        """Pack publishes of one key into ``packed`` batches (``alone``: those that must go alone)."""
        batch = await batch_for(sender)
        members: list[Pending] = []
        for pending in group:
            if len(members) < self._max_messages and _fits(batch, pending):
                members.append(pending)
                continue
            fresh = await batch_for(sender)
            if not _fits(fresh, pending):  # too large for any batch: the current one stays open
                await self._alone_or_refused(sender, pending, alone)
                continue
            if members:
                packed.append((batch, members))
            batch, members = fresh, [pending]
        if members:
            packed.append((batch, members))

    async def _alone_or_refused(self, sender: ServiceBusSender, pending: Pending, alone: list[Pending]) -> None:
        try:
            await check_fits_alone(
                sender, pending.message, body_size=pending.body_size, what=f"message_id={pending.message_id}"
            )
        except TooLarge as exc:
            pending.fail(PublishError(str(exc), permanent=True))
            return
        alone.append(pending)

    async def _send(
        self, sender: ServiceBusSender, payload: ServiceBusMessageBatch | ServiceBusMessage, members: list[Pending]
    ) -> None:
        try:
            async with asyncio.timeout(self._send_timeout):
                # Throttled: sent again after a backoff (throttling.py), within the send's bound.
                await while_throttled(
                    lambda: sender.send_messages(payload), what=f"a send of {len(members)} events to {self.entity}"
                )
        except Exception as exc:  # noqa: BLE001 - classified below
            if len(members) > 1 and is_refusal(exc):
                logger.warning(
                    "a batch of %s events to %s was refused (%s): sending each alone",
                    len(members), self.entity, describe(exc),
                )
                if not self.keys_apart and len({_key(m) for m in members}) > 1:
                    self.keys_apart = True  # a partitioned entity (module docstring)
                    logger.warning("batches to %s keep to one partition key from now on", self.entity)
                for pending in members:
                    await self._send(sender, pending.message, [pending])
                return
            if not is_refusal(exc):
                await self._reset()  # a link that failed is not used again
            for pending in members:
                pending.fail(publish_error(exc, pending.message_id, self.entity, alone=len(members) == 1))
            return
        self.batches_sent += 1
        for pending in members:
            pending.succeed()
        logger.debug("sent %s events to %s in one batch", len(members), self.entity)

    async def _ready_sender(self) -> ServiceBusSender:
        if self._sender is None:
            self._sender = sender_for(self._client, self.entity)
        return self._sender

    async def _reset(self) -> None:
        sender, self._sender = self._sender, None
        await close_quietly(sender, self._send_timeout, f"the sender to {self.entity}")


def _by_key(taken: list[Pending]) -> list[list[Pending]]:
    """``taken`` grouped by session id / partition key, groups and members in arrival order."""
    groups: dict[str | None, list[Pending]] = {}
    for pending in taken:
        groups.setdefault(_key(pending), []).append(pending)
    return list(groups.values())


def _key(pending: Pending) -> str | None:
    """What places a message in a partition: its session id, else its partition key."""
    return pending.message.session_id or pending.message.partition_key


def _fits(batch: ServiceBusMessageBatch, pending: Pending) -> bool:
    """Add ``pending`` to ``batch`` if it fits."""
    return add_or_refuse(batch, pending.message)
