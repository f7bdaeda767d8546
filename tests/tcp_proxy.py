"""A small asyncio TCP proxy for fault tests: a server that stops answering, a network cut, a
service that refuses connections.

It forwards ``127.0.0.1:<port>`` to any ``target_host:target_port`` (RabbitMQ, PostgreSQL, ...)::

    proxy = TcpProxy("127.0.0.1", 5672)
    port = await proxy.start()     # clients connect to 127.0.0.1:<port>
    proxy.pause()                  # bytes stop flowing both ways; connections stay open
    proxy.resume()                 # held bytes flow again, in order
    await proxy.drop()             # cut every proxied connection (new ones are still accepted)
    await proxy.close()            # stop listening and cut everything (connections are refused)
    await proxy.start()            # listen again on the same port
    proxy.lose_replies(b"AmazonSQS.ReceiveMessage", 3)  # the next 3 requests containing these
                                   # bytes reach the server; their replies are cut (connection reset)

Nothing is lost or reordered by ``pause``: each direction stops reading from its source, so the
sender's kernel buffers fill up as they would in front of a server that stopped reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field

_CHUNK = 65536


@dataclass
class _Connection:
    lose_reply: bool = False  # the request just forwarded is one whose reply is to be lost
    request: bytearray | None = None  # the marked request being forwarded (until its reply)


@dataclass
class _ReplyLoss:
    marker: bytes
    left: int
    requests: list[bytes] = field(default_factory=list)


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``(target_host, target_port)``.

    Attributes:
        port: the listening port (fixed after the first :meth:`start`; 0 before).
        accepted: connections accepted so far (a reconnect shows as one more).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._loss: _ReplyLoss | None = None
        self.requests: list[bytearray] = []  # client-to-server requests holding a lose_replies marker

    def lose_replies(self, marker: bytes, count: int = 1) -> None:
        """The next ``count`` client chunks containing ``marker`` go to the server (which acts on
        them); the server's reply to each is cut: the client's connection is reset instead. Every
        request with ``marker`` (its chunks up to the reply) is kept in :attr:`requests`, also
        after ``count`` is used up."""
        self._loss = _ReplyLoss(marker, count)

    @property
    def connections(self) -> int:
        """Proxied connections open right now."""
        return len(self._pipes)

    async def start(self) -> int:
        """Listen (again) and return the port. Idempotent."""
        if self._server is None:
            if self.port == 0:
                self.port = _free_port()
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        return self.port

    def pause(self) -> None:
        """Stop forwarding in both directions; connections stay open, bytes are held."""
        self._flowing.clear()

    def resume(self) -> None:
        """Forward again, the held bytes first."""
        self._flowing.set()

    async def drop(self) -> None:
        """Cut every proxied connection at once (both sides see the connection reset); keep
        listening. A pause stays in force for new connections until :meth:`resume`."""
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()
        pipes = list(self._pipes)
        for pipe in pipes:
            pipe.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)

    async def close(self) -> None:
        """Stop listening (new connections are refused), cut every proxied connection and clear
        a pause, so a later :meth:`start` forwards at once."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        await self.drop()
        self._flowing.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        # A task of our own for the two directions: drop() cancels it, never the server's task.
        pipe = asyncio.create_task(self._pipe(reader, writer, up_reader, up_writer))
        self._pipes.add(pipe)
        pipe.add_done_callback(self._pipes.discard)
        await asyncio.wait({pipe})

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        state = _Connection()
        try:
            await asyncio.gather(self._copy(reader, up_writer, state, upstream=True),
                                 self._copy(up_reader, writer, state, upstream=False))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _copy(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, state: _Connection, *, upstream: bool,
    ) -> None:
        try:
            while True:
                await self._flowing.wait()  # paused: stop reading, so the sender's buffers fill
                data = await source.read(_CHUNK)
                if not data:
                    break
                await self._flowing.wait()  # paused after the read: hold these bytes
                loss = self._loss
                if upstream and loss is not None and loss.marker in data:
                    state.request = bytearray(data)
                    self.requests.append(state.request)
                    if loss.left > 0:
                        loss.left -= 1
                        state.lose_reply = True
                elif upstream and state.request is not None:
                    state.request.extend(data)
                if not upstream:
                    state.request = None
                    if state.lose_reply:
                        break  # the server answered: the reply is lost, the connection reset
                sink.write(data)
                await sink.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            sink.transport.abort()  # one side ended: end the other too


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
