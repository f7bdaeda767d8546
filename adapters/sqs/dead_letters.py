"""Listing and redriving a work queue's dead-letter queue (``consumer-kit dlq``; contract:
:class:`consumer_kit.broker.DeadLetterQueues`).

**Which queue.** The work queue's ``RedrivePolicy`` ``deadLetterTargetArn``, else ``<name>-dlq``:
the queue :class:`~consumer_kit.adapters.sqs.delivery.SQSDelivery` dead-letters to
(:meth:`~consumer_kit.adapters.sqs.topology.QueueDirectory.dead_letter_queue`). A dead-letter queue may serve
several work queues; only the dead letters of the queue asked for are listed and redriven (by
``x-original-queue``, or SQS's ``DeadLetterQueueSourceArn`` for a message SQS moved itself); the
others are left alone.

**Count**: ``ApproximateNumberOfMessages`` of the whole dead-letter queue (approximate: SQS may
lag by a minute; messages held by a peek or redrive in progress are not counted).

**Peek.** SQS has no peek: ``ReceiveMessage`` hides each message for :data:`HOLD_SECONDS`
(long polls of 1 s, so that every SQS server is asked), and once the pass ends
``ChangeMessageVisibilityBatch`` makes all of them visible again. Caveats: every peek adds one to
each message's ``ApproximateReceiveCount`` (a dead-letter queue that itself has a redrive policy
moves messages on); a peek that dies leaves its messages hidden for up to :data:`HOLD_SECONDS`;
while one pass holds messages another sees fewer; a standard queue has no order, so with more
dead letters than ``limit`` the ones listed are not necessarily the oldest (they are sorted by
their time); a FIFO queue hands out nothing more of a message group while some of it is held, so
a pass sees at most one receive's worth of each group.

**Redrive** (copy, then delete): each selected message is sent to the work queue with the same
body, ``x-consumer-kit-message-id`` (so the same message id; SQS's own ``MessageId`` for a
message SQS moved) and operation attributes, without the dead-letter attributes and without
``x-consumer-kit-deliveries`` (its delivery count starts again), plus ``x-consumer-kit-redriven``
= the reason it had. Only after ``SendMessage`` succeeded is it deleted from the dead-letter
queue: **at least once** — a crash (or a failed delete) in between leaves it in both queues, and a
second redrive sends it again, which the ledger answers as a duplicate. On a FIFO work queue the
copy keeps its ``MessageGroupId`` and gets a ``MessageDeduplicationId`` keyed by the deployment's
mark key on the dead letter's SQS MessageId (:func:`consumer_kit.broker.kit.copy_ids.keyed_copy_id`:
SQS drops a second copy within 5 minutes, and no producer can send under the id first). Messages not selected, and
those whose copy SQS refused, are held until the pass ends and then made visible again. Messages
that reach the dead-letter queue after the redrive started (``SentTimestamp`` against this host's
clock: a skew moves that line by as much) are not looked at, so a message that fails again at once
is not redriven twice in one pass.

**Not StartMessageMoveTask.** SQS's own redrive (``StartMessageMoveTask``) moves every message
of the dead-letter queue as it is: it cannot select by reason or key, keeps the dead-letter and
delivery-count attributes (the delivery count would not start again), only serves queues that
are registered as dead-letter queues of their source, and moto does not implement it.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError

from consumer_kit.broker import DeadLetter, DeadLetterQueues, RedriveReport, header_count, header_text
from consumer_kit.broker.dead_letters import REASON_ON_COPY_CHARS, Redrive, RedriveAsked
from consumer_kit.broker.kit.copy_ids import keyed_copy_id
from consumer_kit.codec import headers as own
from consumer_kit.codec.envelope import OPERATION_ID_HEADER
from consumer_kit.errors import ConfigurationError, CopyRefused, RemoveFailed

from .config import SQSConfig
from .connection import SQSClient
from .delivery import DEFAULT_GROUP
from .envelope import (
    DEAD_LETTER_DETAIL_ATTRIBUTE,
    DEAD_LETTER_REASON_ATTRIBUTE,
    DELIVERIES_ATTRIBUTE,
    MESSAGE_ID_ATTRIBUTE,
    ORIGINAL_QUEUE_ATTRIBUTE,
    PACKED_ATTRIBUTE,
    REDELIVERED_ATTRIBUTE,
    headers_of,
)
from .errors import describe, is_unreachable
from .limits import fit
from .topology import QueueDirectory, QueueInfo, sqs_queue_name

logger = logging.getLogger(__name__)

HOLD_SECONDS = 120
"""Visibility timeout of the messages a peek or redrive receives (made visible again at its end)."""

POLL_SECONDS = 1
"""``WaitTimeSeconds`` of each receive: a long poll asks every SQS server; an empty one ends a pass."""

REDRIVEN_ATTRIBUTE = "x-consumer-kit-redriven"
"""On a redriven copy: the dead-letter reason it had (for the record; the runtime ignores it)."""

BROKER_REASON = "broker:maxReceiveCount"
"""The reason of a message SQS moved itself (its redrive policy's ``maxReceiveCount``)."""

_DROPPED = frozenset({
    DEAD_LETTER_REASON_ATTRIBUTE, DEAD_LETTER_DETAIL_ATTRIBUTE, ORIGINAL_QUEUE_ATTRIBUTE,
    DELIVERIES_ATTRIBUTE, REDELIVERED_ATTRIBUTE, PACKED_ATTRIBUTE, REDRIVEN_ATTRIBUTE,
})
_NEVER = dt.datetime.max.replace(tzinfo=dt.UTC)
_SYSTEM = ["ApproximateReceiveCount", "SentTimestamp", "MessageGroupId", "DeadLetterQueueSourceArn", "SenderId"]


@dataclass
class _Pass:
    """One pass over a dead-letter queue: what it saw and what it holds (to make visible again)."""

    seen: set[str] = field(default_factory=set)
    held: list[str] = field(default_factory=list)


class SQSDeadLetters(DeadLetterQueues):
    """The dead-letter queues of the work queues at an ``sqs://`` endpoint (module docstring).

    Args:
        config: the parsed ``sqs://`` URL.
        client: an :class:`~consumer_kit.adapters.sqs.connection.SQSClient` to use (tests); default: its own.
    """

    def __init__(self, config: SQSConfig, *, client: SQSClient | None = None) -> None:
        self._owns_client = client is None
        self.client = client or SQSClient(config, threads=2, pollers=0)
        self._directory = QueueDirectory(self.client, account_id=config.account_id)

    async def count(self, queue: str) -> int:
        _, dlq = await self._queues(queue)
        reply = await self._call("get_queue_attributes", QueueUrl=dlq.url,
                                 AttributeNames=["ApproximateNumberOfMessages"])
        return int(reply.get("Attributes", {}).get("ApproximateNumberOfMessages", 0))

    async def peek(self, queue: str, *, limit: int = 100) -> list[DeadLetter]:
        work, dlq = await self._queues(queue)
        found: list[DeadLetter] = []
        run = _Pass()
        try:
            while len(found) < limit:
                batch = await self._receive(dlq, run, min(10, limit - len(found)))
                if batch is None:
                    break
                run.held += [str(raw["ReceiptHandle"]) for raw in batch]
                found += [letter for raw in batch if (letter := dead_letter_of(raw, queue, work)) is not None]
        finally:
            await self._make_visible(dlq, run)
        return sorted(found, key=_time_of)

    async def _redrive(self, queue: str, asked: RedriveAsked) -> RedriveReport:
        work, dlq = await self._queues(queue)
        started_ms = int(time.time() * 1000)
        run = _Pass()
        redrive = _Redrive(asked, self.client, work, dlq)
        try:
            while (batch := await self._receive(dlq, run, 10)) is not None:
                for raw in batch:
                    letter = dead_letter_of(raw, queue, work)
                    if letter is None or _sent_ms(raw) > started_ms:  # another queue's, or arrived since
                        run.held.append(str(raw["ReceiptHandle"]))
                    elif not await redrive.look_at(raw, letter):  # not sent back: held, left in the DLQ
                        run.held.append(str(raw["ReceiptHandle"]))
        finally:
            await self._make_visible(dlq, run)
        return redrive.report

    async def close(self) -> None:
        if self._owns_client:
            await self.client.close()

    # -- helpers -----------------------------------------------------------------------------

    async def _receive(self, dlq: QueueInfo, run: _Pass, most: int) -> list[dict[str, Any]] | None:
        """The next messages of ``dlq`` not seen in this pass (each now held), or ``None`` when the
        pass is over: nothing came, or only messages it had seen (their hold lapsed)."""
        reply = await self._call(
            "receive_message", QueueUrl=dlq.url, MaxNumberOfMessages=most, WaitTimeSeconds=POLL_SECONDS,
            VisibilityTimeout=HOLD_SECONDS, MessageAttributeNames=["All"], MessageSystemAttributeNames=_SYSTEM,
        )
        fresh = []
        for raw in reply.get("Messages", []):
            if raw["MessageId"] in run.seen:
                run.held.append(str(raw["ReceiptHandle"]))
                continue
            run.seen.add(raw["MessageId"])
            fresh.append(raw)
        return fresh or None

    async def _make_visible(self, dlq: QueueInfo, run: _Pass) -> None:
        """``ChangeMessageVisibilityBatch(0)`` for every message the pass still holds. A stale
        receipt handle (the hold lapsed, or the message is gone) needs nothing."""
        for start in range(0, len(run.held), 10):
            entries = [{"Id": str(i), "ReceiptHandle": handle, "VisibilityTimeout": 0}
                       for i, handle in enumerate(run.held[start:start + 10])]
            try:
                reply = await self.client.call("change_message_visibility_batch", QueueUrl=dlq.url, Entries=entries)
            except Exception as exc:  # noqa: BLE001 - they become visible when the hold lapses
                logger.warning("could not make %s held message(s) of %s visible again (%s): they "
                               "are hidden for up to %s s", len(entries), dlq.name, describe(exc), HOLD_SECONDS)
                continue
            for failed in reply.get("Failed", []):
                logger.debug("visibility of a held message of %s not changed: %s", dlq.name, failed.get("Code"))
        run.held.clear()

    async def _queues(self, queue: str) -> tuple[QueueInfo, QueueInfo]:
        try:
            work = await self._directory.lookup(queue)
            return work, await self._directory.dead_letter_queue(work)
        except LookupError as exc:
            raise ConfigurationError(f"{exc} (is {queue!r} a work queue?)") from None
        except ClientError as exc:
            raise ConfigurationError(f"SQS refused to describe {queue!r}: {describe(exc)}") from exc
        except Exception as exc:
            raise_if_unreachable(exc)
            raise

    async def _call(self, operation: str, **params: Any) -> dict[str, Any]:
        try:
            return await self.client.call(operation, **params)
        except ClientError as exc:
            raise ConfigurationError(f"SQS refused {operation}: {describe(exc)}") from exc
        except Exception as exc:
            raise_if_unreachable(exc)
            raise


class _Redrive(Redrive[Mapping[str, Any]]):
    """One redrive from ``dlq`` to ``work``: ``SendMessage`` of the copy, then ``DeleteMessage``."""

    def __init__(self, asked: RedriveAsked, client: SQSClient, work: QueueInfo, dlq: QueueInfo) -> None:
        super().__init__(asked, target=work.name, source=dlq.name)
        self._client = client
        self._work = work
        self._dlq = dlq

    async def send_copy(self, raw: Mapping[str, Any], letter: DeadLetter) -> None:
        """Raises :class:`CopyRefused` when the copy does not fit or SQS refuses it."""
        body = str(raw.get("Body", ""))
        headers = {k: v for k, v in letter.headers.items() if k not in _DROPPED}
        headers[MESSAGE_ID_ATTRIBUTE] = letter.message_id
        headers[REDRIVEN_ATTRIBUTE] = letter.reason[:REASON_ON_COPY_CHARS]
        try:
            attributes, _ = fit(body, headers, self._work.max_message_size, droppable=(REDRIVEN_ATTRIBUTE,))
        except ValueError as exc:
            raise CopyRefused(str(exc)) from exc
        params: dict[str, Any] = {"QueueUrl": self._work.url, "MessageBody": body, "MessageAttributes": attributes}
        if self._work.fifo:
            params["MessageGroupId"] = raw.get("Attributes", {}).get("MessageGroupId") or DEFAULT_GROUP
            params["MessageDeduplicationId"] = keyed_copy_id(self._work.url, raw["MessageId"], "redrive")
        try:
            await self._client.call("send_message", **params)
        except Exception as exc:
            raise_if_unreachable(exc)
            raise CopyRefused(describe(exc)) from exc

    async def remove(self, raw: Mapping[str, Any], letter: DeadLetter) -> None:
        try:
            await self._client.call("delete_message", QueueUrl=self._dlq.url, ReceiptHandle=raw["ReceiptHandle"])
        except Exception as exc:
            raise_if_unreachable(exc)
            raise RemoveFailed(describe(exc)) from exc


def raise_if_unreachable(exc: Exception) -> None:
    """Raise :class:`ConnectionError` (the command stops there) when ``exc`` says SQS cannot be
    reached; return otherwise."""
    if is_unreachable(exc):
        raise ConnectionError(f"cannot reach SQS: {describe(exc)}") from exc


def dead_letter_of(raw: Mapping[str, Any], queue: str, work: QueueInfo) -> DeadLetter | None:
    """What ``consumer-kit dlq list`` shows of one message of ``work``'s dead-letter queue, or
    ``None`` when it is another work queue's (``x-original-queue``, or ``DeadLetterQueueSourceArn``
    for a message SQS moved).

    consumer-kit's copies carry ``x-dead-letter-reason``/``-detail``, ``x-original-queue`` and
    ``x-consumer-kit-deliveries``; their ``SentTimestamp`` is the dead-letter time. A message SQS
    moved itself has reason :data:`BROKER_REASON`, ``maxReceiveCount`` (plus the deliveries of
    earlier copies) as its delivery count, and its original ``SentTimestamp`` (standard queues
    keep it) as the enqueue time.
    """
    system = raw.get("Attributes", {})
    # Only consumer-kit's signed marks are believed (origin, reason, detail, count, message id).
    headers = dict(own.read(headers_of(raw.get("MessageAttributes")), str(raw.get("Body", "")).encode("utf-8")).headers)
    origin = header_text(headers.get(ORIGINAL_QUEUE_ATTRIBUTE))
    source_arn = header_text(system.get("DeadLetterQueueSourceArn"))
    if (origin and _queue_name(origin) != work.name) or (source_arn and work.arn and source_arn != work.arn):
        return None
    reason = header_text(headers.get(DEAD_LETTER_REASON_ATTRIBUTE))
    sent = _sent_ms(raw)
    at = dt.datetime.fromtimestamp(sent / 1000, dt.UTC) if sent else None
    earlier = header_count(headers.get(DELIVERIES_ATTRIBUTE))
    broker_count = work.redrive.max_receive_count if work.redrive else 0
    return DeadLetter(
        queue=queue,
        message_id=header_text(headers.get(MESSAGE_ID_ATTRIBUTE)) or str(raw["MessageId"]),
        reason=reason or BROKER_REASON,
        detail=header_text(headers.get(DEAD_LETTER_DETAIL_ATTRIBUTE)),
        delivery_count=earlier if reason else earlier + broker_count,
        dead_lettered_at=at if reason else None,
        enqueued_at=None if reason else at,
        operation_key=header_text(headers.get(OPERATION_ID_HEADER)) or None,
        headers=headers,
        body=str(raw.get("Body", "")).encode("utf-8"),
        sender=header_text(system.get("SenderId")) or None,
    )


def _time_of(letter: DeadLetter) -> dt.datetime:
    return letter.dead_lettered_at or letter.enqueued_at or _NEVER


def _queue_name(target: str) -> str:
    """The SQS queue name a consumer-kit queue name, URL or ARN stands for."""
    if target.startswith(("https://", "http://")):
        return target.rstrip("/").rsplit("/", 1)[-1]
    if target.startswith("arn:"):
        return target.rsplit(":", 1)[-1]
    try:
        return sqs_queue_name(target)
    except ConfigurationError:
        return target


def _sent_ms(raw: Mapping[str, Any]) -> int:
    return header_count(raw.get("Attributes", {}).get("SentTimestamp"))
