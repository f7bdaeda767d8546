"""Operation identity: scope, key and fingerprint of the canonical intent projection.

Rules (docs/explanation/architecture.md, "Words"): the *scope* is tenant + operation type + version; the *key* is stable
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

from consumer_kit.errors import ConfigurationError, DeadLetterReason, InvalidMessage, UnsupportedNumber

MAX_NUMBER_DIGITS = 1000
"""Largest number the fingerprint compares by value: at most this many digits, and a decimal
exponent within +/- this many places (``Decimal("1E+5000")`` is refused)."""

# Limits in UTF-8 bytes, the unit an index counts: the ledger's indexes hold (scope, key) in one
# btree row (operations' and attempts' primary keys, evidence (scope, key, id)), and btree refuses a
# row over about 2,700 bytes on 8 KB pages (54000 "index row size exceeds btree maximum"), which a
# worker would take for a handler fault and retry. The largest scope and key together use less than
# half of that, so a future index with one more column still fits.
MAX_KEY_BYTES = 512
"""Longest operation key: 512 bytes of UTF-8 (512 ASCII characters, 128 of 4-byte ones); a longer
key is refused, never truncated (truncation merges keys)."""
MAX_TENANT_BYTES = 200
"""Longest tenant (broker path) or escaped client id (HTTP): 200 bytes of UTF-8."""
MAX_OPERATION_TYPE_BYTES = 512
"""Longest operation type (a handler's ``operation_type``, an HTTP ``"<METHOD> <template>"``)."""
MAX_VERSION = 2**31 - 1
"""Largest scope version (``v<version>``: at most 10 digits)."""
MAX_SCOPE_BYTES = MAX_TENANT_BYTES + len("/") + MAX_OPERATION_TYPE_BYTES + len("/v") + len(str(MAX_VERSION))

BTREE_ROW_BYTES = 2704
"""PostgreSQL's largest btree index row on 8 KB pages (BTMaxItemSize)."""
_INDEX_ROW_OVERHEAD = 8 + 2 * 4 + 2 * 8 + 8  # tuple header, two varlena headers, alignment, evidence id
assert 2 * (MAX_SCOPE_BYTES + MAX_KEY_BYTES + _INDEX_ROW_OVERHEAD) <= BTREE_ROW_BYTES


def utf8_bytes(text: str) -> int:
    """Length of ``text`` in UTF-8 bytes (a lone surrogate counts as its 3 bytes)."""
    return len(text.encode("utf-8", "surrogatepass"))


def normalize_key(raw: object, *, what: str = "operation key", max_bytes: int = MAX_KEY_BYTES) -> str:
    """Validate an operation key (or tenant) and return its NFC form.

    Args:
        what: how the error names the value (``"operation key (header 'operation-id')"``).
        max_bytes: longest NFC form in UTF-8 bytes (:data:`MAX_KEY_BYTES`; a tenant:
            :data:`MAX_TENANT_BYTES`).

    Raises:
        InvalidMessage: ``missing_operation_key`` when empty or absent, ``invalid_operation_key``
            when not a string, longer than ``max_bytes`` bytes of UTF-8, or holding control
            characters (NUL...) or a lone surrogate.
    """
    if raw is None or raw == "" or raw == b"":
        raise InvalidMessage(DeadLetterReason.MISSING_OPERATION_KEY, f"{what} is missing or empty")
    if isinstance(raw, bytes):
        if len(raw) > 4 * max_bytes:  # NFC never shrinks text 4-fold: too long whatever it holds
            raise InvalidMessage(DeadLetterReason.INVALID_OPERATION_KEY, _too_long(what, len(raw), max_bytes))
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidMessage(DeadLetterReason.INVALID_OPERATION_KEY, f"{what} is not UTF-8") from None
    if not isinstance(raw, str):
        raise InvalidMessage(
            DeadLetterReason.INVALID_OPERATION_KEY, f"{what} must be a string, got {type(raw).__name__}"
        )
    if len(raw) > 4 * max_bytes:  # spare NFC a huge string: it cannot come back short enough
        raise InvalidMessage(DeadLetterReason.INVALID_OPERATION_KEY, _too_long(what, utf8_bytes(raw), max_bytes))
    if raw.isascii() and raw.isprintable():  # the common key: its own NFC form, no Cc, no Cs, 1 byte a character
        if not raw.strip():
            raise InvalidMessage(DeadLetterReason.MISSING_OPERATION_KEY, f"{what} is blank")
        if len(raw) > max_bytes:
            raise InvalidMessage(DeadLetterReason.INVALID_OPERATION_KEY, _too_long(what, len(raw), max_bytes))
        return raw
    key = unicodedata.normalize("NFC", raw)
    if not key.strip():
        raise InvalidMessage(DeadLetterReason.MISSING_OPERATION_KEY, f"{what} is blank")
    if any(unicodedata.category(ch) == "Cc" for ch in key):
        raise InvalidMessage(DeadLetterReason.INVALID_OPERATION_KEY, f"{what} contains control characters")
    if any(unicodedata.category(ch) == "Cs" for ch in key):  # lone surrogate: not encodable as UTF-8
        raise InvalidMessage(DeadLetterReason.INVALID_OPERATION_KEY, f"{what} contains a lone surrogate")
    size = utf8_bytes(key)
    if size > max_bytes:
        raise InvalidMessage(DeadLetterReason.INVALID_OPERATION_KEY, _too_long(what, size, max_bytes))
    return key


def _too_long(what: str, size: int, max_bytes: int) -> str:
    return f"{what} is {size} bytes of UTF-8 (max {max_bytes})"


def check_scope_parts(operation_type: str, version: int, *, owner: str) -> None:
    """Refuse, at start-up, an operation type or version that would make scopes too long for the
    ledger's index (:data:`MAX_OPERATION_TYPE_BYTES`, ``0 <= version <=`` :data:`MAX_VERSION`).

    Raises:
        ConfigurationError: naming ``owner`` (``"CreateInvoiceHandler"``) and the rule.
    """
    size = utf8_bytes(operation_type)
    if size > MAX_OPERATION_TYPE_BYTES:
        raise ConfigurationError(
            f"{owner}: operation type of {size} bytes of UTF-8 (max {MAX_OPERATION_TYPE_BYTES}: the ledger"
            " indexes scope and key together)"
        )
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ConfigurationError(f"{owner}: version={version!r} must be an integer from 0 to {MAX_VERSION}")


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
    # The common exact types first (a bool is not an int here, a StrEnum not a str: type() is).
    kind = type(value)
    if kind is str:
        out.append(_json_string(unicodedata.normalize("NFC", value)))
        return
    if kind is int:
        if value.bit_length() > _MAX_INT_BITS:
            raise UnsupportedNumber(f"an integer of more than {MAX_NUMBER_DIGITS} digits")
        out.append(str(value))
        return
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
        out.append(_json_string(unicodedata.normalize("NFC", value)))
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
            out.append(_json_string(k))
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


_json_string = json.encoder.encode_basestring  # what json.dumps(s, ensure_ascii=False) returns, without an encoder per call


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
