"""The relay's direct AMQP frame encoder writes exactly pamqp's bytes (adapters/rabbitmq/frames.py),
and gives back what it does not encode."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import frame
from pamqp.body import ContentBody
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from consumer_kit.adapters.rabbitmq import frames
from consumer_kit.adapters.rabbitmq.envelope import properties_of
from consumer_kit.broker.publishing import OutgoingMessage


def pamqp_bytes(
    channel: int,
    exchange: str,
    routing_key: str,
    properties: Basic.Properties,
    body: bytes,
    max_content_size: int,
) -> bytes:
    parts = [
        frame.marshal(Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True), channel),
        frame.marshal(ContentHeader(properties=properties, body_size=len(body)), channel),
    ]
    for i in range(0, len(body), max_content_size):
        parts.append(frame.marshal(ContentBody(body[i : i + max_content_size]), channel))
    return b"".join(parts)


def test_a_relay_message_encodes_as_pamqp_does() -> None:
    message = OutgoingMessage(
        destination="billing.events",
        routing_key="invoice.created",
        message_id="3f1c0c1e-0000-4000-8000-000000000001",
        body=b'{"invoice_id": 1, "amount_cents": 1250}',
        message_type="InvoiceCreated",
        headers={
            "event-id": "3f1c",
            "relay-id": "relay-1",
            "publish-attempt": "1",
            "traceparent": "00-ab-cd-01",
        },
        first_enqueued_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    )
    properties = properties_of(message, user_id="guest")
    got = frames.encode(7, message.destination, message.routing_key, properties, message.body, 131064)
    assert got == pamqp_bytes(7, message.destination, message.routing_key, properties, message.body, 131064)


text = st.text(max_size=40)


@given(
    headers=st.dictionaries(st.text(max_size=20), st.text(max_size=60), max_size=8),
    body=st.binary(max_size=300),
    content_type=st.none() | text,
    message_type=st.none() | text,
    user_id=st.none() | text,
    message_id=st.none() | text,
    delivery_mode=st.none() | st.sampled_from([1, 2]),
    max_content_size=st.integers(min_value=1, max_value=120),
)
def test_any_shape_it_accepts_encodes_as_pamqp_does(
    headers: dict[str, str],
    body: bytes,
    content_type: str | None,
    message_type: str | None,
    user_id: str | None,
    message_id: str | None,
    delivery_mode: int | None,
    max_content_size: int,
) -> None:
    properties = Basic.Properties(
        content_type=content_type,
        headers=headers or None,
        delivery_mode=delivery_mode,
        priority=0,
        message_id=message_id,
        message_type=message_type,
        user_id=user_id,
    )
    got = frames.encode(1, "ex", "rk.é", properties, body, max_content_size)
    assert got == pamqp_bytes(1, "ex", "rk.é", properties, body, max_content_size)


@pytest.mark.parametrize(
    "properties",
    [
        Basic.Properties(headers={"count": 3}),  # not a string header: pamqp's own encoder
        Basic.Properties(headers={"nested": {"a": "b"}}),
        Basic.Properties(correlation_id="c-1"),  # a property outside the relay's shape
        Basic.Properties(message_id="x" * 256),  # too long for a short string: pamqp raises its own error
    ],
)
def test_what_it_does_not_encode_is_handed_back(properties: Basic.Properties) -> None:
    assert frames.encode(1, "ex", "rk", properties, b"{}", 1000) is None


def test_a_name_over_255_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 255"):
        frames.publish_frame(1, "e" * 256, "rk")
