"""consumer-kit's marks are believed only under a valid signature (a producer cannot steer
the bookkeeping). Codec level: every mark, forged, tampered, under another key, rotated."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest

from consumer_kit.codec import headers as own
from consumer_kit.codec import marks

BODY = b'{"order": 418}'

GOOD_VALUES: dict[str, Any] = {
    own.DELIVERIES: 3,
    own.REDELIVERED: 1,
    own.MESSAGE_ID: "m-original",
    own.REDRIVEN: "max_deliveries_exceeded",
    own.TRIMMED: 2,
    own.FIRST_ENQUEUED: "2026-01-01T00:00:00+00:00",
    own.SENDER: "acme-producer",
    own.DEAD_LETTER_REASON: "handler_failed",
    own.DEAD_LETTER_DETAIL: "ValueError: boom",
    own.ORIGINAL_QUEUE: "orders",
}


@pytest.fixture(autouse=True)
def _own_keyring() -> Iterator[None]:
    before = marks.installed()
    marks.install(b"k" * 32, source="test")
    yield
    marks.install(before.current, before.previous, source=before.source)


def test_every_mark_is_in_the_table() -> None:
    assert set(GOOD_VALUES) == own.MARKS


@pytest.mark.parametrize("name", sorted(own.MARKS))
def test_a_forged_mark_is_dropped_and_counted(name: str) -> None:
    before = own.UNVERIFIED[name]
    reading = own.read({name: GOOD_VALUES[name], "operation-id": "k"}, BODY)
    assert name not in reading.headers and reading.headers["operation-id"] == "k"
    assert (reading.deliveries_before, reading.suspect, reading.message_id) == (0, False, None)
    assert reading.fault is None
    assert own.UNVERIFIED[name] == before + 1


@pytest.mark.parametrize("name", sorted(own.MARKS))
def test_a_signed_mark_is_believed(name: str) -> None:
    reading = own.read(own.seal({name: GOOD_VALUES[name], "operation-id": "k"}, BODY), BODY)
    assert reading.headers[name] == GOOD_VALUES[name]


def test_signed_marks_give_the_bookkeeping() -> None:
    reading = own.read(own.seal(dict(GOOD_VALUES), BODY), BODY)
    assert (reading.deliveries_before, reading.suspect, reading.message_id) == (3, True, "m-original")


def test_marks_signed_as_text_verify_as_numbers_and_back() -> None:
    """SQS hands every value back as text, Service Bus and AMQP keep ints: the signature covers
    the normalised value."""
    signed = own.seal({own.DELIVERIES: 3, own.REDELIVERED: 1}, BODY)
    as_text = {name: str(value) for name, value in signed.items()}
    reading = own.read(as_text, BODY)
    assert (reading.deliveries_before, reading.suspect) == (3, True)


@pytest.mark.parametrize("change", ["body", "value", "added mark", "removed mark", "other key", "garbage"])
def test_a_tampered_copy_loses_all_its_marks(change: str) -> None:
    headers = own.seal({own.DELIVERIES: 3, own.MESSAGE_ID: "m-1", own.ORIGINAL_QUEUE: "orders"}, BODY)
    body = BODY
    if change == "body":
        body = b'{"order": 419}'
    elif change == "value":
        headers[own.DELIVERIES] = 0
    elif change == "added mark":
        headers[own.REDELIVERED] = 1
    elif change == "removed mark":
        del headers[own.ORIGINAL_QUEUE]
    elif change == "other key":
        marks.install(b"o" * 32, source="test")
    else:
        headers[own.SIGNATURE] = "A" * 22
    reading = own.read(headers, body)
    assert not own.MARKS & set(reading.headers)
    assert (reading.deliveries_before, reading.suspect, reading.message_id) == (0, False, None)


def test_the_previous_key_is_accepted_while_rotating() -> None:
    old = b"p" * 32
    marks.install(old, source="test")
    signed = own.seal({own.DELIVERIES: 2}, BODY)
    marks.install(b"n" * 32, [old], source="test")
    assert own.read(signed, BODY).deliveries_before == 2
    resealed = own.seal(dict(signed), BODY)
    assert resealed[own.SIGNATURE] != signed[own.SIGNATURE]  # new copies: the new key
    assert own.read(resealed, BODY).deliveries_before == 2
    marks.install(b"n" * 32, source="test")  # rotation over: the old key is refused
    assert own.read(signed, BODY).deliveries_before == 0


def test_without_a_body_no_mark_is_believed() -> None:
    assert own.read(own.seal({own.DELIVERIES: 2}, BODY)).deliveries_before == 0


def test_a_message_without_marks_costs_no_hmac(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = marks.verify
    monkeypatch.setattr(marks, "verify", lambda *a: calls.append(1) or real(*a))
    own.read({"operation-id": "k", "tenant-id": "t", "traceparent": "00-x"}, BODY)
    assert calls == []
    own.read(own.seal({own.DELIVERIES: 1}, BODY), BODY)
    assert calls == [1]


def test_seal_without_marks_leaves_no_signature() -> None:
    assert own.seal({"operation-id": "k", own.SIGNATURE: "x" * 22}, BODY) == {"operation-id": "k"}


def test_a_bad_mark_value_keeps_its_table_rule() -> None:
    """A mark of a bad value is judged by the table first (the message-id mark: invalid_header)."""
    assert own.read({own.MESSAGE_ID: "a\x00b"}, BODY).fault is not None
    assert own.read({own.DELIVERIES: -1}, BODY).ignored == (own.DELIVERIES,)


def test_a_short_key_is_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        marks.install(b"short")


def test_the_first_enqueue_time_is_the_earliest_trustworthy_one() -> None:
    import datetime as dt

    from consumer_kit.broker import first_enqueue_time

    now = dt.datetime.now(dt.UTC)
    day = dt.timedelta(days=1)
    first = (now - 3 * day).isoformat()
    # a signed mark from an earlier copy wins over this copy's newer broker time ...
    headers = own.read(own.seal({own.FIRST_ENQUEUED: first}, BODY), BODY).headers
    assert first_enqueue_time(headers, now - day) == now - 3 * day
    # an unsigned one is dropped by the codec: this copy's broker time
    forged = own.read({own.FIRST_ENQUEUED: first}, BODY).headers
    assert first_enqueue_time(forged, now - day) == now - day
    # never later than now: a broker (or AMQP timestamp) time in the future does not count
    assert first_enqueue_time({}, now + day) <= dt.datetime.now(dt.UTC)
    # a signed mark later than this copy's broker time does not make it newer
    later = own.read(own.seal({own.FIRST_ENQUEUED: (now - day).isoformat()}, BODY), BODY).headers
    assert first_enqueue_time(later, now - 2 * day) == now - 2 * day


def test_a_producer_s_operation_time_only_makes_it_earlier_and_never_lies_ahead() -> None:
    import datetime as dt

    from consumer_kit.codec.envelope import Envelope
    from consumer_kit.errors import InvalidMessage
    from consumer_kit.pipeline.decoding import CLOCK_SKEW_SECONDS, operation_time

    now = dt.datetime.now(dt.UTC)
    first = now - dt.timedelta(days=2)

    def at(created: dt.datetime) -> dt.datetime | None:
        envelope = Envelope("q", "m", {own.OPERATION_CREATED_AT: created.isoformat()}, 1, enqueued_at=first)
        return operation_time(envelope)

    assert at(now - dt.timedelta(days=5)) == now - dt.timedelta(days=5)  # earlier: believed
    assert at(now - dt.timedelta(days=1)) == first  # later than the broker's: not
    assert at(now + dt.timedelta(seconds=CLOCK_SKEW_SECONDS / 2)) == first  # within the skew
    with pytest.raises(InvalidMessage) as refused:
        at(now + dt.timedelta(days=1))
    assert refused.value.reason.value == "invalid_header" and own.OPERATION_CREATED_AT in refused.value.detail


def test_marks_packed_by_a_producer_are_dropped_too() -> None:
    """SQS packs headers beyond its 10 attributes into ``x-consumer-kit-headers``: a mark hidden
    there is read after unpacking, so it needs the same signature."""
    packed = own.pack({own.REDELIVERED: "1", own.DELIVERIES: "5", "tenant-id": "t-1"})
    reading = own.read({own.PACKED: packed}, BODY)
    assert (reading.suspect, reading.deliveries_before, reading.headers["tenant-id"]) == (False, 0, "t-1")
    signed = own.seal({own.REDELIVERED: "1", own.DELIVERIES: "5", "tenant-id": "t-1"}, BODY)
    reading = own.read({own.PACKED: own.pack(signed)}, BODY)
    assert (reading.suspect, reading.deliveries_before) == (True, 5)


def test_mark_names_are_matched_ignoring_case_when_dropped() -> None:
    reading = own.read({"X-Consumer-Kit-Redelivered": "1", "X-Original-Queue": "elsewhere"}, BODY)
    assert reading.suspect is False and not reading.headers


@pytest.mark.parametrize("when", [
    dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC),
    dt.datetime(2026, 12, 1, 13, 30, 5, 123456, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
    dt.datetime(1999, 1, 1, 0, 0, 0, 1, tzinfo=dt.timezone(dt.timedelta(hours=-8))),
])
def test_a_relay_publish_is_signed_as_seal_signs_it(when: dt.datetime) -> None:
    """The relay's fast path (publishing.headers_to_send -> headers.seal_new) gives exactly the
    headers the general seal gives, forged marks and a stale signature a handler passed on dropped."""
    from consumer_kit.broker.publishing import OutgoingMessage, headers_to_send

    passed_on = {"trace": "t", own.REDELIVERED: "1", own.SIGNATURE.upper(): "x" * 22}
    message = OutgoingMessage(destination="d", routing_key="r", message_id="m", body=b'{"n": 1}',
                              message_type="T", headers=passed_on, first_enqueued_at=when)
    fast = headers_to_send(message)
    general = own.seal({**own.without_marks({**passed_on, own.MESSAGE_TYPE: "T"}),
                        own.FIRST_ENQUEUED: when.astimezone(dt.UTC).isoformat()}, message.body)
    assert fast == general
    assert own.REDELIVERED not in fast and own.SIGNATURE.upper() not in fast
    read = own.read(fast, body=message.body)
    assert own.read_time(own.lookup(read.headers, own.FIRST_ENQUEUED)) == when  # verified, kept


@pytest.mark.parametrize("name", ["operation-id", "tenant-id", "message-type", "partition-key"])
def test_signed_marks_replayed_on_another_operation_are_dropped(name: str) -> None:
    """The signature covers the operation's identity: a signed copy's marks (its sender above all)
    copied onto a message with the same body under another key, tenant, type or partition key are
    not believed there."""
    identity = {"operation-id": "o-1", "tenant-id": "acme", "message-type": "order", "partition-key": "p-1"}
    signed = own.seal({**identity, own.SENDER: "acme-producer", own.DELIVERIES: 3}, b"{}")
    assert own.read(signed, b"{}").headers.get(own.SENDER) == "acme-producer"
    replayed = {**signed, name: "other"}
    read = own.read(replayed, b"{}")
    assert own.SENDER not in read.headers and read.deliveries_before == 0
    added = {k: v for k, v in signed.items() if k != name}  # an identity header left out counts too
    assert own.SENDER not in own.read(added, b"{}").headers


@pytest.mark.parametrize("marks", [
    {own.DEAD_LETTER_REASON: "max_deliveries_exceeded\x07"},  # a control character
    {own.DEAD_LETTER_DETAIL: "x" * 4097},  # over its length
    {own.DEAD_LETTER_REASON: "max_deliveries_exceeded\x1b[2J", own.DEAD_LETTER_DETAIL: "ok"},
])
def test_out_of_range_marks_are_never_kept_signed_or_not(marks: dict[str, str]) -> None:
    """A forged reason with a control character or an oversized detail is removed: not shown to
    operators, not matched by ``dlq redrive --reason``; nor is it kept beside marks that are signed."""
    read = own.read(marks, b"{}").headers
    assert not set(marks) & set(read)
    signed = own.seal({own.DELIVERIES: 2, **marks}, b"{}")
    read = own.read(signed, b"{}")
    assert read.deliveries_before == 2
    assert not {name for name in marks if name != own.DEAD_LETTER_DETAIL or len(marks[name]) > 4096} & set(read.headers)
