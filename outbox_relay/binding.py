"""One outbox, one broker: the relay records the broker it publishes to and refuses another.

The outbox holds events written for the broker its relay published to. Pointed at another broker
(CONSUMER_KIT_BROKER_URL switched from RabbitMQ to SQS), a relay would publish the pending ones
there: consumers on the first broker never see them. So the relay writes the broker's identity
(scheme, host, port, path and an SQS region; never credentials) into ``<schema>.outbox_broker`` at
its first start (migration 105) and, at every start:

* same broker: nothing to say;
* another broker, no pending event: logs a warning and records the new broker (a deliberate move);
* another broker with pending events: refuses (:class:`~consumer_kit.errors.ConfigurationError`)
  and names both brokers and the ways out: a schema of its own for the new broker, the old broker
  until the outbox drained, or ``outbox-relay rebind`` to send the pending events to the new one.

``memory://`` (in-process: the demo, tests) is never recorded.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import parse_qs, urlsplit

from psycopg import AsyncConnection, sql

from consumer_kit.errors import ConfigurationError

logger = logging.getLogger("consumer_kit.outbox_relay")

_READ = "SELECT broker, bound_at FROM {table}"
_WRITE = """
    INSERT INTO {table} (singleton, broker, bound_by) VALUES (true, %(broker)s, %(by)s)
    ON CONFLICT (singleton) DO UPDATE SET broker = EXCLUDED.broker, bound_at = now(), bound_by = EXCLUDED.bound_by
"""
_PENDING = "SELECT count(*) FROM {table} WHERE published_at IS NULL"


def broker_identity(url: str) -> str | None:
    """``scheme://host:port/path`` of ``url`` (plus ``?region=`` for SQS), without user, password
    or other options; ``None`` for ``memory://``. Example: ``amqp://guest:pw@mq:5672/prod`` ->
    ``amqp://mq:5672/prod``."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        return None
    host = (parts.hostname or "").lower()
    port = f":{parts.port}" if parts.port else ""
    identity = f"{scheme}://{host}{port}{parts.path}"
    region = parse_qs(parts.query).get("region")
    if scheme == "sqs" and region:
        identity += f"?region={region[0]}"
    return identity


async def check_binding(conn: AsyncConnection[Any], schema: str, broker_url: str, *, relay_id: str) -> None:
    """Record or check the broker of ``schema``'s outbox (see module doc).

    Raises:
        ConfigurationError: the outbox belongs to another broker and holds pending events.
    """
    broker = broker_identity(broker_url)
    if broker is None:
        return
    cur = await conn.execute(sql.SQL(_READ).format(table=sql.Identifier(schema, "outbox_broker")))
    row = await cur.fetchone()
    if row is not None and row[0] == broker:
        return
    if row is not None:
        cur = await conn.execute(sql.SQL(_PENDING).format(table=sql.Identifier(schema, "outbox")))
        pending = (await cur.fetchone() or (0,))[0]
        if pending:
            raise ConfigurationError(
                f"the outbox of schema {schema!r} belongs to broker {row[0]} (since {row[1]:%Y-%m-%d %H:%M} UTC) "
                f"and holds {pending} pending event(s) written for it; this relay publishes to {broker}. "
                f"Give this broker a schema of its own (CONSUMER_KIT_DB_SCHEMA), drain the outbox with a relay "
                f"on {row[0]} first, or run `outbox-relay rebind` to send the pending events to {broker}"
            )
        logger.warning("outbox of schema %s moves from broker %s to %s (no pending event)", schema, row[0], broker)
    await rebind(conn, schema, broker_url, relay_id=relay_id)


async def rebind(conn: AsyncConnection[Any], schema: str, broker_url: str, *, relay_id: str) -> str | None:
    """Record ``broker_url``'s broker as the one ``schema``'s outbox belongs to; returns its identity."""
    broker = broker_identity(broker_url)
    if broker is not None:
        await conn.execute(
            sql.SQL(_WRITE).format(table=sql.Identifier(schema, "outbox_broker")), {"broker": broker, "by": relay_id}
        )
    return broker
