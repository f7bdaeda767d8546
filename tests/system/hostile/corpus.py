"""The hostile input corpus: each case, what is sent and what must happen.

Expectations per send, in order: ``"executed"``, ``"duplicate"``, ``"payload_conflict"`` (an
acceptance or a conflict) or ``"dead:<reason>"`` (dead-lettered with exactly that reason). Every
case is run by ``test_corpus.py`` through the runtime, the memory broker and the real PostgreSQL.

Documented acceptances (not bugs):

* a UTF-8 body with a byte order mark is decoded (RFC 8259 section 8.1 lets a parser ignore it);
* ``10``, ``10.0``, ``1e1`` and ``"10"`` for an ``int`` field are one intent (numbers by value;
  pydantic's lax mode reads the string): the later ones are duplicates; ``10.5`` is a schema
  mismatch;
* an unknown extra field is ignored (pydantic's default) and is not part of the fingerprint;
* an operation key or header holding SQL or quotes is just text (parameters, never formatted);
* a key in NFD and the same key in NFC are one key (keys are NFC-normalised);
* a value PostgreSQL rejects the same way every time (NUL in text, an integer beyond bigint, a NOT
  NULL or CHECK violation) fails in the handler's INSERT; the runtime dead-letters it at once with
  reason ``invalid_data:<error class>``.

Refused as having no single meaning (``consumer_kit.codec.strict_json``, ``consumer_kit.identity``):
``NaN``/``Infinity`` literals, repeated object keys (also after NFC), lone surrogates, UTF-16/32
bodies (``invalid_json``); numbers a 64-bit float cannot hold by value, integers over 1,000 digits,
and NaN, infinities or extreme decimals reached through strings (``invalid_number``).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import unicodedata
from dataclasses import dataclass, field
from typing import Any, ClassVar

from psycopg import AsyncConnection
from pydantic import BaseModel, Field

from consumer_kit import Context, Handler, Result

TABLES = """
CREATE TABLE effects (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_key text NOT NULL,
    customer text NOT NULL,
    amount bigint NOT NULL CHECK (amount > -1000),
    note text NOT NULL
);
"""


class PlaceOrder(BaseModel):
    customer: str = Field(min_length=1, max_length=200)
    amount: int
    note: str | None = ""
    placed_at: dt.datetime | None = None
    rate: float | None = None
    price: decimal.Decimal | None = None


class PlaceOrderHandler(Handler[PlaceOrder]):
    """Keyed by header ``operation-id``; one ``effects`` row per execution (no unique key)."""

    operation_type = "hostile.place_order"
    fingerprint_exclude: ClassVar[Any] = frozenset({"placed_at"})

    async def handle(self, message: PlaceOrder, ctx: Context) -> Result:
        conn: AsyncConnection[Any] = ctx.connection
        await conn.execute(
            "INSERT INTO effects (operation_key, customer, amount, note) VALUES (%s, %s, %s, %s)",
            (ctx.operation.key, message.customer, message.amount, message.note),
        )
        return Result("placed")


GOOD = {"customer": "c-1", "amount": 10, "note": "n", "placed_at": "2024-05-01T10:00:00Z"}
GOOD_BYTES = json.dumps(GOOD).encode()


@dataclass(frozen=True)
class Send:
    body: bytes
    operation_id: Any = "op-1"
    headers: dict[str, Any] = field(default_factory=dict)
    message_type: Any = None  # None: the handler's; False: no header


@dataclass(frozen=True)
class Case:
    name: str
    sends: tuple[Send, ...]
    expect: tuple[str, ...]

    @property
    def executions(self) -> int:
        return self.expect.count("executed")


def j(value: Any) -> bytes:
    return json.dumps(value).encode()


def one(name: str, body: bytes, expect: str, **send: Any) -> Case:
    return Case(name, (Send(body, **send),), (expect,))


def after_good(name: str, body: bytes, expect: str, **send: Any) -> Case:
    """The good message first, then the variant with the same key."""
    return Case(name, (Send(GOOD_BYTES), Send(body, **send)), ("executed", expect))


NFC_KEY = unicodedata.normalize("NFC", "op-café-Å")
NFD_KEY = unicodedata.normalize("NFD", "op-café-Å")
assert NFC_KEY != NFD_KEY

CASES: list[Case] = [
    # -- bodies -----------------------------------------------------------------------------
    one("invalid_json_truncated", b'{"customer": "c-1", "amount": ', "dead:invalid_json"),
    one("invalid_json_garbage", b"\x00\x01\x02 not json", "dead:invalid_json"),
    one("empty_body", b"", "dead:invalid_json"),
    one("deeply_nested", b"[" * 200_000 + b"]" * 200_000, "dead:invalid_json"),
    one("body_6_mb", b'{"customer": "' + b"x" * (6 * 1024 * 1024) + b'", "amount": 1}', "dead:invalid_json"),
    one("body_3_mb_field_too_long", j({**GOOD, "customer": "x" * (3 * 1024 * 1024)}), "dead:schema_mismatch"),
    one("non_utf8_latin1", b'{"customer": "caf\xe9", "amount": 1}', "dead:invalid_json"),
    one("non_utf8_random", b'{"customer": "\xff\xfe\xfa", "amount": 1}', "dead:invalid_json"),
    # -- JSON outside RFC 8259 or without one meaning: refused before validation ------------
    one("lone_surrogate_constrained_field", b'{"customer": "\\ud800", "amount": 1}', "dead:invalid_json"),
    one("lone_surrogate_plain_field", b'{"customer": "c", "amount": 1, "note": "\\udc00"}', "dead:invalid_json"),
    one("lone_surrogate_unknown_field", b'{"customer": "c", "amount": 1, "x": ["\\udbff"]}', "dead:invalid_json"),
    one("lone_surrogate_in_a_key", b'{"customer": "c", "amount": 1, "\\ud800": 1}', "dead:invalid_json"),
    one("utf16_with_bom", json.dumps(GOOD).encode("utf-16"), "dead:invalid_json"),
    one("utf32", json.dumps(GOOD).encode("utf-32-le"), "dead:invalid_json"),
    one("utf8_with_bom_accepted", b"\xef\xbb\xbf" + GOOD_BYTES, "executed"),
    one("nan_literal", b'{"customer": "c-1", "amount": 1, "rate": NaN}', "dead:invalid_json"),
    one("nan_literal_in_int_field", b'{"customer": "c-1", "amount": NaN}', "dead:invalid_json"),
    one("nan_literal_in_unknown_field", b'{"customer": "c-1", "amount": 1, "extra": NaN}', "dead:invalid_json"),
    one("infinity_literal", b'{"customer": "c-1", "amount": 1, "rate": Infinity}', "dead:invalid_json"),
    one("minus_infinity_literal", b'{"customer": "c-1", "amount": 1, "rate": -Infinity}', "dead:invalid_json"),
    one("repeated_key", b'{"customer": "c-1", "amount": 99, "amount": 10}', "dead:invalid_json"),
    one("repeated_key_after_nfc", b'{"customer": "c-1", "amount": 1, "extra": {"\\u00e9": 1, "e\\u0301": 2}}',
        "dead:invalid_json"),
    # -- numbers the runtime cannot hold or compare by value ------------------------------------
    one("nan_string_in_float_field", j({"customer": "c-1", "amount": 1, "rate": "NaN"}), "dead:invalid_number"),
    one("infinity_string_in_float_field", j({"customer": "c-1", "amount": 1, "rate": "-inf"}), "dead:invalid_number"),
    # pydantic's Decimal refuses NaN itself (a Decimal field with allow_inf_nan would reach the
    # fingerprint, which refuses it as invalid_number)
    one("nan_string_in_decimal_field", j({"customer": "c-1", "amount": 1, "price": "NaN"}), "dead:schema_mismatch"),
    one("float_literal_overflows", b'{"customer": "c-1", "amount": 1, "rate": 1e400}', "dead:invalid_number"),
    one("float_string_overflows", j({"customer": "c-1", "amount": 1, "rate": "1e400"}), "dead:invalid_number"),
    one("float_literal_underflows", b'{"customer": "c-1", "amount": 1, "rate": 1e-400}', "dead:invalid_number"),
    one("float_literal_loses_precision", b'{"customer": "c-1", "amount": 1, "rate": 1.00000000000000000001}',
        "dead:invalid_number"),
    one("integer_of_5000_digits", b'{"customer": "c-1", "amount": ' + b"9" * 5000 + b"}", "dead:invalid_number"),
    one("integer_of_5000_digits_unknown_field", b'{"customer": "c-1", "amount": 1, "x": ' + b"9" * 5000 + b"}",
        "dead:invalid_number"),
    one("integer_string_of_5000_digits", j({"customer": "c-1", "amount": "9" * 5000}), "dead:schema_mismatch"),
    one("decimal_1e5000", j({"customer": "c-1", "amount": 1, "price": "1E+5000"}), "dead:invalid_number"),
    one("decimal_exact_30_digits_accepted", j({"customer": "c-1", "amount": 1, "price": "1.23456789012345678901234567890"}),
        "executed"),
    one("json_array", b"[1, 2, 3]", "dead:schema_mismatch"),
    one("json_string", b'"hello"', "dead:schema_mismatch"),
    one("json_null", b"null", "dead:schema_mismatch"),
    one("missing_field", j({"customer": "c-1"}), "dead:schema_mismatch"),
    one("wrong_type", j({"customer": "c-1", "amount": "ten"}), "dead:schema_mismatch"),
    one("customer_is_object", j({"customer": {"$ne": None}, "amount": 1}), "dead:schema_mismatch"),
    one("fractional_int", j({"customer": "c-1", "amount": 10.5}), "dead:schema_mismatch"),
    one("bigint_overflow", j({"customer": "c-1", "amount": 10**30}),
        "dead:invalid_data:NumericValueOutOfRange"),
    one("nul_in_text_field", j({"customer": "a\x00b", "amount": 1}), "dead:invalid_data:DataError"),
    one("not_null_violation", j({"customer": "c-1", "amount": 1, "note": None}),
        "dead:invalid_data:NotNullViolation"),
    one("check_violation", j({"customer": "c-1", "amount": -5000}), "dead:invalid_data:CheckViolation"),
    # -- same intent written differently: documented acceptance as duplicates -----------------
    after_good("number_10_point_0", j({**GOOD, "amount": 10.0}), "duplicate"),
    after_good("number_as_string", j({**GOOD, "amount": "10"}), "duplicate"),
    after_good("number_exponent", b'{"customer": "c-1", "amount": 1e1, "note": "n"}', "duplicate"),
    after_good("fields_in_another_order", j(dict(reversed(list(GOOD.items())))), "duplicate"),
    after_good("insignificant_whitespace", json.dumps(GOOD, indent=4).encode(), "duplicate"),
    after_good("unknown_extra_field_ignored", j({**GOOD, "surprise": [1, 2]}), "duplicate"),
    after_good("volatile_field_differs", j({**GOOD, "placed_at": "2030-01-01T00:00:00+05:00"}), "duplicate"),
    after_good("note_nfd_vs_nfc", j({**GOOD, "note": unicodedata.normalize("NFD", "n")}), "duplicate"),
    after_good("repeated_json_key_is_no_duplicate", b'{"customer": "c-1", "amount": 99, "amount": 10, "note": "n"}',
               "dead:invalid_json"),
    after_good("decimal_differs_in_30th_digit", j({**GOOD, "price": "1.23456789012345678901234567891"}),
               "payload_conflict"),
    after_good("conflicting_amount", j({**GOOD, "amount": 11}), "payload_conflict"),
    after_good("conflicting_note_case", j({**GOOD, "note": "N"}), "payload_conflict"),
    # -- operation keys -----------------------------------------------------------------------
    one("missing_operation_key", GOOD_BYTES, "dead:missing_operation_key", operation_id=None),
    one("empty_operation_key", GOOD_BYTES, "dead:missing_operation_key", operation_id=""),
    one("blank_operation_key", GOOD_BYTES, "dead:missing_operation_key", operation_id="   "),
    one("operation_key_513_chars", GOOD_BYTES, "dead:invalid_operation_key", operation_id="k" * 513),
    one("operation_key_512_chars", GOOD_BYTES, "executed", operation_id="k" * 512),
    one("operation_key_sql", GOOD_BYTES, "executed", operation_id="x'); DROP TABLE operations; --"),
    one("operation_key_quotes", GOOD_BYTES, "executed", operation_id="he said \"hi\" 'yo' `z` \\ %s %(x)s"),
    one("operation_key_nul", GOOD_BYTES, "dead:invalid_operation_key", operation_id="a\x00b"),
    one("operation_key_newline", GOOD_BYTES, "dead:invalid_operation_key", operation_id="a\nb"),
    one("operation_key_lone_surrogate", GOOD_BYTES, "dead:invalid_operation_key", operation_id="a\ud800"),
    one("operation_key_emoji", GOOD_BYTES, "executed", operation_id="op-🧾-ß-ǅ"),
    Case("operation_key_nfc_then_nfd", (Send(GOOD_BYTES, operation_id=NFC_KEY), Send(GOOD_BYTES, operation_id=NFD_KEY)),
         ("executed", "duplicate")),
    Case("operation_key_nfd_conflict", (Send(GOOD_BYTES, operation_id=NFD_KEY),
                                        Send(j({**GOOD, "amount": 12}), operation_id=NFC_KEY)),
         ("executed", "payload_conflict")),
    # -- headers ------------------------------------------------------------------------------
    one("operation_key_int", GOOD_BYTES, "dead:invalid_operation_key", operation_id=42),
    one("operation_key_float", GOOD_BYTES, "dead:invalid_operation_key", operation_id=4.2),
    one("operation_key_bool", GOOD_BYTES, "dead:invalid_operation_key", operation_id=True),
    one("operation_key_list", GOOD_BYTES, "dead:invalid_operation_key", operation_id=["a"]),
    one("operation_key_dict", GOOD_BYTES, "dead:invalid_operation_key", operation_id={"a": 1}),
    one("operation_key_bytes_utf8", GOOD_BYTES, "executed", operation_id=b"op-bytes"),
    one("operation_key_bytes_not_utf8", GOOD_BYTES, "dead:invalid_operation_key", operation_id=b"\xff\xfe"),
    one("tenant_int", GOOD_BYTES, "dead:invalid_header", headers={"tenant-id": 7}),
    one("tenant_not_utf8", GOOD_BYTES, "dead:invalid_header", headers={"tenant-id": b"\xff"}),
    one("tenant_too_long", GOOD_BYTES, "dead:invalid_header", headers={"tenant-id": "t" * 201}),
    one("tenant_control_char", GOOD_BYTES, "dead:invalid_header", headers={"tenant-id": "t\x07"}),
    # "a/invoice.create" + "/invoice.create/v1" would read as another tenant's scope
    one("tenant_with_slash", GOOD_BYTES, "dead:invalid_header", headers={"tenant-id": "a/invoice.create"}),
    one("message_type_int", GOOD_BYTES, "dead:invalid_header", message_type=5),
    one("message_type_unknown", GOOD_BYTES, "dead:unknown_message_type", message_type="DropTables"),
    one("message_type_absent_single_handler", GOOD_BYTES, "executed", message_type=False),
    one("ten_thousand_headers", GOOD_BYTES, "executed", headers={f"x-h-{i}": i for i in range(10_000)}),
    one("header_name_case", GOOD_BYTES, "executed", operation_id=None, headers={"Operation-ID": "op-case"}),
]

CASES_BY_NAME = {case.name: case for case in CASES}
assert len(CASES_BY_NAME) == len(CASES), "case names must be unique"
