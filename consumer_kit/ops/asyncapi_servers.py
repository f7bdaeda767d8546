"""The broker side of the AsyncAPI document (:mod:`consumer_kit.ops.asyncapi`): the server a
``CONSUMER_KIT_BROKER_URL`` names, the AMQP bindings of queues and event exchanges, and where an
event with a routing key lands on each broker (docs/how-to/producer-contract.md).

Nothing secret leaves the URL: user, password, query options (keys, tokens) are dropped; the server
is host, port and (RabbitMQ) virtual host only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from consumer_kit.errors import ConfigurationError

AMQP_BINDING_VERSION = "0.3.0"
"""The AsyncAPI AMQP 0-9-1 bindings version the document uses (the 3.0.0 schema knows 0.3.0)."""


@dataclass(frozen=True)
class Broker:
    """What the document says of the configured broker.

    Attributes:
        protocol: AsyncAPI's protocol name (``amqp``, ``amqps``, ``sqs``, ``nats``; Service Bus:
            ``amqp`` version 1.0).
        server: the AsyncAPI Server Object (no credentials).
        vhost: RabbitMQ's virtual host (``/`` by default); ``None`` elsewhere.
    """

    protocol: str
    server: dict[str, Any]
    vhost: str | None = None

    @property
    def amqp(self) -> bool:
        """RabbitMQ (AMQP 0-9-1): queues and exchanges get AMQP bindings."""
        return self.vhost is not None


def broker_of(url: str | None) -> Broker | None:
    """The broker of ``url`` (``CONSUMER_KIT_BROKER_URL``); ``None`` for none and for the in-process
    ``memory://`` broker (no server a producer could reach).

    Raises:
        ConfigurationError: a scheme the document does not know.
    """
    if not url or not url.strip():
        return None
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = parts.hostname or ""
    address = f"{host}:{parts.port}" if host and parts.port else host
    if scheme == "memory":
        return None
    if scheme in ("amqp", "amqps"):
        vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
        server = {"host": address or "localhost", "protocol": scheme, "protocolVersion": "0.9.1",
                  "pathname": "/" + vhost.lstrip("/"), "title": "RabbitMQ",
                  "description": f"RabbitMQ, virtual host {vhost!r}."}
        return Broker(scheme, server, vhost)
    if scheme == "sqs":
        region = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p).get("region", "")
        endpoint = address or (f"sqs.{region}.amazonaws.com" if region else "sqs.amazonaws.com")
        return Broker("sqs", {"host": endpoint, "protocol": "sqs", "title": "AWS SQS",
                              "description": "Amazon SQS; each queue is a channel's address."})
    if scheme in ("servicebus", "sb"):
        return Broker("amqp", {"host": address, "protocol": "amqp", "protocolVersion": "1.0",
                               "title": "Azure Service Bus",
                               "description": "Azure Service Bus namespace (AMQP 1.0); queues and topics by name."})
    if scheme == "nats":
        return Broker("nats", {"host": address or "localhost:4222", "protocol": "nats", "title": "NATS JetStream",
                               "description": "NATS with JetStream; each queue is a stream's subject."})
    raise ConfigurationError(f"the AsyncAPI document knows no broker of scheme {scheme!r}")


def queue_bindings(broker: Broker | None, queue: str) -> dict[str, Any] | None:
    """The channel bindings of a queue the worker consumes (RabbitMQ: a durable queue)."""
    if broker is None or not broker.amqp:
        return None
    return {"amqp": {"is": "queue", "queue": {"name": queue, "durable": True, "exclusive": False,
                                              "autoDelete": False, "vhost": broker.vhost},
                     "bindingVersion": AMQP_BINDING_VERSION}}


def exchange_bindings(broker: Broker | None, destination: str) -> dict[str, Any] | None:
    """The channel bindings of an event destination (RabbitMQ: a durable topic exchange, which
    ``consumer-kit declare`` creates; a relay destination map may name another exchange)."""
    if broker is None or not broker.amqp:
        return None
    return {"amqp": {"is": "routingKey", "exchange": {"name": destination, "type": "topic", "durable": True,
                                                      "autoDelete": False, "vhost": broker.vhost},
                     "bindingVersion": AMQP_BINDING_VERSION}}


def publish_bindings(broker: Broker | None, routing_key: str) -> dict[str, Any] | None:
    """The operation bindings of the relay's publish of an event with ``routing_key``
    (RabbitMQ: the routing key, persistent delivery)."""
    if broker is None or not broker.amqp:
        return None
    binding: dict[str, Any] = {"deliveryMode": 2, "bindingVersion": AMQP_BINDING_VERSION}
    if routing_key:
        binding["cc"] = [routing_key]
    return {"amqp": binding}


def where_events_land(destination: str, routing_key: str) -> str:
    """Where the relay puts an event of ``destination`` with ``routing_key``, on each broker (the
    adapters' publishers)."""
    key = f" with routing key `{routing_key}`" if routing_key else ""
    subject = f"{destination}.{routing_key}" if routing_key else destination
    sqs = " (the routing key in message attribute `routing-key`)" if routing_key else ""
    return (f"RabbitMQ: topic exchange `{destination}`{key}. NATS: subject `{subject}`. "
            f"SQS: queue `{destination}`{sqs}. Service Bus: queue or topic `{destination}`.")
