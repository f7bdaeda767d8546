"""The AMQP side: python-qpid-proton events turned into entity operations, as Service Bus answers them.

What each kind of link does (addresses as the SDK sends them):

- ``$cbs`` and ``<entity>/$management`` request links: each request is answered on the link of
  the same AMQP session whose source is that same address (``cbs.py``, ``management.py``);
- a sender link to ``amqps://host:port/<queue or topic>`` (a producer): each transfer is stored, or
  refused with ``rejected`` and a condition (too large, not found...); batches are opened;
- a receiver link from a queue, subscription or ``.../$DeadLetterQueue`` (a consumer): messages are
  locked and transferred while the link has credit; the delivery tag is the lock token
  (``bytes_le``); the consumer's disposition is applied and echoed back settled (the SDK attaches
  with receiver-settle-mode "second" and waits for that echo), or answered ``rejected`` with
  ``com.microsoft:message-lock-lost`` / ``session-lock-lost``;
- a receiver link with a ``com.microsoft:session-filter`` locks a session first (the named one or,
  for a null filter, the next one with messages, waiting up to the link's ``com.microsoft:timeout``)
  and answers the attach with the session id in the filter and ``com.microsoft:locked-until-utc``.

A link to an unknown entity is attached and detached at once with ``amqp:not-found``, which the
SDK raises as ``MessagingEntityNotFoundError``.

All work happens on the reactor thread while holding ``Namespace.lock``.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from proton import Condition, Delivery, Endpoint, Event, Handler, Link, Message, Terminus

from . import cbs, management, wire
from .entities import Namespace
from .errors import BrokerError, MessageTooLarge, NotAllowed, SessionLockLost
from .queues import MessageSession, Queue, Settlement
from .sections import EncodedMessage, unbatch
from .send_target import SendTarget
from .throttling import ServerBusy, Throttles

_LOGGER = logging.getLogger(__name__)

PRODUCER_CREDIT = 100  # credit kept open on every link the SDK sends on
DEFAULT_SESSION_WAIT = 60.0  # seconds a NEXT_AVAILABLE session attach waits without a link timeout


class Consumer:
    """A receive link on a queue, subscription or dead-letter queue (proton's side is the Sender)."""

    def __init__(self, link: Link, queue: Queue, *, receive_and_delete: bool, session_id: str | None) -> None:
        self.link = link
        self.queue = queue
        self.receive_and_delete = receive_and_delete
        self.session_id = session_id
        self.session_lost = False

    def __repr__(self) -> str:
        return f"Consumer({self.queue.path!r}, link={self.link.name!r}, session={self.session_id!r})"


@dataclass
class PendingSessionAttach:
    """A NEXT_AVAILABLE session receiver waiting for a session with messages (deadline in epoch seconds)."""

    link: Link
    queue: Queue
    receive_and_delete: bool
    deadline: float


class ServiceBusHandler(Handler):
    """Reactor event handler: connections, sessions and links of every client of one server."""

    def __init__(self, namespace: Namespace) -> None:
        super().__init__()
        self.namespace = namespace
        self._consumers: list[Consumer] = []
        self._pending_sessions: list[PendingSessionAttach] = []
        self.connections: set[Any] = set()  # open connections, for shutdown
        self.throttles = Throttles()  # test hook: operations answered "server busy" (throttling.py)

    # -- connections and sessions ---------------------------------------------------------------

    def on_connection_remote_open(self, event: Event) -> None:
        connection = event.connection
        self.connections.add(connection)
        if connection.state & Endpoint.LOCAL_UNINIT:
            connection.container = "servicebus-test-server"
            connection.open()

    def on_session_remote_open(self, event: Event) -> None:
        if event.session.state & Endpoint.LOCAL_UNINIT:
            event.session.open()

    def on_session_remote_close(self, event: Event) -> None:
        event.session.close()

    def on_connection_remote_close(self, event: Event) -> None:
        self._forget_connection(event.connection)
        event.connection.close()

    def on_transport_closed(self, event: Event) -> None:
        if event.connection is not None:
            self._forget_connection(event.connection)
            self.connections.discard(event.connection)

    def _forget_connection(self, connection: Any) -> None:
        with self.namespace.lock:
            for consumer in [c for c in self._consumers if c.link.connection == connection]:
                self._forget_consumer(consumer)
            self._pending_sessions = [p for p in self._pending_sessions if p.link.connection != connection]

    # -- link attach ------------------------------------------------------------------------------

    def on_link_remote_open(self, event: Event) -> None:
        link = event.link
        if not link.state & Endpoint.LOCAL_UNINIT:
            return
        with self.namespace.lock:
            try:
                if link.is_receiver:
                    self._attach_incoming(link)
                else:
                    self._attach_outgoing(link)
            except BrokerError as error:
                self._refuse(link, error)

    def _attach_incoming(self, link: Link) -> None:
        """The client sends on this link: $cbs or $management requests, or messages to an entity."""
        path = wire.entity_path(link.remote_target.address)
        if path == cbs.CBS_ADDRESS:
            link.request_node = cbs.CBS_ADDRESS
        elif path.endswith(wire.MANAGEMENT_SUFFIX):
            self.namespace.entity(path[: -len(wire.MANAGEMENT_SUFFIX)])  # unknown entity: refuse now
            link.request_node = path
        else:
            target = self.namespace.send_target(path)
            link.send_target = target
            link.max_message_size = target.options.max_message_size
        self._open(link)
        link.flow(PRODUCER_CREDIT)

    def _attach_outgoing(self, link: Link) -> None:
        """The client receives on this link: $cbs/$management responses, or messages from a queue."""
        source = link.remote_source
        path = wire.entity_path(source.address)
        if path == cbs.CBS_ADDRESS or path.endswith(wire.MANAGEMENT_SUFFIX):
            responders = getattr(link.session, "responders", None) or {}
            responders[path] = link
            link.session.responders = responders
            link.pending_responses = []
            self._open(link)
            return
        queue = self.namespace.receive_source(path)
        filters = wire.read_data(source.filter)
        wants_session = isinstance(filters, dict) and wire.SESSION_FILTER in filters
        if wants_session != queue.requires_session:
            raise NotAllowed(
                f"{path} {'requires' if queue.requires_session else 'does not support'} session receivers"
            )
        receive_and_delete = link.remote_snd_settle_mode == Link.SND_SETTLED
        if not wants_session:
            self._start_consumer(link, queue, receive_and_delete, None)
            return
        assert isinstance(filters, dict)
        requested = wire.as_text(filters.get(wire.SESSION_FILTER))
        consumer = Consumer(link, queue, receive_and_delete=receive_and_delete, session_id=requested)
        session = queue.accept_session(consumer, requested, self.namespace.now())
        if session is not None:
            self._start_session_consumer(consumer, session)
            return
        wait_ms = (link.remote_properties or {}).get(wire.LINK_TIMEOUT)
        wait = DEFAULT_SESSION_WAIT if wait_ms is None else int(wait_ms) / 1000
        self._pending_sessions.append(
            PendingSessionAttach(link, queue, receive_and_delete, self.namespace.now() + wait)
        )

    def _start_consumer(
        self, link: Link, queue: Queue, receive_and_delete: bool, session_id: str | None
    ) -> None:
        consumer = Consumer(link, queue, receive_and_delete=receive_and_delete, session_id=session_id)
        link.consumer = consumer
        self._consumers.append(consumer)
        self._open(link)
        _LOGGER.debug("receiver attached to %s (link %s)", queue.path, link.name)

    def _start_session_consumer(self, consumer: Consumer, session: MessageSession) -> None:
        link = consumer.link
        consumer.session_id = session.session_id
        link.consumer = consumer
        self._consumers.append(consumer)
        link.properties = {wire.SESSION_LOCKED_UNTIL: wire.dotnet_ticks(session.locked_until)}
        self._open(link)
        link.source.filter.clear()
        link.source.filter.put_object({wire.SESSION_FILTER: session.session_id})
        _LOGGER.debug(
            "session %s of %s locked for link %s", session.session_id, consumer.queue.path, link.name
        )

    def _open(self, link: Link) -> None:
        link.source.copy(link.remote_source)
        link.target.copy(link.remote_target)
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        link.open()

    def _refuse(self, link: Link, error: BrokerError) -> None:
        """Attach with a null terminus, then detach with the error: AMQP's way to refuse a link."""
        _LOGGER.info("refusing link %s: %s", link.name, error)
        if link.is_sender:
            link.source.type = Terminus.UNSPECIFIED
            link.target.copy(link.remote_target)
        else:
            link.source.copy(link.remote_source)
            link.target.type = Terminus.UNSPECIFIED
        link.condition = _condition(error)
        link.open()
        link.close()

    # -- link detach ------------------------------------------------------------------------------

    def on_link_remote_close(self, event: Event) -> None:
        link = event.link
        with self.namespace.lock:
            consumer = getattr(link, "consumer", None)
            if consumer is not None:
                self._forget_consumer(consumer)
            self._pending_sessions = [p for p in self._pending_sessions if p.link != link]
        if not link.state & Endpoint.LOCAL_CLOSED:
            link.close()

    def _forget_consumer(self, consumer: Consumer) -> None:
        if consumer in self._consumers:
            self._consumers.remove(consumer)
        if consumer.session_id is not None and not consumer.session_lost:
            consumer.queue.release_session(consumer.session_id, consumer)

    # -- transfers in -----------------------------------------------------------------------------

    def on_delivery(self, event: Event) -> None:
        link = event.link
        delivery = event.delivery
        with self.namespace.lock:
            if link.is_receiver:
                self._receive_transfer(link, delivery)
            else:
                self._receive_disposition(link, delivery)
            self.pump()

    def _receive_transfer(self, link: Link, delivery: Delivery) -> None:
        if not delivery.readable or delivery.partial:
            return  # wait for the rest of a multi-frame transfer
        payload = link.recv(delivery.pending)
        link.advance()
        node = getattr(link, "request_node", None)
        if node is not None:
            self._answer_request(link, node, payload)
            delivery.update(Delivery.ACCEPTED)
        else:
            self._store_messages(link, delivery, payload)
        delivery.settle()
        link.flow(1)

    def _store_messages(self, link: Link, delivery: Delivery, payload: bytes) -> None:
        target: SendTarget = link.send_target
        try:
            self.throttles.check(target.path, "send")
            if len(payload) > target.options.max_message_size:
                raise MessageTooLarge(
                    f"transfer of {len(payload)} bytes exceeds {target.options.max_message_size}"
                )
            contents = [EncodedMessage.decode(inner) for inner in unbatch(payload)]
            for content in contents:  # a batch is taken whole or not at all, as Service Bus does
                target.check(content)
            target.check_batch(contents)
            now = self.namespace.now()
            for content in contents:
                target.send(content, now)
        except (BrokerError, ValueError) as error:
            _LOGGER.info("send to %s rejected: %s", target.path, error)
            if not isinstance(error, BrokerError):
                error = _Undecodable(str(error))
            delivery.local.condition = _condition(error)
            delivery.update(Delivery.REJECTED)
            return
        delivery.update(Delivery.ACCEPTED)

    def _answer_request(self, link: Link, node: str, payload: bytes) -> None:
        request = Message()
        request.decode(payload)
        if node == cbs.CBS_ADDRESS:
            response = cbs.answer_put_token(request)
        elif (busy := self.throttles.management_busy(node[: -len(wire.MANAGEMENT_SUFFIX)], request)) is not None:
            response = busy
        else:
            properties = request.properties or {}
            request_context = management.Request(
                namespace=self.namespace,
                entity_path=node[: -len(wire.MANAGEMENT_SUFFIX)],
                body=wire.detach_buffers(request.body) if isinstance(request.body, dict) else {},
                receiver=self._consumer_named(link, wire.as_text(properties.get("associated-link-name"))),
                now=self.namespace.now(),
            )
            response = management.answer(request, request_context)
        responder = (getattr(link.session, "responders", None) or {}).get(node)
        if responder is None:
            _LOGGER.warning("no response link for %s in this session: request dropped", node)
            return
        responder.pending_responses.append(response)
        self._flush_responses(responder)

    def _consumer_named(self, link: Link, name: str | None) -> Consumer | None:
        if name is None:
            return None
        for consumer in self._consumers:
            if consumer.link.name == name and consumer.link.connection == link.connection:
                return consumer
        return None

    def _flush_responses(self, link: Link) -> None:
        pending: list[Message] = getattr(link, "pending_responses", None) or []
        while pending and link.credit > 0:
            delivery = link.send(pending.pop(0))
            delivery.settle()  # responses are pre-settled: the SDK never settles them

    # -- dispositions in --------------------------------------------------------------------------

    def _receive_disposition(self, link: Link, delivery: Delivery) -> None:
        """A consumer settled (or changed) a delivery of ours: apply it to the entity and echo it."""
        consumer: Consumer | None = getattr(link, "consumer", None)
        token = getattr(delivery, "lock_token", None)
        if (
            getattr(delivery, "answered", False)
            or consumer is None
            or token is None
            or not delivery.remote_state
        ):
            return
        outcome, reason, description = _outcome_of(delivery)
        if outcome is None:
            return  # a non-terminal state (received): nothing to settle yet
        delivery.answered = True
        try:
            self.throttles.check(consumer.queue.path, "settle")
            if consumer.session_lost:
                consumer.queue.session_for(consumer.session_id or "", consumer, self.namespace.now())
            consumer.queue.settle(token, outcome, self.namespace.now(), reason=reason, description=description)
        except BrokerError as error:
            _LOGGER.info("settlement %s on %s refused: %s", outcome, consumer.queue.path, error)
            delivery.local.condition = _condition(error)
            delivery.update(Delivery.REJECTED)
            delivery.settle()
            return
        if consumer.queue.take_lost_reply():
            return  # applied, the reply lost (test hook): the delivery stays unsettled, unanswered
        remote = delivery.remote
        if delivery.remote_state == Delivery.MODIFIED:
            delivery.local.failed = remote.failed
            delivery.local.undeliverable = remote.undeliverable
        # Echo the outcome without an error: the SDK treats a rejected echo carrying one as a failure.
        delivery.update(delivery.remote_state)
        delivery.settle()

    # -- transfers out ----------------------------------------------------------------------------

    def on_link_flow(self, event: Event) -> None:
        link = event.link
        if link.is_sender:
            with self.namespace.lock:
                self._flush_responses(link)
                self._throttle_receive(link)
                self.pump()

    def _throttle_receive(self, link: Link) -> None:
        """A receiver asked for messages while its entity is throttled: detach it with server-busy
        (throttling.py); its message locks stay with the entity."""
        consumer: Consumer | None = getattr(link, "consumer", None)
        if consumer is None or link.credit <= 0 or not link.state & Endpoint.LOCAL_ACTIVE:
            return
        if self.throttles.take(consumer.queue.path, "receive"):
            _LOGGER.info("receive on %s throttled: detaching link %s", consumer.queue.path, link.name)
            self._forget_consumer(consumer)
            link.condition = _condition(ServerBusy(consumer.queue.path))
            link.close()

    def pump(self) -> None:
        """Hand available messages to every consumer with credit (caller holds the namespace lock)."""
        now = self.namespace.now()
        for consumer in list(self._consumers):
            self._pump_consumer(consumer, now)

    def _pump_consumer(self, consumer: Consumer, now: float) -> None:
        link = consumer.link
        if consumer.session_lost or not link.state & Endpoint.LOCAL_ACTIVE:
            return
        session = None
        if consumer.session_id is not None:
            try:
                session = consumer.queue.session_for(consumer.session_id, consumer, now)
            except BrokerError:
                return
        while link.credit > 0:
            stored = consumer.queue.lock_next(consumer, now, consumer.session_id)
            if stored is None:
                break
            token = stored.lock_token
            payload = stored.render(locked_until=session.locked_until if session else None)
            delivery = link.delivery(wire.delivery_tag(token))
            delivery.lock_token = token
            link.send(payload)
            link.advance()
            if consumer.receive_and_delete:
                consumer.queue.take(stored)
                delivery.settle()
        if link.drain_mode:
            link.drained()

    # -- time -------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Expire locks and sessions, release scheduled messages, serve waiting session receivers."""
        now = self.namespace.now()
        with self.namespace.lock:
            for owner, session_id in self.namespace.expire(now):
                if isinstance(owner, Consumer):
                    self._detach_lost_session(owner, session_id)
            self._serve_pending_sessions(now)
            self.pump()

    def _detach_lost_session(self, consumer: Consumer, session_id: str) -> None:
        """Service Bus detaches a session receiver whose session lock expired (the SDK relies on it)."""
        _LOGGER.info("session %s lock lost by link %s", session_id, consumer.link.name)
        consumer.session_lost = True
        link = consumer.link
        if link.state & Endpoint.LOCAL_ACTIVE:
            link.condition = _condition(SessionLockLost(f"the lock on session {session_id} expired"))
            link.close()

    def _serve_pending_sessions(self, now: float) -> None:
        still_waiting = []
        for pending in self._pending_sessions:
            consumer = Consumer(
                pending.link, pending.queue, receive_and_delete=pending.receive_and_delete, session_id=None
            )
            session = pending.queue.accept_session(consumer, None, now)
            if session is not None:
                self._start_session_consumer(consumer, session)
            elif pending.deadline <= now:
                self._refuse(pending.link, _NoSessionAvailable("no session became available in time"))
            else:
                still_waiting.append(pending)
        self._pending_sessions = still_waiting


def _condition(error: BrokerError) -> Condition:
    # Always with a non-empty info map, as Service Bus sends (a tracking id): the SDK's sender
    # indexes condition, description and info, and proton leaves an empty map out.
    return Condition(error.condition, str(error), {wire.TRACKING_ID: str(uuid.uuid4())})


class _Undecodable(BrokerError):
    condition = "amqp:decode-error"
    status_code = 400


class _NoSessionAvailable(BrokerError):
    condition = wire.OPERATION_TIMEOUT
    status_code = 408


def _outcome_of(delivery: Delivery) -> tuple[str | None, str | None, str | None]:
    """The settlement a consumer asked for, with the dead-letter reason and description if any."""
    state = delivery.remote_state
    remote = delivery.remote
    if state == Delivery.ACCEPTED:
        return Settlement.COMPLETE, None, None
    if state == Delivery.RELEASED:
        return Settlement.RELEASE, None, None
    if state == Delivery.MODIFIED:
        return (Settlement.DEFER if remote.undeliverable else Settlement.ABANDON), None, None
    if state == Delivery.REJECTED:
        condition = remote.condition
        info = condition.info if condition is not None and isinstance(condition.info, dict) else {}
        return (
            Settlement.DEAD_LETTER,
            wire.as_text(info.get(wire.DEAD_LETTER_REASON)),
            wire.as_text(info.get(wire.DEAD_LETTER_ERROR_DESCRIPTION)),
        )
    return None, None, None
