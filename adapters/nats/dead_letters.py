"""Listing and redriving a work queue's dead-letter stream (``consumer-kit dlq``; contract:
:class:`consumer_kit.broker.DeadLetterQueues`).

**Which stream.** ``<stream>_dlq`` of the work queue (:mod:`consumer_kit.adapters.nats.topology`):
one per work queue, so every message in it is that queue's.

**Count**: the stream's message count. **Peek**: the stream is read by sequence
(``STREAM.MSG.GET``), oldest first; nothing is held or removed, and no consumer is created.

**Redrive** (copy, then delete): each selected message present when the redrive starts is published
to its work queue's subject (``subject_for(queue, partition-key)``) with the same body,
``x-consumer-kit-message-id`` and operation headers, without the dead-letter headers and
``x-consumer-kit-deliveries`` (its delivery count starts again), plus ``x-consumer-kit-redriven`` =
the reason it had, and a random ``Nats-Msg-Id`` (:mod:`consumer_kit.broker.kit.copy_ids`: no
producer can pre-empt it); a publish ack saying ``duplicate`` is a refused copy, never a redrive. Only after the publish ack is it deleted from the
dead-letter stream (``STREAM.MSG.DELETE``): at least once; a crash in between leaves it in both,
which the ledger answers as a duplicate.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from consumer_kit.broker import DeadLetter, DeadLetterQueues, RedriveReport, header_count, header_text
from consumer_kit.broker.dead_letters import REASON_ON_COPY_CHARS, Redrive, RedriveAsked
from consumer_kit.broker.kit.copy_ids import random_copy_id
from consumer_kit.codec import headers as own
from consumer_kit.codec.envelope import OPERATION_ID_HEADER
from consumer_kit.errors import CopyRefused, RemoveFailed

from .config import NATSConfig
from .connection import API_TIMEOUT, NATSConnection
from .envelope import (
    DEAD_LETTER_DETAIL_HEADER,
    DEAD_LETTER_REASON_HEADER,
    DELIVERIES_HEADER,
    MESSAGE_ID_HEADER,
    MSG_ID,
    ORIGINAL_QUEUE_HEADER,
    PACKED_HEADER,
    REDELIVERED_HEADER,
    copy_headers,
    headers_of,
)
from .errors import describe, is_unreachable
from .limits import fit, limit_of
from .topology import QueueInfo, lookup_queue, subject_for

logger = logging.getLogger(__name__)

REDRIVEN_HEADER = own.REDRIVEN
_DROPPED = frozenset({DEAD_LETTER_REASON_HEADER, DEAD_LETTER_DETAIL_HEADER, ORIGINAL_QUEUE_HEADER,
                      DELIVERIES_HEADER, REDELIVERED_HEADER, PACKED_HEADER, REDRIVEN_HEADER})


class NATSDeadLetters(DeadLetterQueues):
    """The dead-letter streams of the work queues at a ``nats://`` server (module docstring)."""

    def __init__(self, config: NATSConfig, *, connection: NATSConnection | None = None) -> None:
        self._owns_connection = connection is None
        self.connection = connection or NATSConnection(config)

    async def count(self, queue: str) -> int:
        info = await self._queue(queue)
        js = await self.connection.jetstream()
        return int((await self._call(js.stream_info(info.dlq_stream))).state.messages)

    async def peek(self, queue: str, *, limit: int = 100) -> list[DeadLetter]:
        info = await self._queue(queue)
        found: list[DeadLetter] = []
        async for raw in self._messages(info):
            found.append(dead_letter_of(raw, queue))
            if len(found) >= limit:
                break
        return found

    async def _redrive(self, queue: str, asked: RedriveAsked) -> RedriveReport:
        info = await self._queue(queue)
        redrive = _Redrive(asked, self.connection, info, limit_of(await self.connection.max_payload(), info.max_msg_size))
        async for raw in self._messages(info):
            await redrive.look_at(raw, dead_letter_of(raw, queue))
        return redrive.report

    async def close(self) -> None:
        if self._owns_connection:
            await self.connection.close()

    async def _messages(self, info: QueueInfo) -> Any:
        """The messages of the dead-letter stream present now, by sequence."""
        js = await self.connection.jetstream()
        state = (await self._call(js.stream_info(info.dlq_stream))).state
        for seq in range(int(state.first_seq or 0), int(state.last_seq or 0) + 1):
            try:
                yield await self._call(js.get_msg(info.dlq_stream, seq=seq))
            except NotFoundError:
                continue  # deleted (redriven) earlier

    async def _queue(self, queue: str) -> QueueInfo:
        js = await self.connection.jetstream()
        info: QueueInfo = await self._call(lookup_queue(js, queue))
        return info

    @staticmethod
    async def _call(work: Any) -> Any:
        try:
            return await work
        except Exception as exc:
            if is_unreachable(exc):
                raise ConnectionError(f"cannot reach NATS: {describe(exc)}") from exc
            raise


