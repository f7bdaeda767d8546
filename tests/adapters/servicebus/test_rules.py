"""Topic subscription rules: the relay's events routed by ``subject`` and properties.

The relay publishes each event with its routing key as the message's ``subject`` and its headers
(``message-type`` included) as application properties (``envelope.outgoing_message``); on Service
Bus, subscriptions pick what they take with rules (Microsoft's *Topic filters and actions*; SQL
syntax: *Subscription Rule SQL Filter Syntax*; correlation filters: ``CorrelationRuleFilter``).
The test server applies them (``tests/adapters/servicebus/server/rules.py``); these tests publish with the
relay's publisher and receive with the real azure-servicebus SDK.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from proton import Message

from consumer_kit.broker.publishing import OutgoingMessage
from tests.adapters.servicebus.server import CorrelationFilter, FalseFilter, Rule, SqlFilter
from tests.adapters.servicebus.server.fixtures import SDK_CALL_TIMEOUT, SBEnv
from tests.adapters.servicebus.server.sections import EncodedMessage


def event(topic: str, routing_key: str, message_type: str, **headers: str) -> OutgoingMessage:
    return OutgoingMessage(
        destination=topic,
        routing_key=routing_key,
        message_id=str(uuid.uuid4()),
        body=b"{}",
        message_type=message_type,
        headers=headers,
    )


async def received_ids(sb: SBEnv, path: str, expected: int) -> set[str]:
    """Message ids received (and completed) from ``path`` through the SDK: ``expected`` of them,
    and nothing left in the subscription after them."""
    found: set[str] = set()
    async with asyncio.timeout(SDK_CALL_TIMEOUT * 2), sb.receiver(path, prefetch=expected) as receiver:
        while len(found) < expected:
            batch = await receiver.receive_messages(max_message_count=expected - len(found), max_wait_time=2)
            assert batch, f"{path}: {len(found)} of {expected} messages arrived"
            for message in batch:
                await receiver.complete_message(message)
                found.add(str(message.message_id))
    assert sb.server.entity(path).messages == []  # every copy it got was received: no extra one
    return found


async def test_each_subscription_gets_exactly_what_its_rules_select(sb: SBEnv) -> None:
    topic = sb.topic
    created = sb.create_subscription(
        "created", rules=[Rule("created", CorrelationFilter(subject="invoice.created"))]
    )
    paid_eu = sb.create_subscription(
        "paid-eu",
        rules=[
            Rule("paid-eu", CorrelationFilter(subject="invoice.paid", properties={"region": "eu"})),
        ],
    )
    uk_or_big = sb.create_subscription(
        "invoices-uk-or-big",
        rules=[
            Rule("uk", SqlFilter("sys.Label LIKE 'invoice.%' AND region IN ('uk')")),
            Rule("by-type", SqlFilter("user.[message-type] = 'RefundIssued' AND NOT EXISTS(region)")),
        ],
    )
    every = sb.create_subscription("all")  # $Default: the true filter
    none = sb.create_subscription("none", rules=[Rule("off", FalseFilter())])
    events = {
        "created-eu": event(topic, "invoice.created", "InvoiceCreated", region="eu"),
        "created-uk": event(topic, "invoice.created", "InvoiceCreated", region="uk"),
        "paid-eu": event(topic, "invoice.paid", "InvoicePaid", region="eu"),
        "paid-us": event(topic, "invoice.paid", "InvoicePaid", region="us"),
        "refund": event(topic, "refund.issued", "RefundIssued"),
    }
    publisher = sb.publisher()
    await asyncio.gather(*(publisher.publish(e) for e in events.values()))  # the relay's concurrent pass
    ids = {name: e.message_id for name, e in events.items()}

    def of(*names: str) -> set[str]:
        return {ids[n] for n in names}

    assert await received_ids(sb, created.path, 2) == of("created-eu", "created-uk")
    assert await received_ids(sb, paid_eu.path, 1) == of("paid-eu")
    # Two rules, one copy of a message that matches both ("created-uk" matches only the first).
    assert await received_ids(sb, uk_or_big.path, 2) == of("created-uk", "refund")
    assert await received_ids(sb, every.path, 5) == set(ids.values())
    assert none.messages == []


async def test_rules_changed_on_a_live_subscription_apply_to_later_messages(sb: SBEnv) -> None:
    topic = sb.topic
    ledger = sb.create_subscription("ledger")
    rules = sb.server.entity(topic)
    rules.remove_rule("ledger", "$Default")  # no rule at all: the subscription takes nothing
    publisher = sb.publisher()
    await publisher.publish(event(topic, "invoice.created", "InvoiceCreated"))
    rules.add_rule("ledger", Rule("paid", CorrelationFilter(subject="invoice.paid")))
    paid = event(topic, "invoice.paid", "InvoicePaid")
    await publisher.publish(paid)
    await publisher.publish(event(topic, "invoice.created", "InvoiceCreated"))
    assert await received_ids(sb, ledger.path, 1) == {paid.message_id}
    with pytest.raises(ValueError, match="two rules"):
        rules.add_rule("ledger", Rule("PAID", CorrelationFilter(subject="x")))  # names are case-insensitive


# -- the SQL subset and correlation matching, evaluated on an encoded message --------------------


def _message() -> EncodedMessage:
    message = Message(
        body=b"{}",
        id="m-1",
        subject="invoice.created",
        correlation_id="c-1",
        group_id="s-1",
        content_type="application/json",
        reply_to="replies",
        properties={"region": "eu", "amount": 120, "ratio": 0.5, "vip": True, "note": "50% off"},
    )
    return EncodedMessage.decode(message.encode())


@pytest.mark.parametrize(
    ("expression", "matches"),
    [
        ("sys.Label = 'invoice.created'", True),
        ("sys.label = 'Invoice.Created'", False),  # string comparison is case-sensitive
        ("sys.Subject LIKE 'invoice._reated'", True),
        ("sys.MessageId = 'm-1' AND sys.CorrelationId = 'c-1' AND sys.SessionId = 's-1'", True),
        ("sys.ContentType = 'application/json' AND sys.ReplyTo = 'replies'", True),
        ("sys.To IS NULL AND NOT EXISTS(sys.To) AND EXISTS(sys.ReplyTo)", True),
        ("region = 'eu' AND amount > 100", True),
        ("region <> 'eu' OR amount < 100", False),
        ("region != 'us'", True),
        ("region IN ('us', 'eu')", True),
        ("region NOT IN ('us', 'eu')", False),
        ("note LIKE '50!% %' ESCAPE '!'", True),
        ("note LIKE '50!%' ESCAPE '!'", False),
        ("note NOT LIKE '%off'", False),
        ("(amount + 30) / 3 = 50 AND amount % 7 = 1 AND -ratio < 0", True),
        ("ratio * 4 >= 2.0", True),
        ("vip AND vip = TRUE", True),
        ("amount = '120'", False),  # a number and a string: unknown, never a match
        ("missing = 1", False),  # a missing user property is unknown...
        ("NOT missing = 1", False),  # ...and NOT unknown is unknown
        ("missing = 1 OR region = 'eu'", True),
        ("missing IS NULL AND region IS NOT NULL", True),
        ("user.region = 'eu' AND EXISTS(user.amount)", True),
        ("1 = 1", True),
        ("1 = 0", False),
    ],
)
def test_sql_filters_follow_the_documented_subset(expression: str, matches: bool) -> None:
    assert SqlFilter(expression).matches(_message()) is matches


@pytest.mark.parametrize("expression", ["sys.Nope = 1", "region =", "region LIKE", "other.x = 1", "a = 1 b"])
def test_sql_filters_outside_the_subset_are_refused_when_made(expression: str) -> None:
    with pytest.raises(ValueError, match="SQL filter"):
        SqlFilter(expression)


def test_correlation_filters_and_every_condition_exactly() -> None:
    message = _message()
    assert CorrelationFilter(
        correlation_id="c-1",
        message_id="m-1",
        subject="invoice.created",
        session_id="s-1",
        content_type="application/json",
        reply_to="replies",
        properties={"region": "eu", "amount": 120},
    ).matches(message)
    assert CorrelationFilter(label="invoice.created").matches(message)  # the older name of subject
    assert not CorrelationFilter(correlation_id="c-1", to="somewhere").matches(
        message
    )  # unset on the message
    assert not CorrelationFilter(correlation_id="C-1").matches(message)  # case-sensitive
    assert not CorrelationFilter(properties={"vip": 1}).matches(message)  # a bool is not the number 1
    assert not CorrelationFilter(properties={"absent": "x"}).matches(message)
    with pytest.raises(ValueError):
        CorrelationFilter()
