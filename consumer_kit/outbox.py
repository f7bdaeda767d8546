"""The transactional outbox: the events handlers publish (written with the ledger's completion, see
:func:`events_cte`) and a writer for code outside handlers; the ``outbox`` table's migrations are
:mod:`consumer_kit.ledger.outbox_schema`.

All outbox SQL used by the core lives here; the relay's claim/mark statements live in
``outbox_relay`` next to the loop that uses them (they are the relay's own protocol).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from psycopg import AsyncConnection, sql
from pydantic import BaseModel

from consumer_kit.codec import marks
from consumer_kit.model.events import OutboxEvent, PendingEvent
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.telemetry.trace_context import inject_into

NOTIFY_CHANNEL_SUFFIX = "_outbox"

def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel the outbox trigger signals on: ``"<schema>_outbox"``."""
    return schema + NOTIFY_CHANNEL_SUFFIX


MAX_EVENT_HEADERS_BYTES = 16 * 1024
"""Bytes: the largest encoding (compact JSON, UTF-8) of an event's own headers.

The relay sends an event's properties and headers in one AMQP frame, whose size the broker
negotiates (RabbitMQ: ``frame_max`` 131,072 bytes by default); a frame larger than that closes
the relay's whole connection, so the relay refuses such an event and parks it. 16 KiB leaves
room for the relay's own headers (event id, operation, trace context) far below any default
frame, and refuses an oversized event where it is written, in the handler, not at publish time.
"""


MAX_PARTITION_KEY_BYTES = 1024
"""Longest event partition key, in UTF-8 bytes: the outbox indexes (partition_key, commit_seq), and
btree refuses a row over about 2,700 bytes (a handler deriving the key from a producer's field
would otherwise fail at COMMIT with ``54000 index row size ... exceeds btree maximum``)."""


_EVENT_ID_CONTEXT = b"consumer-kit event id\n"


def event_id_for(scope: str, key: str, fingerprint: str, place: int) -> uuid.UUID:
    """The id of the ``place``-th event (0, 1, ...) an execution of operation ``scope``/``key``
    with ``fingerprint`` publishes: the same in every execution, so one re-run after a commit lost
    with a failed-over primary publishes the ids the first run's relay may already have published,
    and deduplication by event id downstream holds (docs/scaling.md).

    Keyed (HMAC-SHA256 under the deployment's mark key, :mod:`consumer_kit.codec.marks`), never a
    hash of public parts: a producer knows its operation's scope, key and fingerprint, and an id it
    could compute would let it publish junk under that id first, so that a broker's duplicate
    window (JetStream, SQS FIFO, Service Bus) drops the real event (docs/explanation/trust.md)."""
    return uuid.UUID(bytes=marks.keyed_digest(_EVENT_ID_CONTEXT, scope, key, fingerprint, place)[:16], version=4)


def operation_event(
    operation: OperationIdentity,
    place: int,
    event: BaseModel,
    *,
    destination: str,
    routing_key: str,
    partition_key: str | None,
    headers: Mapping[str, str],
    message_type: str | None,
) -> PendingEvent:
    """The ``place``-th event (0, 1, ...) an execution of ``operation`` publishes: ``event``
    serialised in JSON mode, its type name by default, its id from :func:`event_id_for` (the
    handler's :meth:`consumer_kit.Context.publish` and the HTTP front door's alike).

    Raises:
        ValueError: as :func:`pending_event`.
    """
    return pending_event(
        destination=destination,
        routing_key=routing_key,
        message_type=message_type or type(event).__name__,
        payload=event.model_dump(mode="json"),
        partition_key=partition_key,
        headers=headers,
        event_id=event_id_for(operation.scope, operation.key, operation.fingerprint, place),
    )


