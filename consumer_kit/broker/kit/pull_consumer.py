"""What the pull adapters (SQS, NATS JetStream) share: the consumer asks the broker for messages
in a loop of its own per queue, instead of the broker pushing them.

* :class:`PulledQueue`: one subscribed queue. Its loop pulls at most ``prefetch - held`` messages
  (nothing while ``prefetch`` are held); a pull that fails is logged once per outage and retried
  with backoff (0.1 s doubling to 5 s), the queue ``failing`` meanwhile. A delivery whose
  hand-over ended without a settlement (a crash point fired: the runtime treats it as process
  death) is *left to lapse*: no longer held, not renewed, not given back at close, so its lock
  lapses and the broker hands it out again, counted, as after a real crash.
* :class:`PullConsumer`: pause (no new pull; what the pull in flight brings is given back, uncounted),
  resume, stop, the hand-over of each delivery in a task of its own, and the give-backs of close.
* :class:`PulledDelivery`: a delivery that tells its queue once it is settled, so the slot frees,
  and keeps the clock of its peek-lock: it lapses at the time the pull was *sent* plus the lock's
  seconds, moved by each extension (:mod:`consumer_kit.broker.kit.lock_heartbeat`). From a margin before that
  (10 % of the lock's seconds, at most 1 s) nothing is settled any more: the broker may have
  handed the message to someone else.

The adapter supplies the broker's calls: :meth:`PulledQueue._pull`, :meth:`PulledQueue._take`.
Nothing here imports an adapter or an SDK.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from consumer_kit.broker import Consumer, Delivery, DeliveryCallback, Settlement, hand_over
from consumer_kit.resilience.backoff import RECONNECT
from consumer_kit.resilience.one_shots import OneShots
from consumer_kit.resilience.supervised import Supervised, all_running

D = TypeVar("D", bound=Delivery)
D_contra = TypeVar("D_contra", bound=Delivery, contravariant=True)
M = TypeVar("M")


class PulledDelivery(Delivery):
    """A delivery that calls ``_on_settled(self)`` once its first settlement has ended, whatever
    the outcome (the subscriber stops holding it), and knows whether it still holds its lock
    (module docstring).

    The subclass sets ``_on_settled`` and the lock's attributes: ``lock_seconds`` (seconds of
    peek-lock the pull and each extension give), ``locked_until`` (``time.monotonic()`` when the
    lock lapses) and ``lock_lost`` (the broker handed the message out again, or the lock lapsed
    before a settlement).
    """

    _on_settled: Callable[[Any], None]
    lock_seconds: float
    locked_until: float
    lock_lost: bool

    @property
    def holds_lock(self) -> bool:
        """``True`` while the lock, less its margin, has not lapsed and is not lost."""
        margin = min(1.0, 0.1 * self.lock_seconds)
        return not self.lock_lost and time.monotonic() < self.locked_until - margin

    async def _settle(self, how: Settlement, hook: Callable[[], Awaitable[None]]) -> None:
        first = self.settlement is None
        try:
            await super()._settle(how, hook)
        finally:
            if first:
                self._on_settled(self)


class Holder(Protocol[D_contra]):
    """The adapter's heartbeat as far as a queue needs it: start and stop keeping a delivery locked."""

    def hold(self, delivery: D_contra, /) -> None: ...

    def drop(self, delivery: D_contra, /) -> None: ...


