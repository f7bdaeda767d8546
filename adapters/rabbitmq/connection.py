"""Opening and closing AMQP connections and channels, and the backoff between reconnects."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_not_exception_type,
    stop_after_delay,
)

from consumer_kit.codec.redaction import redact_url
from consumer_kit.resilience.backoff import RECONNECT
from consumer_kit.resilience.one_shots import OneShots

from . import wire
from .errors import REFUSED, VhostUnavailable, describe, is_vhost_refusal

logger = logging.getLogger(__name__)

_closing = OneShots()  # channel closes still waiting for the broker's reply

# Pause between recovery attempts: 0.1 s, 0.2 s, 0.4 s, ... at most 5 s.
BACKOFF = RECONNECT.wait()


def log_retries(what: str, *, alert_after: float | None = None) -> Callable[[RetryCallState], None]:
    """A tenacity ``before_sleep``: one WARNING per failed attempt at ``what``, and one ERROR once
    it has failed for longer than ``alert_after`` seconds (an outage someone should look at)."""
    alerted = False

    def log(state: RetryCallState) -> None:
        nonlocal alerted
        exc = state.outcome.exception() if state.outcome is not None else None
        failing = state.seconds_since_start or 0.0
        if alert_after is not None and failing > alert_after and not alerted:
            alerted = True
            logger.error("%s: failing for %.1fs (%s); still retrying", what, failing, describe(exc))
            return
        logger.warning(
            "%s: attempt %s failed (%s); next in %.1fs", what, state.attempt_number, describe(exc),
            state.next_action.sleep if state.next_action else 0.0,
        )

    return log


async def open_connection(url: str, *, timeout: float, name: str) -> AbstractConnection:
    """Connect to ``url`` within ``timeout`` seconds; ``name`` shows in the management UI
    (``consumer-kit consumer``, ``consumer-kit publisher``).

    Raises:
        VhostUnavailable: the URL's vhost does not exist or the user may not use it.
        aiormq.exceptions.AMQPConnectionError, OSError, TimeoutError: no connection.
    """
    wire.install()  # no message's headers may close this connection (consumer_kit.adapters.rabbitmq.wire)
    try:
        return await aio_pika.connect(
            url, timeout=timeout, client_properties={"connection_name": name}
        )
    except aio_pika.exceptions.AMQPError as exc:
        if is_vhost_refusal(exc):
            raise VhostUnavailable(url) from None
        raise


async def connect_retrying(url: str, connect: Callable[[], Awaitable[object]], *, within: float) -> None:
    """Run ``connect()`` until it succeeds, backing off (:data:`BACKOFF`) for at most ``within``
    seconds; a refusal that retrying cannot fix (credentials, vhost, permissions) ends it at once.

    Raises:
        ConnectionError: ``"cannot connect to RabbitMQ at <url, password redacted>: <reason>"``.
    """
    where = f"RabbitMQ at {redact_url(url)}"
    try:
        async for attempt in AsyncRetrying(
            wait=BACKOFF,
            stop=stop_after_delay(within),
            retry=retry_if_not_exception_type(REFUSED),
            before_sleep=log_retries(f"connecting to {where}"),
            reraise=True,
        ):
            with attempt:
                await connect()
    except Exception as exc:
        reason = str(exc) if isinstance(exc, VhostUnavailable) else describe(exc)
        raise ConnectionError(f"cannot connect to {where}: {reason}") from exc


def is_open(connection: AbstractConnection | None) -> bool:
    """True while ``connection`` is usable. aio-pika's ``is_closed`` only turns True when the
    client closes it; a connection the broker or the network closed shows in ``connected``."""
    return connection is not None and not connection.is_closed and connection.connected.is_set()


async def close_quietly(connection: AbstractConnection | None, timeout: float, whose: str) -> None:
    """Close ``connection`` within ``timeout`` seconds, ignoring errors: it is going away either way."""
    if connection is None or connection.is_closed:
        return
    try:
        async with asyncio.timeout(timeout):
            await connection.close()
    except Exception as exc:  # noqa: BLE001 - it is going away either way
        logger.debug("closing the %s connection failed (%s)", whose, type(exc).__name__)


async def close_channel_soon(channel: AbstractChannel, wait: float) -> None:
    """Start closing ``channel`` and wait at most ``wait`` seconds for the broker's reply.

    The close keeps going in the background after that: its Channel.Close frame is already queued,
    so a broker that stopped answering still sees it as soon as it reads again, and requeues the
    channel's unacked deliveries then (or when the connection drops, whichever comes first).
    """
    if channel.is_closed:
        return
    task = _closing.start(_close(channel), name="consumer-kit rabbitmq channel close")
    await asyncio.wait({task}, timeout=wait)


async def _close(channel: AbstractChannel) -> None:
    try:
        await channel.close()
    except Exception as exc:  # noqa: BLE001 - a channel that fails to close is closed
        logger.debug("closing a channel failed (%s)", type(exc).__name__)
