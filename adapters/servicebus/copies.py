"""Scheduled copies for delayed retries on a queue: one sender per queue, opened on first use."""

from __future__ import annotations

import datetime as dt

from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient, ServiceBusSender

from adapters.servicebus.connection import close_quietly
from adapters.servicebus.entities import sender_for
from adapters.servicebus.limits import TooLarge, check_fits_alone


class RetryCopies:
    """Schedules retry copies into ``queue`` (``ServiceBusSender.schedule_messages``).

    Args:
        client: the consumer's client (the copies share its connection).
        queue: the queue the copies go back to.
        close_timeout: seconds to wait for the sender to close.
    """

    def __init__(self, client: ServiceBusClient, queue: str, *, close_timeout: float) -> None:
        self._client = client
        self.queue = queue
        self._close_timeout = close_timeout
        self._sender: ServiceBusSender | None = None

    async def schedule(self, copy: ServiceBusMessage, when: dt.datetime, *, body_size: int, what: str) -> int:
        """Schedule ``copy`` to become receivable at ``when`` (aware UTC); returns its sequence
        number. No timeout here: the delivery's settlement bound covers the call.

        Raises:
            adapters.servicebus.limits.TooLarge: the copy does not fit the queue's limits (not sent).
            azure.servicebus.exceptions.ServiceBusError: the broker refused it or the link failed
                (the sender is re-opened on the next call).
        """
        sender = self._sender or sender_for(self._client, self.queue)
        self._sender = sender
        try:
            await check_fits_alone(sender, copy, body_size=body_size, what=what)
            [sequence_number] = await sender.schedule_messages(copy, when)
        except TooLarge:
            raise
        except Exception:
            self._sender = None
            await close_quietly(sender, self._close_timeout, f"the retry sender of {self.queue}")
            raise
        return int(sequence_number)

    async def close(self) -> None:
        sender, self._sender = self._sender, None
        await close_quietly(sender, self._close_timeout, f"the retry sender of {self.queue}")