class PulledQueue(abc.ABC, Generic[M, D]):
    """One subscribed queue, pulled by a task of its own (:meth:`pull_until_stopped`).

    Args:
        queue: the consumer-kit queue name.
        callback: the worker's delivery callback; ``prefetch``: the most deliveries held at once.
        heartbeat: keeps held deliveries locked.

    Class attributes (the adapter's): ``log`` (its logger), ``verb`` (``"pull"``, ``"receive"``:
    the word its log lines use), ``lapse_note`` (what happens to a delivery left to lapse).

    Attributes:
        held: unsettled deliveries by :meth:`_key`. ``left_to_lapse``: deliveries handed back
        unsettled. ``failing``: the last pull failed.
    """

    log: ClassVar[logging.Logger]
    verb: ClassVar[str]
    lapse_note: ClassVar[str]

    def __init__(
        self, queue: str, callback: DeliveryCallback, prefetch: int, *, heartbeat: Holder[D]
    ) -> None:
        self.queue, self.callback, self.prefetch = queue, callback, prefetch
        self._heartbeat = heartbeat
        self.held: dict[Hashable, D] = {}
        self._room = asyncio.Event()
        self._room.set()
        self.left_to_lapse = 0
        self.failing = False
        self._stopping = False

    @abc.abstractmethod
    async def _pull(self, room: int, requested_at: float) -> Sequence[M]:
        """Ask the broker for at most ``room`` messages (``requested_at``: ``time.monotonic()``
        now, the locks' start); empty when none came. Raises whatever the broker call raises:
        an outage, retried with backoff."""

    @abc.abstractmethod
    async def _take(self, messages: Sequence[M], requested_at: float) -> None:
        """Make deliveries of what one pull brought, hold them and hand them out."""

    @abc.abstractmethod
    def _describe(self, exc: Exception) -> str:
        """What a failed pull says in the log (no secrets, no payloads)."""

    @abc.abstractmethod
    def _key(self, delivery: D) -> Hashable:
        """The key of ``delivery`` in :attr:`held` (the broker's id of the message)."""

    def stop(self) -> None:
        """Pull no more (the pull in flight finishes; what it brings is given back)."""
        self._stopping = True
        self._room.set()

    async def pull_until_stopped(self, resumed: asyncio.Event) -> None:
        """The loop: wait until resumed and there is room, pull, take, repeat until :meth:`stop`."""
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
                messages = await self._pull(room, requested_at)
            except Exception as exc:  # noqa: BLE001 - an outage: back off and pull again
                failures += 1
                if not self.failing:
                    self.log.warning(
                        "%s from queue=%s failed (%s); retrying", self.verb, self.queue, self._describe(exc)
                    )
                self.failing = True
                await asyncio.sleep(RECONNECT.delay(failures))
                continue
            if self.failing:
                self.log.info("%s from queue=%s works again", self.verb, self.queue)
            self.failing, failures = False, 0
            await self._take(messages, requested_at)

    def leave_to_lapse(self, delivery: D) -> None:
        """The hand-over of ``delivery`` ended and left it unsettled: stop holding it (module
        docstring), so its lock lapses and the broker redelivers it. No-op once settled."""
        if delivery.settlement is not None:
            return
        self.left_to_lapse += 1
        self.log.info(
            "queue=%s message_id=%s handed back unsettled: %s",
            self.queue,
            delivery.message_id,
            self.lapse_note,
        )
        self._settled(delivery)

    def _settled(self, delivery: D) -> None:
        """``delivery`` is settled or left to lapse: not held any more, its slot free."""
        self._heartbeat.drop(delivery)
        key = self._key(delivery)
        if self.held.get(key) is delivery:
            del self.held[key]
        self._room.set()

    def unsettled(self) -> list[D]:
        """The held deliveries not yet settled (close gives them back)."""
        return [d for d in self.held.values() if d.settlement is None]


Q = TypeVar("Q", bound=PulledQueue[Any, Any])