def pending_event(
    *,
    destination: str,
    routing_key: str,
    message_type: str,
    payload: Any,
    partition_key: str | None,
    headers: Mapping[str, str],
    event_id: uuid.UUID | None = None,
) -> PendingEvent:
    """A :class:`PendingEvent` with ``event_id`` (default: a new random one; a handler's events
    get :func:`event_id_for`). The stored headers are ``headers`` plus the
    current W3C trace context (``traceparent``, ``tracestate``; none without an active span, and
    never over a ``traceparent`` the caller set), so the relay's ``publish`` span continues the
    trace of the transaction that wrote the event (:mod:`consumer_kit.telemetry.tracing`).

    Raises:
        ValueError: empty destination, headers over :data:`MAX_EVENT_HEADERS_BYTES` encoded, or
            a partition key over :data:`MAX_PARTITION_KEY_BYTES`.
        TypeError: payload or headers not JSON-serialisable.
    """
    if not destination:
        raise ValueError("destination must be a non-empty outbox destination name")
    if partition_key is not None:
        key_bytes = len(partition_key.encode("utf-8", "surrogatepass"))
        if key_bytes > MAX_PARTITION_KEY_BYTES:
            raise ValueError(
                f"partition key of {key_bytes} bytes (UTF-8); the limit is {MAX_PARTITION_KEY_BYTES}"
                " (MAX_PARTITION_KEY_BYTES), so that the outbox's index can hold it"
            )
    stored = dict(headers)
    inject_into(stored)  # the current trace context: the relay's publish span continues it
    encoded_headers = _compact(stored) if stored else "{}"
    size = len(encoded_headers.encode("utf-8"))
    if size > MAX_EVENT_HEADERS_BYTES:
        raise ValueError(
            f"event headers are {size} bytes encoded (JSON, UTF-8); the limit is "
            f"{MAX_EVENT_HEADERS_BYTES} bytes (MAX_EVENT_HEADERS_BYTES), so that they always fit "
            "the broker's frame with the relay's own headers"
        )
    return PendingEvent(
        event_id=event_id or uuid.uuid4(),
        destination=destination,
        routing_key=routing_key,
        message_type=message_type,
        partition_key=partition_key,
        payload=_compact(payload),
        headers=encoded_headers,
    )


_compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""``json.dumps(value, separators=(",", ":"), ensure_ascii=False)`` without an encoder made per call."""


def events_cte(schema: str) -> sql.Composed:
    """``events AS (INSERT INTO <schema>.outbox ... RETURNING 1)``: a WITH item that writes the
    events of :func:`events_params` in publish order, for a statement that also completes the
    ledger row (one round trip for both). PostgreSQL runs a data-modifying WITH item to
    completion whether or not the main statement reads it."""
    return sql.SQL(
        """
        events AS (
            INSERT INTO {table} (event_id, destination, routing_key, message_type, partition_key,
                                 payload, headers, operation_scope, operation_key, correlation_id)
            SELECT (e.doc ->> 'i')::uuid, e.doc ->> 'd', e.doc ->> 'r', e.doc ->> 't', e.doc ->> 'p',
                   e.doc -> 'b', e.doc -> 'h', %(ev_scope)s, %(ev_key)s, %(ev_correlation)s
              FROM jsonb_array_elements(%(ev_docs)s::text::jsonb) WITH ORDINALITY AS e(doc, position)
             ORDER BY e.position
            RETURNING 1
        )
        """
    ).format(table=sql.Identifier(schema, "outbox"))


def events_params(
    events: Sequence[PendingEvent], operation: OperationIdentity, correlation_id: str | None
) -> dict[str, Any]:
    """The parameters :func:`events_cte` reads: the events as one JSON array (one parameter to
    convert, whatever the number of events; payload and headers are JSON text already)."""
    docs = ",".join(
        f'{{"i":"{e.event_id}","d":{_json_text(e.destination)},"r":{_json_text(e.routing_key)},'
        f'"t":{_json_text(e.message_type)},"p":{_json_text(e.partition_key)},'
        f'"b":{e.payload},"h":{e.headers}}}'
        for e in events
    )
    return {
        "ev_docs": f"[{docs}]",
        "ev_scope": operation.scope,
        "ev_key": operation.key,
        "ev_correlation": correlation_id,
    }


def batch_events_cte(schema: str) -> sql.Composed:
    """Like :func:`events_cte`, for the events of a whole batch (:func:`batch_events_params`):
    each event carries its own operation scope, key and correlation id."""
    return sql.SQL(
        """
        events AS (
            INSERT INTO {table} (event_id, destination, routing_key, message_type, partition_key,
                                 payload, headers, operation_scope, operation_key, correlation_id)
            SELECT (e.doc ->> 'i')::uuid, e.doc ->> 'd', e.doc ->> 'r', e.doc ->> 't', e.doc ->> 'p',
                   e.doc -> 'b', e.doc -> 'h', e.doc ->> 's', e.doc ->> 'k', e.doc ->> 'c'
              FROM jsonb_array_elements(%(ev_docs)s::text::jsonb) WITH ORDINALITY AS e(doc, position)
             ORDER BY e.position
            RETURNING 1
        )
        """
    ).format(table=sql.Identifier(schema, "outbox"))


def batch_events_params(
    batch: Sequence[tuple[Sequence[PendingEvent], OperationIdentity, str | None]],
) -> dict[str, Any]:
    """The parameter :func:`batch_events_cte` reads: the events of every ``(events, operation,
    correlation id)`` of the batch, in order, as one JSON array."""
    docs = ",".join(
        f'{{"i":"{e.event_id}","d":{_json_text(e.destination)},"r":{_json_text(e.routing_key)},'
        f'"t":{_json_text(e.message_type)},"p":{_json_text(e.partition_key)},'
        f'"b":{e.payload},"h":{e.headers},"s":{_json_text(operation.scope)},'
        f'"k":{_json_text(operation.key)},"c":{_json_text(correlation_id)}}}'
        for events, operation, correlation_id in batch
        for e in events
    )
    return {"ev_docs": f"[{docs}]"}


_json_text = json.JSONEncoder(ensure_ascii=False).encode
"""A str (or None) as a JSON value."""


class OutboxWriter:
    """Writes one outbox row at once, inside the caller's transaction: for code outside a handler
    (an API endpoint that must publish exactly what it commits). Handlers use ``ctx.publish``."""

    def __init__(self, schema: str) -> None:
        # Composed once: the schema never changes, so execute need not render it every time.
        self._insert = sql.SQL(
            """
            INSERT INTO {table} (event_id, destination, routing_key, message_type, partition_key,
                                 payload, headers, operation_scope, operation_key, correlation_id)
            VALUES (%s, %s, %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s, %s)
            """
        ).format(table=sql.Identifier(schema, "outbox")).as_bytes(None)

    async def add(
        self,
        conn: AsyncConnection[Any],
        *,
        destination: str,
        routing_key: str,
        message_type: str,
        payload: Any,
        partition_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        operation: OperationIdentity | None = None,
        correlation_id: str | None = None,
    ) -> uuid.UUID:
        """Insert one event row; returns its event ID.

        Raises:
            ValueError: empty destination, headers over :data:`MAX_EVENT_HEADERS_BYTES` encoded, or
                a partition key over :data:`MAX_PARTITION_KEY_BYTES`.
            TypeError: payload or headers not JSON-serialisable.
        """
        event = pending_event(
            destination=destination, routing_key=routing_key, message_type=message_type,
            payload=payload, partition_key=partition_key, headers=headers or {},
        )
        await conn.execute(
            self._insert,
            (
                event.event_id,
                event.destination,
                event.routing_key,
                event.message_type,
                event.partition_key,
                event.payload,
                event.headers,
                operation.scope if operation else None,
                operation.key if operation else None,
                correlation_id,
            ),
        )
        return event.event_id


async def outbox_events(
    conn: AsyncConnection[Any], schema: str, *, destination: str | None = None
) -> list[OutboxEvent]:
    """Every outbox row of ``schema`` (only ``destination``'s when given), in the order written.

    For tests and inspection (the testing kit's ``Harness.outbox_events``); the relay claims rows
    with its own statements.
    """
    query = sql.SQL(
        "SELECT event_id, destination, routing_key, message_type, partition_key, payload, headers,"
        " operation_key, published_at IS NOT NULL FROM {} WHERE %(destination)s::text IS NULL"
        " OR destination = %(destination)s ORDER BY id"
    ).format(sql.Identifier(schema, "outbox"))
    cur = await conn.execute(query, {"destination": destination})
    return [OutboxEvent(*row) for row in await cur.fetchall()]
