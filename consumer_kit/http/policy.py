"""What an API promises about ``Idempotency-Key``: the knobs of the HTTP front door and the
specification it publishes.

draft-ietf-httpapi-idempotency-key-header-07, section 2.5 "Responsibilities": the resource server
MUST publish its idempotency-related specification, including its expiration policy (section 2.3
"Idempotency Key Validity and Expiry": keys MAY expire; the expiry policy SHOULD be documented).
:meth:`IdempotencyPolicy.describe` is that specification as JSON, to serve at ``docs_url``.

Retention (applied by ``consumer-kit prune``, which deletes what expired):

* the stored response (status, selected headers, body) is kept ``response_retention``
  (default 24 hours); a retry after that, while the key is still known, gets ``410`` with problem
  type ``response-expired`` and is **not** run again;
* the key's identity (scope, key, fingerprint, outcome, timestamps) is kept ``key_retention``
  (default 7 days; ``None``: for ever); once it is deleted, a request with that key is a new
  operation.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from consumer_kit.errors import ConfigurationError
from consumer_kit.http.body import DEFAULT_MAX_BODY_BYTES, MAX_BODY_BYTES_LIMIT
from consumer_kit.http.keys import IDEMPOTENCY_KEY_HEADER, KeyFormat
from consumer_kit.http.stored import (
    DEFAULT_MAX_STORED_BODY_BYTES,
    MAX_STORED_BODY_BYTES,
    REPLAYED_HEADER,
    stored_header_names,
)
from consumer_kit.model.retention import Retention


@dataclass(frozen=True)
class IdempotencyPolicy:
    """The HTTP front door's rules for one API.

    Attributes:
        docs_url: where the API documents its idempotency rules (the ``Link`` of every problem
            and the base of problem types); serve :meth:`describe` there, or your own page.
        api_version: part of every operation's scope: keys of version 1 and 2 never meet.
        key_format: the published key format, validated before any lookup.
        stored_headers: response headers stored for replays besides the default ones
            (``Content-Type``, ``Location``, ``ETag``, ...; see :mod:`consumer_kit.http.stored`).
        max_stored_body_bytes: bytes, 0 to 1,048,576; a larger response is refused before COMMIT.
        max_body_bytes: bytes, 0 to 1 GiB (default 4 MiB): a larger request body is answered
            ``413`` (``request-body-too-large``) before any lookup, by ``Content-Length`` or while
            it streams in: nothing stored, the endpoint not run.
        response_retention: how long the stored response is kept (``None``: until the key goes).
        key_retention: how long the key's identity is kept (``None``: for ever).
        retry_after: seconds, 1 to 3600: ``Retry-After`` of a ``409`` (request outstanding) and a
            ``503`` (try again).

    Raises (on construction):
        ConfigurationError: a value out of its range, an empty ``docs_url``, a never-stored header,
            or a response kept longer than its key.
    """

    docs_url: str
    api_version: int = 1
    key_format: KeyFormat = field(default_factory=KeyFormat)
    stored_headers: Iterable[str] = ()
    max_stored_body_bytes: int = DEFAULT_MAX_STORED_BODY_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    response_retention: dt.timedelta | None = dt.timedelta(hours=24)
    key_retention: dt.timedelta | None = dt.timedelta(days=7)
    retry_after: int = 1

    def __post_init__(self) -> None:
        if not self.docs_url.strip():
            raise ConfigurationError("IdempotencyPolicy.docs_url: the API must publish its idempotency rules")
        if not 1 <= self.api_version <= 1_000_000:
            raise ConfigurationError(f"IdempotencyPolicy.api_version={self.api_version}: must be 1 to 1000000")
        if not 0 <= self.max_stored_body_bytes <= MAX_STORED_BODY_BYTES:
            raise ConfigurationError(
                f"IdempotencyPolicy.max_stored_body_bytes={self.max_stored_body_bytes}: bytes, "
                f"must be between 0 and {MAX_STORED_BODY_BYTES} (e.g. {DEFAULT_MAX_STORED_BODY_BYTES})"
            )
        if not 0 <= self.max_body_bytes <= MAX_BODY_BYTES_LIMIT:
            raise ConfigurationError(
                f"IdempotencyPolicy.max_body_bytes={self.max_body_bytes}: bytes, must be between 0 and "
                f"{MAX_BODY_BYTES_LIMIT} (e.g. {DEFAULT_MAX_BODY_BYTES})"
            )
        if not 1 <= self.retry_after <= 3600:
            raise ConfigurationError(f"IdempotencyPolicy.retry_after={self.retry_after}: seconds, must be 1 to 3600")
        for name in ("response_retention", "key_retention"):
            value = getattr(self, name)
            if value is not None and value <= dt.timedelta(0):
                raise ConfigurationError(f"IdempotencyPolicy.{name} must be a positive timedelta or None")
        if self.key_retention is not None and (
            self.response_retention is None or self.response_retention > self.key_retention
        ):
            raise ConfigurationError(
                "IdempotencyPolicy.response_retention cannot outlast key_retention: a response without its key "
                "could never be found"
            )
        object.__setattr__(self, "stored_headers", stored_header_names(self.stored_headers))

    @property
    def header_names(self) -> frozenset[str]:
        """Every response header stored for replays (lower case)."""
        return frozenset(self.stored_headers)

    @property
    def retention(self) -> Retention:
        """The ledger retention of this API's operations (seconds)."""
        return Retention(
            body_seconds=self.response_retention.total_seconds() if self.response_retention else None,
            key_seconds=self.key_retention.total_seconds() if self.key_retention else None,
        )

    def describe(self) -> dict[str, Any]:
        """The published specification (draft sections 2.3 and 2.5), as a JSON object."""
        return {
            "header": IDEMPOTENCY_KEY_HEADER,
            "key_format": self.key_format.description,
            "required": "on every operation documented as idempotent; a request without the header gets 400",
            "scope": "a key belongs to the authenticated client, the method, the route and API version "
            f"{self.api_version}: other clients can never see its response",
            "fingerprint": "the JSON body (volatile fields excluded), path and query parameters; the same key "
            "with another fingerprint gets 422",
            "concurrent_retry": f"409 with Retry-After: {self.retry_after} while the first request runs",
            "replay": f"the stored status, headers and body, marked {REPLAYED_HEADER}: true",
            "request_body_max_bytes": self.max_body_bytes,
            "stored_response_max_bytes": self.max_stored_body_bytes,
            "stored_headers": sorted(self.header_names),
            "response_retention_seconds": _seconds(self.response_retention),
            "key_retention_seconds": _seconds(self.key_retention),
            "not_stored": "requests refused before they ran (invalid key or body, a body over "
            "request_body_max_bytes: 413, authentication, validation), "
            "responses with status 400 or above that the operation returned, and unhandled errors: fix and "
            "retry with the same key",
            "stored_failures": "failures the operation reports as permanent are stored and replayed",
        }


def _seconds(value: dt.timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()
