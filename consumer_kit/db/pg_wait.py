"""A pooled connection whose socket stays registered with the event loop between waits.

psycopg's ``AsyncConnection.wait`` (``psycopg.waiting.wait_async``) registers the socket with the
loop for every wait and removes it afterwards (two ``epoll_ctl`` calls), and arms a 0.1 s timer
that only wakes the wait up to wait again; psycopg offers no other async wait to select
(``PSYCOPG_WAIT_FUNC`` picks the blocking one only). A delivery waits about five times (claim,
two handler statements, completion, COMMIT): measured on the benchmark machine, 17 µs for a
register/unregister pair and 4.5 µs for the timer, about 100 µs of client CPU per delivery.

:class:`KeptWaitConnection` keeps the reader registered while waits follow each other. A read
wait then costs a future. The rules that keep it as safe as psycopg's own:

* the socket reported readable twice in a row with nobody waiting (a NOTICE, a NOTIFY, the
  server closing) drops the registration, so an idle connection never spins the loop; the next
  wait registers again and reads what is there, as psycopg's would (once is usually a stale
  report of data the waiting task then read);
* a wait that has to write (``Wait.W``/``Wait.RW``: the send buffer was full), a wait with a
  ``timeout``, and the wait after a cancellation go to psycopg's own wait unchanged (psycopg's
  cancel-on-interrupt included: see :meth:`KeptWaitConnection.wait`);
* the registration is dropped before the socket can go: in ``close()``, when any exception
  passes through a wait (a broken connection), and before psycopg's interrupt handling (which
  may close the socket). A socket closed while the loop still held its number would stall the
  next socket the kernel gives that number, psycopg's own ``connect()`` included (a test showed
  it), so no path may leave one; as a second guard a connection's first registration removes
  whatever the loop holds for its number (no system call when it holds nothing);
* nothing bounds a wait here, as nothing does in psycopg's (its timer only loops): consumer-kit
  bounds its statements with ``asyncio.timeout`` (:func:`consumer_kit.db.pool.bounded`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, TypeVar, cast

import psycopg
from psycopg import waiting
from psycopg.abc import PQGen

RV = TypeVar("RV")

_R = waiting.Wait.R
_READY_R = waiting.Ready.R


class _Resumed(Iterator[Any]):
    """``gen`` whose first step already yielded ``state``: handed to psycopg's wait as if new.
    With ``raising``, the first step raises it instead (psycopg's interrupt handling then runs
    on the generator, which is still waiting for its reply)."""

    def __init__(self, gen: Any, state: Any, raising: BaseException | None = None) -> None:
        self._gen, self._state, self._raising = gen, state, raising

    def __next__(self) -> Any:
        if self._raising is not None:
            exc, self._raising = self._raising, None
            raise exc
        if self._state is not None:
            state, self._state = self._state, None
            return state
        return next(self._gen)

    def send(self, value: Any) -> Any:
        if self._state is not None or self._raising is not None:
            return next(self)
        return self._gen.send(value)


class KeptWaitConnection(psycopg.AsyncConnection[Any]):
    """``psycopg.AsyncConnection`` whose read waits keep the socket registered with the loop
    (module docstring). Behaves as its base class otherwise; use it as the pool's
    ``connection_class``."""

    _kept_loop: asyncio.AbstractEventLoop | None = None
    _kept_fd: int = -1
    _waiter: asyncio.Future[None] | None = None
    _idle_reports = 0  # readable reports in a row with nobody waiting

    async def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        """Consume ``gen`` (a psycopg generator on this connection); as psycopg's ``wait``.

        Raises:
            psycopg.OperationalError: the socket was closed.
            psycopg.errors._WaitTimeout: (with ``timeout``) as psycopg's wait.
        """
        if timeout is not None:
            self._drop()
            return await super().wait(gen, interval, timeout)
        try:
            state = next(gen)
        except StopIteration as done:
            return done.value
        loop = asyncio.get_running_loop()
        try:
            while state == _R:  # a write wait (rare) goes to psycopg's own wait, below
                fut = self._waiter = loop.create_future()
                self._idle_reports = 0
                self._keep(loop)
                try:
                    await fut
                finally:
                    self._waiter = None
                state = gen.send(_READY_R)
        except StopIteration as done:
            return done.value
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit) as exc:
            # psycopg's wait answers an interruption by cancelling the statement on the server
            # and reading its reply: let it do exactly that on this generator.
            self._drop()
            return await super().wait(cast("PQGen[Any]", _Resumed(gen, None, raising=exc)), interval)
        except BaseException as exc:
            self._drop()  # libpq may have closed the socket: its number must not stay registered
            if isinstance(exc, OSError):
                raise psycopg.OperationalError("connection socket closed") from exc
            raise
        self._drop()
        return await super().wait(cast("PQGen[Any]", _Resumed(gen, state)), interval)  # from this step on

    def _keep(self, loop: asyncio.AbstractEventLoop) -> None:
        fd = self.pgconn.socket
        if self._kept_loop is loop and self._kept_fd == fd:
            return
        self._drop()
        loop.remove_reader(fd)  # a socket closed behind the loop's back had this number
        loop.add_reader(fd, self._readable)
        self._kept_loop, self._kept_fd = loop, fd

    def _readable(self) -> None:
        fut = self._waiter
        if fut is None:
            # Readable with nobody waiting. Once is usually a stale report: the loop polled the
            # socket before the task that then read its data ran. A second time in a row, data
            # is really there (a NOTICE, a NOTIFY, the server closing): drop the registration,
            # never spin; the next wait reads it.
            self._idle_reports += 1
            if self._idle_reports > 1:
                self._drop()
        elif not fut.done():
            fut.set_result(None)

    def _drop(self) -> None:
        loop, self._kept_loop = self._kept_loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._kept_fd)
        self._kept_fd = -1

    async def close(self) -> None:
        self._drop()
        await super().close()
