"""The consuming side of the broker contract: :class:`Consumer`, and what every adapter does with a
received delivery (:func:`hand_over`). An adapter runs each delivery's callback in a task of its own
(a :class:`~consumer_kit.resilience.one_shots.OneShots` of the consumer's), not the SDK's, so that a
lost channel or receiver never cancels a running handler, and ``close()`` can stop the ones still
running, bounded."""

from __future__ import annotations

import abc
import logging

from consumer_kit.broker.delivery import Delivery, DeliveryCallback
from consumer_kit.errors import ConfigurationError

logger = logging.getLogger("consumer_kit.broker")


async def hand_over(delivery: Delivery, callback: DeliveryCallback, *, wanted: bool) -> None:
    """What every adapter does with a received delivery (made by :func:`build_delivery`): give it
    to ``callback``, or, when it is not ``wanted`` (it arrived while the consumer was pausing or
    stopping), release it uncounted. A callback that raises (it should not: the runtime settles
    every delivery) is logged with ids only and its delivery, if still unsettled, is released.
    Never raises ``Exception``."""
    if not wanted:
        await delivery.release()
        return
    try:
        await callback(delivery)
    except Exception:
        logger.exception(
            "callback failed (queue=%s message_id=%s); releasing the delivery",
            delivery.queue, delivery.message_id,
        )
        if delivery.settlement is None:
            await delivery.release()


class Consumer(abc.ABC):
    """The consuming side of a broker.

    ``subscribe`` registers a callback for a queue; ``start`` begins delivering. The adapter calls
    the callback once per delivery with at most ``prefetch`` deliveries of that queue in flight
    (RabbitMQ: basic.qos prefetch; memory: a semaphore). The callback always settles the delivery.
    """

    @abc.abstractmethod
    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        """Declare what the queue needs (DLQ, retry queues) and register ``callback`` for it."""

    async def declare(self, queue: str) -> list[str]:
        """Create ``queue`` and what it needs (dead-letter queue, retry queues) exactly as
        :meth:`subscribe` would, without consuming, so that producers can send before any worker
        has run (``consumer-kit declare``). Idempotent. Returns the names created or found.

        Raises:
            ConfigurationError: this broker cannot create queues from here (the default); create
                them yourself (console, infrastructure as code).
            ConnectionError: the broker cannot be reached.
        """
        raise ConfigurationError(
            f"declaring queues is not supported by this broker ({type(self).__name__}): "
            f"create queue {queue!r} and its dead-letter queue yourself"
        )

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop handing out new deliveries on every subscription until :meth:`resume` (environment
        fault, poison isolation); in-flight deliveries can still be settled. Idempotent."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Hand out deliveries again after :meth:`pause`. Idempotent."""

    @property
    def ready(self) -> bool:
        """``True`` while the broker connection is up (readiness); adapters override it."""
        return True

    @abc.abstractmethod
    async def stop_consuming(self) -> None:
        """Stop taking new deliveries; in-flight deliveries can still be settled."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close connections. Unsettled deliveries go back to the broker."""
