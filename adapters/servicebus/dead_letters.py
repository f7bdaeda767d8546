"""Listing and redriving the dead letters of a Service Bus queue or subscription (``consumer-kit
dlq``; contract: :class:`consumer_kit.broker.DeadLetterQueues`; the loop:
:class:`consumer_kit.broker.dead_letters.Redrive`).

**Which queue.** ``<entity>/$DeadLetterQueue`` of the queue or ``topic/Subscriptions/name`` asked
for, read with a ``sub_queue=ServiceBusSubQueue.DEAD_LETTER`` receiver (never a session receiver: a
dead-letter sub-queue does not lock by session). It holds that entity's dead letters only.

**Peek**: ``peek_messages`` (no lock, the delivery count untouched), pages of :data:`PEEK_PAGE`
from sequence number 1 on: oldest first on a plain entity; on a partitioned one, partition by
partition in the order they answer (each partition oldest first; none skipped:
:mod:`~consumer_kit.adapters.servicebus.browse`). **Count**: the messages one peek pass finds, at most
:data:`COUNT_LIMIT`. Service Bus's own count (``get_queue_runtime_properties``) needs the HTTPS
management API and *Manage* rights; consumer-kit speaks AMQP only, with a worker's rights
(*Listen*, and *Send* to redrive), and the local test server has no management API.

**What a dead letter shows** (:func:`~consumer_kit.adapters.servicebus.dead_letter_reading.dead_letter_of`): reason ``DeadLetterReason`` as consumer-kit
set it, or ``broker:<reason>`` for one of Service Bus's own (:data:`~consumer_kit.adapters.servicebus.dead_letter_reading.SERVICE_BUS_REASONS`); detail
``DeadLetterErrorDescription``; the message id consumer-kit saw (``x-consumer-kit-message-id`` of
a retry copy, else the message's); delivery count ``x-consumer-kit-deliveries + delivery_count +
1`` when a receiver dead-lettered it (what the worker counted), without the ``+ 1`` when Service Bus
moved it (its count holds the last delivery); each earlier redrive that locked and kept the
message adds one. Service Bus keeps no dead-letter time: ``dead_lettered_at`` is ``None``,
``enqueued_at`` the message's enqueued time.

**Redrive** (queues only), in two steps:

1. *Choose*: one peek pass calls ``select`` on each message there (no lock). That pass is the
   start line: messages dead-lettered after it are left for the next redrive. A dry run ends here.
2. *Move*: receive in peek-lock, oldest first, at most as many at a time as chosen messages are
   still missing. A chosen message gets a copy sent to the queue
   (:func:`~consumer_kit.adapters.servicebus.envelope.redrive_copy_of`: same body, session id, correlation id,
   subject and application properties, no dead-letter properties, its delivery count starting
   again) and is completed **only after** Service Bus accepted the send: at least once (a crash in
   between leaves it in both places; the ledger answers the second as a duplicate). Every other
   message received (not chosen, arrived after step 1, back after its lock lapsed) is held until
   the end and then abandoned (one more on its delivery count). The step ends once every chosen
   message is moved, or when a receive brings nothing new within ``receive_wait`` seconds; chosen
   messages never received (locked elsewhere, or removed) count as failed.

The copy's own message id is keyed by the deployment's mark key on the dead letter (entity,
sequence number, message id; :func:`consumer_kit.broker.kit.copy_ids.keyed_copy_id`, so no producer
can send under it first), never the original's: duplicate detection would silently drop a copy under an id it saw within its
window, and the dead letter would be completed with nothing delivered; a second send of the same
dead letter (after a crash) has the same id, which duplicate detection, where on, drops.

**Subscriptions** are listed and counted, never redriven (dry runs too): Service Bus cannot send
to one subscription, and a copy sent to the topic reaches every subscription of it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from azure.servicebus import ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver, ServiceBusSender
from azure.servicebus.exceptions import ServiceBusAuthorizationError

from consumer_kit.broker import DeadLetter, DeadLetterQueues, RedriveReport
from consumer_kit.broker.dead_letters import REASON_ON_COPY_CHARS, Redrive, RedriveAsked
from consumer_kit.broker.kit.copy_ids import keyed_copy_id
from consumer_kit.errors import ConfigurationError, CopyRefused, RemoveFailed

from .browse import BrowseCursor
from .config import Namespace
from .connection import Connection, close_quietly
from .dead_letter_reading import dead_letter_of
from .envelope import (
    redrive_copy_of,
)
from .errors import LOCK_LOST, TooLarge, dead_letter_error, describe, is_refusal
from .limits import check_fits_alone
from .throttling import while_throttled
from .topology import Entity, sender_for

logger = logging.getLogger(__name__)

T = TypeVar("T")

PEEK_PAGE = 100
"""Messages asked for by one ``peek_messages`` call."""

COUNT_LIMIT = 10_000
"""The most :meth:`ServiceBusDeadLetters.count` counts (one peek pass; see the module docstring)."""

RECEIVE_BATCH = 50
"""The most messages one receive of a redrive locks."""

CALL_TIMEOUT = 30.0
"""Seconds any one SDK call may take (the SDK hangs instead of failing against a server that
answers wrongly, so every call is bounded)."""



class ServiceBusDeadLetters(DeadLetterQueues):
    """The dead-letter sub-queues of the queues and subscriptions of one namespace (module docstring).

    Args:
        namespace: where and how to sign in.
        call_timeout: seconds any one SDK call may take.
        receive_wait: seconds one receive of a redrive waits for a first message; a receive that
            brings nothing new ends the redrive's second step.

    Raises:
        ValueError: on invalid arguments (here). Every method raises ``ConfigurationError`` for a
            name that is not a queue or ``topic/Subscriptions/name``, no such entity, or access
            refused, and ``ConnectionError`` when Service Bus cannot be reached or did not answer
            in time.
    """

    def __init__(self, namespace: Namespace, *, call_timeout: float = CALL_TIMEOUT, receive_wait: float = 1.0) -> None:
        if call_timeout <= 0 or receive_wait <= 0:
            raise ValueError("call_timeout and receive_wait must be > 0 seconds")
        self._namespace = namespace
        self._call_timeout = call_timeout
        self._receive_wait = receive_wait
        self._connection: Connection | None = None
        self._browsers: dict[str, ServiceBusReceiver] = {}

    async def count(self, queue: str) -> int:
        """Dead letters of ``queue`` now, at most :data:`COUNT_LIMIT` (by peeking; module docstring).
        Raises as the class says."""
        entity = _entity(queue)
        total = 0
        async for page in self._browse(entity, COUNT_LIMIT):
            total += len(page)
        return total

    async def peek(self, queue: str, *, limit: int = 100) -> list[DeadLetter]:
        """Up to ``limit`` dead letters of ``queue`` by ``peek_messages``: nothing is locked or
        counted. Oldest (lowest sequence number) first on a plain entity; on a partitioned one,
        partition by partition in the order they answer (the first ``limit`` found are not
        necessarily the oldest of all). Raises as the class says."""
        entity = _entity(queue)
        return [dead_letter_of(message, queue) async for page in self._browse(entity, limit) for message in page]

    async def _redrive(self, queue: str, asked: RedriveAsked) -> RedriveReport:
        """:meth:`redrive`: move the dead letters of the queue ``queue`` that ``select`` accepts back to it: choose
        by one peek pass, then copy and complete each (module docstring). ``failed`` counts copies
        Service Bus refused or that do not fit the queue's size limit, and chosen messages that
        were never received; they stay in the dead-letter queue (unless removed meanwhile).

        Raises:
            ConfigurationError: ``queue`` is a topic subscription (see the module docstring), not
                an entity name, no such queue, or access refused.
            ConnectionError: Service Bus cannot be reached or did not answer in time (messages
                already copied stay moved; the rest stay in the dead-letter queue).
        """
        entity = _entity(queue)
        if not entity.is_queue:
            raise ConfigurationError(
                f"{queue!r} is a topic subscription: consumer-kit dlq redrive moves dead letters back "
                "to queues only. Service Bus cannot send to one subscription, and a copy sent to the "
                f"topic {entity.topic!r} would reach every subscription of it. List them with "
                "`consumer-kit dlq list`; resubmit to the topic yourself if every subscription may "
                "get them again"
            )
        chosen: set[int] = set()
        choosing = _Redrive(asked, entity, call_timeout=self._call_timeout,
                            fail=lambda what, exc: self._error(entity, what, exc))
        async for page in self._browse(entity, sys.maxsize):  # step 1: the start line
            for message in page:
                letter = dead_letter_of(message, queue)
                if choosing.choose(letter):
                    chosen.add(message.sequence_number or 0)
        if chosen:
            await self._move(entity, queue, chosen, choosing)
        return choosing.report

    async def close(self) -> None:
        """Close the receivers and the client (idempotent)."""
        browsers, self._browsers = list(self._browsers.values()), {}
        for browser in browsers:
            await close_quietly(browser, self._call_timeout, "a dead-letter browser")
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close(self._call_timeout)

    # -- step 2 of a redrive ----------------------------------------------------------------------

    async def _move(self, entity: Entity, queue: str, chosen: set[int], run: _Redrive) -> None:
        """Receive until every chosen message is moved or a receive brings nothing new; abandon
        what was held, whatever happens."""
        client = self._client()
        receiver = entity.dead_letter_receiver(client)
        sender = sender_for(client, entity.path)
        run.links = (receiver, sender)
        missing = set(chosen)  # chosen and not received yet
        seen: set[int] = set()
        try:
            # Opened first: a receive's short wait would also bound opening the link.
            await self._call(entity, "open a receiver", receiver.__aenter__())
            while missing:
                most = min(RECEIVE_BATCH, len(missing))
                batch = await self._call(
                    entity, "receive",
                    receiver.receive_messages(max_message_count=most, max_wait_time=self._receive_wait),
                )
                new = False
                for message in batch:
                    number = message.sequence_number or 0
                    new = new or number not in seen
                    seen.add(number)
                    if number not in missing:  # not chosen, arrived since step 1, or back after a lapse
                        run.held.append(message)
                        continue
                    missing.discard(number)
                    if not await run.move(message, dead_letter_of(message, queue)):
                        run.held.append(message)  # the copy was refused: left, given back at the end
                if not new:
                    break
        finally:
            await self._give_back(entity, receiver, run.held)
            await close_quietly(sender, self._call_timeout, f"the redrive sender of {entity.path}")
            await close_quietly(receiver, self._call_timeout, f"the redrive receiver of {entity.dead_letter_path}")
        if missing:
            run.report.failed += len(missing)
            logger.warning(
                "%s chosen dead letter(s) of %s were not received (locked by another receiver, or "
                "removed meanwhile): not redriven", len(missing), entity.path,
            )

    async def _give_back(self, entity: Entity, receiver: ServiceBusReceiver, held: list[ServiceBusReceivedMessage]) -> None:
        """Abandon every held message (each goes back with one more on its delivery count). A lock
        that lapsed needs nothing; any other failure stops here: the locks lapse by themselves."""
        for index, message in enumerate(held):
            try:
                async with asyncio.timeout(self._call_timeout):
                    await receiver.abandon_message(message)
            except LOCK_LOST:
                continue
            except Exception as exc:  # noqa: BLE001 - they come back when their locks lapse
                logger.warning(
                    "could not give back %s held dead letter(s) of %s (%s): they come back when their "
                    "locks lapse", len(held) - index, entity.path, describe(exc),
                )
                return

    # -- peeking ---------------------------------------------------------------------------------

    async def _browse(self, entity: Entity, most: int) -> AsyncIterator[list[ServiceBusReceivedMessage]]:
        """Pages of the dead-letter queue by ``peek_messages``, ``most`` messages at most, each
        message once: in sequence order on a plain entity; on a partitioned one partition by
        partition, in the order the partitions answer (:class:`~.browse.BrowseCursor` says where each
        peek starts so that none is skipped). A page may be empty (a peek that brought only messages
        already seen)."""
        cursor, seen = BrowseCursor(), 0
        while seen < most:
            count = min(PEEK_PAGE, most - seen)
            receiver = self._browser(entity)
            try:
                def peek(r: Any = receiver, n: int = count, at: int = cursor.start) -> Awaitable[list[Any]]:
                    return r.peek_messages(max_message_count=n, sequence_number=at)  # type: ignore[no-any-return]

                page = await self._call(entity, "peek", while_throttled(  # throttled: peeked again (throttling.py)
                    peek, what=f"a peek of {entity.dead_letter_path}",
                ))
            except BaseException:
                self._browsers.pop(entity.path, None)  # a fresh receiver for the next call
                await close_quietly(receiver, self._call_timeout, "a dead-letter browser")
                raise
            new, more = cursor.take([message.sequence_number or 0 for message in page])
            if not more:
                return
            fresh = [page[i] for i in new][: most - seen]
            seen += len(fresh)
            yield fresh

    def _browser(self, entity: Entity) -> ServiceBusReceiver:
        """The receiver that peeks ``entity``'s dead letters (kept for the next call; it never locks)."""
        receiver = self._browsers.get(entity.path)
        if receiver is None:
            receiver = self._browsers[entity.path] = entity.dead_letter_receiver(self._client())
        return receiver

    def _client(self) -> ServiceBusClient:
        if self._connection is None:
            self._connection = Connection(self._namespace, name="consumer-kit dlq")
        return self._connection.client

    async def _call(self, entity: Entity, what: str, call: Awaitable[T]) -> T:
        """Await one SDK call within ``call_timeout``, its failure turned into :meth:`_error`'s."""
        try:
            async with asyncio.timeout(self._call_timeout):
                return await call
        except Exception as exc:
            raise self._error(entity, what, exc) from exc

    def _error(self, entity: Entity, what: str, exc: Exception) -> Exception:
        return dead_letter_error(exc, what=what, entity=entity.path, dead_letters=entity.dead_letter_path,
                                 where=self._namespace.description, call_timeout=self._call_timeout)


