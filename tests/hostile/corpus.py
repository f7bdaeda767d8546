"""The hostile input corpus: each case, what is sent and what must happen.

Expectations per send, in order: ``"executed"``, ``"duplicate"``, ``"payload_conflict"`` (an
acceptance or a conflict) or ``"dead:<reason>"`` (dead-lettered with exactly that reason). Every
case is run by ``test_corpus.py`` through the runtime, the memory broker and the real PostgreSQL.

Documented acceptances (not bugs):

* a body in UTF-16/32 with a BOM, or UTF-8 with a BOM, is decoded (``json.loads`` on bytes,
  RFC 8259 section 8.1 detection) and accepted;
* ``10``, ``10.0`` and ``"10"`` for an ``int`` field are one intent (pydantic's lax mode): the
  later ones are duplicates; ``10.5`` is a schema mismatch;
* an unknown extra field is ignored (pydantic's default) and is not part of the fingerprint;
* repeated JSON object keys: the last one wins (Python's ``json``);
* an operation key or header holding SQL or quotes is just text (parameters, never formatted);
* a key in NFD and the same key in NFC are one key (keys are NFC-normalised);
* a payload PostgreSQL cannot store (NUL in text, an integer beyond bigint) fails in the handler's
  INSERT with a ``DataError``; the same values fail the same way every time, so the runtime
  dead-letters it at once with reason ``invalid_data:<error class>``.
"""

from __future__ import annotations

import datetime as dt
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
    amount bigint NOT NULL
);
"""


class PlaceOrder(BaseModel):
    customer: str = Field(min_length=1, max_length=200)
    amount: int
    note: str = ""
    placed_at: dt.datetime | None = None


class PlaceOrderHandler(Handler[PlaceOrder]):
    """Keyed by header ``operation-id``; one ``effects`` row per execution (no unique key)."""

    operation_type = "hostile.place_order"
    fingerprint_exclude: ClassVar[Any] = frozenset({"placed_at"})

    async def handle(self, message: PlaceOrder, ctx: Context) -> Result:
        conn: AsyncConnection[Any] = ctx.connection
        await conn.execute(
            "INSERT INTO effects (operation_key, customer, amount) VALUES (%s, %s, %s)",
            (ctx.operation.key, message.customer, message.amount),
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
    # pydantic rejects a lone surrogate in a constrained str; an unconstrained one reaches the
    # fingerprint, which cannot encode it
    one("lone_surrogate_constrained_field", b'{"customer": "\\ud800", "amount": 1}', "dead:schema_mismatch"),
    one("lone_surrogate_plain_field", b'{"customer": "c", "amount": 1, "note": "\\udc00"}', "dead:invalid_json"),
    one("utf16_with_bom_accepted", json.dumps(GOOD).encode("utf-16"), "executed"),
    one("utf8_with_bom_accepted", b"\xef\xbb\xbf" + GOOD_BYTES, "executed"),
    one("json_array", b"[1, 2, 3]", "dead:schema_mismatch"),
    one("json_string", b'"hello"', "dead:schema_mismatch"),
    one("json_null", b"null", "dead:schema_mismatch"),
    one("missing_field", j({"customer": "c-1"}), "dead:schema_mismatch"),
    one("wrong_type", j({"customer": "c-1", "amount": "ten"}), "dead:schema_mismatch"),
    one("customer_is_object", j({"customer": {"$ne": None}, "amount": 1}), "dead:schema_mismatch"),
    one("fractional_int", j({"customer": "c-1", "amount": 10.5}), "dead:schema_mismatch"),
    one("nan_amount", b'{"customer": "c-1", "amount": NaN}', "dead:schema_mismatch"),
    one("bigint_overflow", j({"customer": "c-1", "amount": 10**30}),
        "dead:invalid_data:NumericValueOutOfRange"),
    one("nul_in_text_field", j({"customer": "a\x00b", "amount": 1}), "dead:invalid_data:DataError"),
    # -- same intent written differently: documented acceptance as duplicates -----------------
    after_good("number_10_point_0", j({**GOOD, "amount": 10.0}), "duplicate"),
    after_good("number_as_string", j({**GOOD, "amount": "10"}), "duplicate"),
    after_good("number_exponent", b'{"customer": "c-1", "amount": 1e1, "note": "n"}', "duplicate"),
    after_good("fields_in_another_order", j(dict(reversed(list(GOOD.items())))), "duplicate"),
    after_good("insignificant_whitespace", json.dumps(GOOD, indent=4).encode(), "duplicate"),
    after_good("unknown_extra_field_ignored", j({**GOOD, "surprise": [1, 2]}), "duplicate"),
    after_good("volatile_field_differs", j({**GOOD, "placed_at": "2030-01-01T00:00:00+05:00"}), "duplicate"),
    after_good("note_nfd_vs_nfc", j({**GOOD, "note": unicodedata.normalize("NFD", "n")}), "duplicate"),
    after_good("repeated_json_key_last_wins", b'{"customer": "c-1", "amount": 99, "amount": 10, "note": "n"}',
               "duplicate"),
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
    one("message_type_int", GOOD_BYTES, "dead:invalid_header", message_type=5),
    one("message_type_unknown", GOOD_BYTES, "dead:unknown_message_type", message_type="DropTables"),
    one("message_type_absent_single_handler", GOOD_BYTES, "executed", message_type=False),
    one("ten_thousand_headers", GOOD_BYTES, "executed", headers={f"x-h-{i}": i for i in range(10_000)}),
    one("header_name_case", GOOD_BYTES, "executed", operation_id=None, headers={"Operation-ID": "op-case"}),
]

CASES_BY_NAME = {case.name: case for case in CASES}
assert len(CASES_BY_NAME) == len(CASES), "case names must be unique"
