"""Copies sent back to a queue in a delivery's place (delayed retries, releases): one sender per
queue, opened on first use."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient, ServiceBusSender

from .connection import close_quietly
from .errors import TooLarge, describe, is_refusal
from .limits import check_fits_alone, encoded_size, link_message_limit
from .throttling import while_throttled
from .topology import sender_for

logger = logging.getLogger(__name__)


class Copies:
    """Sends copies into ``queue``: at once (``send_messages``) or scheduled (``schedule_messages``),
    one at a time: the SDK neither opens one sender concurrently nor keeps concurrent transfers and
    management requests on one link in order (see :class:`~consumer_kit.adapters.servicebus.route.Route`).

    Args:
        client: the consumer's client (the sender opens a connection of its own).
        queue: the queue the copies go back to.
        close_timeout: seconds to wait for the sender to close.
    """

    def __init__(self, client: ServiceBusClient, queue: str, *, close_timeout: float) -> None:
        self._client = client
        self.queue = queue
        self._close_timeout = close_timeout
        self._sender: ServiceBusSender | None = None
        self._one_at_a_time = asyncio.Lock()

    async def put(self, copy: ServiceBusMessage, *, when: dt.datetime | None, body_size: int, what: str) -> None:
        """Send ``copy`` now (``when`` is ``None``) or schedule it to become receivable at ``when``
        (aware UTC). No timeout here: the delivery's settlement bound covers the call.

        Raises:
            consumer_kit.adapters.servicebus.limits.TooLarge: the copy does not fit the queue's limits (not sent).
            azure.servicebus.exceptions.ServiceBusError: the broker refused it or the link failed
                (a sender opened before this call is first re-opened and the copy sent once more
                through it: its connection may have died since; a new one is re-opened on the
                next call).
        """
        async with self._one_at_a_time:
            opened_before = self._sender is not None
            try:
                await self._put(copy, when=when, body_size=body_size, what=what)
            except Exception as exc:
                if not opened_before or isinstance(exc, TooLarge) or is_refusal(exc):
                    raise
                # A sender opened before may have died since with its connection (a drop the
                # receiver recovers from): sent once more through a new one (at least once).
                logger.info("the copy sender of %s failed (%s): sending through a new one", self.queue, describe(exc))
                await self._put(copy, when=when, body_size=body_size, what=what)

    async def _put(self, copy: ServiceBusMessage, *, when: dt.datetime | None, body_size: int, what: str) -> None:
        sender = self._sender or sender_for(self._client, self.queue)
        self._sender = sender
        try:
            await check_fits_alone(sender, copy, body_size=body_size, what=what)
            # Throttled: sent again after a backoff (throttling.py), within the settlement's bound.
            await while_throttled(
                (lambda: sender.send_messages(copy)) if when is None else (lambda: sender.schedule_messages(copy, when)),
                what=f"the {what} to {self.queue}",
            )
        except TooLarge:
            raise
        except Exception:
            self._sender = None
            await close_quietly(sender, self._close_timeout, f"the copy sender of {self.queue}")
            raise

    async def room_beside(self, message: ServiceBusMessage) -> int | None:
        """Bytes left under the queue's message size limit beside ``message`` (0 when it is as large
        as the limit or larger; ``None`` when the link reports no limit), measured on this queue's
        link (opened if needed).

        Raises:
            azure.servicebus.exceptions.ServiceBusError: the link could not be opened.
        """
        async with self._one_at_a_time:
            sender = self._sender = self._sender or sender_for(self._client, self.queue)
            try:
                size = await encoded_size(sender, message)
            except TooLarge:
                return 0
            limit = link_message_limit(sender)
        return max(0, limit - size) if limit else None

    async def close(self) -> None:
        sender, self._sender = self._sender, None
        await close_quietly(sender, self._close_timeout, f"the copy sender of {self.queue}")
