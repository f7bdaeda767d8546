"""Input the runtime must refuse or read exactly: JSON with one meaning, numbers compared by
value, a sealed handler context, fingerprints across projection versions, the broker's own
correlation id. The hostile corpus (tests/system/hostile) runs the body cases through the whole runtime;
these tests pin the rules themselves and the cases that need a handler of their own.
"""

from __future__ import annotations

import asyncio
import decimal
import uuid
from typing import Any, ClassVar

import aio_pika
import pytest
from pydantic import BaseModel

from consumer_kit import Context, Handler, Result
from consumer_kit.codec.strict_json import MAX_INTEGER_DIGITS, loads
from consumer_kit.errors import ContextSealed, DeadLetterReason, InvalidMessage, UnsupportedNumber
from consumer_kit.identity import MAX_NUMBER_DIGITS, canonical_json
from consumer_kit.testing import Harness
from tests.fixtures.broker_env import Env, command

# -- the JSON rules --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"a": NaN}', DeadLetterReason.INVALID_JSON),
        (b'{"a": Infinity}', DeadLetterReason.INVALID_JSON),
        (b'[-Infinity]', DeadLetterReason.INVALID_JSON),
        (b'{"a": 1, "a": 1}', DeadLetterReason.INVALID_JSON),  # even with the same value
        (b'{"\\u00c5": 1, "A\\u030a": 2}', DeadLetterReason.INVALID_JSON),  # one key after NFC
        (b'{"a": "\\udfff"}', DeadLetterReason.INVALID_JSON),
        ('{"a": 1}'.encode("utf-16-le"), DeadLetterReason.INVALID_JSON),
        (b'{"a": "caf\xe9"}', DeadLetterReason.INVALID_JSON),  # Latin-1, not UTF-8
        (b"1e309", DeadLetterReason.INVALID_NUMBER),
        (b"-1e309", DeadLetterReason.INVALID_NUMBER),
        (b"4e-330", DeadLetterReason.INVALID_NUMBER),  # would become 0
        (b"0.10000000000000000001", DeadLetterReason.INVALID_NUMBER),  # would become 0.1
        (b"1" * (MAX_INTEGER_DIGITS + 1), DeadLetterReason.INVALID_NUMBER),
    ],
)
def test_bodies_without_one_meaning_are_refused_with_a_specific_reason(
    body: bytes, reason: DeadLetterReason
) -> None:
    with pytest.raises(InvalidMessage) as refused:
        loads(body)
    assert refused.value.reason is reason
    assert body.decode("latin-1") not in refused.value.detail  # the detail never quotes the body


@pytest.mark.parametrize(
    ("body", "value"),
    [
        (b'\xef\xbb\xbf{"a": 1}', {"a": 1}),  # a UTF-8 BOM may be ignored (RFC 8259 8.1)
        (b'{"a": 0.1, "b": 1e1, "c": -0.0, "d": 1.5e-300}', {"a": 0.1, "b": 10.0, "c": -0.0, "d": 1.5e-300}),
        (b"9" * MAX_INTEGER_DIGITS, int("9" * MAX_INTEGER_DIGITS)),
        (b'{"\\u00e9": "e\\u0301"}', {"\u00e9": "e\u0301"}),  # values are not keys: not merged
        (b'"\\ud83d\\ude00"', "\U0001f600"),  # a surrogate pair is one character
    ],
)
def test_json_with_one_meaning_is_read_exactly(body: bytes, value: Any) -> None:
    assert loads(body) == value


def test_canonical_numbers_are_exact_beyond_28_digits() -> None:
    """``Decimal.normalize`` rounds to the context's 28 digits: two decimals differing in the 30th
    digit must still fingerprint differently, and the same value written twice the same."""
    a = decimal.Decimal("1.23456789012345678901234567890")
    b = decimal.Decimal("1.23456789012345678901234567891")
    assert canonical_json(a) != canonical_json(b)
    assert canonical_json(a) == canonical_json(decimal.Decimal("1.234567890123456789012345678900"))
    assert canonical_json(decimal.Decimal("1E+3")) == canonical_json(1000) == canonical_json(1000.0)


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), -float("inf"), decimal.Decimal("NaN"), decimal.Decimal("-Infinity"),
     decimal.Decimal(f"1E+{MAX_NUMBER_DIGITS + 1}"), decimal.Decimal(f"1E-{MAX_NUMBER_DIGITS + 1}"),
     10 ** (MAX_NUMBER_DIGITS + 1)],
)
def test_numbers_without_a_comparable_value_are_refused(value: Any) -> None:
    with pytest.raises(UnsupportedNumber):
        canonical_json({"x": value})


# -- a sealed context --------------------------------------------------------------------------------


class Note(BaseModel):
    text: str


class NoteCreated(BaseModel):
    text: str


class LatePublisher(Handler[Note]):
    """Publishes one event in time and starts a background task that publishes after returning."""

    operation_type = "note.create"

    def __init__(self) -> None:
        super().__init__()
        self.late: asyncio.Future[BaseException | None] | None = None
        self.returned = asyncio.Event()

    async def handle(self, message: Note, ctx: Context) -> Result:
        await ctx.publish(NoteCreated(text=message.text), destination="notes")

        async def publish_later() -> BaseException | None:
            await self.returned.wait()
            try:
                await ctx.publish(NoteCreated(text="late"), destination="notes")
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                return exc
            return None

        self.late = asyncio.ensure_future(publish_later())
        return Result("noted")


