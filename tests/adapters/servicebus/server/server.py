"""Start and stop the server: a proton reactor on a free loopback port, in one background thread.

Usage::

    with ServiceBusTestServer() as server:
        server.create_queue("orders", lock_duration=5)
        client = ServiceBusClient.from_connection_string(server.connection_string)
        ...
        assert server.entity("orders").active_count == 0

The reactor thread owns every AMQP object; tests touch only entities, under the namespace lock.
A tick every ``tick_interval`` seconds expires locks and sessions and releases scheduled messages,
so time-based behaviour is accurate to about that interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from proton import Endpoint, Event, Handler
from proton.reactor import ApplicationEvent, Container, EventInjector

from .entities import Namespace, Topic
from .links import ServiceBusHandler
from .queues import Queue
from .rules import Rule
from .send_target import EntityOptions

_LOGGER = logging.getLogger(__name__)

_STOP = "servicebus_server_stop"
_DROP = "servicebus_server_drop"
SHUTDOWN_GRACE = 0.2  # seconds connections get to close politely before their sockets are closed


class _Reactor(Handler):
    """Reactor-level events: listen, tick, stop. Connection events go to ``ServiceBusHandler``."""

    def __init__(self, server: ServiceBusTestServer, protocol: ServiceBusHandler) -> None:
        super().__init__()
        self._server = server
        self._protocol = protocol
        self._acceptor: Any = None
        self._container: Any = None
        self._stopping = False
        self.injector = EventInjector()

    def on_reactor_init(self, event: Event) -> None:
        container = self._container = event.container
        container.selectable(self.injector)
        try:
            self._acceptor = container.acceptor(
                self._server.host, self._server.requested_port, self._protocol
            )
            # proton keeps the listening socket private; it is the only way to learn port 0's choice.
            self._server.port = self._acceptor._selectable.getsockname()[1]
        except OSError as error:
            self._server.startup_error = error
            self.injector.close()
            self._server.listening.set()
            return
        container.schedule(self._server.tick_interval, self)
        self._server.listening.set()

    def on_timer_task(self, event: Event) -> None:
        if self._stopping:
            return
        self._protocol.tick()
        event.container.schedule(self._server.tick_interval, self)

    def on_servicebus_server_drop(self, event: Event) -> None:
        """Cut every client's socket, as a network failure does (no AMQP close is sent)."""
        for connection in list(self._protocol.connections):
            transport = connection.transport
            if transport is not None and not transport.closed:
                transport.close_tail()
                transport.close_head()
        self._server.dropped.set()

    def on_servicebus_server_stop(self, event: Event) -> None:
        """Stop accepting, close every connection, then close what did not close in time."""
        self._stopping = True
        if self._acceptor is not None:
            self._acceptor.close()
        for connection in list(self._protocol.connections):
            if not connection.state & Endpoint.LOCAL_CLOSED:
                connection.close()
        if self._protocol.connections:
            self._container.schedule(
                _CloseWatch.POLL, _CloseWatch(self._protocol, time.monotonic() + SHUTDOWN_GRACE)
            )
        self.injector.close()


class _CloseWatch(Handler):
    """Waits for connections to close after shutdown; past the grace period, closes their sockets."""

    POLL = 0.01  # seconds

    def __init__(self, protocol: ServiceBusHandler, deadline: float) -> None:
        super().__init__()
        self._protocol = protocol
        self._deadline = deadline

    def on_timer_task(self, event: Event) -> None:
        if not self._protocol.connections:
            return  # nothing left: the reactor runs out of work and stops
        if time.monotonic() < self._deadline:
            event.container.schedule(self.POLL, self)
            return
        for connection in list(self._protocol.connections):
            transport = connection.transport
            if transport is not None and not transport.closed:
                transport.close_tail()
                transport.close_head()


