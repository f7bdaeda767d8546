"""The consuming side: one long-poll loop per queue, FIFO lanes, the heartbeat, pause and resume.

* **Polling**: :mod:`consumer_kit.adapters.sqs.subscription` (batch receive up to 10, long polling, broker
  duplicates absorbed).
* **Standard queues**: every delivery runs in a task of its own, at most ``prefetch`` held.
* **FIFO queues**: deliveries go through their message group's lane (:mod:`consumer_kit.adapters.sqs.fifo`).
* **Peek-lock**: :mod:`consumer_kit.adapters.sqs.renewal` extends every held delivery until it is settled,
  or until its hand-over to the worker ends without a settlement (a crash point: the delivery is
  left to lapse, :mod:`consumer_kit.adapters.sqs.subscription`).
* **Pause / resume**: a paused consumer starts no new poll (pause does not wait for the one in
  flight: what it brings is given back at once, uncounted); resume polls again.
* **Stop / close**: ``stop_consuming`` ends the poll loops; ``close`` waits for the polls in
  flight (at most the long-poll wait plus 15 s), cancels the deliveries still running (the
  runtime releases them), gives back the held deliveries that never ran and closes the client.
"""

from __future__ import annotations

import asyncio
import logging

from consumer_kit.broker import DeliveryCallback
from consumer_kit.broker.kit.pull_consumer import PullConsumer

from .config import MAX_VISIBILITY_SECONDS, SQSConfig
from .connection import SQSClient
from .delivery import SQSDelivery
from .errors import describe, is_unreachable
from .fifo import GroupLanes
from .renewal import Heartbeat
from .settlement import Settler
from .subscription import Subscription
from .topology import QueueDirectory, QueueInfo, recommended_max_receive_count

logger = logging.getLogger(__name__)

_CLOSE_MARGIN = 15.0  # seconds a closing consumer waits beyond the long-poll wait


