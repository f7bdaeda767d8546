"""One subscribed queue: its pull loop and the deliveries it holds.

Each pull asks for ``min(64, prefetch - held)`` messages (none while ``prefetch`` are held) and
waits at most ``fetch_wait`` seconds; an empty pull is no error. A pull that fails (NATS away,
reconnecting) is logged once per outage and retried with backoff (0.1 s doubling to 5 s); the
consumer is not ready meanwhile.

**Handed back unsettled.** A delivery whose hand-over ended without a settlement (a crash point
fired: the runtime treats it as process death) is *left to lapse*: no longer held, not renewed,
not given back at close, so its ``ack_wait`` lapses and JetStream redelivers it, counted, as after
a real crash. **The same message again** (a redelivery of a message still held, after its lock
lapsed): the earlier delivery loses its lock (it will not ack) and the new one is handed out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from consumer_kit import headers as own_headers
from consumer_kit.broker import DeliveryCallback, build_delivery
from consumer_kit.errors import DeadLetterReason

from .delivery import NATSDelivery
from .envelope import DEAD_LETTER_DETAIL_HEADER, DEAD_LETTER_REASON_HEADER, ORIGINAL_QUEUE_HEADER, headers_for
from .errors import describe
from .renewal import Heartbeat
from .topology import QueueInfo

logger = logging.getLogger(__name__)

_BATCH = 64


class Subscription:
    """One queue, pulled by a task of its own.

    Args:
        info: the work queue; ``pull``: its pull subscription.
        callback: the worker's delivery callback; ``prefetch``: the most deliveries held at once.
        js, heartbeat: the consumer's. ``max_payload``: the server's limit in bytes.
        fetch_wait, settle_timeout: seconds.
        wanted: whether the consumer wants deliveries now; ``dispatch``: hands a delivery to the worker.

    Attributes:
        held: unsettled deliveries by stream sequence. ``pulls``, ``receives``, ``left_to_lapse``: counters.
        failing: the last pull failed.
    """

    def __init__(
        self, info: QueueInfo, pull: JetStreamContext.PullSubscription, callback: DeliveryCallback, prefetch: int,
        *, js: JetStreamContext, heartbeat: Heartbeat, max_payload: int, fetch_wait: float, settle_timeout: float,
        wanted: Callable[[], bool], dispatch: Callable[[Subscription, NATSDelivery], None],
    ) -> None:
        self.info, self.pull, self.callback, self.prefetch = info, pull, callback, prefetch
        self.queue = info.queue
        self._js, self._heartbeat, self._max_payload = js, heartbeat, max_payload
        self._fetch_wait, self._settle_timeout = fetch_wait, settle_timeout
        self._wanted, self._dispatch = wanted, dispatch
        self.held: dict[int, NATSDelivery] = {}
        self._room = asyncio.Event()
        self._room.set()
        self.pulls = 0
        self.receives = 0
        self.left_to_lapse = 0
        self.failing = False
        self._stopping = False

    def stop(self) -> None:
        """Pull no more (the pull in flight finishes; what it brings is given back)."""
        self._stopping = True
        self._room.set()

    async def pull_until_stopped(self, resumed: asyncio.Event) -> None:
        failures = 0
        while not self._stopping:
            await resumed.wait()
            room = self.prefetch - len(self.held)
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            requested_at = time.monotonic()
            try:
                messages = await self.pull.fetch(batch=min(_BATCH, room), timeout=self._fetch_wait)
            except (nats.errors.TimeoutError, TimeoutError):
                # nothing arrived in fetch_wait (FetchTimeoutError), or the pull was cut short by
                # the close (a plain TimeoutError); a server that is away shows in ``ready``
                messages = []
            except Exception as exc:  # noqa: BLE001 - an outage: back off and pull again
                failures += 1
                if not self.failing:
                    logger.warning("pull from queue=%s failed (%s); retrying", self.queue, describe(exc))
                self.failing = True
                await asyncio.sleep(min(5.0, 0.1 * 2 ** (failures - 1)))
                continue
            self.pulls += 1
            if self.failing:
                logger.info("pull from queue=%s works again", self.queue)
            self.failing, failures = False, 0
            for msg in messages:
                await self.accept(msg, requested_at)

    async def accept(self, msg: Msg, requested_at: float) -> NATSDelivery | None:
        """Make a delivery of one pulled message, hold it and dispatch it."""
        self.receives += 1

        def build() -> NATSDelivery:
            return NATSDelivery(
                msg, info=self.info, js=self._js, max_payload=self._max_payload, requested_at=requested_at,
                settle_timeout=self._settle_timeout, renew=self._heartbeat.renew, on_settled=self._settled,
            )

        delivery = build_delivery(build, unbuildable=lambda detail: None, what=f"queue={self.queue}")
        if delivery is None:
            await self._dead_letter_raw(msg)
            return None
        earlier = self.held.get(delivery.stream_seq)
        if earlier is not None and earlier.settlement is None:
            earlier.lock_lost = True  # JetStream handed it out again: the earlier hold is gone
        self.held[delivery.stream_seq] = delivery
        self._heartbeat.hold(delivery)
        self._dispatch(self, delivery)
        return delivery

    async def _dead_letter_raw(self, msg: Msg) -> None:
        """A message no delivery could be made of: a copy to the dead-letter stream with reason
        ``invalid_header``, then ``term()`` (never retried forever, never dropped)."""
        headers: dict[str, Any] = {k: v for k, v in (msg.headers or {}).items() if not k.lower().startswith("nats-")}
        headers.update({DEAD_LETTER_REASON_HEADER: DeadLetterReason.INVALID_HEADER.value,
                        DEAD_LETTER_DETAIL_HEADER: "the message could not be mapped",
                        ORIGINAL_QUEUE_HEADER: self.queue})
        try:
            sent = headers_for(own_headers.seal(headers, msg.data))  # signed: dlq list believes the reason
            await self._js.publish(self.info.dlq_subject, msg.data, headers=sent, timeout=self._settle_timeout)
            await msg.term()
        except Exception as exc:  # noqa: BLE001 - it comes back when ack_wait lapses
            logger.error("dead-lettering an unmappable message of queue=%s failed (%s)", self.queue, describe(exc))

    def leave_to_lapse(self, delivery: NATSDelivery) -> None:
        """The hand-over of ``delivery`` ended and left it unsettled (module docstring)."""
        if delivery.settlement is not None:
            return
        self.left_to_lapse += 1
        logger.info("queue=%s message_id=%s handed back unsettled: not renewed, it comes back when ack_wait lapses",
                    self.queue, delivery.message_id)
        self._settled(delivery)

    def _settled(self, delivery: NATSDelivery) -> None:
        self._heartbeat.drop(delivery)
        if self.held.get(delivery.stream_seq) is delivery:
            del self.held[delivery.stream_seq]
        self._room.set()

    def unsettled(self) -> list[Any]:
        return [d for d in self.held.values() if d.settlement is None]
