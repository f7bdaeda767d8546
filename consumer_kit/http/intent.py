"""The fingerprint of an HTTP request: SHA-256 of its canonical intent projection.

draft-ietf-httpapi-idempotency-key-header-07, section 2.4 "Idempotency Fingerprint": a server MAY
fingerprint the request payload, e.g. a checksum of selected elements, to tell a retry from a key
reused with another request. Here a route's :class:`RequestIntent` selects them:

* the JSON body minus the route's volatile fields (``exclude``: ``"requested_at"``, or a dotted
  path into nested objects, ``"meta.trace_id"``), parsed by the strict rules of
  :mod:`consumer_kit.codec.strict_json` (no ``NaN``, no repeated keys, no number a float cannot hold);
* the path parameters (always: they name the resource);
* the query parameters (all by default; ``query=False`` none, or a set of names).

The projection is ``{"body": ..., "path": {...}, "query": {name: [values...]}}``, canonicalised
exactly like a message's (:func:`consumer_kit.identity.canonical_json`: keys sorted, numbers by
value, strings NFC), so ``{"amount": 10}`` and ``{"amount": 10.0}`` are one intent and a resend
with a new ``requested_at`` is a retry, not a conflict. A body that is not JSON (another content
type) is fingerprinted as its bytes.
"""

from __future__ import annotations

import email.message
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from consumer_kit.codec import strict_json
from consumer_kit.errors import ConfigurationError, InvalidBody, InvalidMessage, UnsupportedNumber
from consumer_kit.identity import fingerprint_of


@dataclass(frozen=True)
class RequestParts:
    """The parts of a request its intent is made of: the ``body`` (bytes), its ``content_type``,
    the ``path_params`` and the ``query_items`` ((name, value) pairs in request order)."""

    body: bytes
    content_type: str | None
    path_params: Mapping[str, Any]
    query_items: Sequence[tuple[str, str]]


@dataclass(frozen=True)
class RequestIntent:
    """Which parts of a request define its intent, for one route.

    Attributes:
        exclude: JSON body fields left out (volatile: timestamps, trace ids); a dotted name
            reaches into nested objects (``"meta.trace_id"``).
        query: query parameters in the intent: all (``True``), none (``False``) or these names.
        version: the projection version, stored with the fingerprint; bump it when the
            projection changes (a retry recorded under another version is compared under it
            when ``earlier`` names it).
        earlier: ``{version: RequestIntent}`` of earlier projection versions still in retention.

    Raises (on construction):
        ConfigurationError: ``version`` < 1, or ``earlier`` naming a version not below it.
    """

    exclude: frozenset[str] = frozenset()
    query: bool | frozenset[str] = True
    version: int = 1
    earlier: Mapping[int, RequestIntent] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude", frozenset(self.exclude))
        if not isinstance(self.query, bool):
            object.__setattr__(self, "query", frozenset(self.query))
        if self.version < 1:
            raise ConfigurationError(f"RequestIntent version {self.version}: must be >= 1")
        stale = [v for v in self.earlier or {} if v >= self.version]
        if stale:
            raise ConfigurationError(f"RequestIntent.earlier names versions {stale}, not below version {self.version}")

    def under(self, version: int) -> RequestIntent | None:
        """This route's intent under projection ``version`` (``None``: not declared)."""
        if version == self.version:
            return self
        return (self.earlier or {}).get(version)

    def projection(self, request: RequestParts) -> dict[str, Any]:
        """The intent projection of ``request`` (shape in the module docstring).

        Raises:
            InvalidBody: a JSON body that :func:`consumer_kit.codec.strict_json.loads` refuses.
        """
        return {
            "body": self._body(request.body, request.content_type),
            "path": dict(request.path_params),
            "query": self._query(request.query_items),
        }

    def fingerprint(self, request: RequestParts) -> str:
        """SHA-256 (hex, 64 characters) of the canonical JSON of :meth:`projection`.

        Raises:
            InvalidBody: the body has no single meaning (strict JSON, or a number the fingerprint
                cannot compare by value).
        """
        try:
            return fingerprint_of(self.projection(request))
        except UnsupportedNumber as exc:
            raise InvalidBody(f"a number the fingerprint cannot compare by value: {exc}") from None
        except RecursionError:  # strict JSON reads ~1000 levels; the canonical form recurses deeper
            raise InvalidBody("the body is nested too deeply to fingerprint") from None

    def _body(self, body: bytes, content_type: str | None) -> Any:
        if not body:
            return None
        if not _is_json(content_type):
            return body  # canonical_json writes bytes as base64
        try:
            value = strict_json.loads(body)
        except InvalidMessage as exc:
            raise InvalidBody(exc.detail) from None
        for name in self.exclude:
            _drop(value, name.split("."))
        return value

    def _query(self, items: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
        if self.query is False:
            return {}
        wanted = None if self.query is True else self.query
        grouped: dict[str, list[str]] = {}
        for name, value in items:
            if wanted is None or name in wanted:
                grouped.setdefault(name, []).append(value)  # order kept: a=1&a=2 is not a=2&a=1
        return grouped


def _is_json(content_type: str | None) -> bool:
    """No content type (FastAPI reads such a body as JSON too), ``application/json`` or
    ``application/*+json``."""
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _drop(value: Any, path: list[str]) -> None:
    """Remove the field at ``path`` from nested JSON objects, where it exists."""
    for name in path[:-1]:
        if not isinstance(value, dict):
            return
        value = value.get(name)
    if isinstance(value, dict):
        value.pop(path[-1], None)
