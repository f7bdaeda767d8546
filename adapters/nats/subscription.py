"""One subscribed queue: its pull loop and the deliveries it holds.

Each pull asks for ``min(64, prefetch - held)`` messages (none while ``prefetch`` are held) and
waits at most ``fetch_wait`` seconds; an empty pull is no error. A pull that fails (NATS away,
reconnecting) is logged once per outage and retried with backoff (0.1 s doubling to 5 s); the
consumer is not ready meanwhile (the loop: :mod:`consumer_kit.broker.kit.pull_consumer`).

**Handed back unsettled.** A delivery whose hand-over ended without a settlement (a crash point
fired: the runtime treats it as process death) is *left to lapse*: no longer held, not renewed,
not given back at close, so its ``ack_wait`` lapses and JetStream redelivers it, counted, as after
a real crash (:meth:`~consumer_kit.broker.kit.pull_consumer.PulledQueue.leave_to_lapse`). **The same message
again** (a redelivery of a message still held, after its lock lapsed): the earlier delivery loses
its lock (it will not ack) and the new one is handed out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from consumer_kit.broker import DeliveryCallback, build_delivery
from consumer_kit.broker.kit.pull_consumer import PulledQueue
from consumer_kit.codec import headers as own_headers
from consumer_kit.errors import DeadLetterReason

from .delivery import NATSDelivery
from .envelope import DEAD_LETTER_DETAIL_HEADER, DEAD_LETTER_REASON_HEADER, ORIGINAL_QUEUE_HEADER, headers_for
from .errors import describe
from .renewal import Heartbeat
from .topology import QueueInfo

logger = logging.getLogger(__name__)

_BATCH = 64


class Subscription(PulledQueue[Msg, NATSDelivery]):
    """One queue, pulled by a task of its own (the loop: :class:`~consumer_kit.broker.kit.pull_consumer.PulledQueue`).

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

    log = logger
    verb = "pull"
    lapse_note = "not renewed, it comes back when ack_wait lapses"
    _heartbeat: Heartbeat

    def __init__(
        self, info: QueueInfo, pull: JetStreamContext.PullSubscription, callback: DeliveryCallback, prefetch: int,
        *, js: JetStreamContext, heartbeat: Heartbeat, max_payload: int, fetch_wait: float, settle_timeout: float,
        wanted: Callable[[], bool], dispatch: Callable[[Subscription, NATSDelivery], None],
    ) -> None:
        super().__init__(info.queue, callback, prefetch, heartbeat=heartbeat)
        self.info, self.pull = info, pull
        self._js, self._max_payload = js, max_payload
        self._fetch_wait, self._settle_timeout = fetch_wait, settle_timeout
        self._wanted, self._dispatch = wanted, dispatch
        self.pulls = 0
        self.receives = 0

    async def _pull(self, room: int, requested_at: float) -> list[Msg]:
        try:
            messages = await self.pull.fetch(batch=min(_BATCH, room), timeout=self._fetch_wait)
        except (nats.errors.TimeoutError, TimeoutError):
            # nothing arrived in fetch_wait (FetchTimeoutError), or the pull was cut short by
            # the close (a plain TimeoutError); a server that is away shows in ``ready``
            messages = []
        self.pulls += 1
        return messages

    async def _take(self, messages: Sequence[Msg], requested_at: float) -> None:
        for msg in messages:
            await self.accept(msg, requested_at)

    def _describe(self, exc: Exception) -> str:
        return describe(exc)

    def _key(self, delivery: NATSDelivery) -> int:
        return delivery.stream_seq

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