class ServiceBusTestServer:
    """A local AMQP 1.0 server that the unmodified azure-servicebus SDK can talk to (no TLS, no auth)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, tick_interval: float = 0.05) -> None:
        """``port`` 0 picks a free port; ``tick_interval`` is in seconds."""
        self.host = host
        self.requested_port = port
        self.port = 0
        self.tick_interval = tick_interval
        self.namespace = Namespace()
        self.listening = threading.Event()
        self.dropped = threading.Event()  # set once drop_connections() has cut every connection
        self.startup_error: BaseException | None = None
        self.failure: BaseException | None = None
        self._protocol = ServiceBusHandler(self.namespace)
        self._reactor = _Reactor(self, self._protocol)
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 5.0) -> ServiceBusTestServer:
        """Start listening; returns once the port is bound (raises OSError if it could not be)."""
        container = Container(self._reactor)
        self._thread = threading.Thread(
            target=self._run, args=(container,), name="servicebus-test-server", daemon=True
        )
        self._thread.start()
        if not self.listening.wait(timeout):
            raise TimeoutError(f"the Service Bus test server did not start within {timeout} s")
        if self.startup_error is not None:
            self._thread.join(timeout)
            raise self.startup_error
        _LOGGER.info("Service Bus test server listening on %s:%s", self.host, self.port)
        return self

    def _run(self, container: Container) -> None:
        try:
            container.run()
        except BaseException as error:  # a handler bug: keep it for stop() to raise
            _LOGGER.exception("Service Bus test server crashed")
            self.failure = error
            self.listening.set()

    def drop_connections(self, timeout: float = 5.0) -> None:
        """Test hook: cut every client connection now (sockets closed, no AMQP close), as a network
        failure does. The server side forgets their links: message locks stay until they expire
        (Service Bus cannot carry a link over to another connection), session locks are released
        (uncounted, as a closed session). Returns once done."""
        self.dropped.clear()
        self._reactor.injector.trigger(ApplicationEvent(_DROP))
        if not self.dropped.wait(timeout):
            raise TimeoutError("the test server did not drop its connections in time")

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection and join the reactor thread; re-raises a crash of the reactor."""
        if self._thread is None:
            return
        if self._thread.is_alive():
            self._reactor.injector.trigger(ApplicationEvent(_STOP))
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the Service Bus test server did not stop within {timeout} s")
        self._thread = None
        if self.failure is not None:
            raise RuntimeError("the Service Bus test server crashed") from self.failure

    def __enter__(self) -> ServiceBusTestServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- what clients need --------------------------------------------------------------------

    @property
    def fully_qualified_namespace(self) -> str:
        """``host:port``, what the SDK calls the namespace once the emulator flag keeps the port."""
        return f"{self.host}:{self.port}"

    @property
    def connection_string(self) -> str:
        """Plain AMQP (``UseDevelopmentEmulator=true`` turns TLS off); the key is never checked."""
        return (
            f"Endpoint=sb://{self.host}:{self.port};SharedAccessKeyName=k;SharedAccessKey=v;"
            "UseDevelopmentEmulator=true"
        )

    # -- entities -----------------------------------------------------------------------------

    def create_queue(self, name: str, **options: Any) -> Queue:
        """Create (or replace) a queue; ``options`` are ``EntityOptions`` fields (seconds, bytes)."""
        return self.namespace.create_queue(name, EntityOptions(**options))

    def create_topic(self, name: str, **options: Any) -> Topic:
        return self.namespace.create_topic(name, EntityOptions(**options))

    def create_subscription(
        self, topic: str, name: str, *, rules: Iterable[Rule] | None = None, **options: Any
    ) -> Queue:
        """Create (or replace) a subscription of ``topic`` with ``rules`` (``rules.Rule``; None:
        ``$Default``, the true filter, as Service Bus gives a new subscription). Change them later
        with ``server.entity(topic).set_rules / add_rule / remove_rule``."""
        return self.namespace.create_subscription(topic, name, EntityOptions(**options), rules)

    def skew_clock(self, seconds: float) -> None:
        """Run the broker's clock ``seconds`` ahead of the host's (negative: behind), as a worker
        whose clock is off Service Bus's sees it: every ``locked_until`` and enqueued time it hands
        out, and every expiry it applies, follow the skewed clock. 0 restores it."""
        with self.namespace.lock:
            self.namespace.clock_skew = seconds

    def throttle(self, path: str, kind: str, count: int = 1) -> None:
        """Test hook: the next ``count`` operations of ``kind`` (``send``, ``receive``, ``settle``,
        ``peek``, ``renew``) on the entity at ``path`` are refused as throttled, with
        ``com.microsoft:server-busy`` (``ServiceBusServerBusyError``; how each kind is answered:
        ``throttling.py``). 0 stops throttling it."""
        self._protocol.throttles.add(path, kind, count)

    def throttled(self, path: str, kind: str) -> int:
        """How many operations of ``kind`` on ``path`` were refused as throttled so far."""
        return self._protocol.throttles.refused(path, kind)

    def entity(self, path: str) -> Queue | Topic:
        """The entity at ``path`` (``q``, ``q/$DeadLetterQueue``, ``t/Subscriptions/s``) for inspection."""
        return self.namespace.entity(path)
