"""The AsyncAPI 3.0 document of an :class:`~consumer_kit.app.App`: the contract a producer in another
language needs (``consumer-kit asyncapi module:app``, docs/how-to/producer-contract.md).

It lists, from what the app declares:

* the server of the configured broker (``CONSUMER_KIT_BROKER_URL``: host, port, virtual host;
  never credentials) with its AMQP bindings where it is RabbitMQ
  (:mod:`consumer_kit.ops.asyncapi_servers`);
* one channel per queue the worker consumes, with one message per handler on it: the payload is
  the handler's pydantic model (``model_json_schema()``), the headers are those the runtime reads
  (:mod:`consumer_kit.codec.headers`) with the rules it enforces: ``operation-id`` (the operation
  key; required unless the handler derives its key itself), ``tenant-id``, ``message-type``
  (required where handlers share a queue), ``partition-key``, ``operation-created-at``,
  ``correlation-id``;
* for each message, what a producer must keep stable on a resend of the same operation (every
  field the fingerprint covers) and what may change (``fingerprint_exclude``: volatile), in
  ``x-consumer-kit-fingerprint`` and in the fields' descriptions;
* a ``receive`` operation per queue (the worker receives, producers send there);
* one channel per event destination (``App(events=[...])``) with a ``send`` operation per event
  type the app declares (:meth:`~consumer_kit.app.App.event`: typed payload, routing key), and an
  open one for a destination with none declared.

The document is a plain ``dict`` (JSON-serialisable); the schema it follows is AsyncAPI 3.0.0
(https://www.asyncapi.com/docs/reference/specification/v3.0.0).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from consumer_kit.app import App, EventType
from consumer_kit.codec.headers import (
    CORRELATION_ID,
    OPERATION_CREATED_AT,
    OPERATION_ID,
    PARTITION_KEY,
    SPEC_BY_NAME,
    TENANT,
)
from consumer_kit.codec.headers import MESSAGE_TYPE as MESSAGE_TYPE_HEADER
from consumer_kit.handler import Handler
from consumer_kit.identity import MAX_KEY_BYTES, MAX_TENANT_BYTES
from consumer_kit.ops.asyncapi_servers import (
    Broker,
    broker_of,
    exchange_bindings,
    publish_bindings,
    queue_bindings,
    where_events_land,
)

ASYNCAPI_VERSION = "3.0.0"
_REF_TEMPLATE = "#/components/schemas/{model}"
_COMPONENT_KEY = re.compile(r"[^A-Za-z0-9._-]")  # AsyncAPI component and channel keys: ^[\w\d.\-_]+$


def document(
    app: App, *, version: str = "1.0.0", title: str | None = None, broker_url: str | None = None,
) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``app`` (module docstring).

    Args:
        version: the ``info.version`` of the contract (the app's own version, not AsyncAPI's).
        title: ``info.title``; default ``app.name``.
        broker_url: the broker the worker uses (``CONSUMER_KIT_BROKER_URL``): the document's
            server; ``None`` or ``memory://``: no server.

    Raises:
        ConfigurationError: ``broker_url`` of a scheme no adapter has.
    """
    broker = broker_of(broker_url)
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    schemas: dict[str, Any] = {}
    for queue, handlers in app.routes.items():
        channel_id = _key(f"queue.{queue}")
        shared = len(handlers) > 1
        refs = {}
        for message_type, handler in handlers.items():
            message_id = _key(f"{queue}.{message_type}")
            messages[message_id] = _message(handler, message_type, shared=shared, schemas=schemas)
            refs[_key(message_type)] = {"$ref": f"#/components/messages/{message_id}"}
        channels[channel_id] = _with_bindings({
            "address": queue,
            "title": queue,
            "description": f"Queue {queue}: consumed by a consumer-kit worker of app {app.name!r}; "
            "producers send commands here.",
            "messages": refs,
        }, queue_bindings(broker, queue))
        operations[_key(f"receive.{queue}")] = {
            "action": "receive",
            "title": f"Consume {queue}",
            "summary": "One business effect per operation key, however often the broker delivers it.",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{name}"} for name in refs],
        }
    for destination in app.events:
        _add_destination(app, destination, broker, channels, operations, messages, schemas)
    components: dict[str, Any] = {"messages": messages}
    if schemas:
        components["schemas"] = schemas
    doc: dict[str, Any] = {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": title or app.name,
            "version": version,
            "description": f"Queues and event destinations of the consumer-kit app {app.name!r}. "
            f"Header {OPERATION_ID} carries the operation key: the same on every send of one intended "
            "operation (retries, resends), new for a new one. A resend under the same key must keep every "
            "field the fingerprint covers (each message's x-consumer-kit-fingerprint says which may change), "
            "or it is dead-lettered as payload_conflict and never executed.",
        },
        "defaultContentType": "application/json",
    }
    if broker is not None:
        doc["servers"] = {"broker": broker.server}
    doc.update({"channels": channels, "operations": operations, "components": components})
    return doc