class SQSConsumer(PullConsumer[Subscription, SQSDelivery]):
    """Consume SQS standard and FIFO queues (pause, resume, stop and the hand-overs:
    :class:`~consumer_kit.broker.kit.pull_consumer.PullConsumer`).

    Args:
        config: the parsed ``sqs://`` URL.
        max_deliveries, crash_limit: the runtime's bounds; a queue whose redrive policy's
            ``maxReceiveCount`` is not above them is warned about, and created queues get
            :func:`~consumer_kit.adapters.sqs.topology.recommended_max_receive_count`.
        settle_timeout: seconds; the bound on each settlement.
        concurrency: the worker's concurrency: sizes the client's threads and connection pool.
        handler_timeout: the runtime's handler timeout in seconds, only checked against the
            visibility timeout and the 12-hour maximum (WARNING).
        client: an :class:`~consumer_kit.adapters.sqs.connection.SQSClient` to use (tests); default: its own.

    Raises:
        ValueError: on invalid arguments.

    Attributes:
        heartbeat: the visibility heartbeat (``extensions``, ``locks_lost``).
        settler: the settlement calls (``deletes``, ``stale_receipts``, ``delete_retries``).
    """

    log = logger
    release_task = "consumer-kit sqs release"

    def __init__(
        self,
        config: SQSConfig,
        *,
        max_deliveries: int = 5,
        crash_limit: int = 3,
        settle_timeout: float = 10.0,
        concurrency: int = 8,
        handler_timeout: float | None = None,
        client: SQSClient | None = None,
    ) -> None:
        if max_deliveries < 1 or crash_limit < 1 or concurrency < 1:
            raise ValueError("max_deliveries, crash_limit and concurrency must be >= 1")
        if settle_timeout <= 0:
            raise ValueError("settle_timeout must be > 0 seconds")
        super().__init__(settle_timeout=settle_timeout)
        self.config = config
        self._owns_client = client is None
        self.client = client or SQSClient(config, threads=concurrency + 2, pollers=4)
        self._minimum_receives = max_deliveries + crash_limit
        self._directory = QueueDirectory(
            self.client, account_id=config.account_id,
            max_receive_count=recommended_max_receive_count(max_deliveries, crash_limit),
        )
        self._handler_timeout = handler_timeout
        self.settler = Settler(self.client)
        self.heartbeat = Heartbeat(self.client, enabled=config.heartbeat)
        self._lanes: dict[str, GroupLanes] = {}

    @property
    def ready(self) -> bool:
        """True while the last poll of every queue worked and no poll loop or heartbeat is down
        (readiness)."""
        return self._pulling_well(*self.heartbeat.supervised())

    @property
    def receives(self) -> int:
        return sum(s.receives for s in self._subscriptions.values())

    @property
    def duplicates_absorbed(self) -> int:
        return sum(s.duplicates_absorbed for s in self._subscriptions.values())

    # -- Consumer API ------------------------------------------------------------------------

    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        """Look up ``queue`` and its dead-letter queue (see :mod:`consumer_kit.adapters.sqs.topology`) and start
        polling it, holding at most ``prefetch`` deliveries.

        Raises:
            ValueError: ``queue`` is already subscribed or ``prefetch`` < 1.
            RuntimeError: the consumer was stopped or closed.
            LookupError: no such queue (and ``create_queues`` is off).
            ConsumerKit ConfigurationError: the queue has no dead-letter queue.
            botocore errors: SQS refused or did not answer.
        """
        self._check_new(queue, prefetch)
        if self.config.create_queues:
            info = await self._directory.ensure(queue, dead_letters=True)
        else:
            info = await self._directory.lookup(queue)
        dead_letters = await self._directory.dead_letter_queue(info)
        visibility = self.config.visibility_timeout or info.visibility_timeout
        self._check(queue, info, visibility)
        subscription = Subscription(
            queue, info, dead_letters, callback, prefetch,
            client=self.client, settler=self.settler, heartbeat=self.heartbeat,
            visibility=visibility, wait_seconds=self.config.wait_seconds,
            settle_timeout=self._settle_timeout, wanted=self._wants_deliveries,
            dispatch=self._dispatch, give_back=self._give_back,
        )
        if info.fifo:
            self._lanes[queue] = GroupLanes(
                lambda delivery: self._handle(subscription, delivery), self._release_now
            )
        self._start_pulling(queue, subscription, name=f"consumer-kit sqs poll {queue}")
        logger.info(
            "consuming queue=%s (%s, %s) prefetch=%s visibility=%ss heartbeat=%s dead letters to %s",
            queue, info.name, "FIFO" if info.fifo else "standard", prefetch, visibility,
            "on" if self.heartbeat.enabled else "off", dead_letters.name,
        )

    async def declare(self, queue: str) -> list[str]:
        """Create ``queue`` with a redrive policy to a new ``<name>-dlq`` where it does not exist
        (``consumer-kit declare``; :mod:`consumer_kit.adapters.sqs.topology`); returns the SQS names of the queue
        and its dead-letter queue. Idempotent.

        Raises:
            ConfigurationError: an existing queue has no dead-letter queue.
            LookupError: a URL or ARN names no queue.
            ConnectionError: SQS cannot be reached.
        """
        try:
            info = await self._directory.ensure(queue, dead_letters=True)
            dead_letters = await self._directory.dead_letter_queue(info)
        except Exception as exc:
            if is_unreachable(exc):
                raise ConnectionError(f"SQS cannot be reached: {describe(exc)}") from exc
            raise
        return [info.name, dead_letters.name]

    async def close(self) -> None:
        """Stop consuming, give back every held delivery (module docstring), close the client."""
        if not await self._wind_down(self.config.wait_seconds + _CLOSE_MARGIN):
            return
        await self.heartbeat.close()
        await self.settler.close()
        self._cancel_pullers()
        if self._owns_client:
            await self.client.close()

    # -- deliveries --------------------------------------------------------------------------

    def _dispatch(self, subscription: Subscription, delivery: SQSDelivery) -> None:
        lanes = self._lanes.get(subscription.queue)
        if lanes is not None:
            lanes.submit(delivery)
            return
        self._handlers.start(self._handle(subscription, delivery))

    def _other_handlers(self) -> list[asyncio.Task[None]]:
        return [t for lanes in self._lanes.values() for t in lanes.tasks]

    def _check(self, queue: str, info: QueueInfo, visibility: int) -> None:
        if info.redrive is None:
            logger.warning(
                "SQS queue %s has no redrive policy: a message whose dead-letter copy cannot be "
                "sent keeps coming back (consumer-kit's own dead letters still go to the DLQ)",
                info.name,
            )
        elif info.redrive.max_receive_count < self._minimum_receives:
            logger.warning(
                "SQS queue %s has maxReceiveCount=%s, not above max_deliveries + crash_limit=%s: SQS "
                "may dead-letter a message before consumer-kit does (FIFO retries count receives)",
                info.name, info.redrive.max_receive_count, self._minimum_receives,
            )
        if info.fifo and not self.heartbeat.enabled:
            logger.warning(
                "heartbeat=off on FIFO queue %s: a retry is given back to SQS with the rest of its "
                "message group, and every give-back counts a receive of each message in hand towards "
                "maxReceiveCount: SQS may dead-letter healthy messages behind a failing one, "
                "without a reason (consumer-kit holds FIFO retries only with the heartbeat on)",
                info.name,
            )
        timeout = self._handler_timeout
        if timeout is not None and timeout >= MAX_VISIBILITY_SECONDS:
            logger.warning(
                "handler_timeout=%ss reaches SQS's 12-hour visibility maximum: a handler that long "
                "loses its lock on queue=%s", timeout, queue,
            )
        elif timeout is not None and not self.heartbeat.enabled and timeout >= visibility:
            logger.warning(
                "heartbeat=off and handler_timeout=%ss is not below the visibility timeout of %ss "
                "on queue=%s: a slow handler's message is handed out again while it runs",
                timeout, visibility, queue,
            )
