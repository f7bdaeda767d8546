"""Signing consumer-kit's marks on a copy and dropping those no valid signature covers
(:mod:`consumer_kit.codec.marks` holds the key and the HMAC; :mod:`consumer_kit.codec.headers`
re-exports these functions)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from consumer_kit.codec import marks as mark_keys
from consumer_kit.codec.header_names import (
    MARKS,
    MESSAGE_TYPE,
    OPERATION_ID,
    PARTITION_KEY,
    SIGNATURE,
    SPEC_BY_NAME,
    TENANT,
    lookup,
    own_values,
)
from consumer_kit.codec.header_values import read_count, read_flag, read_text, read_time

logger = logging.getLogger("consumer_kit.headers")

UNVERIFIED: Counter[str] = Counter()
"""Marks ignored since the process started because no valid signature covered them, by name."""


def without_marks(headers: Mapping[str, Any]) -> dict[str, Any]:
    """``headers`` without any mark or signature (names matched ignoring case): what a new message
    (a relay publish) starts from, so that it never signs marks a handler passed on."""
    return {k: v for k, v in headers.items() if not (isinstance(k, str) and k.lower() in _NOT_PASSED_ON)}


def seal_new(headers: dict[Any, Any], marks: Mapping[str, str], body: bytes) -> dict[Any, Any]:
    """:func:`seal` for a new message: ``headers`` (without any mark, see :func:`without_marks`)
    with ``marks`` (values already in their normalised text, as :func:`seal` would read them back)
    added and signed. Returns ``headers`` (changed in place). The relay's per-event path: it skips
    re-reading values consumer-kit has just written."""
    headers.update(marks)
    headers[SIGNATURE] = mark_keys.sign(marks, body, identity_of(headers))
    return headers


def seal(headers: dict[Any, Any], body: bytes) -> dict[Any, Any]:
    """Sign the marks in ``headers`` (a copy consumer-kit is about to send with ``body``): set
    :data:`SIGNATURE` over them, or remove it when there are none. Returns ``headers`` (changed in
    place). The one place marks are signed: every adapter calls it on every copy it writes."""
    found = _good_marks(own_values(headers))
    for name in [k for k in headers if isinstance(k, str) and k.lower() == SIGNATURE]:
        del headers[name]
    if found:
        headers[SIGNATURE] = mark_keys.sign(found, body, identity_of(headers))
    return headers


IDENTITY = (OPERATION_ID, TENANT, MESSAGE_TYPE, PARTITION_KEY)
"""The headers naming the operation a message is (its scope, key, type, ordering): a signature
covers them too, so marks signed on one operation are not valid on another."""


def identity_of(headers: Mapping[Any, Any]) -> tuple[str, ...]:
    """The values of :data:`IDENTITY` in ``headers`` (as :func:`lookup` finds them) as text, ``""``
    for absent ones; a value that is not text is shown by its type, so it can match no other."""
    found = []
    for name in IDENTITY:
        value = lookup(headers, name)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        found.append(value if isinstance(value, str) else ("" if value is None else f"<{type(value).__name__}>"))
    return tuple(found)


def _good_marks(own: Mapping[str, Any]) -> dict[str, str]:
    """The marks among ``own`` with a good value, as the normalised text a signature covers."""
    found: dict[str, str] = {}
    for name in MARKS.intersection(own):
        value = own[name]
        spec = SPEC_BY_NAME[name]
        if spec.kind == "count":
            count = read_count(value)
            text = None if count is None else str(count)
        elif spec.kind == "flag":
            text = "1" if read_flag(value) else None
        elif spec.kind == "time":
            when = read_time(value)
            text = None if when is None else when.isoformat()
        else:
            text = read_text(value, spec.max_chars)
        if text is not None:
            found[name] = text
    return found


def drop_unverified(headers: dict[Any, Any], own: dict[str, Any], body: bytes | None) -> None:
    """Remove the marks from ``headers`` and ``own`` unless a valid signature covers them. A mark
    whose value is out of range (a control character, over its length) is never covered: it is
    removed from ``headers`` signed or not (no operator tool shows it), and stays in ``own`` for the
    table's rule (ignored and counted, or ``invalid_header``)."""
    present = MARKS.intersection(own)
    if not present:
        return
    found = _good_marks(own)
    signature = read_text(own.get(SIGNATURE), 64)
    verified = bool(found) and body is not None and mark_keys.verify(signature, found, body, identity_of(headers))
    if found and not verified:
        UNVERIFIED.update(found.keys())
        logger.info("ignored unauthenticated mark(s) %s", ",".join(sorted(found)))
        for name in found:
            del own[name]
    dropped = present if not verified else present.difference(found)
    if dropped:
        lowered = {name.lower() for name in dropped}
        for key in [k for k in headers if isinstance(k, str) and k.lower() in lowered]:
            del headers[key]


_MARKS_LOWER = frozenset(name.lower() for name in MARKS)
_NOT_PASSED_ON = _MARKS_LOWER | {SIGNATURE}
