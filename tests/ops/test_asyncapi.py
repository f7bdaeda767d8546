"""`consumer-kit asyncapi APP` writes an AsyncAPI 3.0 document that the official AsyncAPI 3.0.0
JSON Schema accepts, with each queue's message schemas, the headers a producer must send and the
event destinations, for the invoices example and for an app with a shared queue."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
from jsonschema import Draft7Validator, Draft202012Validator
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from consumer_kit import App, Context, Envelope, Handler, Result
from consumer_kit.cli.main import cli
from consumer_kit.errors import ConfigurationError
from consumer_kit.ops.asyncapi import document

SCHEMA = json.loads((Path(__file__).parent / "asyncapi" / "asyncapi-3.0.0.schema.json").read_text())


class Address(BaseModel):
    street: str
    city: str


class ShipOrder(BaseModel):
    """Nested models land in components.schemas, referenced from the payload."""

    order_id: int = Field(ge=1)
    to: Address
    at: dt.datetime


class CancelOrder(BaseModel):
    order_id: int


class ShipHandler(Handler[ShipOrder]):
    """Ships an order."""

    operation_type = "order.ship"

    async def handle(self, message: ShipOrder, ctx: Context) -> Result:
        return Result(status="shipped")


class CancelHandler(Handler[CancelOrder]):
    operation_type = "order.cancel"
    message_type = "cancel"

    def operation_key(self, message: CancelOrder, envelope: Envelope) -> str:
        return f"cancel-{message.order_id}"

    async def handle(self, message: CancelOrder, ctx: Context) -> Result:
        return Result(status="cancelled")


def shop() -> App:
    app = App("shop", events=["shop.events", "audit"])
    app.subscribe("orders", ShipHandler())
    app.subscribe("orders", CancelHandler())  # two handlers share a queue: message-type picks one
    return app


BROKER_URLS = [None, "memory://", "amqp://app:s3cret@rabbit.example:5672/billing?heartbeat=30",
               "amqps://app:s3cret@rabbit.example/", "sqs://?region=eu-west-1&tls=true",
               "servicebus://my-ns.servicebus.windows.net?key=s3cret", "nats://app:s3cret@nats.example:4222"]


@pytest.mark.parametrize("broker_url", BROKER_URLS)
def test_the_documents_are_valid_asyncapi_3(broker_url: str | None) -> None:
    from consumer_kit.demo.app import app as invoices

    for app in (invoices, shop()):
        errors = sorted(Draft7Validator(SCHEMA).iter_errors(document(app, broker_url=broker_url)), key=str)
        assert errors == [], [f"{list(e.absolute_path)}: {e.message}" for e in errors]


def test_a_broken_document_is_refused_by_the_schema() -> None:
    """The validation can fail: the schema is really checked."""
    broken = document(shop())
    broken["operations"]["receive.orders"]["action"] = "consume"
    assert not Draft7Validator(SCHEMA).is_valid(broken)


def payload_validator(doc: dict[str, Any], message_id: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/messages/{message_id}/payload", "components": doc["components"]})


def test_the_invoices_queue_carries_the_handlers_model_and_its_headers() -> None:
    from consumer_kit.demo.app import app as invoices

    doc = document(invoices)
    assert doc["channels"]["queue.invoices.commands"]["address"] == "invoices.commands"
    assert doc["operations"]["receive.invoices.commands"]["action"] == "receive"
    message = doc["components"]["messages"]["invoices.commands.CreateInvoice"]
    assert set(message["payload"]["required"]) >= {"order_id", "revision", "customer_id", "amount_cents"}
    headers = message["headers"]
    assert {"operation-id", "tenant-id", "message-type", "partition-key", "correlation-id"} <= set(headers["properties"])
    assert headers["properties"]["tenant-id"]["maxLength"] == 200
    assert "required" not in headers  # its handler derives the key from the body without operation-id
    assert doc["channels"]["events.billing.events"]["address"] == "billing.events"
    assert doc["operations"]["send.billing.events.InvoiceCreated"]["action"] == "send"
    good = {"order_id": 1, "revision": 1, "customer_id": "c", "amount_cents": 5, "currency": "EUR",
            "requested_at": "2026-01-01T00:00:00Z"}
    validator = payload_validator(doc, "invoices.commands.CreateInvoice")
    assert validator.is_valid(good)
    assert not validator.is_valid({**good, "currency": "EURO"})


def test_a_shared_queue_requires_message_type_and_a_default_key_requires_operation_id() -> None:
    doc = document(shop())
    messages = doc["components"]["messages"]
    ship, cancel = messages["orders.ShipOrder"], messages["orders.cancel"]
    assert ship["headers"]["required"] == ["operation-id", "message-type"]
    assert ship["headers"]["properties"]["message-type"]["const"] == "ShipOrder"
    assert cancel["headers"]["required"] == ["message-type"]  # it derives its key itself
    assert cancel["headers"]["properties"]["message-type"]["const"] == "cancel"
    assert ship["description"].startswith("Ships an order. A resend of the same operation")
    assert "Address" in doc["components"]["schemas"]
    validator = payload_validator(doc, "orders.ShipOrder")
    assert validator.is_valid({"order_id": 3, "to": {"street": "s", "city": "c"}, "at": "2026-01-01T00:00:00Z"})
    assert not validator.is_valid({"order_id": 3, "to": {"street": "s"}, "at": "2026-01-01T00:00:00Z"})
    assert [doc["channels"][c]["address"] for c in doc["channels"]] == ["orders", "shop.events", "audit"]


def test_the_command_prints_the_document_or_writes_it_to_a_file(tmp_path: Path) -> None:
    printed = CliRunner().invoke(cli, ["asyncapi", "consumer_kit.demo.app:app", "--version", "2.1.0"])
    assert printed.exit_code == 0, printed.output
    doc = json.loads(printed.stdout)
    assert (doc["asyncapi"], doc["info"]["version"]) == ("3.0.0", "2.1.0")
    target = tmp_path / "asyncapi.json"
    written = CliRunner().invoke(cli, ["asyncapi", "consumer_kit.demo.app:app", "--out", str(target)])
    assert written.exit_code == 0
    assert json.loads(target.read_text()) == document(__import__("consumer_kit.demo.app", fromlist=["app"]).app)


@pytest.mark.parametrize("path", ["examples/invoices/app.py", "consumer_kit.demo.app:nothing"])
def test_a_bad_app_path_is_one_line_and_exit_2(path: str) -> None:
    result = CliRunner().invoke(cli, ["asyncapi", path])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ")


# -- the producer contract: servers, typed events, routing keys, volatile fields, header rules ----------


@pytest.mark.parametrize("broker_url, server", [
    ("amqp://app:s3cret@rabbit.example:5672/billing?heartbeat=30",
     {"host": "rabbit.example:5672", "protocol": "amqp", "pathname": "/billing"}),
    ("amqps://app:s3cret@rabbit.example/", {"host": "rabbit.example", "protocol": "amqps", "pathname": "/"}),
    ("sqs://?region=eu-west-1&tls=true", {"host": "sqs.eu-west-1.amazonaws.com", "protocol": "sqs"}),
    ("servicebus://my-ns.servicebus.windows.net?key=s3cret",
     {"host": "my-ns.servicebus.windows.net", "protocol": "amqp", "protocolVersion": "1.0"}),
    ("nats://app:s3cret@nats.example:4222", {"host": "nats.example:4222", "protocol": "nats"}),
])
def test_the_server_comes_from_the_configured_broker_without_credentials(broker_url: str, server: dict[str, str]) -> None:
    doc = document(shop(), broker_url=broker_url)
    assert server.items() <= doc["servers"]["broker"].items()
    text = json.dumps(doc)
    assert "s3cret" not in text and "app:" not in text and "heartbeat" not in text
    assert "servers" not in document(shop(), broker_url="memory://")  # in-process: nothing to reach


def test_declared_events_have_typed_payloads_and_their_routing_keys() -> None:
    from consumer_kit.demo.app import app as invoices

    doc = document(invoices, broker_url="amqp://guest:guest@127.0.0.1:5672/")
    message = doc["components"]["messages"]["events.billing.events.InvoiceCreated"]
    assert message["headers"]["properties"]["message-type"]["const"] == "InvoiceCreated"
    validator = Draft202012Validator({"$ref": "#/components/messages/events.billing.events.InvoiceCreated/payload",
                                      "components": doc["components"]})
    event = {"invoice_id": 1, "order_id": 2, "revision": 1, "customer_id": "c", "amount_cents": 5}
    assert validator.is_valid(event)
    assert not validator.is_valid({**event, "amount_cents": "five"})
    send = doc["operations"]["send.billing.events.InvoiceCreated"]
    assert send["bindings"]["amqp"]["cc"] == ["invoice.created"]
    assert send["x-consumer-kit-routing-key"] == "invoice.created"
    assert "subject `billing.events.invoice.created`" in send["description"]  # NATS
    exchange = doc["channels"]["events.billing.events"]["bindings"]["amqp"]
    assert exchange["is"] == "routingKey" and exchange["exchange"]["type"] == "topic"
    queue = doc["channels"]["queue.invoices.commands"]["bindings"]["amqp"]
    assert queue["is"] == "queue" and queue["queue"]["name"] == "invoices.commands"


def test_a_destination_without_declared_events_keeps_an_open_payload() -> None:
    doc = document(shop())
    assert doc["components"]["messages"]["event"]["payload"] == {"type": "object"}
    assert doc["operations"]["send.audit"]["messages"] == [{"$ref": "#/channels/events.audit/messages/event"}]


class Stamped(BaseModel):
    order_id: int
    trace: dict[str, str]
    sent_at: dt.datetime


class StampedHandler(Handler[Stamped]):
    operation_type = "order.stamp"
    fingerprint_exclude: ClassVar[dict[str, Any]] = {"sent_at": True, "trace": {"span"}}

    async def handle(self, message: Stamped, ctx: Context) -> Result:
        return Result(status="ok")


def test_each_message_says_which_fields_a_resend_may_change_and_which_it_must_keep() -> None:
    from consumer_kit.demo.app import app as invoices

    message = document(invoices)["components"]["messages"]["invoices.commands.CreateInvoice"]
    rules = message["x-consumer-kit-fingerprint"]
    assert rules["volatile"] == ["requested_at"]
    assert rules["stable"] == ["order_id", "revision", "customer_id", "amount_cents", "currency"]
    assert "Volatile" in message["payload"]["properties"]["requested_at"]["description"]
    assert "except requested_at identical" in message["description"]

    app = App("stamps")
    app.subscribe("stamps", StampedHandler())
    nested = document(app)["components"]["messages"]["stamps.Stamped"]["x-consumer-kit-fingerprint"]
    assert nested["volatile"] == ["sent_at", "trace.span"]  # pydantic's nested exclude, as paths


def test_the_headers_carry_the_rules_the_runtime_enforces() -> None:
    doc = document(shop())
    headers = doc["components"]["messages"]["orders.ShipOrder"]["headers"]
    validator = Draft202012Validator(headers)
    good = {"operation-id": "ship-1", "message-type": "ShipOrder", "tenant-id": "acme"}
    assert validator.is_valid(good)
    assert not validator.is_valid({**good, "operation-id": "ship\x00-1"})  # invalid_operation_key
    assert not validator.is_valid({**good, "operation-id": ""})  # missing_operation_key
    assert not validator.is_valid({**good, "tenant-id": "t" * 201})
    assert not validator.is_valid({"message-type": "ShipOrder"})  # no operation-id


def test_an_event_declaration_is_checked() -> None:
    app = App("x")
    with pytest.raises(ConfigurationError, match="pydantic BaseModel"):
        app.event(dict, destination="d")  # type: ignore[arg-type]
    app.event(CancelOrder, destination="d", routing_key="order.cancelled")
    app.event(CancelOrder, destination="d", routing_key="order.cancelled")  # the same again: one
    assert len(app.event_types) == 1 and app.events == ["d"]
    with pytest.raises(ConfigurationError, match="already has event 'CancelOrder'"):
        app.event(CancelOrder, destination="d", routing_key="other")


def test_the_command_names_the_configured_broker() -> None:
    printed = CliRunner().invoke(cli, ["asyncapi", "consumer_kit.demo.app:app"],
                                 env={"CONSUMER_KIT_BROKER_URL": "nats://127.0.0.1:4222"})
    assert printed.exit_code == 0, printed.output
    assert json.loads(printed.stdout)["servers"]["broker"]["protocol"] == "nats"