def _add_destination(
    app: App, destination: str, broker: Broker | None, channels: dict[str, Any], operations: dict[str, Any],
    messages: dict[str, Any], schemas: dict[str, Any],
) -> None:
    """The channel of one event destination and its send operations: one per declared event
    type (typed payload, routing key), else one with an open payload."""
    channel_id = _key(f"events.{destination}")
    declared = [event for event in app.event_types if event.destination == destination]
    refs: dict[str, Any] = {}
    for declaration in declared:
        message_id = _key(f"events.{destination}.{declaration.message_type}")
        messages[message_id] = _event_message(declaration, schemas)
        refs[_key(declaration.message_type)] = {"$ref": f"#/components/messages/{message_id}"}
    if not declared:
        messages.setdefault("event", _event_message(None, schemas))
        refs["event"] = {"$ref": "#/components/messages/event"}
    channels[channel_id] = _with_bindings({
        "address": destination,
        "title": destination,
        "description": f"Event destination {destination}: the handlers' outbox events, published by "
        "outbox-relay at least once (the broker message id is the event id).",
        "messages": refs,
    }, exchange_bindings(broker, destination))
    sends: list[EventType | None] = [*declared] or [None]
    for event in sends:
        name = _key(event.message_type) if event else "event"
        routing_key = event.routing_key if event else ""
        operation_id = _key(f"send.{destination}.{name}" if event else f"send.{destination}")
        operation: dict[str, Any] = {
            "action": "send",
            "title": f"Publish {name} to {destination}",
            "description": where_events_land(destination, routing_key) if event else
            f"{where_events_land(destination, '')} Routing key: the one each ctx.publish(...) gives "
            "(declare the events with App.event to have them listed here).",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{name}"}],
        }
        if event:
            operation["x-consumer-kit-routing-key"] = routing_key
        operations[operation_id] = _with_bindings(operation, publish_bindings(broker, routing_key))


def _with_bindings(entry: dict[str, Any], bindings: dict[str, Any] | None) -> dict[str, Any]:
    if bindings:
        entry["bindings"] = bindings
    return entry


def _message(handler: Handler[Any], message_type: str, *, shared: bool, schemas: dict[str, Any]) -> dict[str, Any]:
    """The message a producer sends to reach ``handler``: payload from its model, its headers."""
    cls = type(handler)
    payload = _payload(cls.model, schemas)
    fingerprint = _fingerprint_rules(handler, payload)
    message: dict[str, Any] = {
        "name": message_type,
        "title": cls.model.__name__,
        "summary": f"Operation type {cls.operation_type} (handler {cls.__name__}).",
        "description": " ".join([*(cls.__doc__ or "").split(), fingerprint["rule"]]).strip(),
        "contentType": "application/json",
        "headers": _headers(handler, message_type, shared=shared),
        "payload": payload,
        "x-consumer-kit-fingerprint": fingerprint,
    }
    return message