class _Redrive(Redrive[RawStreamMsg]):
    """One redrive from the dead-letter stream to the work queue: publish, then delete."""

    def __init__(self, asked: RedriveAsked, connection: NATSConnection, info: QueueInfo, limit: int) -> None:
        super().__init__(asked, target=info.queue, source=info.dlq_stream)
        self._connection, self._info, self._limit = connection, info, limit

    async def send_copy(self, raw: RawStreamMsg, letter: DeadLetter) -> None:
        body = raw.data or b""
        headers = {k: v for k, v in copy_headers(letter.headers).items() if k not in _DROPPED}
        headers[MESSAGE_ID_HEADER] = letter.message_id
        headers[REDRIVEN_HEADER] = letter.reason[:REASON_ON_COPY_CHARS]
        try:
            sent, _ = fit(body, headers, self._limit, droppable=(REDRIVEN_HEADER,),
                          extra={MSG_ID: random_copy_id()})
        except ValueError as exc:
            raise CopyRefused(str(exc)) from exc
        subject = subject_for(self._info.queue, own.read_text(letter.headers.get(own.PARTITION_KEY), 512))
        js = await self._connection.jetstream()
        try:
            ack = await js.publish(subject, body, headers=sent, timeout=API_TIMEOUT)
        except Exception as exc:
            if is_unreachable(exc):
                raise ConnectionError(f"cannot reach NATS: {describe(exc)}") from exc
            raise CopyRefused(describe(exc)) from exc
        if ack.duplicate:
            raise CopyRefused(f"stream {ack.stream} answered the copy as a duplicate: its Nats-Msg-Id was used before")

    async def remove(self, raw: RawStreamMsg, letter: DeadLetter) -> None:
        js = await self._connection.jetstream()
        try:
            await js.delete_msg(self._info.dlq_stream, int(raw.seq or 0))
        except Exception as exc:
            if is_unreachable(exc):
                raise ConnectionError(f"cannot reach NATS: {describe(exc)}") from exc
            raise RemoveFailed(describe(exc)) from exc


def dead_letter_of(raw: RawStreamMsg, queue: str) -> DeadLetter:
    """What ``consumer-kit dlq list`` shows of one message of a dead-letter stream: consumer-kit's
    signed marks only (reason, detail, count, message id); the stream's timestamp is the
    dead-letter time."""
    body = raw.data or b""
    headers = dict(own.read(headers_of(raw.headers), body).headers)
    at = raw.time.astimezone(dt.UTC) if raw.time else None
    return DeadLetter(
        queue=queue,
        message_id=header_text(headers.get(MESSAGE_ID_HEADER)) or header_text(headers.get(MSG_ID)) or None,
        reason=header_text(headers.get(DEAD_LETTER_REASON_HEADER)) or "unknown",
        detail=header_text(headers.get(DEAD_LETTER_DETAIL_HEADER)),
        delivery_count=header_count(headers.get(DELIVERIES_HEADER)),
        dead_lettered_at=at,
        enqueued_at=None,
        operation_key=header_text(headers.get(OPERATION_ID_HEADER)) or None,
        headers=headers,
        body=body,
    )
