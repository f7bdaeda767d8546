"""Publishing outbox events (the relay's side) with publisher confirms, one message never hurting
the others.

Three channels on one connection, each for one job:

* the **publishing channel** carries every publish (confirms, ``mandatory``), many in flight;
* each **declaration** runs on a short-lived channel of its own
  (:func:`~consumer_kit.adapters.rabbitmq.topology.declare_topic_exchange`): a destination that exists as
  another exchange type (406) or is refused (403) closes only that channel, and the row is
  refused at once with the broker's reply text;
* an **isolated publish** (a short-lived channel of its own) for a destination whose publish
  closed the publishing channel: a channel-closing refusal cannot be pinned on one of the
  messages in flight, so they all fail as transient and their destinations are published alone
  next time, where a refusal is this message's own (permanent) and a success clears the suspicion.

Before any of that, the message's encoded properties and headers are checked against the
connection's negotiated ``frame_max`` and its body against ``max_message_size``
(:mod:`consumer_kit.adapters.rabbitmq.limits`): too large is permanent, and never sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, cast

import aio_pika
import aiormq
import aiormq.abc
from aio_pika.abc import AbstractChannel, AbstractConnection
from pamqp.commands import Basic

from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.errors import ConfigurationError, PublishError, PublishTimeout

from . import confirms
from .connection import close_quietly, connect_retrying, is_open, open_connection
from .envelope import properties_of, user_of_url
from .errors import Unsendable, check_returned, describe, is_refusal, publish_error, reply_of
from .limits import DEFAULT_MAX_MESSAGE_SIZE, check_fits, frame_max_of, prepare
from .topology import declare_topic_exchange

logger = logging.getLogger(__name__)


class RabbitMQPublisher(Publisher):
    """Publish :class:`~consumer_kit.broker.publishing.OutgoingMessage` with publisher confirms.

    ``message.destination`` names a durable topic exchange (declared on first use, then cached
    per connection) and ``message.routing_key`` its routing key; destination ``""`` is the
    default exchange, so the routing key is a queue name (commands, tests). Messages are
    persistent, with ``message_id``, ``content_type``, ``type = message_type`` and the headers
    plus ``message-type``. ``partition_key`` is not used on RabbitMQ.

    Unroutable messages (mandatory publish returned by the broker): on a topic exchange this is
    a normal pub/sub state (no subscriber bound yet), logged at DEBUG and treated as published;
    on the default exchange it means the queue does not exist (a row error).

    The connection is opened on first publish and re-opened on the next publish after a loss or
    a confirm timeout, also one made of several shorter waits: a connection that has answered
    none of them for ``confirm_timeout`` seconds is reset, though each caller's bound
    (``within``) was shorter than that.

    Args:
        url: AMQP URL.
        confirm_timeout: seconds to wait for connecting, declaring and the broker's confirm.
        max_message_size: bytes; a larger body is refused before sending (the broker's
            ``max_message_size``, RabbitMQ 3.10 default 128 MiB).

    Raises:
        ValueError: on invalid arguments.
    """

    def __init__(
        self,
        url: str,
        *,
        confirm_timeout: float = 10.0,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        if confirm_timeout <= 0:
            raise ValueError("confirm_timeout must be > 0 seconds")
        if max_message_size < 1:
            raise ValueError("max_message_size must be >= 1 byte")
        self._url = url
        # sent as user_id (RabbitMQ validates it): consumers can allow the relay's user as a sender
        self._user_id = user_of_url(url)
        self._confirm_timeout = confirm_timeout
        self._max_message_size = max_message_size
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchanges: set[str] = set()  # declared on the current connection
        self._declaring: dict[str, asyncio.Lock] = {}
        self._suspects: set[str] = set()  # destinations to publish alone (module docstring)
        # loop time since which the current connection has answered none of our waits (None: it
        # answered the last one); across calls, so short bounds add up to confirm_timeout
        self._silent_since: float | None = None
        self._lock = asyncio.Lock()
        self._alone = asyncio.Lock()  # one isolated publish at a time: few channels, clear blame

    async def publish(self, message: OutgoingMessage) -> None:
        """Publish ``message`` and wait for the broker's confirm.

        Raises:
            PublishError: permanent: too large for the frame or the message size limit, or
                refused by the broker as addressed (reply text included); row: no queue of that
                name on the default exchange; transient: nack, confirm timeout, connection loss.
                Publishing again with the same ``message_id`` is safe for consumers that
                deduplicate.
        """
        properties = properties_of(message, user_id=self._user_id)
        connection: AbstractConnection | None = None
        try:
            # one deadline for every step, without wait_for's extra task per publish
            async with asyncio.timeout(self._confirm_timeout):
                connection, channel = await self._ready()
                check_fits(
                    properties, len(message.body),
                    frame_max=frame_max_of(await channel.get_underlay_channel()),
                    max_message_size=self._max_message_size,
                )
                if message.destination in self._suspects:
                    result = await self._publish_alone(connection, message, properties)
                else:
                    await self._declare(connection, message)
                    result = await self._publish_shared(channel, message, properties)
        except PublishError:
            raise
        except Unsendable as exc:
            raise PublishError(
                f"message_id={message.message_id} to {message.destination!r} cannot be "
                f"published: {exc}",
                permanent=True,
            ) from exc
        except Exception as exc:
            if isinstance(exc, TimeoutError):  # the broker stopped answering: start afresh
                await self._reset(connection)
            raise publish_error(exc, message.message_id, message.destination, alone=False) from exc
        self._silent_since = None  # the broker answered
        check_returned(message, result)

    async def publish_batch(
        self, messages: Sequence[OutgoingMessage], *, within: float
    ) -> list[BaseException | None]:
        """Publish ``messages`` with one socket write and one wait for all their confirms (at
        most ``within`` seconds, and at most ``confirm_timeout``); one outcome per message, in
        order: ``None`` confirmed, else the :class:`PublishError` :meth:`publish` would raise.
        Unconfirmed when ``within`` ran out: :class:`PublishTimeout` (nothing is sent once it has);
        when ``confirm_timeout`` did: a transient :class:`PublishError`, and the connection is
        reset (the broker stopped answering). Messages to a destination published alone (module
        docstring), and a message repeating an earlier one's ``message_id``, go one by one after
        the others."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        wait = min(max(within, 0.0), self._confirm_timeout)
        deadline, caller_deadline = began + wait, began + max(within, 0.0)
        # Nothing counts as confirmed until its confirm is in: every outcome starts as a failure.
        outcomes: list[BaseException | None] = [
            PublishTimeout(f"message_id={m.message_id} not sent within {wait:.1f} s") for m in messages
        ]
        shared: list[int] = []  # indexes of the messages sent on the publishing channel
        alone: list[int] = []
        futures: list[asyncio.Future[Any]] = []
        connection: AbstractConnection | None = None
        try:
            async with asyncio.timeout_at(deadline):  # connecting and declaring within the bound too
                connection, channel = await self._ready()
                underlay = await channel.get_underlay_channel()
                frame_max = frame_max_of(underlay)
                sends: dict[int, confirms.Publish] = {}
                ids: set[str] = set()
                for i, message in enumerate(messages):
                    prepared = prepare(message, properties_of(message, user_id=self._user_id), frame_max=frame_max, max_message_size=self._max_message_size)
                    if isinstance(prepared, PublishError):
                        outcomes[i] = prepared
                    elif message.destination in self._suspects or message.message_id in ids:
                        # a second publish of one message id in flight: a basic.return finds its
                        # publish by message id, so it could resolve the other one's confirmation
                        alone.append(i)
                    else:
                        sends[i] = prepared
                        ids.add(message.message_id)
                first = {messages[i].destination: messages[i] for i in reversed(sends)}
                for name, message in first.items():  # each new destination declared once
                    try:
                        await self._declare(connection, message)
                    except PublishError as exc:
                        for i in [i for i in sends if messages[i].destination == name]:
                            outcomes[i] = exc
                            del sends[i]
                shared = list(sends)
                if shared:
                    if loop.time() >= deadline:
                        # asyncio's timeout fires only at a suspension, and queueing the frames
                        # need not suspend: past the bound they would be sent yet reported unsent.
                        return outcomes
                    futures = await confirms.send(cast(aiormq.Channel, underlay), list(sends.values()))
        except TimeoutError as exc:
            if wait >= self._confirm_timeout:  # the broker stopped answering: start afresh
                await self._reset(connection)
                for i in range(len(messages)):
                    if i not in alone and isinstance(outcomes[i], PublishTimeout):
                        outcomes[i] = publish_error(exc, messages[i].message_id, messages[i].destination, alone=False)
            elif self._silent_too_long(began):
                await self._reset(connection)
            return outcomes
        except Exception as exc:  # noqa: BLE001 - connection or channel lost before anything was sent
            for i, message in enumerate(messages):
                if isinstance(outcomes[i], PublishTimeout):
                    outcomes[i] = self._shared_failure(message, exc)
            return outcomes
        if futures:
            done, pending = await asyncio.wait(futures, timeout=max(deadline - loop.time(), 0.0))
            for future in pending:
                future.cancel()  # aiormq ignores a late confirm of a cancelled future
            if done:
                self._silent_since = None  # the broker answered
            if pending and (wait >= self._confirm_timeout or (not done and self._silent_too_long(began))):
                await self._reset(connection)  # confirm_timeout passed: the broker stopped answering
            for i, future in zip(shared, futures, strict=True):
                outcomes[i] = self._settled(messages[i], future, wait)
        for i in alone:
            if loop.time() >= caller_deadline:  # never sent past the bound (see above)
                outcomes[i] = PublishTimeout(f"message_id={messages[i].message_id} not sent within {within:.1f} s")
                continue
            try:
                async with asyncio.timeout_at(caller_deadline):
                    await self.publish(messages[i])
                outcomes[i] = None
            except TimeoutError:
                outcomes[i] = PublishTimeout(f"message_id={messages[i].message_id} not confirmed within {within:.1f} s")
            except PublishError as exc:
                outcomes[i] = exc
        return outcomes

    def _settled(self, message: OutgoingMessage, future: asyncio.Future[Any], wait: float) -> BaseException | None:
        """The outcome of one confirmation future of :meth:`publish_batch`."""
        if future.cancelled():
            if wait >= self._confirm_timeout:  # the broker's silence, not the caller's bound
                return publish_error(TimeoutError(), message.message_id, message.destination, alone=False)
            return PublishTimeout(f"message_id={message.message_id} not confirmed within {wait:.1f} s")
        exc = future.exception()
        if exc is not None:
            return self._shared_failure(message, exc)
        try:
            check_returned(message, future.result())
        except PublishError as returned:
            return returned
        return None

    def _shared_failure(self, message: OutgoingMessage, exc: BaseException) -> PublishError:
        """What a failure on the shared publishing channel means for ``message`` (as in
        :meth:`_publish_shared`: a refusal makes its destination published alone from now on)."""
        if is_refusal(exc) and message.destination not in self._suspects:
            self._suspects.add(message.destination)
            logger.warning(
                "publishing channel closed by the broker (%s); destination %s is published "
                "alone from now on (message_id=%s)",
                describe(exc), message.destination, message.message_id,
            )
        return publish_error(exc, message.message_id, message.destination, alone=False)

    async def connect(self, *, within: float = 30.0) -> None:
        """Open the connection and the publishing channel now (the relay's start-up probe),
        retrying for at most ``within`` seconds.

        Raises:
            ConnectionError: no connection: the URL (password redacted) and the reason; a missing
                vhost or a refused login at once.
        """
        await connect_retrying(self._url, self._ready, within=within)

    async def declare(self, destination: str) -> None:
        """Declare ``destination`` as a durable topic exchange, as the first publish to it would
        (``""``, the default exchange, always exists).

        Raises:
            ConnectionError: no connection (see :meth:`connect`).
            ConfigurationError: the broker refused it (e.g. it exists as another exchange type,
                access refused); the broker's reply text says why.
        """
        await self.connect()
        if destination == "" or destination in self._exchanges:
            return
        assert self._connection is not None
        try:
            await declare_topic_exchange(self._connection, destination, self._confirm_timeout)
        except aio_pika.exceptions.AMQPError as exc:
            code, text = reply_of(exc)
            raise ConfigurationError(
                f"RabbitMQ refused exchange {destination!r} (reply {code}): {text or describe(exc)}"
            ) from exc
        self._exchanges.add(destination)

    async def close(self) -> None:
        """Close the connection (idempotent)."""
        await self._reset(self._connection)

    # -- steps -------------------------------------------------------------------------------

    async def _ready(self) -> tuple[AbstractConnection, AbstractChannel]:
        """The connection and the publishing channel, (re)opened as needed."""
        async with self._lock:
            if not is_open(self._connection):
                await self._reset(self._connection)
                self._connection = await open_connection(
                    self._url, timeout=self._confirm_timeout, name="consumer-kit publisher"
                )
                self._silent_since = None  # a new connection has not been silent yet
            assert self._connection is not None
            if self._channel is None or self._channel.is_closed:
                self._channel = await self._connection.channel(
                    publisher_confirms=True, on_return_raises=False
                )
            return self._connection, self._channel

    async def _declare(self, connection: AbstractConnection, message: OutgoingMessage) -> None:
        name = message.destination
        if name == "" or name in self._exchanges:
            return
        # One declaration per destination at a time: a first batch of many events to a new
        # exchange opens one declaration channel, not one per event.
        async with self._declaring.setdefault(name, asyncio.Lock()):
            if name in self._exchanges:
                return
            try:
                await declare_topic_exchange(connection, name, self._confirm_timeout)
            except Exception as exc:
                raise publish_error(exc, message.message_id, name, alone=True) from exc
            self._exchanges.add(name)

    async def _publish_shared(
        self, channel: AbstractChannel, message: OutgoingMessage, properties: Basic.Properties
    ) -> object:
        underlay = await channel.get_underlay_channel()
        try:
            return await underlay.basic_publish(
                message.body, exchange=message.destination, routing_key=message.routing_key,
                properties=properties, mandatory=True,
            )
        except Exception as exc:
            if is_refusal(exc):  # some message in flight closed the channel: maybe this one
                self._suspects.add(message.destination)
                logger.warning(
                    "publishing channel closed by the broker (%s); destination %s is published "
                    "alone from now on (message_id=%s)",
                    describe(exc), message.destination, message.message_id,
                )
            raise

    async def _publish_alone(
        self, connection: AbstractConnection, message: OutgoingMessage, properties: Basic.Properties
    ) -> object:
        async with self._alone:
            return await self._publish_on_own_channel(connection, message, properties)

    async def _publish_on_own_channel(
        self, connection: AbstractConnection, message: OutgoingMessage, properties: Basic.Properties
    ) -> object:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=False)
        try:
            if message.destination:
                await declare_topic_exchange(connection, message.destination, self._confirm_timeout)
            underlay = await channel.get_underlay_channel()
            result = await underlay.basic_publish(
                message.body, exchange=message.destination, routing_key=message.routing_key,
                properties=properties, mandatory=True,
            )
        except Exception as exc:
            raise publish_error(exc, message.message_id, message.destination, alone=True) from exc
        finally:
            if not channel.is_closed:
                await channel.close()
        self._suspects.discard(message.destination)
        self._exchanges.add(message.destination)
        return result

    def _silent_too_long(self, since: float) -> bool:
        """Note a wait on the broker that went unanswered (it began at loop time ``since``) and say
        whether the connection has now answered nothing for ``confirm_timeout`` seconds. A relay's
        bound can stay shorter than ``confirm_timeout`` on every call (its lease's publish deadline
        set close to it): counted alone, its waits would never reset a blocked connection."""
        if self._silent_since is None:
            self._silent_since = since
        return asyncio.get_running_loop().time() - self._silent_since >= self._confirm_timeout

    async def _reset(self, connection: AbstractConnection | None) -> None:
        """Forget ``connection`` (when it is still the current one) and close it."""
        if connection is None or connection is not self._connection:
            await close_quietly(connection, self._confirm_timeout, "publisher")
            return
        self._connection, self._channel, self._silent_since = None, None, None
        self._exchanges.clear()
        await close_quietly(connection, self._confirm_timeout, "publisher")