def _payload(model: Any, schemas: dict[str, Any]) -> dict[str, Any]:
    """``model``'s JSON Schema, nested models moved to ``components.schemas``."""
    payload: dict[str, Any] = model.model_json_schema(ref_template=_REF_TEMPLATE)
    for name, schema in payload.pop("$defs", {}).items():
        schemas.setdefault(_key(name), schema)
    return payload


def _fingerprint_rules(handler: Handler[Any], payload: dict[str, Any]) -> dict[str, Any]:
    """What a producer may change on a resend of one operation and what it must keep: the
    handler's ``fingerprint_exclude`` as dotted field paths (``volatile``), the top-level fields
    the fingerprint covers (``stable``), its ``projectionVersion`` and the ``rule`` in words. The
    volatile fields' descriptions in ``payload`` say so too."""
    cls = type(handler)
    volatile = _paths(cls.fingerprint_exclude)
    properties = payload.get("properties", {})
    stable = [name for name in properties if name not in volatile]
    for path in volatile:
        field_schema = properties.get(path)
        if isinstance(field_schema, dict):
            field_schema["description"] = (field_schema.get("description", "") + " " + _VOLATILE).strip()
    own_projection = cls.projection is not Handler.projection
    if own_projection:
        rule = ("The handler computes its intent projection itself (Handler.projection): ask its team which "
                "fields a resend of the same operation may change.")
    else:
        rule = ("A resend of the same operation (same operation-id) must keep every field except "
                + (", ".join(volatile) if volatile else "none")
                + " identical, or it is dead-lettered as payload_conflict and never executed.")
    return {"volatile": volatile, "stable": [] if own_projection else stable,
            "projectionVersion": cls.projection_version, "ownProjection": own_projection, "rule": rule}


_VOLATILE = ("Volatile: left out of the fingerprint (fingerprint_exclude), so it may change when the same "
             "operation is sent again.")


def _paths(exclude: Any, prefix: str = "") -> list[str]:
    """pydantic ``exclude`` syntax (a set of names, or a mapping of names to ``True`` or to a
    nested exclude) as sorted dotted paths."""
    if not exclude:
        return []
    if isinstance(exclude, Mapping):
        paths: list[str] = []
        for name, inner in exclude.items():
            paths += [f"{prefix}{name}"] if inner is True or inner is ... else _paths(inner, f"{prefix}{name}.")
        return sorted(paths)
    return sorted(f"{prefix}{name}" for name in exclude)


def _headers(handler: Handler[Any], message_type: str, *, shared: bool) -> dict[str, Any]:
    """The headers the runtime reads for ``handler``, as a JSON Schema object."""
    cls = type(handler)
    own_key = cls.operation_key is not Handler.operation_key  # the handler derives its key itself
    own_tenant = cls.tenant is not Handler.tenant
    properties: dict[str, Any] = {
        OPERATION_ID: _text(
            OPERATION_ID,
            "The operation key: the same on every send of one intended operation (retries, resends),"
            " new for a new one."
            + (" Optional for this handler: it derives the key itself when the header is absent."
               if own_key else " Without it the message is dead-lettered (missing_operation_key).")
            + (" Falls back to the broker message id." if cls.key_from_message_id else "")
            + f" At most {MAX_KEY_BYTES} bytes of UTF-8, no control characters (else invalid_operation_key).",
            max_length=MAX_KEY_BYTES,
        ),
        TENANT: _text(
            TENANT,
            f"The tenant the operation belongs to (part of its scope). Default: 'default'. At most "
            f"{MAX_TENANT_BYTES} bytes of UTF-8, no control characters."
            + (" This handler derives the tenant itself." if own_tenant else "")
            + (" Checked against the broker-authenticated sender." if cls.tenant_senders is not None else ""),
        ),
        MESSAGE_TYPE_HEADER: {
            **_text(MESSAGE_TYPE_HEADER, "Picks the handler when several share a queue."),
            "const": message_type,
        },
        PARTITION_KEY: _text(
            PARTITION_KEY, "Ordering key: messages with the same key run one at a time, in order"
            " (where the broker has no group or session of its own)."
        ),
        OPERATION_CREATED_AT: {
            **_text(OPERATION_CREATED_AT, "When the operation was first intended (ISO 8601 with offset);"
                    " decides key expiry. Default: the broker's enqueue time."),
            "format": "date-time",
        },
        CORRELATION_ID: _text(CORRELATION_ID, "Carried into logs, spans and the events the handler writes."),
    }
    required = [] if own_key or cls.key_from_message_id else [OPERATION_ID]
    if shared:
        required.append(MESSAGE_TYPE_HEADER)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _text(name: str, description: str, *, max_length: int | bool | None = True) -> dict[str, Any]:
    """A string header, with the length limit :mod:`consumer_kit.codec.headers` enforces for it
    (or ``max_length``, characters: a byte limit is said in the description)."""
    schema: dict[str, Any] = {"type": "string", "description": description}
    spec = SPEC_BY_NAME.get(name)
    if max_length is True and spec is not None and spec.max_chars:
        schema["maxLength"] = spec.max_chars
    elif isinstance(max_length, int) and not isinstance(max_length, bool):
        schema["maxLength"] = max_length
    if name in (OPERATION_ID, TENANT):
        schema["minLength"] = 1
        schema["pattern"] = _NO_CONTROL_CHARACTERS
    return schema


