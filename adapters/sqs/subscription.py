"""One subscribed queue: its long-poll loop and the deliveries it holds.

Each poll asks for ``min(10, prefetch - held)`` messages (none while ``prefetch`` are held) with
``WaitTimeSeconds``, ``VisibilityTimeout``, ``MessageAttributeNames=["All"]`` and
``MessageSystemAttributeNames`` ``ApproximateReceiveCount``, ``SentTimestamp``, ``SenderId`` and
``MessageGroupId``. A poll that fails (SQS unreachable, throttled) is logged once per outage and
retried with backoff (0.1 s doubling to 5 s); the consumer is not ready meanwhile.

**ReceiveRequestAttemptId (FIFO).** A receive whose reply is lost has still made its messages
invisible; retried without an attempt id, they stay hidden for the whole visibility timeout and
block their message groups. AWS's ReceiveMessage reference: a retry with the same
``ReceiveRequestAttemptId`` (within 5 minutes, nothing of it modified) returns the same messages
and receipt handles. So each receive on a FIFO queue carries one (a UUID, 36 of the 128
characters allowed): botocore's own retries resend the same request, and a poll that failed is
sent again, same parameters, same id, by this loop; only a receive that succeeded (or an id
older than :data:`ATTEMPT_ID_SECONDS`) makes the next poll take a new one.

**The same message twice.** Standard queues deliver at least once: one reply, or two polls, may
carry the same ``MessageId`` again. Received while an earlier delivery of it is held *and that
delivery's lock is still ours*, it is a broker duplicate: its receipt handle joins the held
delivery (settlements use every handle; the newest is the one SQS honours) and it is not handed
out again (``duplicates_absorbed``). Received after the earlier delivery's lock lapsed, the earlier
delivery has lost its lock (it will not ack) and the new one is handed out as a redelivery.

**Handed back unsettled.** A delivery whose hand-over to the worker ended without a settlement (a
crash point fired: the runtime treats it as process death) is *left to lapse*: no longer held
(its slot is free, the heartbeat stops extending it, closing does not give it back), so its
visibility lapses and SQS hands it out again, counted, while the worker lives. Nothing is
remembered as a give-back, so :mod:`consumer_kit.adapters.sqs.redelivery` judges that receive a redelivery,
as after a real crash.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from consumer_kit.broker import DeliveryCallback, build_delivery
from consumer_kit.broker.kit.copy_ids import keyed_copy_id
from consumer_kit.broker.kit.pull_consumer import PulledQueue
from consumer_kit.errors import DeadLetterReason
from consumer_kit.resilience.one_shots import OneShots

from .connection import SQSClient
from .delivery import DEFAULT_GROUP, SQSDelivery
from .envelope import (
    DEAD_LETTER_DETAIL_ATTRIBUTE,
    DEAD_LETTER_REASON_ATTRIBUTE,
    DETAIL_MAX_CHARS,
    MAX_ATTRIBUTES,
    ORIGINAL_QUEUE_ATTRIBUTE,
)
from .errors import describe
from .renewal import Heartbeat
from .settlement import Settler
from .topology import QueueInfo

logger = logging.getLogger(__name__)

SYSTEM_ATTRIBUTES = ["ApproximateReceiveCount", "SentTimestamp", "MessageGroupId", "SenderId"]

ATTEMPT_ID_SECONDS = 240.0
"""A failed FIFO receive is retried with its attempt id for this long: SQS keeps one 5 minutes."""


class Subscription(PulledQueue[dict[str, Any], SQSDelivery]):
    """One queue, polled by a task of its own (the loop: :class:`~consumer_kit.broker.kit.pull_consumer.PulledQueue`).

    Args:
        queue: the consumer-kit queue name.
        info: the SQS queue; ``dead_letters``: its dead-letter queue.
        callback: the worker's delivery callback.
        prefetch: the most deliveries held at once.
        client, settler, heartbeat: the consumer's.
        visibility: seconds of peek-lock asked on each receive.
        wait_seconds: ``WaitTimeSeconds`` of each poll.
        settle_timeout: seconds; passed to each delivery.
        wanted: whether the consumer wants deliveries now (not paused, not stopping).
        dispatch: hands a new delivery to the worker (directly, or through its FIFO lane).
        give_back: releases a delivery that arrived while not ``wanted``.

    Attributes:
        held: unsettled deliveries by SQS ``MessageId``.
        receives: messages received; ``duplicates_absorbed``: of them, broker duplicates.
        left_to_lapse: deliveries handed back unsettled (module docstring).
        failing: the last poll failed.
    """

    log = logger
    verb = "receive"
    lapse_note = "no longer extended, it comes back when its visibility lapses"
    _heartbeat: Heartbeat

    def __init__(
        self,
        queue: str,
        info: QueueInfo,
        dead_letters: QueueInfo,
        callback: DeliveryCallback,
        prefetch: int,
        *,
        client: SQSClient,
        settler: Settler,
        heartbeat: Heartbeat,
        visibility: int,
        wait_seconds: int,
        settle_timeout: float,
        wanted: Callable[[], bool],
        dispatch: Callable[[Subscription, SQSDelivery], None],
        give_back: Callable[[SQSDelivery], None],
    ) -> None:
        super().__init__(queue, callback, prefetch, heartbeat=heartbeat)
        self.info, self.dead_letters = info, dead_letters
        self._client, self._settler = client, settler
        self.visibility, self._wait_seconds, self._settle_timeout = visibility, wait_seconds, settle_timeout
        self._wanted, self._dispatch, self._give_back = wanted, dispatch, give_back
        self.receives = 0
        self.duplicates_absorbed = 0
        self._side_tasks = OneShots()
        self._unanswered: tuple[float, dict[str, Any]] | None = None  # a failed FIFO receive

    def _receive_params(self, room: int) -> dict[str, Any]:
        """The next ReceiveMessage's parameters: a failed FIFO receive again (same attempt id),
        else a new request (module docstring)."""
        if self._unanswered is not None:
            first_sent, params = self._unanswered
            if time.monotonic() - first_sent < ATTEMPT_ID_SECONDS:
                return params
        params = {
            "QueueUrl": self.info.url,
            "MaxNumberOfMessages": min(10, room),
            "WaitTimeSeconds": self._wait_seconds,
            "VisibilityTimeout": self.visibility,
            "MessageAttributeNames": ["All"],
            "MessageSystemAttributeNames": SYSTEM_ATTRIBUTES,
        }
        if self.info.fifo:
            params["ReceiveRequestAttemptId"] = str(uuid.uuid4())
        self._unanswered = None
        return params

    async def _pull(self, room: int, requested_at: float) -> list[dict[str, Any]]:
        params = self._receive_params(room)
        try:
            reply = await self._client.poll(**params)
        except Exception:
            if self.info.fifo and self._unanswered is None:
                self._unanswered = (requested_at, params)  # its messages may be in flight
            raise
        self._unanswered = None
        return list(reply.get("Messages", []))

    async def _take(self, messages: Sequence[dict[str, Any]], requested_at: float) -> None:
        for raw in messages:
            self.accept(raw, requested_at)

    def _describe(self, exc: Exception) -> str:
        return describe(exc)

    def _key(self, delivery: SQSDelivery) -> str:
        return delivery.sqs_message_id

    def accept(self, raw: dict[str, Any], requested_at: float) -> SQSDelivery | None:
        """Take one received message: absorb a broker duplicate, else make a delivery, hold it
        and dispatch it (or give it back when not wanted). Returns the new delivery, if any."""
        self.receives += 1
        sqs_message_id = str(raw["MessageId"])
        earlier = self.held.get(sqs_message_id)
        if earlier is not None and earlier.settlement is None and earlier.holds_lock:
            earlier.receipt_handles.append(str(raw["ReceiptHandle"]))
            self.duplicates_absorbed += 1
            logger.info(
                "queue=%s message_id=%s received again while held: a broker duplicate, not handed "
                "out again", self.queue, earlier.message_id,
            )
            return None
        if earlier is not None:
            earlier.lock_lost = True  # SQS handed it out again: the earlier lock is gone
        delivery = build_delivery(
            lambda: SQSDelivery(
                raw,
                queue=self.queue, info=self.info, dead_letters=self.dead_letters, settler=self._settler,
                requested_at=requested_at, visibility=self.visibility, settle_timeout=self._settle_timeout,
                renew=self._heartbeat.renew, on_settled=self._settled,
                hold_retries=self.info.fifo and self._heartbeat.enabled,
            ),
            unbuildable=lambda detail: self._spawn(self._dead_letter_raw(raw, detail)),
            what=f"queue={self.queue} sqs_message_id={sqs_message_id}",
        )
        if delivery is None:
            return None
        self.held[sqs_message_id] = delivery
        self._heartbeat.hold(delivery)
        if self._wanted() and not self._stopping:
            self._dispatch(self, delivery)
        else:
            self._give_back(delivery)
        return delivery

    async def _dead_letter_raw(self, raw: dict[str, Any], detail: str) -> None:
        """Dead-letter a message that could not be mapped onto a delivery: its body and as many
        of its attributes as fit beside the reason go to the dead-letter queue, then it is
        deleted (a failure is logged; the message then comes back and is tried again)."""
        reason = {
            DEAD_LETTER_REASON_ATTRIBUTE: DeadLetterReason.INVALID_HEADER.value,
            DEAD_LETTER_DETAIL_ATTRIBUTE: detail[:DETAIL_MAX_CHARS],
            ORIGINAL_QUEUE_ATTRIBUTE: self.queue,
        }
        attributes = {n: {"DataType": "String", "StringValue": v} for n, v in reason.items()}
        for name, attribute in list((raw.get("MessageAttributes") or {}).items())[: MAX_ATTRIBUTES - len(reason)]:
            attributes.setdefault(name, attribute)
        params: dict[str, Any] = {"MessageBody": str(raw.get("Body", "")), "MessageAttributes": attributes}
        if self.dead_letters.fifo:
            params["MessageGroupId"] = str(raw.get("Attributes", {}).get("MessageGroupId") or DEFAULT_GROUP)
            params["MessageDeduplicationId"] = keyed_copy_id(self.dead_letters.url, str(raw.get("MessageId")), "dead_letter")
        try:
            await self._settler.send(self.dead_letters.url, params)
            await self._client.call("delete_message", QueueUrl=self.info.url, ReceiptHandle=str(raw["ReceiptHandle"]))
        except Exception as exc:  # noqa: BLE001 - it comes back when its visibility lapses
            logger.error("dead-lettering an unmappable message of queue=%s failed (%s)", self.queue, describe(exc))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._side_tasks.start(work, name=f"consumer-kit sqs dead-letter raw {self.queue}")

    def _settled(self, delivery: SQSDelivery) -> None:
        """As the base's, but a held retry (FIFO) takes its predecessor's place."""
        self._heartbeat.drop(delivery)
        successor = delivery.successor if delivery.settlement is not None and not delivery.lost else None
        if self.held.get(delivery.sqs_message_id) is delivery:
            if successor is not None:  # a held retry (FIFO): it keeps the slot and the lock
                self.held[delivery.sqs_message_id] = successor
                self._heartbeat.hold(successor)
                return
            del self.held[delivery.sqs_message_id]
        self._room.set()

