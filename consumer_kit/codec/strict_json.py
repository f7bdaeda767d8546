"""JSON as RFC 8259 defines it, with one meaning per text, or a specific refusal.

consumer-kit decides "same intent or not" from the message, so a body that Python's ``json`` would
read one way while another parser reads it another way (or that loses information silently) has
no single meaning, and is refused before anything runs. Python's ``json.loads`` is more lenient
than the RFC in these ways, each refused here:

==========================================  ==========================================  ===============
what Python's json accepts                  why it has no single meaning                reason
==========================================  ==========================================  ===============
``NaN``, ``Infinity``, ``-Infinity``        not JSON (RFC 8259 section 6)                ``invalid_json``
an object with a repeated key               parsers disagree on which one wins (section  ``invalid_json``
(``{"a": 1, "a": 2}``), including keys      4: names SHOULD be unique); Python keeps the
equal after NFC normalisation               last one silently
a lone surrogate (``"\\ud800"``)            not a Unicode character (section 8.2;        ``invalid_json``
                                            I-JSON, RFC 7493, forbids it)
UTF-16 or UTF-32 bodies                     JSON exchanged between systems MUST be       ``invalid_json``
                                            UTF-8 (section 8.1)
a number a 64-bit float cannot hold by      ``1e400`` becomes infinity, ``1.0000000000  ``invalid_number``
value (``1e400``, ``1.00000000000000000001``)  0000000001`` becomes ``1.0``: two intents
                                            become one (section 6 leaves it to the
                                            implementation: send exact decimals as
                                            strings)
an integer of more than                     Python refuses to convert it (4,300 digits)  ``invalid_number``
:data:`MAX_INTEGER_DIGITS` digits           and no database column holds it
==========================================  ==========================================  ===============

A UTF-8 byte order mark at the start is ignored (section 8.1 allows it). Numbers that *are* held
exactly stay plain Python ``int`` and ``float`` (``10``, ``10.0`` and ``1e1`` are one number for
the fingerprint, see :mod:`consumer_kit.identity`).
"""

from __future__ import annotations

import decimal
import json
import math
import unicodedata
from typing import Any

from consumer_kit.errors import DeadLetterReason, InvalidMessage

MAX_INTEGER_DIGITS = 1000
"""Longest integer literal accepted, in digits (PostgreSQL ``numeric`` holds 131,072 before the
point, ``bigint`` 19; Python's own ``int`` conversion stops at 4,300)."""

_UTF8_BOM = b"\xef\xbb\xbf"


class _Refused(Exception):
    def __init__(self, reason: DeadLetterReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def loads(body: bytes) -> Any:
    """Parse ``body`` (bytes) as strict RFC 8259 JSON in UTF-8 (rules in the module docstring).

    Raises:
        InvalidMessage: ``invalid_json`` or ``invalid_number``, with a detail that names the rule
            and never quotes the body.
    """
    if body.startswith(_UTF8_BOM):
        body = body[len(_UTF8_BOM):]
    try:
        text = body.decode("utf-8")  # strict: UTF-16/32 and invalid UTF-8 fail here
    except UnicodeDecodeError as exc:
        raise InvalidMessage(
            DeadLetterReason.INVALID_JSON, f"body is not UTF-8 (byte {exc.start}; RFC 8259 8.1)"
        ) from None
    try:
        value = _DECODER.decode(text)
    except _Refused as exc:
        raise InvalidMessage(exc.reason, exc.detail) from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidMessage(DeadLetterReason.INVALID_JSON, f"{type(exc).__name__} at body") from None
    if "\\u" in text and _has_lone_surrogate(value):  # only \\u escapes can produce one
        raise InvalidMessage(
            DeadLetterReason.INVALID_JSON, "a string holds a lone surrogate (RFC 8259 8.2)"
        )
    return value


def _refuse_constant(name: str) -> Any:
    raise _Refused(DeadLetterReason.INVALID_JSON, f"{name} is not a JSON number (RFC 8259 6)")


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise _Refused(
            DeadLetterReason.INVALID_NUMBER,
            f"an integer of {len(literal.lstrip('-'))} digits (max {MAX_INTEGER_DIGITS})",
        )
    return int(literal)


def _parse_float(literal: str) -> float:
    if len(literal) > MAX_INTEGER_DIGITS:
        raise _Refused(
            DeadLetterReason.INVALID_NUMBER,
            f"a number of {len(literal)} characters (max {MAX_INTEGER_DIGITS})",
        )
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused(
            DeadLetterReason.INVALID_NUMBER, "a number beyond the 64-bit float range (send it as a string)"
        )
    # Held by value? 0.1 and 1e1 are; 1.00000000000000000001 is not (it would become 1.0), nor
    # is 1e-400 (it would become 0).
    if decimal.Decimal(repr(value)) != decimal.Decimal(literal):
        raise _Refused(
            DeadLetterReason.INVALID_NUMBER,
            "a number with more precision than a 64-bit float holds (send exact decimals as strings)",
        )
    return value


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise _Refused(DeadLetterReason.INVALID_JSON, "an object repeats a key (RFC 8259 4)")
    if not all(key.isascii() for key in result):
        normalized = {unicodedata.normalize("NFC", key) for key in result}
        if len(normalized) != len(result):
            raise _Refused(
                DeadLetterReason.INVALID_JSON, "an object repeats a key once keys are NFC-normalised"
            )
    return result


# One decoder for every body (json.loads with these hooks would build one per call).
_DECODER = json.JSONDecoder(
    parse_constant=_refuse_constant, parse_int=_parse_int, parse_float=_parse_float, object_pairs_hook=_unique_object,
)


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if any("\ud800" <= ch <= "\udfff" for ch in item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