_NO_CONTROL_CHARACTERS = "^[^\\x00-\\x1f\\x7f]+$"
"""What an operation key or tenant may not hold (consumer_kit.identity.normalize_key)."""


def _event_message(event: EventType | None, schemas: dict[str, Any]) -> dict[str, Any]:
    """The message of a declared event type (its model's payload, ``message-type`` fixed), or of
    a destination without declared types (``event is None``: an open payload)."""
    headers = _event_headers()
    if event is None:
        return {
            "name": "event",
            "title": "Outbox event",
            "summary": "An event a handler wrote with ctx.publish(...) in its transaction.",
            "description": f"{_AT_LEAST_ONCE} The app declares no event types for this destination, so the"
            " payload is left open: App.event(Model, destination=..., routing_key=...) types it.",
            "contentType": "application/json",
            "headers": headers,
            "payload": {"type": "object"},
        }
    headers["properties"][MESSAGE_TYPE_HEADER]["const"] = event.message_type
    description = " ".join((event.model.__doc__ or "").split())
    return {
        "name": event.message_type,
        "title": event.model.__name__,
        "summary": f"Event {event.message_type} on {event.destination}"
        + (f", routing key {event.routing_key}." if event.routing_key else "."),
        "description": f"{description} {_AT_LEAST_ONCE}".strip(),
        "contentType": "application/json",
        "headers": headers,
        "payload": _payload(event.model, schemas),
    }


_AT_LEAST_ONCE = ("Published at least once: the broker message id is the event id (the same on every attempt),"
                  " so a consumer deduplicates on it.")


def _event_headers() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "event-id": {"type": "string", "format": "uuid",
                         "description": "The event id (also the broker message id): the same on every attempt."},
            MESSAGE_TYPE_HEADER: {"type": "string", "description": "The event model's name (e.g. InvoiceCreated)."},
            "operation-scope": {"type": "string", "description": "Scope of the operation that wrote the event."},
            "operation-key": {"type": "string", "description": "Key of the operation that wrote the event."},
            CORRELATION_ID: {"type": "string", "description": "Correlation id of that operation."},
            PARTITION_KEY: {"type": "string", "description": "The ordering key the handler gave the event."},
            "publish-attempt": {"type": "string", "pattern": "^[1-9][0-9]*$",
                                "description": "Which publish attempt of the relay this copy is (1, 2, ...)."},
            "relay-id": {"type": "string", "description": "The relay that published it."},
            "traceparent": {"type": "string", "description": "W3C trace context, where tracing is on."},
        },
        "required": ["event-id", MESSAGE_TYPE_HEADER],
    }


def _key(text: str) -> str:
    """``text`` as an AsyncAPI map key (letters, digits, ``.``, ``-``, ``_``)."""
    return _COMPONENT_KEY.sub("_", text)
