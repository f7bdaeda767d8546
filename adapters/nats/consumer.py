"""The consuming side: one pull loop per queue, the heartbeat, pause and resume.

* **Pulling**: :mod:`consumer_kit.adapters.nats.subscription` (``fetch`` up to 64, ``fetch_wait``).
* Every delivery runs in a task of its own (:class:`~consumer_kit.resilience.one_shots.OneShots`), at most
  ``prefetch`` held; with ``ordered=true`` JetStream itself hands out one message at a time.
* **Peek-lock**: :mod:`consumer_kit.adapters.nats.renewal` sends ``in_progress()`` for every held
  delivery until it is settled or left to lapse.
* **Pause / resume**: a paused consumer starts no new pull (what the pull in flight brings is given
  back at once, uncounted); resume pulls again.
* **Stop / close**: ``stop_consuming`` ends the pull loops; ``close`` waits for the pulls in flight
  (at most ``fetch_wait`` plus 5 s), cancels the deliveries still running (the runtime releases
  them), gives back the held deliveries that never ran and closes the connection.
"""

from __future__ import annotations

import logging

from consumer_kit.broker import DeliveryCallback
from consumer_kit.broker.kit.pull_consumer import PullConsumer

from .config import NATSConfig
from .connection import NATSConnection
from .delivery import NATSDelivery
from .errors import describe, is_unreachable
from .renewal import Heartbeat
from .subscription import Subscription
from .topology import QueueInfo, ensure_queue, recommended_max_deliver

logger = logging.getLogger(__name__)

_CLOSE_MARGIN = 5.0  # seconds a closing consumer waits beyond fetch_wait


class NATSConsumer(PullConsumer[Subscription, NATSDelivery]):
    """Consume JetStream work queues through durable pull consumers (pause, resume, stop and the
    hand-overs: :class:`~consumer_kit.broker.kit.pull_consumer.PullConsumer`).

    Args:
        config: the parsed ``nats://`` URL.
        max_deliveries, crash_limit: the runtime's bounds (``max_deliver`` is set well above them).
        settle_timeout: seconds; the bound on each settlement.
        handler_timeout: seconds; only checked against ``ack_wait`` without a heartbeat (WARNING).
        connection: a :class:`NATSConnection` to use (tests); default: its own.

    Attributes:
        heartbeat: the ``in_progress()`` heartbeat (``extensions``).
    """

    log = logger
    release_task = "consumer-kit nats release"

    def __init__(
        self, config: NATSConfig, *, max_deliveries: int = 5, crash_limit: int = 3, settle_timeout: float = 10.0,
        handler_timeout: float | None = None, connection: NATSConnection | None = None,
    ) -> None:
        if max_deliveries < 1 or crash_limit < 1:
            raise ValueError("max_deliveries and crash_limit must be >= 1")
        if settle_timeout <= 0:
            raise ValueError("settle_timeout must be > 0 seconds")
        super().__init__(settle_timeout=settle_timeout)
        self.config = config
        self._owns_connection = connection is None
        self.connection = connection or NATSConnection(config)
        self._max_deliver = config.max_deliver or recommended_max_deliver(max_deliveries, crash_limit)
        if self._max_deliver <= max_deliveries + crash_limit:
            logger.warning("max_deliver=%s is not above max_deliveries + crash_limit=%s: JetStream may stop "
                           "delivering a message before consumer-kit dead-letters it",
                           self._max_deliver, max_deliveries + crash_limit)
        self._handler_timeout = handler_timeout
        self.heartbeat = Heartbeat(enabled=config.heartbeat)

    @property
    def ready(self) -> bool:
        """True while connected, the last pull of every queue worked and no task is down."""
        return self.connection.connected and self._pulling_well(*self.heartbeat.supervised())

    async def _queue(self, queue: str) -> QueueInfo:
        try:
            js = await self.connection.jetstream()
            return await ensure_queue(js, queue, ack_wait=self.config.ack_wait, max_deliver=self._max_deliver,
                                      ordered=self.config.ordered)
        except Exception as exc:
            if is_unreachable(exc):
                raise ConnectionError(f"NATS cannot be reached: {describe(exc)}") from exc
            raise

    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        """Create or update ``queue``'s streams and durable consumer (:mod:`consumer_kit.adapters.nats.topology`)
        and start pulling, holding at most ``prefetch`` deliveries.

        Raises:
            ValueError: ``queue`` is already subscribed or ``prefetch`` < 1.
            RuntimeError: the consumer was stopped or closed.
            ConfigurationError: an invalid name, or JetStream refused a stream or the consumer.
            ConnectionError: NATS cannot be reached.
        """
        self._check_new(queue, prefetch)
        info = await self._queue(queue)
        js = await self.connection.jetstream()
        pull = await js.pull_subscribe_bind(durable=info.durable, stream=info.stream)
        subscription = Subscription(
            info, pull, callback, prefetch, js=js, heartbeat=self.heartbeat,
            max_payload=await self.connection.max_payload(), fetch_wait=self.config.fetch_wait,
            settle_timeout=self._settle_timeout, wanted=self._wants_deliveries, dispatch=self._dispatch,
        )
        self._start_pulling(queue, subscription, name=f"consumer-kit nats pull {queue}")
        timeout = self._handler_timeout
        if timeout is not None and not self.heartbeat.enabled and timeout >= info.ack_wait:
            logger.warning("heartbeat=off and handler_timeout=%ss is not below ack_wait=%ss on queue=%s: a slow "
                           "handler's message is handed out again while it runs", timeout, info.ack_wait, queue)
        logger.info("consuming queue=%s (stream %s) prefetch=%s ack_wait=%ss max_deliver=%s dead letters to %s",
                    queue, info.stream, prefetch, info.ack_wait, self._max_deliver, info.dlq_stream)

    async def declare(self, queue: str) -> list[str]:
        """Create ``queue``'s work-queue stream, dead-letter stream and durable consumer where they
        do not exist (``consumer-kit declare``); returns the stream names and the consumer's.
        Idempotent. Raises as :meth:`subscribe`."""
        info = await self._queue(queue)
        return [info.stream, info.dlq_stream, f"{info.stream}/{info.durable}"]

    async def close(self) -> None:
        """Stop consuming, give back every held delivery (module docstring), close the connection."""
        if not await self._wind_down(self.config.fetch_wait + _CLOSE_MARGIN):
            return
        await self.heartbeat.close()
        self._cancel_pullers()
        for subscription in self._subscriptions.values():
            try:
                await subscription.pull.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - closing anyway
                logger.debug("unsubscribe of queue=%s failed (%s)", subscription.queue, type(exc).__name__)
        if self._owns_connection:
            await self.connection.close()

    # -- deliveries --------------------------------------------------------------------------

    def _dispatch(self, subscription: Subscription, delivery: NATSDelivery) -> None:
        if not self._wants_deliveries():  # pulled while pausing or closing: back at once, never cancelled
            self._give_back(delivery)
            return
        self._handlers.start(self._handle(subscription, delivery))
