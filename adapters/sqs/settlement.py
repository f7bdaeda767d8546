"""How settlements reach SQS: batched deletes, visibility changes, copies.

=========================  ========================================================================
operation                  SQS call
=========================  ========================================================================
ack                        ``DeleteMessageBatch`` (concurrent acks of a queue share calls,
                           :mod:`consumer_kit.adapters.sqs.batching`), one entry per receipt handle the message
                           was received with in this process
give back (retry,          ``ChangeMessageVisibility`` to the delay (0 = visible now), at most the
release on FIFO)           time left of the 12 hours
copy (retry, release on    ``SendMessage`` of a copy, then the ack of the original
standard queues; dead
letter)
=========================  ========================================================================

**Per-entry delete failures.** A failed entry whose receipt handle is stale (``ReceiptHandleIsInvalid``:
the visibility lapsed and another receive took the message over, or it is gone) cannot succeed
on retry: it is counted in ``stale_receipts``, logged once with the message id and raised as
:class:`LockLost` (the delivery is ``lost``; the message comes back and the ledger answers it as a
duplicate). Any other failed entry (SQS's own fault) is retried in the next batch, at most
``DELETE_ATTEMPTS`` times in all, counted in ``delete_retries``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from consumer_kit.broker.kit.counters import Counted, Counters
from consumer_kit.errors import LockLost

from .batching import Batcher
from .connection import SQSClient
from .errors import entry_code, is_stale, is_stale_receipt

logger = logging.getLogger(__name__)

DELETE_ATTEMPTS = 3
"""Tries of one delete entry that SQS failed on its side (``SenderFault: false``)."""


class _EntryFailed(Exception):
    def __init__(self, code: str, message: str, sender_fault: bool) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.sender_fault = code, sender_fault
        self.stale = is_stale_receipt(code, message)


class Held(Protocol):
    """What the settler needs from a delivery."""

    queue: str
    message_id: str | None
    queue_url: str
    receipt_handles: list[str]


class Settler:
    """Settlement calls of one consumer, with their counters.

    Attributes:
        counters: :class:`~consumer_kit.broker.kit.counters.Counters` of the three below.
        deletes: messages deleted (acks, and originals of copies).
        stale_receipts: deletes refused because the receipt handle was stale (each counted once).
        delete_retries: delete entries sent again after SQS failed them on its side.
    """

    deletes = Counted()
    stale_receipts = Counted()
    delete_retries = Counted()

    def __init__(self, client: SQSClient) -> None:
        self._client = client
        self._deletes: Batcher[dict[str, str], None] = Batcher(self._delete_batch)
        self.counters = Counters(("deletes", "stale_receipts", "delete_retries"))

    async def delete(self, held: Held) -> None:
        """Delete the message with every receipt handle it was received with here (the newest one
        is the one SQS honours).

        Raises:
            LockLost: every receipt handle was stale (counted and logged once).
            _EntryFailed, botocore errors: SQS kept failing (after ``DELETE_ATTEMPTS`` tries).
        """
        outcomes: list[BaseException | None] = []
        for handle in list(held.receipt_handles):
            outcomes.append(await self._delete_one(held, handle))
        if any(outcome is None for outcome in outcomes):
            self.deletes += 1
            return
        if all(isinstance(o, _EntryFailed) and o.stale for o in outcomes):
            self.stale_receipts += 1
            logger.warning(
                "ack of queue=%s message_id=%s refused: receipt handle no longer valid (%s); the "
                "message comes back and is answered as a duplicate",
                held.queue, held.message_id, outcomes[-1],
            )
            raise LockLost(str(outcomes[-1]))
        failure = outcomes[-1]
        assert failure is not None
        raise failure

    async def change_visibility(self, held: Held, seconds: int) -> None:
        """Set the visibility of the held message to ``seconds`` from now (0: visible now).

        Raises:
            LockLost: SQS no longer knows the receipt handle.
            botocore errors: SQS refused or did not answer.
        """
        try:
            await self._client.call(
                "change_message_visibility",
                QueueUrl=held.queue_url, ReceiptHandle=held.receipt_handles[-1], VisibilityTimeout=seconds,
            )
        except Exception as exc:
            if is_stale(exc):
                raise LockLost(str(exc)) from exc
            raise

    async def send(self, queue_url: str, params: Mapping[str, Any]) -> str:
        """``SendMessage`` (a retry, release or dead-letter copy); returns the new ``MessageId``.

        Raises:
            botocore errors: SQS refused or did not answer.
        """
        reply = await self._client.call("send_message", QueueUrl=queue_url, **params)
        return str(reply.get("MessageId", ""))

    async def close(self) -> None:
        await self._deletes.close()

    async def _delete_one(self, held: Held, handle: str) -> BaseException | None:
        failure: BaseException | None = None
        for attempt in range(1, DELETE_ATTEMPTS + 1):
            try:
                await self._deletes.submit(held.queue_url, {"ReceiptHandle": handle})
                return None
            except _EntryFailed as exc:
                failure = exc
                if exc.stale or exc.sender_fault:
                    return exc  # retrying cannot help
            if attempt < DELETE_ATTEMPTS:
                self.delete_retries += 1
                logger.info(
                    "delete of queue=%s message_id=%s failed (%s); retrying (%s of %s)",
                    held.queue, held.message_id, failure, attempt + 1, DELETE_ATTEMPTS,
                )
        return failure

    async def _delete_batch(self, queue_url: str, entries: Sequence[dict[str, str]]) -> list[BaseException | None]:
        # Ids are the positions: distinct within a call by construction (BatchEntryIdsNotDistinct
        # can't happen), and a receipt handle (up to 1 KiB) is never an Id.
        reply = await self._client.call(
            "delete_message_batch",
            QueueUrl=queue_url,
            Entries=[{"Id": str(i), **entry} for i, entry in enumerate(entries)],
        )
        failed = {str(f.get("Id")): f for f in reply.get("Failed", [])}
        results: list[BaseException | None] = []
        for i in range(len(entries)):
            entry = failed.get(str(i))
            if entry is None:
                results.append(None)
            else:
                results.append(
                    _EntryFailed(entry_code(entry), str(entry.get("Message", ""))[:200],
                                 bool(entry.get("SenderFault", False)))
                )
        return results