async def test_a_publish_after_handle_returned_raises_and_writes_nothing(database_url: str) -> None:
    handler = LatePublisher()
    async with Harness(handler, database_url=database_url) as kit:
        await kit.deliver(Note(text="hi"), operation_id="n-1")
        handler.returned.set()
        assert handler.late is not None
        late = await asyncio.wait_for(handler.late, 5)
        assert isinstance(late, ContextSealed)
        assert "after handle() returned" in str(late) and "n-1" in str(late)
        assert await kit.fetch("SELECT payload->>'text' FROM outbox") == [("hi",)]


# -- projection versions ---------------------------------------------------------------------------------


class Transfer(BaseModel):
    account: str
    amount: int
    memo: str = ""


class TransferHandler(Handler[Transfer]):
    operation_type = "transfer"

    async def handle(self, message: Transfer, ctx: Context) -> Result:
        return Result("moved")


class TransferV1(TransferHandler):
    projection_version = 1
    fingerprint_exclude: ClassVar[Any] = None  # v1: the memo was part of the intent


class TransferV2(TransferHandler):
    projection_version = 2
    fingerprint_exclude: ClassVar[Any] = {"memo"}  # v2: the memo no longer is
    earlier_projections: ClassVar[Any] = {1: None}


class TransferV2Forgetful(TransferHandler):
    projection_version = 2
    fingerprint_exclude: ClassVar[Any] = {"memo"}


async def _record_under_v1(database_url: str, kit: Harness) -> None:
    """Record operation t-1 under projection v1 in ``kit``'s schema (another handler version)."""
    async with Harness(TransferV1(), database_url=database_url) as v1:
        await v1.deliver(Transfer(account="a", amount=5, memo="rent"), operation_id="t-1")
        rows = await v1.fetch(
            "SELECT scope, key, tenant, operation_type, fingerprint, projection_version, state "
            "FROM operations"
        )
    for row in rows:
        await kit.fetch(
            "INSERT INTO operations (scope, key, tenant, operation_type, fingerprint, "
            "projection_version, state, result_status) VALUES (%s, %s, %s, %s, %s, %s, %s, 'ok') "
            "RETURNING 1", *row,
        )


@pytest.mark.parametrize(
    ("handler", "message", "expected"),
    [
        (TransferV2(), Transfer(account="a", amount=5, memo="rent"), ("duplicate", None)),
        (TransferV2(), Transfer(account="a", amount=5, memo="food"), ("payload_conflict", "payload_conflict")),
        (TransferV2(), Transfer(account="a", amount=6, memo="rent"), ("payload_conflict", "payload_conflict")),
        # a handler that dropped v1 cannot compare: parked, never acked as a duplicate
        (TransferV2Forgetful(), Transfer(account="a", amount=5, memo="rent"),
         ("uncertain", "needs_reconciliation")),
    ],
    ids=["same-intent-under-v1", "memo-differs-under-v1", "amount-differs", "v1-forgotten"],
)
async def test_a_message_of_an_operation_recorded_under_an_earlier_projection(
    database_url: str, handler: Handler[Transfer], message: Transfer, expected: tuple[str, str | None]
) -> None:
    async with Harness(handler, database_url=database_url) as kit:
        await _record_under_v1(database_url, kit)
        (report,) = await kit.deliver(message, operation_id="t-1")
        assert (report.outcome.value, report.reason) == expected
        assert await kit.fetch("SELECT projection_version, state FROM operations") == [(1, "completed")]


def test_earlier_projections_must_be_earlier() -> None:
    class Wrong(TransferHandler):
        projection_version = 2
        earlier_projections: ClassVar[Any] = {2: None}

    with pytest.raises(Exception, match="not below projection_version 2"):
        Wrong()


# -- the broker's correlation id ----------------------------------------------------------------------


@pytest.mark.rabbitmq
async def test_the_amqp_correlation_id_property_is_read_before_the_header(env: Env) -> None:
    """The standard AMQP ``correlation_id`` property, not only a ``correlation-id`` header, is the
    correlation id copied to the events; when both are set the property wins."""
    async with env.worker():
        connection = await aio_pika.connect(env.rabbitmq_url)
        try:
            channel = await connection.channel(publisher_confirms=True)
            for order, headers, prop in (
                (1, {}, "corr-property"),
                (2, {"correlation-id": "corr-header"}, None),
                (3, {"correlation-id": "corr-header"}, "corr-both"),
            ):
                await channel.default_exchange.publish(
                    aio_pika.Message(command(order), message_id=str(uuid.uuid4()), headers=headers,
                                     correlation_id=prop, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=env.queue,
                )
        finally:
            await connection.close()
        await env.next_reports(3)
    rows = await env.rows("SELECT operation_key, correlation_id FROM outbox ORDER BY operation_key")
    assert rows == [
        ("order-1-rev-2", "corr-property"), ("order-2-rev-2", "corr-header"), ("order-3-rev-2", "corr-both"),
    ]
