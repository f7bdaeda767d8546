"""A producer team's own test: the commands it sends match the consumer's AsyncAPI contract.

It needs only the contract file (``consumer-kit asyncapi APP --out asyncapi.json``, kept in the
producer's repository) and the ``jsonschema`` package; nothing of consumer-kit. ``CONTRACT`` names
the file (default: ``asyncapi.json`` beside this test).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jsonschema import Draft202012Validator

CONTRACT = json.loads(Path(os.environ.get("CONTRACT", Path(__file__).with_name("asyncapi.json"))).read_text())
MESSAGE = "invoices.commands.CreateInvoice"  # components.messages: "<queue>.<message type>"


def check(part: str, value: object) -> list[str]:
    """What is wrong with ``value`` as the message's ``payload`` or ``headers`` (nothing: [])."""
    schema = {"$ref": f"#/components/messages/{MESSAGE}/{part}", "components": CONTRACT["components"]}
    return [error.message for error in Draft202012Validator(schema).iter_errors(value)]


def create_invoice(order_id: int, revision: int, amount_cents: int, requested_at: str) -> tuple[dict, dict]:
    """The producer's own code: the command it sends, body and headers."""
    body = {"order_id": order_id, "revision": revision, "customer_id": "acme",
            "amount_cents": amount_cents, "currency": "EUR", "requested_at": requested_at}
    return body, {"operation-id": f"order-{order_id}-rev-{revision}"}


def test_the_command_matches_the_contract() -> None:
    body, headers = create_invoice(418, 2, 1250, "2026-05-01T10:00:00Z")
    assert check("payload", body) == []
    assert check("headers", headers) == []


def test_a_resend_changes_only_what_the_contract_calls_volatile() -> None:
    rules = CONTRACT["components"]["messages"][MESSAGE]["x-consumer-kit-fingerprint"]
    first, _ = create_invoice(418, 2, 1250, "2026-05-01T10:00:00Z")
    again, _ = create_invoice(418, 2, 1250, "2026-05-01T10:05:00Z")  # the retry, five minutes later
    changed = {name for name in first if first[name] != again[name]}
    assert changed <= set(rules["volatile"])  # else the consumer dead-letters it as payload_conflict
    assert {name: first[name] for name in rules["stable"]} == {name: again[name] for name in rules["stable"]}
