"""The stored response of an idempotent request: what the ledger keeps and what a replay returns.

draft-ietf-httpapi-idempotency-key-header-07, section 2.6 "Idempotency Enforcement Scenarios": a
request retried after the original completed SHOULD get the result of the previously completed
operation, success or error. So the response is kept with the ledger's completion, in the same
transaction as the endpoint's writes and outbox events:

* the status code;
* the headers named in :data:`STORED_HEADERS` (plus those a policy adds): never ``Set-Cookie``,
  ``Date``, hop-by-hop or length headers (:data:`NEVER_STORED`);
* the body, at most the policy's ``max_stored_body_bytes`` (default
  :data:`DEFAULT_MAX_STORED_BODY_BYTES`, at most :data:`MAX_STORED_BODY_BYTES`), kept byte for
  byte: as text when it is UTF-8 without NUL, else base64.

In the ledger row: ``result_status`` = the status code as text (``"201"``), ``result_reference`` =
the ``Location`` header if any, ``result_body`` = ``{"http": 1, "status": 201, "headers": [[name,
value], ...], "body": "..."}`` (or ``"body_base64"``). A replay carries ``Idempotent-Replayed:
true``. A response that cannot be stored (over the size limit, a streaming response without a
body) is refused *before* COMMIT, so nothing of the request takes effect.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from consumer_kit.errors import ConfigurationError, ResponseNotStorable
from consumer_kit.model.results import StoredResult

REPLAYED_HEADER = "Idempotent-Replayed"
"""Set to ``true`` on every replayed response (absent on the first one)."""

STORED_HEADERS = frozenset(
    {"content-type", "content-language", "content-location", "location", "etag", "last-modified"}
)
"""Response headers kept for replays by default (lower case)."""

NEVER_STORED = frozenset(
    {
        "set-cookie", "date", "server", "content-length", "transfer-encoding", "connection",
        "keep-alive", "trailer", "upgrade", "proxy-authenticate", "www-authenticate",
        REPLAYED_HEADER.lower(),
    }
)
"""Headers that are never stored, whatever a policy asks: another session's cookie, per-message
and hop-by-hop headers, and the replay marker itself."""

DEFAULT_MAX_STORED_BODY_BYTES = 64 * 1024
MAX_STORED_BODY_BYTES = 1024 * 1024
"""Bytes: the largest stored body a policy may allow (a ledger row is no blob store)."""

_FORMAT_VERSION = 1


def stored_header_names(extra: Iterable[str]) -> frozenset[str]:
    """:data:`STORED_HEADERS` plus ``extra`` (case-insensitive).

    Raises:
        ConfigurationError: ``extra`` names a header in :data:`NEVER_STORED`.
    """
    names = frozenset(name.lower() for name in extra)
    refused = sorted(names & NEVER_STORED)
    if refused:
        raise ConfigurationError(f"these response headers are never stored for replays: {', '.join(refused)}")
    return STORED_HEADERS | names


@dataclass(frozen=True)
class StoredResponse:
    """A response as kept for replays: ``status`` (HTTP status code), ``headers`` ((name, value)
    pairs, names in lower case, in the response's order) and ``body`` (bytes)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes

    @classmethod
    def of(cls, response: Response, *, header_names: frozenset[str], max_body_bytes: int) -> StoredResponse:
        """What to store of ``response``.

        Raises:
            ResponseNotStorable: a response without a body in memory (``StreamingResponse``,
                ``FileResponse``), or a body over ``max_body_bytes``.
        """
        body = getattr(response, "body", None)
        if not isinstance(body, bytes):
            raise ResponseNotStorable(
                f"an idempotent endpoint must return a response with its body in memory, not a "
                f"{type(response).__name__} (its body could not be replayed)"
            )
        if len(body) > max_body_bytes:
            raise ResponseNotStorable(
                f"the response body is {len(body)} bytes; the stored-response limit is {max_body_bytes} bytes "
                "(max_stored_body_bytes): return a reference to the result instead of the result itself"
            )
        headers = tuple(
            (name.decode("latin-1").lower(), value.decode("latin-1"))
            for name, value in response.raw_headers
            if name.decode("latin-1").lower() in header_names
        )
        return cls(response.status_code, headers, body)

    def result(self) -> StoredResult:
        """This response as the ledger's stored result (shape in the module docstring)."""
        location = next((value for name, value in self.headers if name == "location"), None)
        return StoredResult(str(self.status), location and location[:500], self.encoded())

    def encoded(self) -> dict[str, Any]:
        """The JSON document kept in ``result_body``."""
        document: dict[str, Any] = {
            "http": _FORMAT_VERSION,
            "status": self.status,
            "headers": [list(pair) for pair in self.headers],
        }
        try:
            text = self.body.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or "\x00" in text:  # jsonb holds no NUL character
            document["body_base64"] = base64.b64encode(self.body).decode("ascii")
        else:
            document["body"] = text
        return document

    @classmethod
    def decoded(cls, document: Any) -> StoredResponse | None:
        """The response kept in a ledger row's ``result_body`` (``None``: none is kept, e.g.
        the body was pruned after its retention)."""
        if not isinstance(document, dict) or document.get("http") != _FORMAT_VERSION:
            return None
        if "body_base64" in document:
            body = base64.b64decode(document["body_base64"])
        else:
            body = str(document.get("body", "")).encode("utf-8")
        headers = tuple((str(name), str(value)) for name, value in document.get("headers", []))
        return cls(int(document["status"]), headers, body)

    def replay(self) -> Response:
        """The response to send again, marked ``Idempotent-Replayed: true``."""
        response = Response(content=self.body, status_code=self.status)
        # Response() sets content-length itself and no content-type without a media type: put the
        # stored headers back as they were, in order.
        kept = [(b"content-length", str(len(self.body)).encode("latin-1"))]
        kept += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers]
        kept.append((REPLAYED_HEADER.lower().encode("latin-1"), b"true"))
        response.raw_headers = kept
        return response
