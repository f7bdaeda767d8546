"""Error responses of the HTTP front door: ``application/problem+json`` (RFC 9457) with a ``Link``
to the API's idempotency documentation.

draft-ietf-httpapi-idempotency-key-header-07, section 2.7 "Error Scenarios": a missing key is
``400``, a key reused with another request payload ``422``, a retry while the original request is
still being processed ``409``; each with a body describing the problem (RFC 7807, now RFC 9457)
and a link to the relevant documentation, also as ``Link: <...>; rel="describedby"``.

Every problem's ``type`` is ``<docs_url>#<slug>`` (the slugs below, stable: clients may switch
on them), ``title`` a fixed sentence per type, ``detail`` says what happened to *this* request
without quoting its body or its key. Problems are never cached (``Cache-Control: no-store``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from consumer_kit.errors import PermanentFailure

PROBLEM_JSON = "application/problem+json"


@dataclass(frozen=True)
class ProblemType:
    """One kind of problem: its ``slug`` (the fragment of its type URI), ``title`` and HTTP
    ``status``."""

    slug: str
    title: str
    status: int


MISSING_KEY = ProblemType("idempotency-key-missing", "Idempotency-Key is missing", 400)
MALFORMED_KEY = ProblemType("idempotency-key-malformed", "Idempotency-Key is malformed", 400)
INVALID_BODY = ProblemType("request-body-invalid", "The request body has no single meaning", 400)
BODY_TOO_LARGE = ProblemType("request-body-too-large", "The request body is too large", 413)
KEY_REUSED = ProblemType("idempotency-key-reused", "Idempotency-Key is already used", 422)
REQUEST_OUTSTANDING = ProblemType(
    "request-outstanding", "A request is outstanding for this Idempotency-Key", 409
)
NEEDS_RECONCILIATION = ProblemType(
    "operation-needs-reconciliation", "The operation of this Idempotency-Key awaits reconciliation", 409
)
RESPONSE_EXPIRED = ProblemType(
    "response-expired", "The stored response of this Idempotency-Key has expired", 410
)
OPERATION_FAILED = ProblemType("operation-failed", "The operation failed", 422)
TRY_AGAIN = ProblemType("try-again", "Retry with the same Idempotency-Key", 503)
RESPONSE_NOT_STORABLE = ProblemType(
    "response-not-storable", "The response could not be stored for replay", 500
)


def problem_response(
    kind: ProblemType,
    docs_url: str,
    detail: str,
    *,
    status: int | None = None,
    retry_after: int | None = None,
    headers: Mapping[str, str] | None = None,
    extensions: Mapping[str, Any] | None = None,
) -> Response:
    """A ``kind`` problem response.

    Args:
        docs_url: the API's idempotency documentation (the ``Link`` target; ``type`` is
            ``<docs_url>#<slug>``).
        detail: this occurrence, in a sentence (no body values, no key).
        status: another status than the kind's own (a business failure's chosen one).
        retry_after: seconds, sent as ``Retry-After`` (RFC 9110 section 10.2.3).
        headers: more headers (e.g. the replay marker).
        extensions: more members of the problem object (RFC 9457 section 3.2), e.g. ``code``.
    """
    status = status or kind.status
    document: dict[str, Any] = {
        "type": f"{docs_url}#{kind.slug}",
        "title": kind.title,
        "status": status,
        "detail": detail,
        **(extensions or {}),
    }
    all_headers = {
        "Link": f'<{docs_url}>; rel="describedby"; type="text/html"',
        "Cache-Control": "no-store",
        "Content-Language": "en",
        **(headers or {}),
    }
    if retry_after is not None:
        all_headers["Retry-After"] = str(retry_after)
    return Response(
        content=json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8"),
        status_code=status,
        headers=all_headers,
        media_type=PROBLEM_JSON,
    )


class OperationFailed(PermanentFailure):
    """Raise from an idempotent endpoint for a business failure after the operation was accepted
    ("customer closed", "insufficient funds"): the endpoint's writes and events roll back, the
    failure is recorded with its problem response (``status``, ``code``, ``detail``) and every
    retry with the key gets that response again, marked as a replay. A plain
    :class:`~consumer_kit.PermanentFailure` is the same with status ``422``.

    Args:
        code: short machine-readable code, the problem's ``code`` member (<= 200 characters).
        detail: explanation for the client, without secrets (<= 2,000 characters).
        status: the response status, 400 to 599.

    Raises (on construction):
        ValueError: ``status`` outside 400..599.
    """

    def __init__(self, code: str, detail: str = "", *, status: int = OPERATION_FAILED.status) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"OperationFailed status {status}: must be 400 to 599")
        super().__init__(code, detail)
        self.status = status
