"""The AsyncAPI 3.0 document of an :class:`~consumer_kit.app.App`: the contract a producer in another
language needs (``consumer-kit asyncapi module:app``).

It lists, from what the app declares:

* one channel per queue the worker consumes, with one message per handler on it: the payload is
  the handler's pydantic model (``model_json_schema()``), the headers are those the runtime reads
  (:mod:`consumer_kit.codec.headers`): ``operation-id`` (the operation key; required unless the handler
  derives its key itself), ``tenant-id``, ``message-type`` (required where handlers share a
  queue), ``partition-key``, ``operation-created-at``, ``correlation-id``;
* a ``receive`` operation per queue (the worker receives, producers send there);
* one channel per event destination (``App(events=[...])``) with a ``send`` operation (the relay
  publishes there). The app names destinations, not event types, so their payload is left open.

The document is a plain ``dict`` (JSON-serialisable); the schema it follows is AsyncAPI 3.0.0
(https://www.asyncapi.com/docs/reference/specification/v3.0.0).
"""

from __future__ import annotations

import re
from typing import Any

from consumer_kit.app import App
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

ASYNCAPI_VERSION = "3.0.0"
_REF_TEMPLATE = "#/components/schemas/{model}"
_COMPONENT_KEY = re.compile(r"[^A-Za-z0-9._-]")  # AsyncAPI component and channel keys: ^[\w\d.\-_]+$


def document(app: App, *, version: str = "1.0.0", title: str | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``app`` (module docstring).

    Args:
        version: the ``info.version`` of the contract (the app's own version, not AsyncAPI's).
        title: ``info.title``; default ``app.name``.
    """
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
        channels[channel_id] = {
            "address": queue,
            "title": queue,
            "description": f"Queue {queue}: consumed by a consumer-kit worker of app {app.name!r}; "
            "producers send commands here.",
            "messages": refs,
        }
        operations[_key(f"receive.{queue}")] = {
            "action": "receive",
            "title": f"Consume {queue}",
            "summary": "One business effect per operation key, however often the broker delivers it.",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{name}"} for name in refs],
        }
    for destination in app.events:
        channel_id = _key(f"events.{destination}")
        channels[channel_id] = {
            "address": destination,
            "title": destination,
            "description": f"Event destination {destination}: the handlers' outbox events, published by "
            "outbox-relay (RabbitMQ: a topic exchange; the broker message id is the event id).",
            "messages": {"event": {"$ref": "#/components/messages/event"}},
        }
        operations[_key(f"send.{destination}")] = {
            "action": "send",
            "title": f"Publish to {destination}",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/event"}],
        }
    if app.events:
        messages["event"] = _event_message()
    components: dict[str, Any] = {"messages": messages}
    if schemas:
        components["schemas"] = schemas
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": title or app.name,
            "version": version,
            "description": f"Queues and event destinations of the consumer-kit app {app.name!r}. "
            f"Header {OPERATION_ID} carries the operation key: the same on every retry of one "
            "intended operation, new for a new one.",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": components,
    }


def _message(handler: Handler[Any], message_type: str, *, shared: bool, schemas: dict[str, Any]) -> dict[str, Any]:
    """The message a producer sends to reach ``handler``: payload from its model, its headers."""
    cls = type(handler)
    payload = cls.model.model_json_schema(ref_template=_REF_TEMPLATE)
    for name, schema in payload.pop("$defs", {}).items():
        schemas.setdefault(_key(name), schema)
    message: dict[str, Any] = {
        "name": message_type,
        "title": cls.model.__name__,
        "summary": f"Operation type {cls.operation_type} (handler {cls.__name__}).",
        "contentType": "application/json",
        "headers": _headers(handler, message_type, shared=shared),
        "payload": payload,
    }
    if cls.__doc__:
        message["description"] = " ".join(cls.__doc__.split())
    return message


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
            + (" Falls back to the broker message id." if cls.key_from_message_id else ""),
            max_length=None,
        ),
        TENANT: _text(
            TENANT,
            "The tenant the operation belongs to (part of its scope). Default: 'default'."
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
    """A string header, with the length limit :mod:`consumer_kit.codec.headers` enforces for it."""
    schema: dict[str, Any] = {"type": "string", "description": description}
    spec = SPEC_BY_NAME.get(name)
    if max_length is True and spec is not None and spec.max_chars:
        schema["maxLength"] = spec.max_chars
    if name == OPERATION_ID:
        schema["minLength"] = 1
    return schema


def _event_message() -> dict[str, Any]:
    return {
        "name": "event",
        "title": "Outbox event",
        "summary": "An event a handler wrote with ctx.publish(...) in its transaction.",
        "description": "Published at least once: the broker message id is the event id (the same on"
        " every attempt), so a consumer deduplicates on it. The payload is the event model's JSON;"
        " the app names the destination, not the event types.",
        "contentType": "application/json",
        "headers": {
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
        },
        "payload": {"type": "object"},
    }


def _key(text: str) -> str:
    """``text`` as an AsyncAPI map key (letters, digits, ``.``, ``-``, ``_``)."""
    return _COMPONENT_KEY.sub("_", text)
