"""Fingerprints are equal for equal intents however the JSON is written, and differ when any
intent field differs (hypothesis; pure, no services)."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import unicodedata
from typing import Any, ClassVar

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from consumer_kit.identity import fingerprint

EXCLUDE: ClassVar[Any] = frozenset({"requested_at"})


class Intent(BaseModel):
    order_id: int
    amount: decimal.Decimal
    price: float
    customer: str
    at: dt.datetime
    tags: list[str]
    attributes: dict[str, int]
    requested_at: dt.datetime | None = None  # volatile: excluded from the fingerprint


# Any Unicode scalar value (lone surrogates are rejected before fingerprinting).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
UTC_INSTANTS = st.datetimes(
    min_value=dt.datetime(1971, 1, 1), max_value=dt.datetime(2200, 1, 1), timezones=st.just(dt.UTC)
)
NFC_KEYS = TEXT.map(lambda s: unicodedata.normalize("NFC", s))

INTENTS = st.fixed_dictionaries(
    {
        "order_id": st.integers(-(2**63), 2**63 - 1),
        "amount": st.decimals(min_value=-10**9, max_value=10**9, places=2, allow_nan=False, allow_infinity=False),
        "price": st.floats(allow_nan=False, allow_infinity=False, width=64),
        "customer": TEXT,
        "at": UTC_INSTANTS,
        "tags": st.lists(TEXT, max_size=4),
        "attributes": st.dictionaries(NFC_KEYS, st.integers(-1000, 1000), max_size=4),
        "requested_at": UTC_INSTANTS,
    }
)

OFFSETS = st.integers(-12 * 60, 14 * 60).map(lambda m: dt.timezone(dt.timedelta(minutes=m)))


@st.composite
def encodings(draw: st.DrawFn, intent: dict[str, Any]) -> bytes:
    """One JSON text of ``intent``: key order, whitespace, escapes, number spelling, Unicode
    normal form and timezone offset all chosen by hypothesis."""
    # canonical equivalents only: NFKC would change meaning ("ﬁ" -> "fi")
    form = draw(st.sampled_from(["NFC", "NFD"]))

    def text(value: str) -> str:
        return unicodedata.normalize(form, value)

    def instant(value: dt.datetime) -> str:
        shown = value.astimezone(draw(OFFSETS))
        rendered = shown.isoformat()
        if shown.utcoffset() == dt.timedelta(0) and draw(st.booleans()):
            rendered = rendered.replace("+00:00", "Z")
        return rendered

    def number(value: Any) -> str:
        """A JSON number literal of ``value``, e.g. 10 as ``10``, ``10.0``, ``1e1`` or ``10.00``."""
        d = decimal.Decimal(repr(value)) if isinstance(value, float) else decimal.Decimal(value)
        style = draw(st.sampled_from(["plain", "padded", "exp"]))
        if style == "padded":  # trailing zeros only: 10 -> 10.00, 0.5 -> 0.500
            plain = format(d, "f")
            return plain + ("00" if "." in plain else ".00")
        if style == "exp" and d != 0:
            return format(d, "e") if len(d.as_tuple().digits) < 15 else format(d, "f")
        return format(d, "f")

    fields: dict[str, str] = {
        # order_id is an int field: a float literal like 10.0 is the same intent (pydantic lax)
        "order_id": number(intent["order_id"]) if abs(intent["order_id"]) < 2**52 else str(intent["order_id"]),
        "amount": draw(st.sampled_from([number(intent["amount"]), json.dumps(str(intent["amount"]))])),
        "price": number(intent["price"]) if intent["price"] == intent["price"] else "0",
        "customer": json.dumps(text(intent["customer"]), ensure_ascii=draw(st.booleans())),
        "at": json.dumps(instant(intent["at"])),
        "tags": json.dumps([text(t) for t in intent["tags"]], ensure_ascii=draw(st.booleans())),
        "attributes": json.dumps({text(k): v for k, v in intent["attributes"].items()}),
        "requested_at": json.dumps(instant(intent["requested_at"])),
    }
    order = draw(st.permutations(list(fields)))
    space = draw(st.sampled_from(["", " ", "\n  ", "\t"]))
    body = "{" + ("," + space).join(f"{space}{json.dumps(k)}{space}:{space}{fields[k]}" for k in order) + space + "}"
    return body.encode("utf-8")


def fp(body: bytes) -> str:
    """The fingerprint as the runtime computes it: json.loads on bytes, validate, fingerprint."""
    return fingerprint(Intent.model_validate(json.loads(body)), EXCLUDE)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), intent=INTENTS)
def test_equal_intents_have_equal_fingerprints(data: st.DataObject, intent: dict[str, Any]) -> None:
    first = data.draw(encodings(intent))
    second = data.draw(encodings(intent))
    assert fp(first) == fp(second), (first, second)


MUTATIONS = ["order_id", "amount", "price", "customer", "at", "tags", "attributes"]


@st.composite
def mutated(draw: st.DrawFn, intent: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    field = draw(st.sampled_from(MUTATIONS))
    changed = dict(intent)
    value = intent[field]
    if field == "order_id":
        changed[field] = value + draw(st.sampled_from([1, -1])) if abs(value) < 2**62 else value // 2
    elif field == "amount":
        changed[field] = value + decimal.Decimal(draw(st.sampled_from(["0.01", "-0.01", "1"])))
    elif field == "price":
        changed[field] = draw(st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != value))
    elif field == "customer":
        changed[field] = value + draw(st.sampled_from(["x", "é", " ", "0"]))
    elif field == "at":
        changed[field] = value + dt.timedelta(microseconds=draw(st.sampled_from([1, -1, 1_000_000])))
    elif field == "tags":
        changed[field] = [*value, draw(TEXT)]
    else:
        extra = draw(NFC_KEYS.filter(lambda k: k not in value))
        changed[field] = {**value, extra: 0}
    return field, changed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), intent=INTENTS)
def test_any_changed_intent_field_changes_the_fingerprint(data: st.DataObject, intent: dict[str, Any]) -> None:
    field, changed = data.draw(mutated(intent))
    assert fp(data.draw(encodings(intent))) != fp(data.draw(encodings(changed))), field


@settings(max_examples=50, deadline=None)
@given(data=st.data(), intent=INTENTS, other=UTC_INSTANTS)
def test_excluded_field_does_not_change_the_fingerprint(
    data: st.DataObject, intent: dict[str, Any], other: dt.datetime
) -> None:
    assert fp(data.draw(encodings(intent))) == fp(data.draw(encodings({**intent, "requested_at": other})))
