"""The one codec of consumer-kit's own headers (``consumer_kit.codec.headers``): never raises, never
believes a bad value, and says which header made a delivery ``invalid_header``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from consumer_kit.adapters.rabbitmq import delivery_count_of
from consumer_kit.codec import headers as own
from consumer_kit.codec.envelope import Envelope
from consumer_kit.errors import DeadLetterReason, InvalidMessage
from tests.system.hostile.bookkeeping import nested, nested_json


class Hostile:
    """A value whose comparisons and conversions all raise."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("compared")

    def __hash__(self) -> int:
        return 1

    def __str__(self) -> str:
        raise RuntimeError("converted")

    __repr__ = __str__


BAD_COUNTS: list[Any] = [
    -1, "-1", 2**63, float(2**63), str(2**63), str(2**63).encode(), float("inf"), float("nan"), "inf",
    True, 1.0, "1.0", " 1", "three", b"\xff", nested(), nested_json(), "9" * 1_000_000, [1], {"a": 1}, None,
    Hostile(), 2**31,
]


@pytest.mark.parametrize("value", BAD_COUNTS, ids=lambda v: type(v).__name__ + ":" + _short(v))
def test_a_bad_count_is_never_believed(value: Any) -> None:
    assert own.read_count(value) is None


def test_good_counts_in_every_encoding_the_brokers_use() -> None:
    assert [own.read_count(v) for v in (0, 3, "3", b"3", 2**31 - 1)] == [0, 3, 3, 3, 2**31 - 1]


def test_2_to_the_63_as_a_double_or_as_text_is_no_rabbitmq_delivery_count() -> None:
    """It was read as 9223372036854775809: now the header is ignored and this copy counts 1."""
    for value in (float(2**63), str(2**63), str(2**63).encode()):
        assert delivery_count_of({own.DELIVERIES: value}, redelivered=False) == 1
        assert delivery_count_of({own.BROKER_COUNT: value}, redelivered=True) == 2  # the flag's lower bound


@pytest.mark.parametrize("value", [*BAD_COUNTS, "t\x00", "a\ud800", "x" * 201], ids=lambda v: type(v).__name__ + ":" + _short(v))
def test_reading_never_raises_and_names_the_header(value: Any) -> None:
    for name in [spec.name for spec in own.SPECS]:
        reading = own.read({name: value, "operation-id": "k"})
        spec = own.SPEC_BY_NAME[name]
        if reading.fault is not None:
            assert spec.invalid and name in reading.fault
        elif value is not None and not own.is_valid(spec, value):
            assert name in reading.ignored and not spec.invalid


def test_a_packed_header_nested_5000_levels_deep_is_invalid_not_a_recursion_error() -> None:
    reading = own.read({own.PACKED: nested_json(5_000)})
    assert reading.fault is not None and own.PACKED in reading.fault


def test_packed_headers_are_unpacked_and_the_messages_own_win() -> None:
    reading = own.read({own.PACKED: own.pack({"tenant-id": "t-1", "a": "packed"}), "a": "own"})
    assert reading.fault is None and reading.headers == {"tenant-id": "t-1", "a": "own"}


def test_headers_that_cannot_even_be_listed_make_a_fault() -> None:
    class Broken(Mapping[str, Any]):
        def __getitem__(self, key: str) -> Any:
            raise KeyError(key)

        def __iter__(self) -> Iterator[str]:
            raise RuntimeError("broken mapping")

        def __len__(self) -> int:
            return 1

    reading = own.read(Broken())
    assert reading.fault is not None and "RuntimeError" in reading.fault


def test_names_are_read_as_the_envelope_reads_them_case_insensitive() -> None:
    assert own.read({"Tenant-ID": 7}).fault is not None
    assert own.read(own.seal({"X-Consumer-Kit-Deliveries": "4"}, b""), b"").deliveries_before == 4


def test_an_invalid_delivery_cannot_be_read_through_its_envelope() -> None:
    reading = own.read({"tenant-id": ["nested"], "message-type": "PlaceOrder"})
    envelope = Envelope("q", "m-1", reading.headers, 1)
    with pytest.raises(InvalidMessage) as raised:
        envelope.header("message-type")
    assert raised.value.reason is DeadLetterReason.INVALID_HEADER and "tenant-id" in raised.value.detail


def test_a_bad_correlation_id_is_ignored() -> None:
    assert Envelope("q", None, {"correlation-id": "c" * 257}, 1).correlation_id is None
    assert Envelope("q", None, {"correlation-id": b"c-1"}, 1).correlation_id == "c-1"


def _short(value: Any) -> str:
    try:
        return repr(value)[:20]
    except Exception:  # noqa: BLE001 - Hostile
        return "hostile"
