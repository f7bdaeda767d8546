"""Operation identity: scope, key and fingerprint of the canonical intent projection.

Rules (DESIGN.md "Words"): the *scope* is tenant + operation type + version; the *key* is stable
across retries; the *fingerprint* is SHA-256 over canonical JSON of the message minus its excluded
(volatile) fields. Canonical JSON here means: object keys sorted, no insignificant whitespace, strings
NFC-normalised, numbers by value (``10``, ``10.0`` and ``Decimal("10.00")`` are one number), aware
datetimes in UTC, enums by value, sets sorted. So two encodings of one intent share a fingerprint,
which Powertools' ``json.dumps``-based hash does not guarantee.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import enum
import hashlib
import json
import math
import unicodedata
import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from consumer_kit.errors import DeadLetterReason, InvalidMessage

MAX_NUMBER_DIGITS = 1000
"""Largest number the fingerprint compares by value: at most this many digits, and a decimal
exponent within +/- this many places (``Decimal("1E+5000")`` is refused)."""

MAX_KEY_LENGTH = 512  # characters; a longer key is rejected, never truncated (truncation merges keys)
MAX_SCOPE_PART_LENGTH = 200


def normalize_key(raw: object, *, what: str = "operation key") -> str:
    """Validate an operation key (or tenant) and return its NFC form.

    Raises:
        InvalidMessage: ``missing_operation_key`` when empty or absent, ``invalid_operation_key``
            when not a string, longer than 512 characters, or holding control characters (NUL...).
    """
    if raw is None or raw == "" or raw == b"":
        raise InvalidMessage(DeadLetterReason.MISSING_OPERATION_KEY, f"{what} is missing or empty")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidMessage(DeadLetterReason.INVALID_OPERATION_KEY, f"{what} is not UTF-8") from None
    if not isinstance(raw, str):
        raise InvalidMessage(
            DeadLetterReason.INVALID_OPERATION_KEY, f"{what} must be a string, got {type(raw).__name__}"
        )
    key = unicodedata.normalize("NFC", raw)
    if not key.strip():
        raise InvalidMessage(DeadLetterReason.MISSING_OPERATION_KEY, f"{what} is blank")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidMessage(
            DeadLetterReason.INVALID_OPERATION_KEY, f"{what} is {len(key)} characters (max {MAX_KEY_LENGTH})"
        )
    if any(unicodedata.category(ch) == "Cc" for ch in key):
        raise InvalidMessage(DeadLetterReason.INVALID_OPERATION_KEY, f"{what} contains control characters")
    if any(unicodedata.category(ch) == "Cs" for ch in key):  # lone surrogate: not encodable as UTF-8
        raise InvalidMessage(DeadLetterReason.INVALID_OPERATION_KEY, f"{what} contains a lone surrogate")
    return key


class UnsupportedNumber(ValueError):
    """A number the fingerprint cannot compare by value: NaN or an infinity (NaN is not even
    equal to itself), or beyond :data:`MAX_NUMBER_DIGITS`."""


_DOWNSTREAM_NAMESPACE = uuid.UUID("5c0a1f3e-7d2b-4e8a-9b61-0c4f2e9d7a13")


def downstream_key(scope: str, key: str, name: str) -> str:
    """The idempotency key of remote call ``name`` of operation (``scope``, ``key``): a UUIDv5
    string, the same on every attempt and every worker (RFC 9562 name-based UUID over the three
    parts, separated so that no two triples collide)."""
    return str(uuid.uuid5(_DOWNSTREAM_NAMESPACE, "\x1f".join((scope, key, name))))


def canonical_json(value: Any) -> str:
    """Serialise ``value`` canonically (see module docstring).

    Raises:
        TypeError: an unsupported type.
        UnsupportedNumber: NaN, an infinity, or a number beyond :data:`MAX_NUMBER_DIGITS`.
    """
    parts: list[str] = []
    _emit(value, parts)
    return "".join(parts)


_MAX_INT_BITS = math.ceil(MAX_NUMBER_DIGITS * math.log2(10))
# normalize() rounds to the context's precision (28 digits by default): use one that holds every
# number allowed above, so two different numbers never normalise to one.
_EXACT = decimal.Context(prec=MAX_NUMBER_DIGITS + 1, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)


def fingerprint(message: BaseModel, exclude: Any = None) -> str:
    """SHA-256 (hex, 64 characters) of the canonical JSON of ``message`` minus ``exclude``
    (pydantic's exclude syntax: a set of field names or a nested mapping).

    Raises:
        UnsupportedNumber: see :func:`canonical_json`.
    """
    return fingerprint_of(message.model_dump(mode="python", exclude=exclude))


def fingerprint_of(projection: Any) -> str:
    """SHA-256 (hex, 64 characters) of the canonical JSON of an intent ``projection``.

    Raises:
        UnsupportedNumber: see :func:`canonical_json`.
    """
    return hashlib.sha256(canonical_json(projection).encode("utf-8")).hexdigest()


def _emit(value: Any, out: list[str]) -> None:
    if value is None or isinstance(value, bool):
        out.append("null" if value is None else ("true" if value else "false"))
    elif isinstance(value, enum.Enum):
        _emit(value.value, out)
    elif isinstance(value, int):
        if value.bit_length() > _MAX_INT_BITS:
            raise UnsupportedNumber(f"an integer of more than {MAX_NUMBER_DIGITS} digits")
        out.append(str(value))
    elif isinstance(value, float):
        out.append(_number_from_float(value))
    elif isinstance(value, decimal.Decimal):
        out.append(_number_from_decimal(value))
    elif isinstance(value, str):
        out.append(json.dumps(unicodedata.normalize("NFC", value), ensure_ascii=False))
    elif isinstance(value, BaseModel):
        _emit(value.model_dump(mode="python"), out)
    elif isinstance(value, Mapping):
        items = [(unicodedata.normalize("NFC", str(k)), v) for k, v in value.items()]
        if len({k for k, _ in items}) == len(items):
            items.sort(key=lambda kv: kv[0])
        else:
            # Two keys equal after NFC: order them by their canonical value (comparing the raw
            # values would raise TypeError for dicts). Rare, so the common path skips it.
            items.sort(key=lambda kv: (kv[0], canonical_json(kv[1])))
        out.append("{")
        for i, (k, v) in enumerate(items):
            if i:
                out.append(",")
            out.append(json.dumps(k, ensure_ascii=False))
            out.append(":")
            _emit(v, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        _emit_sequence(value, out)
    elif isinstance(value, (set, frozenset)):
        _emit_sequence(sorted(value, key=canonical_json), out)
    elif isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.UTC)
        out.append(json.dumps(value.isoformat()))
    elif isinstance(value, (dt.date, dt.time)):
        out.append(json.dumps(value.isoformat()))
    elif isinstance(value, dt.timedelta):
        out.append(_number_from_decimal(decimal.Decimal(str(value.total_seconds()))))
    elif isinstance(value, uuid.UUID):
        out.append(json.dumps(str(value)))
    elif isinstance(value, bytes):
        out.append(json.dumps(base64.b64encode(value).decode("ascii")))
    else:
        raise TypeError(f"cannot fingerprint a value of type {type(value).__name__}")


def _emit_sequence(values: Any, out: list[str]) -> None:
    out.append("[")
    for i, item in enumerate(values):
        if i:
            out.append(",")
        _emit(item, out)
    out.append("]")


def _number_from_float(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        raise UnsupportedNumber(f"{value!r} has no single value to compare")
    if value == 0:
        return "0"  # -0.0 and 0.0 are one intent
    return _number_from_decimal(decimal.Decimal(repr(value)))


def _number_from_decimal(value: decimal.Decimal) -> str:
    if not value.is_finite():
        raise UnsupportedNumber(f"{value} has no single value to compare")
    if value.is_zero():
        return "0"
    if abs(value.adjusted()) > MAX_NUMBER_DIGITS or len(value.as_tuple().digits) > MAX_NUMBER_DIGITS:
        raise UnsupportedNumber(f"a decimal beyond {MAX_NUMBER_DIGITS} digits or places")
    normalized = value.normalize(_EXACT)
    exponent = normalized.as_tuple().exponent
    assert isinstance(exponent, int)
    if exponent >= 0:
        return str(int(normalized))
    return format(normalized, "f")