class _Redrive(Redrive[ServiceBusReceivedMessage]):
    """One redrive of one queue's dead letters: send the copy (:func:`redrive_copy_of`, checked
    against the queue's size limit), then complete the dead letter. Step 1 chooses with it; step 2
    sets ``links`` (the dead-letter receiver and the queue's sender it opened) and moves.
    ``held``: messages locked, to give back at the end."""

    def __init__(
        self, asked: RedriveAsked, entity: Entity, *, call_timeout: float, fail: Callable[[str, Exception], Exception],
    ) -> None:
        super().__init__(asked, target=entity.path, source=entity.dead_letter_path)
        self.held: list[ServiceBusReceivedMessage] = []
        self._call_timeout = call_timeout
        self._fail = fail  # the ConfigurationError or ConnectionError for a failed SDK call
        self.links: tuple[ServiceBusReceiver, ServiceBusSender] | None = None

    async def send_copy(self, message: ServiceBusReceivedMessage, letter: DeadLetter) -> None:
        """Raises :class:`CopyRefused` when the copy does not fit or Service Bus refuses it;
        :class:`ConfigurationError` when the queue is gone or sending to it is not allowed;
        :class:`ConnectionError` when the send failed otherwise (unknown whether it arrived: left
        in the dead-letter queue, a repeat is a duplicate)."""
        assert self.links is not None, "step 2 sets the links before it moves"
        _, sender = self.links
        copy_id = keyed_copy_id(self._target, message.sequence_number or 0, letter.message_id or "")
        what = f"redrive copy of message_id={letter.message_id}"
        try:
            async with asyncio.timeout(self._call_timeout):
                copy = redrive_copy_of(message, letter.headers, letter.body, copy_id=copy_id,
                                       message_id=letter.message_id, reason=letter.reason[:REASON_ON_COPY_CHARS])
                try:
                    await check_fits_alone(sender, copy, body_size=len(letter.body), what=what)
                except TooLarge:  # the record of the reason is the one thing that may go
                    copy = redrive_copy_of(message, letter.headers, letter.body, copy_id=copy_id,
                                           message_id=letter.message_id, reason=None)
                    await check_fits_alone(sender, copy, body_size=len(letter.body), what=what)
                await sender.send_messages(copy)
        except Exception as exc:
            if isinstance(exc, TooLarge) or (is_refusal(exc) and not isinstance(exc, ServiceBusAuthorizationError)):
                raise CopyRefused(describe(exc)) from exc
            raise self._fail("send", exc) from exc

    async def remove(self, message: ServiceBusReceivedMessage, letter: DeadLetter) -> None:
        assert self.links is not None, "step 2 sets the links before it moves"
        receiver, _ = self.links
        try:
            async with asyncio.timeout(self._call_timeout):
                await receiver.complete_message(message)
        except Exception as exc:
            if not isinstance(exc, LOCK_LOST):
                self.held.append(message)  # still locked, maybe: abandoned at the end
            raise RemoveFailed(describe(exc)) from exc


def _entity(queue: str) -> Entity:
    try:
        return Entity.parse(queue)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