class PullConsumer(Consumer, Generic[Q, D]):
    """The consumer side of a pull adapter: its queues, pause and resume, stop, the hand-over of
    each delivery and the give-backs of :meth:`_wind_down`.

    Args:
        settle_timeout: seconds; the bound on each settlement and on each step of closing.

    Class attributes (the adapter's): ``log`` (its logger), ``release_task`` (the name of a
    give-back's task).
    """

    log: ClassVar[logging.Logger]
    release_task: ClassVar[str]

    def __init__(self, *, settle_timeout: float) -> None:
        self._settle_timeout = settle_timeout
        self._subscriptions: dict[str, Q] = {}
        self._pullers: dict[str, Supervised] = {}
        self._handlers = OneShots()
        self._releases = OneShots()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._consuming = True
        self._closed = False

    def subscription(self, queue: str) -> Q:
        return self._subscriptions[queue]

    def _pulling_well(self, *also: Supervised) -> bool:
        """Not closed, the last pull of every queue worked, no pull loop (nor ``also``) is down."""
        return (
            not self._closed
            and not any(s.failing for s in self._subscriptions.values())
            and all_running([*self._pullers.values(), *also])
        )

    def _check_new(self, queue: str, prefetch: int) -> None:
        """Raises what :meth:`subscribe` raises before it asks the broker anything.

        Raises:
            ValueError: ``queue`` is already subscribed or ``prefetch`` < 1.
            RuntimeError: the consumer was stopped or closed.
        """
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1")
        if self._closed or not self._consuming:
            raise RuntimeError("consumer is stopped")
        if queue in self._subscriptions:
            raise ValueError(f"queue {queue!r} is already subscribed")

    def _start_pulling(self, queue: str, subscription: Q, *, name: str) -> None:
        """Hold ``subscription`` as ``queue``'s and start its loop in a supervised task ``name``."""
        self._subscriptions[queue] = subscription
        self._pullers[queue] = Supervised(
            name, lambda: subscription.pull_until_stopped(self._resumed)
        ).start()

    async def pause(self) -> None:
        """Start no new pull until :meth:`resume`; held deliveries still settle. Idempotent."""
        if self._resumed.is_set():
            self._resumed.clear()
            self.log.info("paused consuming queues=%s", ",".join(self._subscriptions))

    async def resume(self) -> None:
        """Pull again after :meth:`pause`. Idempotent."""
        if not self._resumed.is_set() and self._consuming:
            self._resumed.set()
            self.log.info("resumed consuming queues=%s", ",".join(self._subscriptions))

    async def stop_consuming(self) -> None:
        """End the pull loops; held deliveries can still be settled."""
        self._consuming = False
        for subscription in self._subscriptions.values():
            subscription.stop()
        self._resumed.set()  # a paused loop wakes up to see it is stopped

    async def _wind_down(self, last_pull: float) -> bool:
        """The first part of ``close``: stop consuming, wait for the pulls in flight (at most
        ``last_pull`` seconds), cancel the hand-overs still running (and :meth:`_other_handlers`;
        the runtime releases them), give back the held deliveries that never ran and wait for
        those releases. ``False`` when the consumer was closed already (nothing done)."""
        if self._closed:
            return False
        await self.stop_consuming()
        await asyncio.gather(*(p.wait_finished(last_pull) for p in self._pullers.values()))
        self._closed = True
        await self._handlers.cancel(self._settle_timeout, also=self._other_handlers())
        for subscription in self._subscriptions.values():
            for delivery in subscription.unsettled():
                self._give_back(delivery)
        await self._releases.wait(self._settle_timeout)
        return True

    def _other_handlers(self) -> Iterable[asyncio.Task[Any]]:
        """Hand-over tasks the adapter runs itself (e.g. SQS's FIFO lanes), cancelled at close."""
        return ()

    def _cancel_pullers(self) -> None:
        for puller in self._pullers.values():
            puller.cancel()

    # -- deliveries --------------------------------------------------------------------------

    def _wants_deliveries(self) -> bool:
        return self._consuming and self._resumed.is_set() and not self._closed

    async def _handle(self, subscription: Q, delivery: D) -> None:
        """Hand ``delivery`` to the worker; one that comes back unsettled is left to lapse."""
        try:
            await hand_over(delivery, subscription.callback, wanted=self._wants_deliveries())
        except asyncio.CancelledError:
            raise  # closing: close() gives back what is still unsettled
        except BaseException:
            subscription.leave_to_lapse(delivery)  # e.g. SimulatedCrash straight from a callback
            raise
        subscription.leave_to_lapse(delivery)  # no-op when settled, as it should be

    def _give_back(self, delivery: D) -> None:
        """Release ``delivery`` in a task of its own (:meth:`_wind_down` waits for it)."""
        self._releases.start(self._release_now(delivery), name=self.release_task)

    async def _release_now(self, delivery: D) -> None:
        await delivery.release()
