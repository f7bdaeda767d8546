"""The HTTP front door: ``Idempotency-Key`` for Starlette and FastAPI endpoints, on the same ledger
and outbox as the queue side (``pip install 'consumer-kit[http]'``).

It implements draft-ietf-httpapi-idempotency-key-header-07, "The Idempotency-Key HTTP Header
Field" ("the draft"; sections cited in each module). A client sends
``Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`` with a ``POST``; the endpoint's
database writes, the ledger's completion with the response and its outbox events commit in one
transaction; a retry gets the stored response back marked ``Idempotent-Replayed: true``; events
carry the key as their ``operation-id``, so a consumer-kit worker downstream runs under the same
operation key. docs/how-to/http.md documents the integration, key format, status codes,
stored-response limit and retention.

One module per job:

=================  ==========================================================================
module             job
=================  ==========================================================================
``keys``           parse the header (one RFC 9651 sf-string) and validate the key format
``intent``         the request's intent projection and fingerprint (body, path, query)
``scope``          the key's scope: client + method + route template + API version
``stored``         what is kept of a response and how a replay is built
``problems``       ``application/problem+json`` errors (RFC 9457) with a ``Link`` to the docs
``policy``         the API's published rules: key format, limits, retention
``operation``      what an endpoint works with: transaction, identity, ``publish``
``pipeline``       one request, step by step: claim, decide, run, complete, commit, replay
``integration``    :class:`Idempotency`: pool, lifespan and the endpoint decorator
``fastapi_route``  :class:`IdempotentRoute` and ``CurrentOperation`` for FastAPI (imports it)
=================  ==========================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from consumer_kit.http.integration import Idempotency
from consumer_kit.http.intent import RequestIntent
from consumer_kit.http.keys import IDEMPOTENCY_KEY_HEADER, UUID_KEYS, KeyFormat
from consumer_kit.http.operation import Operation, current_operation
from consumer_kit.http.policy import IdempotencyPolicy
from consumer_kit.http.problems import PROBLEM_JSON, OperationFailed
from consumer_kit.http.stored import REPLAYED_HEADER

if TYPE_CHECKING:
    from consumer_kit.http.fastapi_route import CurrentOperation, IdempotentRoute

__all__ = [
    "IDEMPOTENCY_KEY_HEADER",
    "PROBLEM_JSON",
    "REPLAYED_HEADER",
    "UUID_KEYS",
    "CurrentOperation",
    "Idempotency",
    "IdempotencyPolicy",
    "IdempotentRoute",
    "KeyFormat",
    "Operation",
    "OperationFailed",
    "RequestIntent",
    "current_operation",
]


def __getattr__(name: str) -> Any:
    if name in ("CurrentOperation", "IdempotentRoute"):  # imported on use: Starlette apps need no FastAPI
        from consumer_kit.http import fastapi_route

        return getattr(fastapi_route, name)
    raise AttributeError(f"module 'consumer_kit.http' has no attribute {name!r}")
