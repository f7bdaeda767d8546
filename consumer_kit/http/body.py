"""The request body of an idempotent request: read within the policy's limit, fingerprinted off the
event loop when it is large.

The limit (``IdempotencyPolicy.max_body_bytes``, bytes) is checked twice: against ``Content-Length``
before a byte is read, and while the body streams in (a chunked request has no length), so a body
over it is never buffered whole. The pipeline answers such a request ``413`` before any lookup.
Parsing and fingerprinting a body of more than :data:`OFF_LOOP_BYTES` runs in a worker thread
(``asyncio.to_thread``): a 4 MB body takes about a second of CPU, which would stall every other
request and delivery on the loop.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from consumer_kit.errors import BodyTooLarge
from consumer_kit.http.intent import RequestIntent, RequestParts

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""Bytes (4 MiB): the default largest request body of an idempotent endpoint."""

MAX_BODY_BYTES_LIMIT = 1024 * 1024 * 1024
"""Bytes (1 GiB): the largest ``max_body_bytes`` a policy may set (the body is held in memory)."""

OFF_LOOP_BYTES = 64 * 1024
"""Bytes: a body larger than this is parsed and fingerprinted in a worker thread."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body of ``request``, at most ``max_bytes`` bytes; the endpoint can read it again.

    Raises:
        BodyTooLarge: ``Content-Length`` says more than ``max_bytes``, or the body streamed past it
            (the rest is not read).
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the request body is {int(declared)} bytes (Content-Length); the limit is {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"the request body is over the limit of {max_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    # Starlette's Request.body() caches the body here: the endpoint's own read (FastAPI's body
    # parsing, `await request.json()`) gets it instead of a consumed stream.
    request._body = body
    return body


async def fingerprint(intent: RequestIntent, parts: RequestParts) -> str:
    """``intent.fingerprint(parts)``, in a worker thread for a body over :data:`OFF_LOOP_BYTES`.

    Raises:
        InvalidBody: the body has no single meaning (as ``RequestIntent.fingerprint``).
    """
    if len(parts.body) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(intent.fingerprint, parts)
    return intent.fingerprint(parts)
